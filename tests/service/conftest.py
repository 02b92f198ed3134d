"""The service, run in-process: on the memory store (most tests) and on PostgreSQL (a few), each
test with a fresh app and, on PostgreSQL, a fresh schema."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import httpx
import pytest

from flowlock.service import ServiceSettings
from service.kit import Service, served


@pytest.fixture
async def service() -> AsyncIterator[Service]:
    """The app with default settings (memory store, flowlock's example workflows)."""
    async with served() as running:
        yield running


@pytest.fixture
def client(service: Service) -> httpx.AsyncClient:
    return service.client


def schema_url(url: str, schema: str) -> str:
    """``url`` with every connection's ``search_path`` set to ``schema`` (asyncpg passes unknown
    query parameters on as server settings): the service has no schema setting of its own."""
    return f"{url}{'&' if '?' in url else '?'}search_path={schema}"


@pytest.fixture
async def pg_service(pg_url: str, pg_schema: str) -> AsyncIterator[Service]:
    """The app on PostgreSQL, its tables in this test's schema."""
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute(f'CREATE SCHEMA "{pg_schema}"')
    finally:
        await conn.close()
    async with served(ServiceSettings(database_url=schema_url(pg_url, pg_schema))) as running:
        yield running
