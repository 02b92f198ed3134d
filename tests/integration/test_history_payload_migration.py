"""The history payload migrations (PostgreSQL 007, SQLite 004) upgrade a database in use: rows
written before them read back with the empty payload, rows written after keep theirs."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

import flowlock
import pg_budget
from flowlock import examples
from flowlock._pg import migrations as pg_migrations
from flowlock.core import migrations
from flowlock.stores.postgres import PostgresStore
from flowlock.stores.sqlite import SqliteStore

PG_PAYLOAD = "007_history_payload"
SQLITE_PAYLOAD = "004_history_payload"


def test_the_payload_migrations_are_shipped() -> None:
    assert PG_PAYLOAD in [m.name for m in migrations.load("postgres")]
    assert SQLITE_PAYLOAD in [m.name for m in migrations.load("sqlite")]


async def test_postgres_upgrade_keeps_old_rows_and_records_new_payloads(
    pg_url: str, pg_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A schema migrated up to before 007, holding a transition written then, migrates; the old
    row reads with payload {}, its exact retry is idempotent, and a new call keeps its payload."""
    before = [m for m in migrations.load("postgres") if m.name < PG_PAYLOAD]
    with monkeypatch.context() as patched:
        patched.setattr(pg_migrations, "load", lambda dialect: before)
        old = PostgresStore(pg_url, schema=pg_schema)
        await old.open()
        await old.aclose()
    conn = await pg_budget.connect(pg_url)
    try:
        await conn.execute(f'SET search_path TO "{pg_schema}"')
        await conn.execute(
            "INSERT INTO flowlock_instances (id, workflow, state, version, data, last_event)"
            " VALUES ('r', 'approval', 'approved', 2, '{}', 'approve')"
        )
        await conn.execute(
            "INSERT INTO flowlock_history (instance_id, version, event, from_state, to_state,"
            " request_id, strategy, data) VALUES ('r', 2, 'approve', 'pending', 'approved',"
            " 'k-old', 'optimistic', '{}')"
        )
    finally:
        await conn.close()

    async with flowlock.Engine(PostgresStore(pg_url, schema=pg_schema)) as engine:
        await engine.register(examples.approval())
        [old_row] = await engine.history("r")
        assert old_row.payload == {}
        assert (await engine.fire("r", "approve", request_id="k-old")).idempotent
        await engine.create("approval", instance_id="s")
        await engine.fire("s", "reject", payload={"comment": "over budget"})
        [new_row] = await engine.history("s")
        assert dict(new_row.payload) == {"comment": "over budget"}


async def test_sqlite_upgrade_keeps_old_rows_and_records_new_payloads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "old.db"
    before = [m for m in migrations.load("sqlite") if m.name < SQLITE_PAYLOAD]
    with monkeypatch.context() as patched:
        patched.setattr(migrations, "load", lambda dialect: before)
        old = SqliteStore(path)
        await old.open()
        await old.aclose()
    db = sqlite3.connect(path)
    try:
        db.execute(
            "INSERT INTO flowlock_instances (id, workflow, state, version, data, last_event,"
            " created_at, updated_at) VALUES ('r', 'approval', 'approved', 2, '{}', 'approve',"
            " '2024-01-01T00:00:00+00:00', '2024-01-01T00:00:00+00:00')"
        )
        db.execute(
            "INSERT INTO flowlock_history (instance_id, version, event, from_state, to_state,"
            " request_id, strategy, data, at) VALUES ('r', 2, 'approve', 'pending', 'approved',"
            " 'k-old', 'optimistic', '{}', '2024-01-01T00:00:00+00:00')"
        )
        db.commit()
    finally:
        db.close()

    async with flowlock.Engine(SqliteStore(path)) as engine:
        await engine.register(examples.approval())
        [old_row] = await engine.history("r")
        assert old_row.payload == {}
        assert (await engine.fire("r", "approve", request_id="k-old")).idempotent
        await engine.create("approval", instance_id="s")
        await engine.fire("s", "reject", payload={"comment": "over budget"})
        [new_row] = await engine.history("s")
        assert dict(new_row.payload) == {"comment": "over budget"}
