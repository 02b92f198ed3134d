"""``flowlock db sql``: the PostgreSQL migrations as one script for teams that run their own
migrations. Applied to a fresh schema (with psql, and with asyncpg), it leaves flowlock nothing
to migrate, and an engine works on it."""

from __future__ import annotations

import asyncio
import re
import shutil
import uuid
from collections.abc import AsyncIterator

import pytest
from typer.testing import CliRunner

import flowlock
import pg_budget
from flowlock import examples
from flowlock.cli import app
from flowlock.core.migrations import load
from flowlock.stores.postgres import PostgresStore


def _script(*args: str) -> str:
    result = CliRunner().invoke(app, ["db", "sql", *args])
    assert result.exit_code == 0, result.output
    return result.output


def test_the_script_names_every_migration_in_order_and_records_each() -> None:
    """Every migration under a comment naming it, oldest first, each followed by its record."""
    text = _script()
    names = [m.name for m in load("postgres")]
    places = [text.index(f"-- migration {name}\n") for name in names]
    assert places == sorted(places)
    for name in names:
        assert f"VALUES ('{name}') ON CONFLICT (name) DO NOTHING;" in text
    assert "pg_advisory_xact_lock" in text
    # No statement of the script sets it (the timers' trigger function keeps the one it is
    # made under, a setting of the function only).
    assert not re.search(r"^(SET|RESET) search_path", text, re.MULTILINE)


def test_after_prints_only_the_later_migrations_and_a_bad_name_is_a_bad_argument() -> None:
    """--after NAME leaves out NAME and everything before it; an unknown name exits 2."""
    names = [m.name for m in load("postgres")]
    text = _script("--after", names[0])
    assert f"-- migration {names[0]}\n" not in text
    assert all(f"-- migration {name}\n" in text for name in names[1:])
    result = CliRunner().invoke(app, ["db", "sql", "--after", "999_nothing"])
    assert result.exit_code == 2
    assert "no PostgreSQL migration named" in result.output
    result = CliRunner().invoke(app, ["db", "sql", "--schema", 'x"; DROP'])
    assert result.exit_code == 2


@pytest.fixture
async def fresh_schema(pg_url: str) -> AsyncIterator[str]:
    """A schema name nobody has created yet; dropped afterwards."""
    schema = f"t_{uuid.uuid4().hex[:12]}"
    yield schema
    conn = await pg_budget.connect(pg_url)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()


async def _nothing_pending_and_it_works(pg_url: str, schema: str) -> None:
    """flowlock finds every migration applied, and an engine on the schema applies a transition."""
    store = PostgresStore(pg_url, schema=schema, auto_migrate=False, pool_size=2)
    async with flowlock.Engine(store) as engine:
        assert await store.migrate() == []
        await engine.register(examples.approval())
        await engine.create("approval", instance_id="a")
        assert (await engine.fire("a", "approve")).applied
    conn = await pg_budget.connect(pg_url)
    try:
        recorded = await conn.fetch(
            f'SELECT name FROM "{schema}".flowlock_schema_migrations ORDER BY name'
        )
    finally:
        await conn.close()
    assert [r["name"] for r in recorded] == [m.name for m in load("postgres")]


async def test_the_script_applied_with_asyncpg_leaves_nothing_to_migrate(
    pg_url: str, fresh_schema: str
) -> None:
    """Run in one transaction on a fresh schema: flowlock then sees no pending migration, and
    the session's search_path is back to what it was."""
    conn = await pg_budget.connect(pg_url)
    try:
        before = await conn.fetchval("SHOW search_path")
        async with conn.transaction():
            await conn.execute(_script("--schema", fresh_schema))
        assert await conn.fetchval("SHOW search_path") == before
    finally:
        await conn.close()
    await _nothing_pending_and_it_works(pg_url, fresh_schema)


@pytest.mark.skipif(shutil.which("psql") is None, reason="psql is not installed")
async def test_the_script_applied_with_psql_leaves_nothing_to_migrate(
    pg_url: str, fresh_schema: str
) -> None:
    """``flowlock db sql | psql --single-transaction``: the same, through psql."""
    psql = await asyncio.create_subprocess_exec(
        *("psql", pg_url, "--single-transaction", "-v", "ON_ERROR_STOP=1", "-q", "-f", "-"),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(
        psql.communicate(_script("--schema", fresh_schema).encode()), timeout=60
    )
    assert psql.returncode == 0, (out, err)
    await _nothing_pending_and_it_works(pg_url, fresh_schema)


async def test_a_database_at_an_earlier_migration_takes_the_rest_with_after(
    pg_url: str, fresh_schema: str
) -> None:
    """The first migration by the script, the rest by --after it: up to date as well."""
    first = load("postgres")[0].name
    conn = await pg_budget.connect(pg_url)
    try:
        full = _script("--schema", fresh_schema)
        upto_first = full[: full.index("-- migration ", full.index(f"-- migration {first}") + 1)]
        async with conn.transaction():
            await conn.execute(upto_first + "RESET search_path;")
        async with conn.transaction():
            await conn.execute(_script("--schema", fresh_schema, "--after", first))
    finally:
        await conn.close()
    await _nothing_pending_and_it_works(pg_url, fresh_schema)
