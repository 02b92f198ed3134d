"""The PostgreSQL store's workflow pauses: the [`PauseStore`][flowlock.stores.base.PauseStore]
methods. A workflow's pause is one row of `flowlock_workflow_pauses` (012_admin.sql); the reads
that feed a decision find it with each instance (`flowlock._pg.rows.workflow_paused`), and every
compare-and-swap of a fired event checks it again (sql.py, `_OPEN`).

That check runs on the write statement's own snapshot, taken once the statement holds its lock
on `flowlock_instances`. So once the pause committed, a write that starts later is refused; one
that had started (or a transaction holding a row lock, read before the pause) may still commit.
`pause_workflow` therefore waits, after its commit, for the transactions that held such a lock
then to end: when it returns, nothing decided before the pause can commit any more. The wait
is bounded (FENCE_BOUND); past it the pause stands and a warning names the transactions left."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

import asyncpg

from flowlock.core.admin import WorkflowPause
from flowlock.stores.postgres.calls import Calls
from flowlock.stores.postgres.operations import Operations

__all__ = ["FENCE_BOUND", "PauseMethods"]

log = logging.getLogger("flowlock")

FENCE_BOUND = 30.0
"""The most seconds `pause_workflow` waits for the writes in flight when it committed."""
# The transactions holding a lock that a decision's write takes on the instances table (a row's
# update, a row lock): those in flight when the pause committed, and then those still running.
_IN_FLIGHT = """
SELECT coalesce(array_agg(DISTINCT virtualtransaction), '{}'::text[]) FROM pg_locks
 WHERE locktype = 'relation' AND relation = to_regclass($1)
   AND mode IN ('RowExclusiveLock', 'RowShareLock') AND pid <> pg_backend_pid()
"""
_STILL = """
SELECT coalesce(array_agg(DISTINCT virtualtransaction), '{}'::text[]) FROM pg_locks
 WHERE locktype = 'virtualxid' AND virtualtransaction = ANY($1::text[])
"""

_COLUMNS = "workflow, reason, actor, at"
# The pause in place when there is one already (the insert does nothing then); the SELECT may
# miss a pause another transaction committed after this statement's snapshot, so the caller
# reads again when neither half answered.
_PAUSE = f"""
WITH made AS (
    INSERT INTO flowlock_workflow_pauses (workflow, reason, actor) VALUES ($1, $2, $3)
    ON CONFLICT (workflow) DO NOTHING
    RETURNING {_COLUMNS}
)
SELECT {_COLUMNS} FROM made
UNION ALL
SELECT {_COLUMNS} FROM flowlock_workflow_pauses WHERE workflow = $1
"""
_FIND = f"SELECT {_COLUMNS} FROM flowlock_workflow_pauses WHERE workflow = $1"
_RESUME = f"DELETE FROM flowlock_workflow_pauses WHERE workflow = $1 RETURNING {_COLUMNS}"
_ALL = f'SELECT {_COLUMNS} FROM flowlock_workflow_pauses ORDER BY workflow COLLATE "C"'


def _pause_of(row: asyncpg.Record) -> WorkflowPause:
    return WorkflowPause(row["workflow"], row["reason"], row["actor"], row["at"])


async def _pause(ops: Operations, workflow: str, reason: str, actor: str | None) -> WorkflowPause:
    s = ops.session
    async with s.conn(workflow, writes=True) as conn:
        row = await conn.fetchrow(s.sql(_PAUSE), workflow, reason, actor, timeout=s.timeout)
        if row is None:  # a concurrent pause won the insert after this snapshot: read it
            row = await conn.fetchrow(s.sql(_FIND), workflow, timeout=s.timeout)
    assert row is not None  # a pause is never deleted by another pause
    return _pause_of(row)


async def _fence(ops: Operations, table: str, workflow: str) -> None:
    """Wait until every transaction that held a write's lock on `table` (the instances table,
    schema-qualified) when this is called has ended, at most FENCE_BOUND seconds."""
    s = ops.session
    async with s.conn(workflow) as conn:
        waiting = list(await conn.fetchval(_IN_FLIGHT, table, timeout=s.timeout))
        deadline, pause = time.monotonic() + FENCE_BOUND, 0.002
        while waiting and time.monotonic() < deadline:
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.05)
            waiting = list(await conn.fetchval(_STILL, waiting, timeout=s.timeout))
    if waiting:
        log.warning(
            "flowlock: workflow %r is paused, but %d transaction(s) that began before it were "
            "still open after %.0f s (%s); a fire they decided may still commit",
            workflow, len(waiting), FENCE_BOUND, ", ".join(waiting[:5]),
        )  # fmt: skip


async def _resume(ops: Operations, workflow: str) -> WorkflowPause | None:
    s = ops.session
    async with s.conn(workflow, writes=True) as conn:
        row = await conn.fetchrow(s.sql(_RESUME), workflow, timeout=s.timeout)
    return None if row is None else _pause_of(row)


async def _all(ops: Operations) -> list[WorkflowPause]:
    s = ops.session
    async with s.conn() as conn:
        rows = await conn.fetch(s.sql(_ALL), timeout=s.timeout)
    return [_pause_of(row) for row in rows]


class _Store(Calls, Protocol):
    """What the pause methods need of the store (PostgresStore)."""

    schema: str | None


class PauseMethods:
    """PostgresStore's part as a PauseStore (a mixin: the store is `self`)."""

    async def pause_workflow(
        self: _Store, workflow: str, reason: str, actor: str | None
    ) -> WorkflowPause:
        # May wait for a concurrent pause's insert of the same key to end: bounded by
        # lock_timeout like every write. The fence runs once the pause is committed.
        pause = await self._call(
            lambda ops: _pause(ops, workflow, reason, actor), workflow, writes=True
        )
        schema = self.schema
        table = "flowlock_instances" if schema is None else f'"{schema}".flowlock_instances'
        await self._call(lambda ops: _fence(ops, table, workflow), workflow, waits=False)
        return pause

    async def resume_workflow(self: _Store, workflow: str) -> WorkflowPause | None:
        return await self._call(lambda ops: _resume(ops, workflow), workflow, writes=True)

    async def workflow_pauses(self: _Store) -> list[WorkflowPause]:
        return await self._call(_all, waits=False)
