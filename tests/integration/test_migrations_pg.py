"""Schema migrations on PostgreSQL: recorded, idempotent, safe when processes start at once."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

import flowlock
from flowlock import examples
from flowlock.stores import migrations
from flowlock.stores.postgres import PostgresStore

pytestmark = pytest.mark.postgres


async def test_concurrent_first_opens_migrate_once(pg_url: str, pg_schema: str) -> None:
    """Eight stores opening one empty schema at once: each migration applied and recorded once."""
    stores = [
        PostgresStore(pg_url, schema=pg_schema, pool_size=1, auto_migrate=False) for _ in range(8)
    ]
    for s in stores:
        await s.open()
    try:
        applied = await asyncio.gather(*[s.migrate() for s in stores])
        names = [m.name for m in migrations.load("postgres")]
        assert sorted(n for batch in applied for n in batch) == names
        assert await stores[0].migrate() == []
    finally:
        for s in stores:
            await s.aclose()
    conn = await asyncpg.connect(pg_url, server_settings={"search_path": pg_schema})
    try:
        rows = await conn.fetch("SELECT name FROM flowlock_schema_migrations ORDER BY name")
        assert [r["name"] for r in rows] == names
    finally:
        await conn.close()


async def test_missing_tables_say_how_to_fix(pg_url: str, pg_schema: str) -> None:
    """Without migrations a call fails with MigrationError naming `flowlock db migrate`."""
    store = PostgresStore(pg_url, schema=pg_schema, auto_migrate=False)
    async with flowlock.Engine(store) as eng:
        await eng.register(examples.approval())
        with pytest.raises(flowlock.MigrationError, match="flowlock db migrate"):
            await eng.get("x")


async def test_unreachable_server_is_a_store_error() -> None:
    """A server that is not there fails open() with StoreError saying what to check."""
    store = PostgresStore("postgresql://nobody@127.0.0.1:1/none", connect_timeout=2)
    with pytest.raises(flowlock.StoreError, match="server is running"):
        await store.open()


def test_bad_schema_name_is_refused() -> None:
    """Schema names are identifiers, never SQL text."""
    with pytest.raises(flowlock.InvalidInput):
        PostgresStore("postgresql://x@localhost/db", schema='x"; DROP SCHEMA public; --')
