"""The floor: the least bare asyncpg can do for each scenario's calls.

It skips the engine but writes the same rows, so the checker judges it alike.
docs/benchmarks.md describes each floor and its round trips.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import asyncpg

from flowlock.bench.results import CallSpec
from flowlock.bench.scenarios.base import Fired, Floor
from flowlock.core.definition import Workflow
from flowlock.core.errors import ConflictRetriesExhausted, InstanceNotFound, InvalidInput
from flowlock.core.models import HistoryEntry, Instance, Snapshot
from flowlock.core.step import Call, Idempotent, decide
from flowlock.engine import Engine

__all__ = ["CLAIMS_TABLE", "RawSession"]

CLAIMS_TABLE = "flowlock_bench_claims"
NAME = "raw"
_CAS_LIMIT = 1000

_READ = """
SELECT id, workflow, state, version, data, last_event FROM flowlock_instances WHERE id = $1
"""
_LOCK = _READ.rstrip() + " FOR UPDATE\n"
# $1 id, $2 version read, $3 new state, $4 new data, $5 event, $6 from state, $7 actor.
_WRITE = """
WITH moved AS (
    UPDATE flowlock_instances
       SET state = $3, version = $2 + 1, data = $4, last_event = $5, updated_at = now()
     WHERE id = $1 AND version = $2
 RETURNING id, version, state, data, updated_at
)
INSERT INTO flowlock_history (instance_id, version, event, from_state, to_state, actor,
                              strategy, data, at)
SELECT id, version, $5, $6, state, $7, 'raw', data, updated_at FROM moved
RETURNING version
"""
# $1 id, $2 the one source state, $3 target state, $4 event, $5 actor.
_STATEMENT = """
WITH moved AS (
    UPDATE flowlock_instances
       SET state = $3, version = version + 1, last_event = $4, updated_at = now()
     WHERE id = $1 AND state = $2
 RETURNING id, version, state, data, updated_at
)
INSERT INTO flowlock_history (instance_id, version, event, from_state, to_state, actor,
                              strategy, data, at)
SELECT id, version, $4, $2, state, $5, 'raw', data, updated_at FROM moved
RETURNING version
"""
_CLAIM = f"""
INSERT INTO {CLAIMS_TABLE} (job, tick) VALUES ($1, $2) ON CONFLICT DO NOTHING RETURNING 1
"""


def _instance(row: asyncpg.Record) -> Instance:
    return Instance(
        id=row["id"],
        workflow=row["workflow"],
        state=row["state"],
        version=row["version"],
        data=row["data"],
        last_event=row["last_event"],
    )


def _write_args(entry: HistoryEntry) -> tuple[Any, ...]:
    return (
        entry.instance_id,
        entry.version - 1,
        entry.to_state,
        entry.data,
        entry.event,
        entry.from_state,
        entry.actor,
    )


class RawSession:
    """The floor for one scenario, on the run's asyncpg pool.

    The pool's connections decode jsonb to dicts. `engine` only sets up and reads back.
    """

    def __init__(self, engine: Engine, pool: asyncpg.Pool, floor: Floor) -> None:
        self._engine = engine
        self._pool = pool
        self._floor = floor
        self._workflows: Mapping[str, Workflow] | None = None
        self._statements: dict[str, tuple[str, str]] = {}

    @property
    def strategy(self) -> str:
        return NAME

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def pool(self) -> asyncpg.Pool:
        return self._pool

    async def aclose(self) -> None:
        """Nothing of its own to close: the pool is the run's."""

    def _decide(self, snap: Snapshot, call: CallSpec) -> HistoryEntry | Idempotent:
        if self._workflows is None:
            self._workflows = self._engine.workflows
        step = Call(
            instance_id=call.instance_id,
            event=call.event,
            payload=call.payload or {},
            actor=call.actor,
            request_id=None,
            expected_version=None,
            strategy=NAME,
        )
        return decide(self._workflows, snap, step)

    async def fire(self, call: CallSpec) -> Fired:
        if self._floor == "statement":
            return await self._statement(call)
        if self._floor == "locked":
            return await self._locked(call)
        if self._floor == "cas":
            return await self._cas(call)
        raise InvalidInput(f"the raw floor {self._floor!r} does not fire events")

    def _source_target(self, call: CallSpec) -> tuple[str, str]:
        found = self._statements.get(call.event)
        if found is None:
            if self._workflows is None:
                self._workflows = self._engine.workflows
            for wf in self._workflows.values():
                t = wf.transitions.get(call.event)
                if t is not None:
                    if len(t.sources) != 1:
                        raise InvalidInput(
                            f"the raw statement floor needs one source state for {call.event!r}"
                        )
                    found = (t.sources[0], t.target)
                    break
            else:
                raise InvalidInput(f"no registered workflow has the event {call.event!r}")
            self._statements[call.event] = found
        return found

    async def _statement(self, call: CallSpec) -> Fired:
        source, target = self._source_target(call)
        moved = await self._pool.fetchval(
            _STATEMENT, call.instance_id, source, target, call.event, call.actor
        )
        return Fired("applied" if moved is not None else "idempotent")

    async def _locked(self, call: CallSpec) -> Fired:
        async with self._pool.acquire() as conn:
            await conn.execute("BEGIN")
            try:
                row = await conn.fetchrow(_LOCK, call.instance_id)
                if row is None:
                    raise InstanceNotFound(call.instance_id)
                planned = self._decide(Snapshot(_instance(row)), call)
                if isinstance(planned, Idempotent):
                    await conn.execute("COMMIT")
                    return Fired("idempotent")
                await conn.fetchval(_WRITE, *_write_args(planned))
                await conn.execute("COMMIT")
            except BaseException:
                if not conn.is_closed() and conn.is_in_transaction():
                    await conn.execute("ROLLBACK")
                raise
        return Fired("applied")

    async def _cas(self, call: CallSpec) -> Fired:
        for attempt in range(1, _CAS_LIMIT + 1):
            row = await self._pool.fetchrow(_READ, call.instance_id)
            if row is None:
                raise InstanceNotFound(call.instance_id)
            planned = self._decide(Snapshot(_instance(row)), call)
            if isinstance(planned, Idempotent):
                return Fired("idempotent", attempt)
            if await self._pool.fetchval(_WRITE, *_write_args(planned)) is not None:
                return Fired("applied", attempt)
        raise ConflictRetriesExhausted(call.instance_id, call.event, _CAS_LIMIT)

    async def run_once(self, job: str, tick: int, fn: Callable[[], Awaitable[None]]) -> bool:
        if await self._pool.fetchval(_CLAIM, job, tick) is None:
            return False
        await fn()
        return True
