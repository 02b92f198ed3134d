"""The initial data migrations (PostgreSQL 016, SQLite 011) upgrade a database in use: an
instance created before them has no initial data and replays from its first row (counted in
`unreplayed_first`); one created after replays whole."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

import flowlock
import pg_budget
from flowlock import Transition, Workflow
from flowlock._pg import migrations as pg_migrations
from flowlock.core import migrations
from flowlock.stores.postgres import PostgresStore
from flowlock.stores.sqlite import SqliteStore

PG_INITIAL = "016_initial_data"
SQLITE_INITIAL = "011_initial_data"
# An instance at version 3 of a two-step workflow, written as the engine writes it.
_INSTANCE = (
    "INSERT INTO flowlock_instances (id, workflow, state, version, data, last_event, created_at,"
    " updated_at) VALUES ('old', 'two', 'c', 3, '{}', 'on', '2024-01-01T00:00:00+00:00',"
    " '2024-01-01T00:00:00+00:00')"
)
_HISTORY = (
    "INSERT INTO flowlock_history (instance_id, version, event, from_state, to_state, strategy,"
    " data, at) VALUES ('old', 2, 'go', 'a', 'b', 'optimistic', '{}', '2024-01-01T00:00:00+00:00'),"
    " ('old', 3, 'on', 'b', 'c', 'optimistic', '{}', '2024-01-01T00:00:00+00:00')"
)


def _two() -> Workflow:
    return Workflow(
        "two",
        states=["a", "b", "c"],
        initial="a",
        transitions=[
            Transition("go", source="a", target="b"),
            Transition("on", source="b", target="c"),
        ],
    )


async def _check(engine: flowlock.Engine) -> None:
    await engine.register(_two())
    before = await engine.check_definition(_two())
    assert before.ok and (before.unreplayed_first, before.checked_transitions) == (1, 1)
    await engine.create("two", instance_id="new")
    await engine.fire("new", "go")
    after = await engine.check_definition(_two())
    assert after.ok and (after.unreplayed_first, after.checked_transitions) == (1, 2)


def test_the_initial_data_migrations_are_shipped() -> None:
    """Both dialects ship the migration, named for the order the merge expects."""
    assert PG_INITIAL in [m.name for m in migrations.load("postgres")]
    assert SQLITE_INITIAL in [m.name for m in migrations.load("sqlite")]


async def test_postgres_upgrade(
    pg_url: str, pg_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A schema migrated up to before 016, holding an instance written then, migrates in use."""
    before = [m for m in migrations.load("postgres") if m.name < PG_INITIAL]
    with monkeypatch.context() as patched:
        patched.setattr(pg_migrations, "load", lambda dialect: before)
        old = PostgresStore(pg_url, schema=pg_schema)
        await old.open()
        await old.aclose()
    conn = await pg_budget.connect(pg_url)
    try:
        await conn.execute(f'SET search_path TO "{pg_schema}"')
        await conn.execute(_INSTANCE)
        await conn.execute(_HISTORY)
    finally:
        await conn.close()
    async with flowlock.Engine(PostgresStore(pg_url, schema=pg_schema)) as engine:
        await _check(engine)


async def test_sqlite_upgrade(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A database migrated up to before 011, holding an instance written then, migrates in use."""
    path = tmp_path / "old.db"
    before = [m for m in migrations.load("sqlite") if m.name < SQLITE_INITIAL]
    with monkeypatch.context() as patched:
        patched.setattr(migrations, "load", lambda dialect: before)
        old = SqliteStore(path)
        await old.open()
        await old.aclose()
    db = sqlite3.connect(path)
    try:
        db.execute(_INSTANCE)
        db.execute(_HISTORY)
        db.commit()
    finally:
        db.close()
    async with flowlock.Engine(SqliteStore(path)) as engine:
        await _check(engine)
