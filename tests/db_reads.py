"""What the database holds for an instance, read with the test's own SQL (not through flowlock):
the refusal tests compare it before and after a refused call."""

from __future__ import annotations

import sqlite3
from typing import Any

import flowlock
import pg_budget
from flowlock.stores.postgres import PostgresStore
from flowlock.stores.sqlite import SqliteStore


async def stored(engine: flowlock.Engine, instance_id: str) -> tuple[int, Any, int] | None:
    """(version, data, history rows) of the instance as the database holds it, read with the
    test's own SQL on SQLite and PostgreSQL (the memory store through its reads); None when the
    instance does not exist."""
    store = engine.store
    if isinstance(store, PostgresStore):
        conn = await pg_budget.connect(store.dsn)
        try:
            await conn.execute(f'SET search_path TO "{store.schema}"')
            row = await conn.fetchrow(
                "SELECT version, data::text AS data, (SELECT count(*) FROM flowlock_history h"
                " WHERE h.instance_id = i.id) AS n FROM flowlock_instances i WHERE id = $1",
                instance_id,
            )
        finally:
            await conn.close()
        return None if row is None else (row["version"], row["data"], row["n"])
    if isinstance(store, SqliteStore):
        db = sqlite3.connect(store.path)
        try:
            found = db.execute(
                "SELECT version, data, (SELECT count(*) FROM flowlock_history h"
                " WHERE h.instance_id = i.id) FROM flowlock_instances i WHERE id = ?",
                (instance_id,),
            ).fetchone()
        finally:
            db.close()
        return None if found is None else (found[0], found[1], found[2])
    try:
        inst = await engine.get(instance_id)
    except flowlock.InstanceNotFound:
        return None
    return inst.version, dict(inst.data), len(await engine.history(instance_id))
