"""The PostgreSQL store's retention: the [`RetentionStore`][flowlock.stores.base.RetentionStore]
methods (a mixin of PostgresStore). The age bound is on the server's clock (`now()`).

A purge batch is one transaction: lock the batch's rows in id order (as every statement that
writes several instances does, so they cannot deadlock with each other), delete those still at
the version read with their history, create records and messages (their timers cascade), run the
caller's `before_commit` (the archive's write and fsync), commit.

A hold and a purge meet on the instance's row. `place_hold` locks it (FOR KEY SHARE, which a
fire's update does not wait for) in the transaction that inserts the hold; the purge locks its
rows FOR UPDATE in a statement of its own, then deletes in the next one. So a hold that took the
lock first has committed before the delete's snapshot is taken, and the delete sees it; a hold
that comes later waits for the purge to end, and then finds the row gone or there.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, TypeVar

import asyncpg

from flowlock._pg.errors import in_doubt
from flowlock._pg.rows import HISTORIES_BY_IDS, entry_from_row, instance_from_row, json_object
from flowlock.core.errors import LockTimeout
from flowlock.core.retention import ArchivedInstance, CreateRecord, Hold, PurgeSelection
from flowlock.stores.base import BeforeCommit
from flowlock.stores.postgres.calls import Calls
from flowlock.stores.postgres.operations import Operations
from flowlock.stores.postgres.session import Session, context_of, roll_back
from flowlock.stores.postgres.sql import to_json

_T = TypeVar("_T")

__all__ = ["RetentionMethods"]

_HOLD: Final = """
WITH put AS (
    INSERT INTO flowlock_holds (instance_id, reason, actor) VALUES ($1, $2, $3)
    ON CONFLICT (instance_id) DO NOTHING
    RETURNING instance_id, reason, actor, at
)
SELECT * FROM put
UNION ALL
SELECT instance_id, reason, actor, at FROM flowlock_holds WHERE instance_id = $1
LIMIT 1
"""
# The instance's row, locked against a purge (whose FOR UPDATE conflicts with this lock) until
# the hold commits; no row: the instance does not exist (or a purge deleted it first).
_HOLD_LOCK: Final = "SELECT id FROM flowlock_instances WHERE id = $1 FOR KEY SHARE"
_HOLD_READ: Final = (
    "SELECT instance_id, reason, actor, at FROM flowlock_holds WHERE instance_id = $1"
)
_UNHOLD: Final = "DELETE FROM flowlock_holds WHERE instance_id = $1"
_HOLDS: Final = """
SELECT instance_id, reason, actor, at FROM flowlock_holds
 WHERE instance_id COLLATE "C" > $1 ORDER BY instance_id COLLATE "C" LIMIT $2
"""
# An instance with a message still to deliver is kept: purging it would lose the delivery.
_NOTHING_PENDING: Final = (
    "NOT EXISTS (SELECT FROM flowlock_outbox o WHERE o.instance_id = i.id AND o.status = 'pending')"
)
# The instances a selection takes, holds aside: $1 workflow, $2 states (NULL: any), $3 the age
# in seconds.
_SELECTED: Final = f"""
i.workflow = $1 AND ($2::text[] IS NULL OR i.state = ANY($2::text[]))
AND i.updated_at < now() - make_interval(secs => $3::float8) AND {_NOTHING_PENDING}
"""
_HELD: Final = "EXISTS (SELECT FROM flowlock_holds h WHERE h.instance_id = i.id)"
_COUNT: Final = f"""
SELECT count(*) FILTER (WHERE NOT {_HELD}) AS free, count(*) FILTER (WHERE {_HELD}) AS held
  FROM flowlock_instances i WHERE {_SELECTED}
"""
# The candidates of one state, an index range of (workflow, state, id COLLATE "C") already in
# id order: $1 workflow, $2 the age in seconds, $3 the cursor, $4 the limit, then the state.
_BRANCH: Final = f"""
SELECT i.id, i.workflow, i.state, i.version, i.data, i.last_event, i.created_at, i.updated_at,
       i.stay_version, i.paused, i.fencing_token, i.definition_version
  FROM flowlock_instances i
 WHERE i.workflow = $1 AND {{state}}
   AND i.updated_at < now() - make_interval(secs => $2::float8)
   AND {_NOTHING_PENDING} AND NOT {_HELD} AND i.id COLLATE "C" > $3
 ORDER BY i.id COLLATE "C" LIMIT $4
