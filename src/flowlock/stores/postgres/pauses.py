"""The PostgreSQL store's workflow pauses: the [`PauseStore`][flowlock.stores.base.PauseStore]
methods. A workflow's pause is one row of `flowlock_workflow_pauses` (012_admin.sql); the reads
that feed a decision find it with each instance (`flowlock._pg.rows.workflow_paused`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import asyncpg

from flowlock.core.admin import WorkflowPause
from flowlock.stores.postgres.operations import Operations

__all__ = ["PauseMethods"]

T = TypeVar("T")

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


class _Store(Protocol):
    """What the pause methods need of the store (PostgresStore)."""

    async def _call(
        self,
        op: Callable[[Operations], Awaitable[T]],
        key: str = "",
        *,
        waits: bool = True,
        writes: bool = False,
        own: bool = False,
    ) -> T: ...


class PauseMethods:
    """PostgresStore's part as a PauseStore (a mixin: the store is `self`)."""

    async def pause_workflow(
        self: _Store, workflow: str, reason: str, actor: str | None
    ) -> WorkflowPause:
        # May wait for a concurrent pause's insert of the same key to end: bounded by
        # lock_timeout like every write.
        return await self._call(
            lambda ops: _pause(ops, workflow, reason, actor), workflow, writes=True
        )

    async def resume_workflow(self: _Store, workflow: str) -> WorkflowPause | None:
        return await self._call(lambda ops: _resume(ops, workflow), workflow, writes=True)

    async def workflow_pauses(self: _Store) -> list[WorkflowPause]:
        return await self._call(_all, waits=False)
