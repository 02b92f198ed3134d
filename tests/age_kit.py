"""Ages instances for retention tests without waiting: moves `updated_at` back in the store's
own rows (test-data setup, like an INSERT of old rows). The purge under test still measures the
age on the store's clock (PostgreSQL's now(), SQLite's and the memory store's wall clock);
only the rows it reads are older. Waiting out a bound of a second instead made every such test
sleep, and a short bound raced the instances meant to stay young."""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
from collections.abc import Sequence
from datetime import timedelta

import asyncpg

from flowlock.stores.base import Store
from flowlock.stores.memory import MemoryStore
from flowlock.stores.postgres import PostgresStore
from flowlock.stores.sqlite import SqliteStore
from flowlock.stores.sqlite.sql import parse_timestamp, timestamp_text

AGE = timedelta(hours=1)  # how far back: far past any bound the tests purge with

_PG = "UPDATE flowlock_instances SET updated_at = updated_at - $2::interval WHERE id = ANY($1)"


async def backdate_pg(
    url: str, schema: str | None, ids: Sequence[str], by: timedelta = AGE
) -> None:
    conn = await asyncpg.connect(url)
    try:
        if schema is not None:
            await conn.execute(f'SET search_path TO "{schema}"')
        status = await conn.execute(_PG, list(ids), by)
    finally:
        await conn.close()
    assert status == f"UPDATE {len(set(ids))}", (status, "some instance to age is missing")


def backdate_sqlite(path: str, ids: Sequence[str], by: timedelta = AGE) -> None:
    # SQLite keeps the store's own ISO 8601 text: parsed and written back in the same form,
    # so the purge's text comparison still orders it.
    conn = sqlite3.connect(path, timeout=10)
    try:
        with conn:
            marks = ",".join("?" * len(ids))
            found = conn.execute(
                f"SELECT id, updated_at FROM flowlock_instances WHERE id IN ({marks})", list(ids)
            ).fetchall()
            conn.executemany(
                "UPDATE flowlock_instances SET updated_at = ? WHERE id = ?",
                [(timestamp_text(parse_timestamp(at) - by), iid) for iid, at in found],
            )
    finally:
        conn.close()
    assert len(found) == len(set(ids)), (found, "some instance to age is missing")


def backdate_memory(store: MemoryStore, ids: Sequence[str], by: timedelta = AGE) -> None:
    instances = store._instances
    for iid in ids:
        inst = instances[iid]
        assert inst.updated_at is not None
        instances[iid] = dataclasses.replace(inst, updated_at=inst.updated_at - by)


async def backdate(store: Store, ids: Sequence[str], by: timedelta = AGE) -> None:
    """Makes the instances `ids` of `store` older by `by` (default an hour)."""
    if isinstance(store, MemoryStore):
        backdate_memory(store, ids, by)
    elif isinstance(store, SqliteStore):
        await asyncio.to_thread(backdate_sqlite, store.path, ids, by)
    elif isinstance(store, PostgresStore):
        assert store.dsn is not None, "a store built on a pool of the caller's: no URL to age it"
        await backdate_pg(store.dsn, store.schema, ids, by)
    else:
        raise TypeError(f"no way to age instances of {type(store).__name__}")