"""


def _candidates_sql(states: int | None) -> str:
    """The candidates statement for `states` states (None: any state). Several states: one
    branch per state, merged in id order (Merge Append), as `list_statement` does, so a batch
    reads about as many rows as it returns however many instances match in all."""
    if states is None:
        picked = _BRANCH.format(state="true")
    else:
        picked = " UNION ALL ".join(
            f"({_BRANCH.format(state=f'i.state = ${5 + n}')})" for n in range(states)
        )
    return f"""
SELECT c.*, r.request_id AS made_key, r.state AS made_state, r.data AS made_data
  FROM ({picked}) AS c LEFT JOIN flowlock_create_requests r ON r.instance_id = c.id
 ORDER BY c.id COLLATE "C" LIMIT $4
"""


# $1 ids. The rows locked first, in id order (see CAS_MANY in sql.py), in a statement of their
# own: the delete's snapshot, taken after, sees every hold whose transaction held a row's lock.
_PURGE_LOCK: Final = (
    "SELECT id FROM flowlock_instances WHERE id = ANY($1::text[]) ORDER BY id FOR UPDATE"
)
# $1 ids, $2 the versions read. The delete re-checks the version (on rows locked since the
# statement before, so the newest), and an instance that moved is kept. A slot an instance
# gone still held (a capacity on a final state) is released with it (017_constraints.sql).
# Children go in the same statement: the foreign keys are checked at its end, when they are
# gone too. Each child's "= ANY($1)" lets the planner reach its rows through the index on
# instance_id whatever it estimates of `gone` (a CTE's row count is a guess).
_PURGE: Final = f"""
WITH wanted AS (
    SELECT * FROM unnest($1::text[], $2::bigint[]) AS w(id, version)
), gone AS (
    DELETE FROM flowlock_instances i USING wanted w
     WHERE i.id = ANY($1::text[]) AND i.id = w.id AND i.version = w.version
       AND NOT {_HELD}
       AND NOT EXISTS (SELECT FROM flowlock_outbox o
                        WHERE o.instance_id = i.id AND o.status = 'pending')
    RETURNING i.id
), history AS (
    DELETE FROM flowlock_history
     WHERE instance_id = ANY($1::text[]) AND instance_id IN (SELECT id FROM gone)
), made AS (
    DELETE FROM flowlock_create_requests
     WHERE instance_id = ANY($1::text[]) AND instance_id IN (SELECT id FROM gone)
), messages AS (
    DELETE FROM flowlock_outbox
     WHERE instance_id = ANY($1::text[]) AND instance_id IN (SELECT id FROM gone)
), freed AS (
    SELECT flowlock_free_slots(ARRAY(SELECT id FROM gone), $1::text[], $2::bigint[]) AS n
)
SELECT id FROM gone CROSS JOIN freed ORDER BY id COLLATE "C"
"""
# The instance verbatim (its version, timestamps and fencing token), unless the id exists.
_RESTORE: Final = """
INSERT INTO flowlock_instances (id, workflow, state, version, data, last_event, created_at,
                                updated_at, stay_version, paused, fencing_token, definition_version)
VALUES ($1, $2, $3, $4, $5::text::jsonb, $6, $7, $8, $9, $10, $11, $12)
ON CONFLICT (id) DO NOTHING
RETURNING id
"""
# The history rows verbatim: one array per column, JSON as text cast where it lands (a text
# parameter is sent as it is, whatever jsonb codec the connection has).
_RESTORE_HISTORY: Final = """
INSERT INTO flowlock_history (instance_id, version, event, from_state, to_state, actor,
                              request_id, strategy, data, at, fencing_token, payload,
                              definition_version)
