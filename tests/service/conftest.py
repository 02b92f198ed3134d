"""The service, run in-process: on the memory store (most tests) and on PostgreSQL (a few), each
test with a fresh app and, on PostgreSQL, a fresh schema."""

from __future__ import annotations

from collections.abc import AsyncIterator

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


@pytest.fixture
async def pg_service(pg_url: str, pg_schema: str) -> AsyncIterator[Service]:
    """The app on PostgreSQL, its tables in this test's schema (``--schema``, which creates it)."""
    async with served(ServiceSettings(database_url=pg_url, schema=pg_schema)) as running:
        yield running
