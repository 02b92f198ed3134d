"""Schema migrations on PostgreSQL: recorded, idempotent, safe when processes start at once."""

from __future__ import annotations

import asyncio

import pytest
from typer.testing import CliRunner, Result

import flowlock
import pg_budget
from flowlock import examples
from flowlock.cli import app
from flowlock.core import migrations
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
    conn = await pg_budget.connect(pg_url, server_settings={"search_path": pg_schema})
    try:
        rows = await conn.fetch("SELECT name FROM flowlock_schema_migrations ORDER BY name")
        assert [r["name"] for r in rows] == names
    finally:
        await conn.close()


async def test_missing_tables_say_how_to_fix(pg_url: str, pg_schema: str) -> None:
    """Without migrations a call fails with MigrationError naming `flowlock db migrate`: a
    register (it stores the definition) as well as a read."""
    store = PostgresStore(pg_url, schema=pg_schema, auto_migrate=False)
    async with flowlock.Engine(store) as eng:
        with pytest.raises(flowlock.MigrationError, match="flowlock db migrate"):
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


async def _migrations_table(url: str, schema: str) -> list[tuple[str, object]]:
    """(name, applied_at) of every row of the schema's flowlock_schema_migrations."""
    conn = await pg_budget.connect(url)
    try:
        rows = await conn.fetch(
            f'SELECT name, applied_at FROM "{schema}".flowlock_schema_migrations ORDER BY name'
        )
    finally:
        await conn.close()
    return [(r["name"], r["applied_at"]) for r in rows]


async def _tables(url: str, schema: str) -> set[str]:
    conn = await pg_budget.connect(url)
    try:
        rows = await conn.fetch(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = $1", schema
        )
    finally:
        await conn.close()
    return {r["table_name"] for r in rows}


async def test_flowlock_db_migrate_migrates_and_a_second_run_applies_nothing(
    pg_url: str, pg_schema: str
) -> None:
    """`flowlock db migrate --schema S` (the URL from FLOWLOCK_DATABASE_URL, as the README
    runs it) creates S, applies and records every migration and lists them; a second run says
    it is up to date and changes no row; an engine that does not migrate then works there."""
    names = [m.name for m in migrations.load("postgres")]
    assert await _tables(pg_url, pg_schema) == set()

    def migrate() -> Result:
        return CliRunner().invoke(
            app, ["db", "migrate", "--schema", pg_schema], env={"FLOWLOCK_DATABASE_URL": pg_url}
        )

    first = await asyncio.to_thread(migrate)
    assert first.exit_code == 0, first.output
    assert f"applied {len(names)} migration(s)" in first.stdout
    assert f"(schema {pg_schema})" in first.stdout
    listed = [line.strip() for line in first.stdout.splitlines()[1:] if line.strip()]
    assert listed == names
    recorded = await _migrations_table(pg_url, pg_schema)
    assert [name for name, _ in recorded] == names
    assert await _tables(pg_url, pg_schema) >= {
        "flowlock_instances",
        "flowlock_history",
        "flowlock_schema_migrations",
        "flowlock_fences",
        "flowlock_escalations",
        "flowlock_job_runs",
    }

    second = await asyncio.to_thread(migrate)
    assert second.exit_code == 0, second.output
    assert "is up to date; no migration to apply" in second.stdout
    assert await _migrations_table(pg_url, pg_schema) == recorded

    store = PostgresStore(pg_url, schema=pg_schema, auto_migrate=False)
    async with flowlock.Engine(store) as eng:
        await eng.register(examples.approval())
        await eng.create("approval", instance_id="req-1")
        assert (await eng.fire("req-1", "approve")).applied