SELECT $1, version, event, from_state, to_state, actor, request_id, strategy, data::jsonb, at,
       fencing_token, payload::jsonb, dv
  FROM unnest($2::bigint[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[],
              $8::text[], $9::text[], $10::timestamptz[], $11::bigint[], $12::text[], $13::int[])
    AS h(version, event, from_state, to_state, actor, request_id, strategy, data, at,
         fencing_token, payload, dv)
"""
_RESTORE_MADE: Final = """
INSERT INTO flowlock_create_requests (request_id, instance_id, state, data)
VALUES ($1, $2, $3, $4::text::jsonb) ON CONFLICT DO NOTHING
"""


def _hold_of(row: asyncpg.Record, found: bool | None = None) -> Hold:
    return Hold(row["instance_id"], row["reason"], row["actor"], row["at"], found)


async def _own(conn: Any, s: Session, key: str, work: Callable[[], Awaitable[_T]]) -> _T:
    """`work()` in a transaction of its own on `conn`, committed here; in the caller's
    transaction (a joined session), just `work()`: the caller commits or rolls back."""
    if s.joined:
        return await work()
    await conn.execute(s.begin, timeout=s.timeout)
    try:
        done = await work()
        with in_doubt(context_of(key)):
            await conn.execute("COMMIT", timeout=s.timeout)
    except asyncio.CancelledError:
        conn.terminate()  # it may be mid-statement: it cannot take a ROLLBACK
        raise
    except BaseException as exc:
        await roll_back(conn, exc, s.timeout)
        raise
    return done


async def _place(s: Session, hold: Hold) -> Hold:
    key = hold.instance_id
    async with s.conn(key, writes=True) as conn:
        return await _own(conn, s, key, lambda: _hold_rows(conn, s, hold))


async def _hold_rows(conn: Any, s: Session, hold: Hold) -> Hold:
    found = await conn.fetchval(s.sql(_HOLD_LOCK), hold.instance_id, timeout=s.timeout)
    row = await conn.fetchrow(
        s.sql(_HOLD), hold.instance_id, hold.reason, hold.actor, timeout=s.timeout
    )
    if row is None:  # a concurrent hold of the id committed while this one waited
        row = await conn.fetchrow(s.sql(_HOLD_READ), hold.instance_id, timeout=s.timeout)
    assert row is not None  # held by this statement or by the one it waited for
    return _hold_of(row, found is not None)


def _states(selection: PurgeSelection) -> list[str] | None:
    return None if selection.states is None else list(selection.states)


async def _candidates(
    s: Session, selection: PurgeSelection, after: str | None, limit: int
) -> list[ArchivedInstance]:
    states = selection.states
    sql = _candidates_sql(None if states is None else len(states))
    args = (selection.workflow, selection.older_than, after or "", limit, *(states or ()))
    async with s.conn() as conn:
        rows = await conn.fetch(s.sql(sql), *args, timeout=s.timeout)
        ids = [row["id"] for row in rows]
        history: dict[str, list[Any]] = {i: [] for i in ids}
        if ids:
            for h in await conn.fetch(s.sql(HISTORIES_BY_IDS), ids, timeout=s.timeout):
                history[h["instance_id"]].append(entry_from_row(h))
    found: list[ArchivedInstance] = []
    for row in rows:
        inst = instance_from_row(row)
        made = None
        if row["made_key"] is not None:
            made = CreateRecord(row["made_key"], row["made_state"], json_object(row["made_data"]))
        # A later statement's rows of a later version belong to a move that makes the delete's
        # compare-and-swap keep the instance anyway.
        own = tuple(e for e in history[inst.id] if e.version <= inst.version)
        found.append(ArchivedInstance(inst, own, row["fencing_token"], made))
    return found


async def _purge(
    s: Session, victims: Sequence[tuple[str, int]], before_commit: BeforeCommit | None
) -> list[str]:
    wanted = dict(victims)
    ids, versions = list(wanted), list(wanted.values())
    key = f"a purge batch of {len(ids)} instance(s)"
    started = time.monotonic()
    try:
        async with s.conn(
            key, busy=lambda _: LockTimeout(key, time.monotonic() - started), writes=True
        ) as conn:
            return await _own(conn, s, key, lambda: _delete(conn, s, ids, versions, before_commit))
    except _Refused as refused:
        raise refused.error from None  # rolled back: the caller's own error, as it raised it


class _Refused(Exception):
    """The caller's `before_commit` raised `error`: carried past the session's translation of
    driver errors (an OSError of the archive's disk is not a lost connection)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


async def _delete(
    conn: Any, s: Session, ids: list[str], versions: list[int], before: BeforeCommit | None
) -> list[str]:
    await conn.execute(s.sql(_PURGE_LOCK), ids, timeout=s.timeout)
    rows = await conn.fetch(s.sql(_PURGE), ids, versions, timeout=s.timeout)
    gone = [row["id"] for row in rows]
    if before is not None:
        # The archive's write and fsync, off the event loop; the rows stay locked meanwhile.
        try:
            await asyncio.to_thread(before, gone)
        except Exception as exc:
            raise _Refused(exc) from exc
    return gone


async def _restore(s: Session, archived: Sequence[ArchivedInstance]) -> list[str]:
    async def work() -> list[str]:
        return [item.instance.id for item in archived if await _restore_one(conn, s, item)]

    async with s.conn("a restore", writes=True) as conn:
        return await _own(conn, s, "a restore", work)


async def _restore_one(conn: Any, s: Session, item: ArchivedInstance) -> bool:
    inst, bound = item.instance, s.timeout
    inserted = await conn.fetchval(
        s.sql(_RESTORE),
        inst.id, inst.workflow, inst.state, inst.version, to_json(inst.data), inst.last_event,
        inst.created_at, inst.updated_at, inst.stay_version, inst.paused, item.fencing_token,
        inst.definition_version, timeout=bound,
    )  # fmt: skip
    if inserted is None:
        return False  # the id exists: skipped, its history with it
    h = item.history
    if h:
        await conn.execute(
            s.sql(_RESTORE_HISTORY),
            inst.id,
            [e.version for e in h],
            [e.event for e in h],
            [e.from_state for e in h],
            [e.to_state for e in h],
            [e.actor for e in h],
            [e.request_id for e in h],
            [e.strategy for e in h],
            [to_json(e.data) for e in h],
            [e.at for e in h],
            [e.fencing_token for e in h],
            [to_json(e.payload) for e in h],
            [e.definition_version for e in h],
            timeout=bound,
        )
    made = item.created
    if made is not None:
        await conn.execute(
            s.sql(_RESTORE_MADE), made.request_id, inst.id, made.state, to_json(made.data),
            timeout=bound,
        )  # fmt: skip
    return True


class RetentionMethods:
    """PostgresStore's part as a RetentionStore (a mixin: the store is `self`)."""

    async def place_hold(self: Calls, hold: Hold) -> Hold:
        return await self._call(
            lambda ops: _place(ops.session, hold), hold.instance_id, writes=True, own=True
        )

    async def lift_hold(self: Calls, instance_id: str) -> bool:
        async def lift(ops: Operations) -> bool:
            s = ops.session
            async with s.conn(instance_id, writes=True) as conn:
                tag = await conn.execute(s.sql(_UNHOLD), instance_id, timeout=s.timeout)
            return bool(tag == "DELETE 1")

        return await self._call(lift, instance_id, writes=True)

    async def find_holds(self: Calls, *, after: str | None, limit: int) -> list[Hold]:
        async def read(ops: Operations) -> list[Hold]:
            s = ops.session
            async with s.conn() as conn:
                rows = await conn.fetch(s.sql(_HOLDS), after or "", limit, timeout=s.timeout)
            return [_hold_of(row) for row in rows]

        return await self._call(read, waits=False)

    async def purge_candidates(
        self: Calls, selection: PurgeSelection, *, after: str | None, limit: int
    ) -> list[ArchivedInstance]:
        return await self._call(
            lambda ops: _candidates(ops.session, selection, after, limit), waits=False
        )

    async def count_purgeable(self: Calls, selection: PurgeSelection) -> tuple[int, int]:
        async def count(ops: Operations) -> tuple[int, int]:
            s = ops.session
            args = (selection.workflow, _states(selection), selection.older_than)
            async with s.conn() as conn:
                row = await conn.fetchrow(s.sql(_COUNT), *args, timeout=s.timeout)
            assert row is not None  # an aggregate has one row
            return int(row["free"]), int(row["held"])

        return await self._call(count, waits=False)

    async def purge_batch(
        self: Calls, victims: Sequence[tuple[str, int]], before_commit: BeforeCommit | None = None
    ) -> list[str]:
        if not victims:
            return []
        return await self._call(
            lambda ops: _purge(ops.session, victims, before_commit), writes=True, own=True
        )

    async def restore_instances(self: Calls, archived: Sequence[ArchivedInstance]) -> list[str]:
        if not archived:
            return []
        return await self._call(lambda ops: _restore(ops.session, archived), writes=True, own=True)
