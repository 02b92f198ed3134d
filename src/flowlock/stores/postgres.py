"""PostgreSQL store on asyncpg.

- One pool; every hot statement is a fixed SQL text, so asyncpg prepares it once per connection and
  reuses it from its statement cache.
- `jsonb` is decoded to dicts and encoded from mappings by a codec set on each new connection.
- The optimistic write is ONE statement: a CTE that compare-and-swaps the instance and appends the
  history row, atomic on its own (no explicit transaction, one round trip).
- A batch (k entries of one instance, decided in memory in order) is the same one-statement
  compare-and-swap, from version v to v + k, its k history rows taken from one array per column.
  `commit_many` writes the batches of several instances in one statement that first locks their
  rows in id order (two of them never deadlock), each instance's compare-and-swap on its own; when
  that statement fails whole (a request id applied before, a deadlock with a caller's
  transaction), each batch is committed alone instead.
- The pessimistic path is one transaction: `SET LOCAL lock_timeout` in the same round trip as
  `BEGIN`, `SELECT ... FOR UPDATE [NOWAIT]` which also reports the lock_timeout in force (so a
  timeout that did not take effect is caught, the seed article's bug), the request-id lookup as its
  own statement (it must see rows committed while we waited for the lock), the same CAS, COMMIT.
- Pipelined pessimistic calls (on different instances, queued while others are in flight) run
  as one transaction: BEGIN, `FOR UPDATE SKIP LOCKED` of all their rows, one request-id lookup,
  each plan in order, one multi-instance CAS, COMMIT. The calls it did not lock (a row held
  elsewhere or missing, a second call on one instance) run alone afterwards, as above.
- `jsonb` goes in as JSON text cast in the statement (`$4::text::jsonb`) and is read back
  whether the connection decodes it or not, so the same statements run on flowlock's own pool, on
  an application's pool (`pool=`) and on a caller's connection, whose codecs flowlock leaves
  alone.
- Where the statements run (`_Session`): flowlock's own pool, each call on a connection of
  its own (the fast path above); an application's pool, each call that can wait for a lock (or
  needs `schema`) in a transaction of its own with flowlock's `lock_timeout` and
  `search_path` set LOCAL, so nothing of the application's connections changes; or a caller's
  open transaction
  ([`PostgresStore.in_transaction`][flowlock.stores.postgres.PostgresStore.in_transaction]), inside
  a savepoint whose settings are put back afterwards.
- Every round trip has a client-side bound (`command_timeout` beyond the lock wait the server
  bounds with `lock_timeout`), passed as `timeout=` to each statement so that it holds on an
  application's pool and a caller's connection too, and set as the `command_timeout` of
  flowlock's own pool for asyncpg's own statements (introspection, the ROLLBACK of a release,
  the goodbye of a close). A server that stops answering (paused, a half-open network) ends the
  call with ConnectionLost, or OutcomeUnknown once a write may have been sent; the connection,
  in an unknown protocol state, is terminated.
- Driver errors are translated at this adapter's edge (`_Session.conn`) by the one
  translation of `flowlock._pg.errors`; this module only says what a lock that is not
  available and a duplicate request id mean to each call, and which statements may commit a
  write (a session lost while one is in flight is OutcomeUnknown, elsewhere ConnectionLost). A
  connection of a pool (flowlock's or the application's) that failed that way is terminated, not
  rolled back on nor given back as it is; a caller's connection is left to the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import replace
from typing import Any, TypeVar

import asyncpg

from flowlock._batching import Coalescer
from flowlock._pg import migrations
from flowlock._pg.errors import DRIVER_ERRORS, Context, broken, in_doubt, wrap_connect, wrap_errors
from flowlock._pg.fence import PostgresFenceEpochs
from flowlock._pg.pool import check_schema, close_pool, connection, create_pool, terminate
from flowlock._pg.rows import HISTORY_COLUMNS, INSTANCE_COLUMNS, entry_from_row, instance_from_row
from flowlock.core.errors import (
    EngineClosed,
    FlowlockError,
    InstanceExists,
    InstanceNotFound,
    InvalidInput,
    LockBusy,
    LockTimeout,
    StoreError,
)
from flowlock.core.models import Escalation, HistoryEntry, Instance, InstanceQuery, Snapshot
from flowlock.core.settings import (
    DEFAULT_ACQUIRE_TIMEOUT,
    DEFAULT_APPLICATION_NAME,
    DEFAULT_COMMAND_TIMEOUT,
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_LOCK_TIMEOUT,
    DEFAULT_MAX_SIZE,
    DEFAULT_MIN_SIZE,
    POSTGRES_SCHEMES,
    check_application_name,
    check_seconds,
    check_size,
    check_url,
)
from flowlock.stores._batch import planned_entries, refused_plan
from flowlock.stores.base import (
    Entries,
    LockedResult,
    Plan,
    RequestIds,
    RowLock,
    Store,
    entries_of,
    request_ids_of,
)

__all__ = ["PostgresStore", "count_statement", "list_statement"]


_READ = f"""
SELECT {INSTANCE_COLUMNS} FROM flowlock_instances WHERE id = $1
"""
# The unlocked read with the request-id lookup in the same snapshot: one round trip.
_READ_JOINED = """
SELECT i.id, i.workflow, i.state, i.version, i.data, i.last_event, i.created_at, i.updated_at,
       h.instance_id AS h_instance_id, h.version AS h_version, h.event AS h_event,
       h.from_state AS h_from_state, h.to_state AS h_to_state, h.actor AS h_actor,
       h.request_id AS h_request_id, h.strategy AS h_strategy, h.data AS h_data, h.at AS h_at,
       h.fencing_token AS h_fencing_token, h.payload AS h_payload
FROM flowlock_instances i
LEFT JOIN flowlock_history h ON h.instance_id = i.id AND {match}
WHERE i.id = $1
"""
_READ_WITH_REQUEST = _READ_JOINED.format(match="h.request_id = $2")
# A batch's read: the instance and the entries of any of its request ids, one row per entry found
# (or one row with no entry), in one snapshot. The unique (instance_id, request_id) index finds
# each of them.
_READ_WITH_REQUESTS = _READ_JOINED.format(match="h.request_id = ANY($2::text[])")
# The reads of several calls (on any instances, each with its request id or NULL) in one round
# trip, each row tagged with the place of its call; a call with no row read a missing instance.
_READ_MANY = """
SELECT r.n, i.id, i.workflow, i.state, i.version, i.data, i.last_event, i.created_at,
       i.updated_at,
       h.instance_id AS h_instance_id, h.version AS h_version, h.event AS h_event,
       h.from_state AS h_from_state, h.to_state AS h_to_state, h.actor AS h_actor,
       h.request_id AS h_request_id, h.strategy AS h_strategy, h.data AS h_data, h.at AS h_at,
       h.fencing_token AS h_fencing_token, h.payload AS h_payload
FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS r(id, request_id, n)
JOIN flowlock_instances i ON i.id = r.id
LEFT JOIN flowlock_history h ON h.instance_id = r.id AND h.request_id = r.request_id
"""
_LOCK = f"""
SELECT {INSTANCE_COLUMNS}, current_setting('lock_timeout') AS lock_timeout
FROM flowlock_instances WHERE id = $1 FOR UPDATE
"""
_LOCK_NOWAIT = _LOCK.rstrip() + " NOWAIT\n"
_PRIOR = f"""
SELECT {HISTORY_COLUMNS} FROM flowlock_history WHERE instance_id = $1 AND request_id = $2
"""
_PRIORS = f"""
SELECT {HISTORY_COLUMNS} FROM flowlock_history
 WHERE instance_id = $1 AND request_id = ANY($2::text[])
"""
# A pipelined group of pessimistic calls (see PostgresStore._apply_locked_together): the rows
# of its instances locked in one statement, skipping any row another transaction holds, so the
# group never waits for a lock (it can neither deadlock nor make one call wait on another's
# contended row). A skipped row's call runs alone afterwards, with its own lock bound.
_LOCK_SKIP = f"""
SELECT {INSTANCE_COLUMNS} FROM flowlock_instances
 WHERE id = ANY($1::text[]) ORDER BY id FOR UPDATE SKIP LOCKED
"""
# The entries of the group's (instance, request id) pairs, its own statement after the locks
# were granted (as _PRIOR): $1 instance ids, $2 request ids, one element per pair.
_PRIORS_MANY = f"""
SELECT {HISTORY_COLUMNS} FROM flowlock_history
 WHERE (instance_id, request_id) IN (SELECT * FROM unnest($1::text[], $2::text[]))
"""
# Why one statement: the UPDATE's row lock and the INSERT commit together or not at all, and
# the version in the WHERE clause is the compare-and-swap; no row back means another writer won.
# A writer that finds the row locked waits for its holder (at most the session's lock_timeout)
# and re-checks the version against what the holder committed, so a loser learns it lost only
# once the winner is durable: its re-read then sees the winner's row, never a stale one.
# (Measured: returning the winner's row from this statement instead, through a VOLATILE function
# with a fresh snapshot, was slower at p99 than the re-read.)
# A lease's fencing token ($10) lower than the last one written is refused like a stale version.
# $1 id, $2 version read, $3 new state, $4 new data (JSON text), $5 event, $6 from state, $7 actor,
# $8 request id, $9 strategy, $10 fencing token (NULL outside the distributed strategy),
# $11 the call's payload (JSON text).
_CAS = f"""
WITH moved AS (
    UPDATE flowlock_instances
       SET state = $3, version = $2 + 1, data = $4::text::jsonb, last_event = $5,
           updated_at = now(), fencing_token = coalesce($10, fencing_token)
     WHERE id = $1 AND version = $2
       AND ($10::bigint IS NULL OR coalesce(fencing_token, 0) <= $10)
 RETURNING {INSTANCE_COLUMNS}
), logged AS (
    INSERT INTO flowlock_history (instance_id, version, event, from_state, to_state,
                                  actor, request_id, strategy, data, at, fencing_token, payload)
    SELECT id, version, $5, $6, state, $7, $8, $9, data, updated_at, $10, $11::text::jsonb
      FROM moved
)
SELECT * FROM moved
"""
# A batch of k entries for one instance: the same compare-and-swap from version v to v + k, the
# instance left as the last entry leaves it (its fencing token checked and recorded), and the k
# history rows from one array per column, entry n (from 1) at version v + n, all stamped with the
# instance's updated_at. Still one statement, so atomic on its own and one round trip.
# $1 id, $2 version read, $3 last state, $4 last data (JSON text), $5 last event, $6 last fencing
# token; then per entry: $7 events, $8 from states, $9 to states, $10 actors, $11 request ids,
# $12 strategies, $13 data (JSON text), $14 fencing tokens, $15 payloads (JSON text).
_CAS_BATCH = f"""
WITH moved AS (
    UPDATE flowlock_instances
       SET state = $3, version = $2::bigint + cardinality($7::text[]), data = $4::text::jsonb,
           last_event = $5, updated_at = now(), fencing_token = coalesce($6, fencing_token)
     WHERE id = $1 AND version = $2::bigint
       AND ($6::bigint IS NULL OR coalesce(fencing_token, 0) <= $6)
 RETURNING {INSTANCE_COLUMNS}
), logged AS (
    INSERT INTO flowlock_history (instance_id, version, event, from_state, to_state,
                                  actor, request_id, strategy, data, at, fencing_token, payload)
    SELECT m.id, $2::bigint + e.n, e.event, e.from_state, e.to_state, e.actor, e.request_id,
           e.strategy, e.data::jsonb, m.updated_at, e.fencing_token, e.payload::jsonb
      FROM moved m,
           unnest($7::text[], $8::text[], $9::text[], $10::text[], $11::text[], $12::text[],
                  $13::text[], $14::bigint[], $15::text[])
           WITH ORDINALITY AS e(event, from_state, to_state, actor, request_id, strategy, data,
                                fencing_token, payload, n)
)
SELECT * FROM moved
"""
# The batches of several instances in one statement. Every instance's compare-and-swap stands
# alone: one whose version moved (or whose fencing token is stale) matches no row of the UPDATE,
# so none of its entries joins ``moved`` and nothing of it is written; the others go on.
#
# Deadlocks: two such statements over overlapping sets would deadlock if each locked its rows in
# the order it happened to scan them. ``locked`` takes every row lock first, in id order (the
# LockRows node sits above the sort), and the UPDATE only ever touches a row it joined to
# ``locked``, i.e. one already locked: so every statement of this kind takes its locks in one
# global order and two of them cannot wait on each other. (MATERIALIZED for the reader: a FOR
# UPDATE CTE is never inlined anyway.)
#
# ``i.id = ANY($1)`` repeats what the join implies so that the planner reads the instances
# through their primary key whatever it estimates of the CTEs.
#
# READ COMMITTED: the statement's snapshot may hold a row version older than the one ``locked``
# waited for and locked. The UPDATE then finds its snapshot's version updated by a committed
# transaction and re-evaluates its WHERE on the newest version (EvalPlanQual; the lock is ours
# already, so no wait): the version and fencing checks are made against the latest committed
# row, never a stale one.
# $1 ids, $2 versions read, $3 new versions, $4 last states, $5 last data (JSON text), $6 last
# events, $7 last fencing tokens: one element per instance. $8 instance ids, $9 versions, $10
# events, $11 from states, $12 to states, $13 actors, $14 request ids, $15 strategies, $16 data
# (JSON text), $17 fencing tokens, $18 payloads (JSON text): one element per entry, the batches'
# entries one after another.
_CAS_MANY = f"""
WITH wanted AS (
    SELECT * FROM unnest($1::text[], $2::bigint[], $3::bigint[], $4::text[], $5::text[],
                         $6::text[], $7::bigint[])
           AS w(id, version, top, state, data, last_event, fencing_token)
), locked AS MATERIALIZED (
    SELECT id FROM flowlock_instances WHERE id = ANY($1::text[]) ORDER BY id FOR UPDATE
), moved AS (
    UPDATE flowlock_instances i
       SET state = w.state, version = w.top, data = w.data::jsonb, last_event = w.last_event,
           updated_at = now(), fencing_token = coalesce(w.fencing_token, i.fencing_token)
      FROM locked l JOIN wanted w ON w.id = l.id
     WHERE i.id = ANY($1::text[]) AND i.id = l.id AND i.version = w.version
       AND (w.fencing_token IS NULL OR coalesce(i.fencing_token, 0) <= w.fencing_token)
 RETURNING {", ".join(f"i.{column}" for column in INSTANCE_COLUMNS.split(", "))}
), logged AS (
    INSERT INTO flowlock_history (instance_id, version, event, from_state, to_state,
                                  actor, request_id, strategy, data, at, fencing_token, payload)
    SELECT e.instance_id, e.version, e.event, e.from_state, e.to_state, e.actor, e.request_id,
           e.strategy, e.data::jsonb, m.updated_at, e.fencing_token, e.payload::jsonb
      FROM unnest($8::text[], $9::bigint[], $10::text[], $11::text[], $12::text[], $13::text[],
                  $14::text[], $15::text[], $16::text[], $17::bigint[], $18::text[])
           AS e(instance_id, version, event, from_state, to_state, actor, request_id, strategy,
                data, fencing_token, payload)
      JOIN moved m ON m.id = e.instance_id
)
SELECT * FROM moved
"""
# An escalation only ever grows longer; rows long past are pruned by the writers.
_PUBLISH = """
WITH pruned AS (
    DELETE FROM flowlock_escalations WHERE until < now() - interval '1 hour'
)
INSERT INTO flowlock_escalations (key, strategy, until, reason)
VALUES ($1, $2, to_timestamp($3), $4)
ON CONFLICT (key) DO UPDATE
   SET until = greatest(flowlock_escalations.until, excluded.until),
       strategy = excluded.strategy, reason = excluded.reason
"""
_ACTIVE = """
SELECT key, strategy, extract(epoch FROM until)::float8 AS until, reason
  FROM flowlock_escalations WHERE until > to_timestamp($1)
"""
# The board's clock is the server's: every engine reads the same one, whatever its host's says.
# clock_timestamp(), not now(): the time of the call, also inside a longer transaction.
_NOW = "SELECT extract(epoch FROM clock_timestamp())::float8"
_CREATE = f"""
INSERT INTO flowlock_instances (id, workflow, state, version, data)
VALUES ($1, $2, $3, 1, $4::text::jsonb)
ON CONFLICT (id) DO NOTHING
RETURNING {INSTANCE_COLUMNS}
"""
_HISTORY = f"""
SELECT {HISTORY_COLUMNS} FROM flowlock_history WHERE instance_id = $1 ORDER BY version
"""
_FENCING_FLOOR = "SELECT coalesce(fencing_token, 0) FROM flowlock_instances WHERE id = $1"
# flowlock's part of a caller's transaction: the caller's settings, read before the savepoint,
# are put back after it (a released savepoint keeps SET LOCAL's effect to the end of the
# transaction; a rolled-back one undoes it).
_SAVEPOINT = "flowlock"
_CALLERS_SETTINGS = (
    "SELECT current_setting('search_path') AS search_path, "
    "current_setting('lock_timeout') AS lock_timeout, "
    "current_setting('transaction_read_only') AS read_only"
)
_READ_ONLY = "SELECT pg_is_in_recovery() OR current_setting('transaction_read_only') = 'on'"
_RESTORE = "SELECT set_config('search_path', $1, true), set_config('lock_timeout', $2, true)"

# At most this many pipelined reads (and as many writes) in flight per store; more calls queue
# and go together in the next free one. A few, so that one statement waiting for a row lock
# holds up the calls that share it, not every call of the process.
_PIPELINE_DEPTH = 4
_PIPELINE_BATCH = 500

Conn = asyncpg.Connection | asyncpg.pool.PoolConnectionProxy
Busy = Callable[[BaseException], FlowlockError]
T = TypeVar("T")


# Workflow and state names are written into a query's text as literals, not passed as
# parameters: asyncpg keeps its statements prepared, and after a few runs PostgreSQL may plan one
# once for any value, estimating "state = $n" as an average state. For a rare state (the pending
# few among millions approved) that plan walks the whole id index instead of the state's own
# range. With the names in the text every (workflow, state) gets its own plan. Only names of the
# shape a Workflow accepts are written, so no quoting can be escaped.
_NAME_LITERAL = re.compile(r"[A-Za-z0-9_.\-]{1,100}")


def _literal(name: str) -> str:
    if not _NAME_LITERAL.fullmatch(name):
        raise InvalidInput(f"{name!r} is not a workflow or state name; nothing was read")
    return f"'{name}'"


def _where(query: InstanceQuery, args: list[object]) -> list[str]:
    """`query` as WHERE conditions; the arguments of the timestamps are appended to `args`
    (numbered on from what `args` already holds)."""
    conditions: list[str] = []
    if query.workflow is not None:
        conditions.append(f"workflow = {_literal(query.workflow)}")
    if query.states is not None:
        # "= 'x'" for one state, not "IN (...)": the planner sees from an equality that the
        # (workflow, state, id) index range is already in id order.
        names = ", ".join(_literal(state) for state in query.states)
        conditions.append(f"state = {names}" if len(query.states) == 1 else f"state IN ({names})")
    if query.updated_before is not None:
        args.append(query.updated_before)
        conditions.append(f"updated_at < ${len(args)}")
    if query.updated_after is not None:
        args.append(query.updated_after)
        conditions.append(f"updated_at > ${len(args)}")
    return conditions


# COLLATE "C": code point order, the order of the other stores and of the indexes of
# 006_queries.sql. $1 is the cursor ('' is below every id, since ids are never empty: the first
# page), $2 the limit.
_PAGE = 'id COLLATE "C" > $1 ORDER BY id COLLATE "C" LIMIT $2'


def list_statement(
    query: InstanceQuery, *, after: str | None, limit: int
) -> tuple[str, list[object]]:
    """The SELECT of `PostgresStore.list_instances` and its arguments."""
    args: list[object] = [after or "", limit]
    states = query.states or ()
    if query.workflow is None or len(states) < 2:
        conditions = " AND ".join([*_where(query, args), ""])
        return f"SELECT {INSTANCE_COLUMNS} FROM flowlock_instances WHERE {conditions}{_PAGE}", args
    # Several states of one workflow: one branch per state, each an index range of
    # (workflow, state, id) already in id order, merged (Merge Append) so that a page reads
    # about as many rows as it returns. One "state = ANY(...)" would have to read every row
    # of those states, or walk the whole id index, to find the first ones in id order.
    branches = [
        f"(SELECT {INSTANCE_COLUMNS} FROM flowlock_instances "
        f"WHERE {' AND '.join(_where(dataclasses.replace(query, states=(state,)), args))} "
        f"AND {_PAGE})"
        for state in states
    ]
    merged = " UNION ALL ".join(branches)
    return f'SELECT * FROM ({merged}) AS page ORDER BY id COLLATE "C" LIMIT $2', args


def count_statement(query: InstanceQuery) -> tuple[str, list[object]]:
    """The SELECT of `PostgresStore.count_instances` and its arguments."""
    args: list[object] = []
    conditions = _where(query, args)
    where = f" WHERE {' AND '.join(conditions)}" if conditions else ""
    return f"SELECT count(*) FROM flowlock_instances{where}", args


_UNITS = {"us": 0.001, "ms": 1.0, "s": 1000.0, "min": 60_000.0, "h": 3_600_000.0, "d": 86_400_000.0}


def _millis(setting: str) -> float:
    """A PostgreSQL time setting ('200ms', '5s', '1min', '0') in milliseconds."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]*)", setting.strip())
    if m is None:
        return -1.0
    return float(m.group(1)) * _UNITS.get(m.group(2) or "ms", -1.0)


def _pg_interval(seconds: float) -> str:
    """Seconds as a PostgreSQL setting, in whole milliseconds (at least 1: '0' means no bound)."""
    return f"{max(1, round(seconds * 1000))}ms"


def _json(data: Mapping[str, Any]) -> str:
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False)


def _snapshot(row: asyncpg.Record) -> Snapshot:
    """A row of _READ_WITH_REQUEST: the instance and the prior entry for the request id."""
    return Snapshot(
        instance_from_row(row), None if row["h_version"] is None else entry_from_row(row, "h_")
    )


def _batch_snapshot(rows: Sequence[asyncpg.Record]) -> Snapshot:
    """The rows of _READ_WITH_REQUESTS (at least one): the instance and the entries found."""
    priors = {
        row["h_request_id"]: entry_from_row(row, "h_")
        for row in rows
        if row["h_version"] is not None
    }
    return Snapshot(instance_from_row(rows[0]), None, priors)


def _cas_args(entry: HistoryEntry) -> tuple[Any, ...]:
    return (
        entry.instance_id,
        entry.version - 1,
        entry.to_state,
        _json(entry.data),
        entry.event,
        entry.from_state,
        entry.actor,
        entry.request_id,
        entry.strategy,
        entry.fencing_token,
        _json(entry.payload),
    )


Batch = tuple[HistoryEntry, ...]  # one instance's entries, checked by entries_of


@dataclasses.dataclass(frozen=True, slots=True)
class _LockedCall:
    """One `apply_locked` call, as the pessimistic pipeline queues it."""

    instance_id: str
    request_id: RequestIds
    plan: Plan
    lock: RowLock


def _cas_of(batch: Batch) -> tuple[str, tuple[Any, ...]]:
    """The compare-and-swap of `batch` and its arguments: the one-entry statement for one
    entry (the common case, kept as it was), the array one for several."""
    if len(batch) == 1:
        return _CAS, _cas_args(batch[0])
    last = batch[-1]
    return _CAS_BATCH, (
        last.instance_id,
        batch[0].version - 1,
        last.to_state,
        _json(last.data),
        last.event,
        last.fencing_token,
        *_entry_columns(batch),
    )


def _entry_columns(entries: Sequence[HistoryEntry]) -> tuple[list[Any], ...]:
    """The history rows to insert, one array per column (the order _CAS_BATCH and _CAS_MANY
    unnest them in): event, from, to, actor, request id, strategy, data, fencing, payload."""
    return (
        [e.event for e in entries],
        [e.from_state for e in entries],
        [e.to_state for e in entries],
        [e.actor for e in entries],
        [e.request_id for e in entries],
        [e.strategy for e in entries],
        [_json(e.data) for e in entries],
        [e.fencing_token for e in entries],
        [_json(e.payload) for e in entries],
    )


def _many_args(batches: Sequence[Batch]) -> tuple[list[Any], ...]:
    """The arguments of _CAS_MANY: one array per instance column, then one per entry column."""
    lasts = [batch[-1] for batch in batches]
    entries = [e for batch in batches for e in batch]
    return (
        [last.instance_id for last in lasts],
        [batch[0].version - 1 for batch in batches],
        [last.version for last in lasts],
        [last.to_state for last in lasts],
        [_json(last.data) for last in lasts],
        [last.event for last in lasts],
        [last.fencing_token for last in lasts],
        [e.instance_id for e in entries],
        [e.version for e in entries],
        *_entry_columns(entries),
    )


def _batches_of(batches: Sequence[Entries]) -> tuple[Batch, ...]:
    """`batches` checked before anything is written: each one instance's contiguous batch
    ([`entries_of`][flowlock.stores.postgres.entries_of]), and no instance in two of them."""
    if isinstance(batches, HistoryEntry):
        raise InvalidInput(
            "commit_many takes a sequence of batches (each an entry or a sequence of entries), "
            "not one HistoryEntry; nothing was written"
        )
    checked = tuple(entries_of(batch) for batch in batches)
    seen: set[str] = set()
    for batch in checked:
        iid = batch[0].instance_id
        if iid in seen:
            raise InvalidInput(
                f"instance {iid!r} appears in two batches of one commit_many; put its entries "
                "in one batch. Nothing was written"
            )
        seen.add(iid)
    return checked


def _keys(batches: Sequence[Batch]) -> str:
    """The instances of `batches` as the errors about all of them quote them."""
    return _keys_of([batch[0].instance_id for batch in batches])


def _keys_of(ids: Sequence[str]) -> str:
    shown = ", ".join(ids[:3])
    return shown if len(ids) <= 3 else f"{shown} and {len(ids) - 3} more"


class _Session:
    """Where the statements of one call run: a connection of the store's pool per call, or the
    one connection `joined`, inside a transaction that someone else ends (the caller's, or the
    one `PostgresStore._app_transaction` opened around the call)."""

    def __init__(self, store: PostgresStore, joined: Conn | None = None) -> None:
        self._store = store
        self._joined = joined

    @property
    def joined(self) -> bool:
        return self._joined is not None

    @property
    def timeout(self) -> float:
        """The client-side bound of one statement: the store's `lock_timeout` (any statement
        may wait that long for a lock, on the server's clock) plus its `command_timeout`."""
        return self._store.round_trip

    @property
    def command_timeout(self) -> float:
        return self._store.command_timeout

    def conn(
        self, key: str = "", *, busy: Busy | None = None, writes: bool = False
    ) -> AbstractAsyncContextManager[Conn]:
        """A connection whose driver errors become flowlock errors about `key`. `busy`: what
        a lock that is not available (SQLSTATE 55P03) means to this call; by default a
        StoreError. `writes`: the block runs one autocommit write, so a session lost while it
        is in flight leaves its outcome unknown (OutcomeUnknown). On a joined connection nothing
        is autocommitted: a session lost there rolls the whole transaction back (ConnectionLost),
        and whoever ends that transaction says whether its COMMIT is in doubt."""
        context = _errors(key, busy)
        if self._joined is not None:
            return _on(self._joined, context)
        store = self._store
        return connection(
            store.pool,
            acquire_timeout=store.acquire_timeout,
            size=store.pool_size,
            context=replace(context, in_doubt=writes),
        )


@asynccontextmanager
async def _on(conn: Conn, context: Context) -> AsyncIterator[Conn]:
    with wrap_errors(context):
        yield conn


class _Operations:
    """The store's statements, run where `session` says."""

    def __init__(self, session: _Session) -> None:
        self._s = session

    async def create(self, instance: Instance) -> Instance:
        key, started = instance.id, time.monotonic()
        # An insert of the same id by a transaction still open waits for it (lock_timeout).
        async with self._s.conn(
            key, busy=lambda _: LockTimeout(key, time.monotonic() - started), writes=True
        ) as conn:
            row = await conn.fetchrow(
                _CREATE,
                instance.id,
                instance.workflow,
                instance.state,
                _json(instance.data),
                timeout=self._s.timeout,
            )
        if row is None:
            raise InstanceExists(instance.id)
        return instance_from_row(row)

    async def get(self, instance_id: str) -> Instance:
        async with self._s.conn(instance_id) as conn:
            row = await conn.fetchrow(_READ, instance_id, timeout=self._s.timeout)
        if row is None:
            raise InstanceNotFound(instance_id)
        return instance_from_row(row)

    async def read(self, instance_id: str, request_id: RequestIds) -> Snapshot:
        if request_id is not None and not isinstance(request_id, str):
            return await self._read_batch(instance_id, request_ids_of(request_id))
        async with self._s.conn(instance_id) as conn:
            if request_id is None:
                row = await conn.fetchrow(_READ, instance_id, timeout=self._s.timeout)
            else:
                row = await conn.fetchrow(
                    _READ_WITH_REQUEST, instance_id, request_id, timeout=self._s.timeout
                )
        if row is None:
            raise InstanceNotFound(instance_id)
        return _snapshot(row) if request_id is not None else Snapshot(instance_from_row(row))

    async def _read_batch(self, instance_id: str, request_ids: tuple[str, ...]) -> Snapshot:
        async with self._s.conn(instance_id) as conn:
            if request_ids:
                rows = await conn.fetch(
                    _READ_WITH_REQUESTS, instance_id, list(request_ids), timeout=self._s.timeout
                )
            else:
                found = await conn.fetchrow(_READ, instance_id, timeout=self._s.timeout)
                rows = [] if found is None else [found]
        if not rows:
            raise InstanceNotFound(instance_id)
        if not request_ids:
            return Snapshot(instance_from_row(rows[0]))
        return _batch_snapshot(rows)

    async def commit(self, entries: Entries) -> Instance | None:
        return await self.commit_batch(entries_of(entries))

    async def commit_batch(self, batch: Batch) -> Instance | None:
        """`commit` of a batch [`entries_of`][flowlock.stores.postgres.entries_of] has checked."""
        key = batch[0].instance_id
        started = time.monotonic()
        (sql, args), timeout = _cas_of(batch), self._s.timeout
        guarded = self._s.joined and any(e.request_id is not None for e in batch)
        try:
            async with self._s.conn(
                key, busy=lambda _: LockTimeout(key, time.monotonic() - started), writes=True
            ) as conn:
                row = await (
                    _guarded_cas(conn, sql, args, timeout)
                    if guarded
                    else conn.fetchrow(sql, *args, timeout=timeout)
                )
        except _DuplicateRequest:
            # The same request id was applied by a concurrent caller; the statement rolled back
            # whole. Report a lost race: the next read finds that entry and answers idempotently.
            return None
        return None if row is None else instance_from_row(row)

    async def read_together(
        self, calls: Sequence[tuple[str, str | None]]
    ) -> list[Snapshot | FlowlockError]:
        """The unlocked reads of several calls (instance id, request id or None) in one round
        trip: each call's Snapshot, or InstanceNotFound, in the calls' order."""
        key = _keys_of([instance_id for instance_id, _ in calls])
        ids = [instance_id for instance_id, _ in calls]
        request_ids = [request_id for _, request_id in calls]
        async with self._s.conn(key) as conn:
            rows = await conn.fetch(_READ_MANY, ids, request_ids, timeout=self._s.timeout)
        found = {row["n"]: row for row in rows}
        answers: list[Snapshot | FlowlockError] = []
        for n, (instance_id, request_id) in enumerate(calls, start=1):
            row = found.get(n)
            if row is None:
                answers.append(InstanceNotFound(instance_id))
            elif request_id is None:
                answers.append(Snapshot(instance_from_row(row)))
            else:
                answers.append(_snapshot(row))
        return answers

    async def commit_together(self, batches: Sequence[Batch]) -> list[Instance | None]:
        """The batches of several instances (checked by `_batches_of`) in one statement,
        each instance's compare-and-swap on its own. Raises _DuplicateRequest or _Contended when
        the statement failed whole (nothing of it written): the caller then commits each batch
        alone."""
        key = _keys(batches)
        started = time.monotonic()
        async with self._s.conn(
            key, busy=lambda _: LockTimeout(key, time.monotonic() - started), writes=True
        ) as conn:
            try:
                rows = await conn.fetch(_CAS_MANY, *_many_args(batches), timeout=self._s.timeout)
            except asyncpg.TransactionRollbackError as exc:
                # 40P01 / 40001: not between two of these statements (they lock in one order),
                # but with a caller's transaction holding rows in another order, or on an
                # application's connection at a stricter isolation level. The statement rolled
                # back whole; caught before the edge, which would make it a plain StoreError.
                raise _Contended(key, exc) from exc
        moved = {row["id"]: instance_from_row(row) for row in rows}
        return [moved.get(batch[0].instance_id) for batch in batches]

    async def apply_locked(
        self, instance_id: str, request_id: RequestIds, plan: Plan, lock: RowLock
    ) -> LockedResult:
        started = time.monotonic()
        wanted = _pg_interval(lock.timeout)
        # Any statement of this transaction may wait the strategy's lock.timeout on the server
        # (which may differ from the store's lock_timeout): the client waits that and more.
        bound = max(self._s.timeout, lock.timeout + self._s.command_timeout)

        def busy(_: BaseException) -> FlowlockError:
            if lock.nowait:
                return LockBusy(instance_id)
            return LockTimeout(instance_id, time.monotonic() - started)

        async with self._s.conn(instance_id, busy=busy) as conn:
            if self._s.joined:
                # Inside a transaction someone else ends: set the bound for the rest of it (the
                # caller's own setting is put back by in_transaction), lock, step, write; the
                # row lock is held until that transaction ends.
                if not lock.nowait:
                    await conn.execute(f"SET LOCAL lock_timeout = '{wanted}'", timeout=bound)
                snap, committed, locked_at = await _locked_step(
                    conn, instance_id, request_id, plan, lock, wanted, bound
                )
            else:
                snap, committed, locked_at = await _own_transaction(
                    conn,
                    instance_id,
                    request_id,
                    plan,
                    lock,
                    wanted,
                    _errors(instance_id, busy),
                    bound,
                )
            released_at = time.monotonic()
        return LockedResult(snap, committed, locked_at - started, released_at - locked_at)

    async def apply_locked_together(
        self, calls: Sequence[_LockedCall]
    ) -> list[LockedResult | BaseException | None]:
        """The calls of a pessimistic group (one per instance) in ONE transaction: their rows
        locked without waiting (SKIP LOCKED), their request ids looked up in one statement,
        each call's plan run in order, every planned batch written by one _CAS_MANY, COMMIT.
        Each call's answer: its LockedResult, its own error (its plan raised, or its
        compare-and-swap matched no row under the lock: nothing of it written, the others go
        on), or None when its row was not locked by the group (held elsewhere, or missing): the
        caller runs it alone. An error of the transaction itself (the connection lost, COMMIT
        in doubt: OutcomeUnknown) is the answer of every call it served, or of every call when
        it came before the rows were locked. Raises _DuplicateRequest or _Contended when the
        write failed whole (rolled back): the caller then runs every call alone."""
        key = _keys_of([call.instance_id for call in calls])
        started = time.monotonic()
        bound = self._s.timeout

        def contended(exc: BaseException) -> FlowlockError:
            # A lock wait in the write (an INSERT behind a concurrent one of the same request
            # id) past the session's lock_timeout: let each call wait alone, with its own bound.
            return _Contended(key, exc)

        context = _errors(key, contended)
        answers: list[LockedResult | BaseException | None] = [None] * len(calls)
        served: list[int] | None = None  # the calls whose rows the group locked, once known
        try:
            async with self._s.conn(key, busy=contended) as conn:
                await conn.execute("BEGIN", timeout=bound)
                try:
                    rows = await conn.fetch(
                        _LOCK_SKIP, [call.instance_id for call in calls], timeout=bound
                    )
                    locked_at = time.monotonic()
                    locked = {row["id"]: row for row in rows}
                    served = [i for i, call in enumerate(calls) if call.instance_id in locked]
                    found = await _priors_of(conn, [calls[i] for i in served], bound)
                    snaps = {
                        i: _locked_snapshot(
                            locked[calls[i].instance_id], calls[i].request_id, found
                        )
                        for i in served
                    }
                    planned = _plan_each(calls, snaps, answers)
                    moved: dict[str, Instance] = {}
                    if planned:
                        try:
                            written = await conn.fetch(
                                _CAS_MANY, *_many_args(list(planned.values())), timeout=bound
                            )
                        except asyncpg.TransactionRollbackError as exc:
                            raise _Contended(key, exc) from exc
                        moved = {row["id"]: instance_from_row(row) for row in written}
                    with in_doubt(context):
                        await conn.execute("COMMIT", timeout=bound)
                except asyncio.CancelledError:
                    conn.terminate()  # it may be mid-statement: see _own_transaction
                    raise
                except BaseException as exc:
                    await _roll_back(conn, exc, bound)
                    raise
                released_at = time.monotonic()
        except (_DuplicateRequest, _Contended):
            raise
        except FlowlockError as exc:
            for i in range(len(calls)) if served is None else served:
                if answers[i] is None:
                    answers[i] = exc
            return answers
        for i, snap in snaps.items():
            if answers[i] is not None:
                continue
            iid, batch = calls[i].instance_id, planned.get(i)
            committed = None if batch is None else moved.get(iid)
            if batch is not None and committed is None:
                answers[i] = _lost_under_lock(iid, batch, snap)
            else:
                answers[i] = LockedResult(
                    snap, committed, locked_at - started, released_at - locked_at
                )
        return answers

    # -- the adaptive strategy's escalation board (flowlock.stores.base.EscalationBoard) -----

    async def publish(self, escalation: Escalation) -> None:
        async with self._s.conn(escalation.key, writes=True) as conn:
            await conn.execute(_PUBLISH, escalation.key, escalation.strategy,
                               escalation.until, escalation.reason,
                               timeout=self._s.timeout)  # fmt: skip

    async def active(self, now: float) -> list[Escalation]:
        async with self._s.conn() as conn:
            rows = await conn.fetch(_ACTIVE, now, timeout=self._s.timeout)
        return [Escalation(r["key"], r["strategy"], r["until"], r["reason"]) for r in rows]

    async def now(self) -> float:
        async with self._s.conn() as conn:
            return float(await conn.fetchval(_NOW, timeout=self._s.timeout))

    async def fencing_floor(self, instance_id: str) -> int:
        async with self._s.conn(instance_id) as conn:
            token = await conn.fetchval(_FENCING_FLOOR, instance_id, timeout=self._s.timeout)
        return int(token or 0)

    async def list_instances(
        self, query: InstanceQuery, *, after: str | None, limit: int
    ) -> list[Instance]:
        sql, args = list_statement(query, after=after, limit=limit)
        async with self._s.conn() as conn:
            rows = await conn.fetch(sql, *args, timeout=self._s.timeout)
        return [instance_from_row(r) for r in rows]

    async def ping(self) -> None:
        async with self._s.conn() as conn:
            read_only = await conn.fetchval(_READ_ONLY, timeout=self._s.timeout)
        if read_only:
            raise StoreError(
                "PostgreSQL answers but is read-only (a standby, or default_transaction_read_only "
                "on): every write would fail. Point the URL at the primary (a multi-host URL with "
                "target_session_attrs=read-write follows it)"
            )

    async def count_instances(self, query: InstanceQuery) -> int:
        sql, args = count_statement(query)
        async with self._s.conn() as conn:
            count = await conn.fetchval(sql, *args, timeout=self._s.timeout)
        return int(count)

    async def history(self, instance_id: str) -> list[HistoryEntry]:
        async with self._s.conn(instance_id) as conn:
            rows = await conn.fetch(_HISTORY, instance_id, timeout=self._s.timeout)
            found = rows or await conn.fetchrow(_READ, instance_id, timeout=self._s.timeout)
            if found is None:
                raise InstanceNotFound(instance_id)
        return [entry_from_row(r) for r in rows]


class _CallerTransaction(_Operations):
    """The store inside a caller's open transaction (a
    [`flowlock.stores.base.Store`][flowlock.stores.base.Store] for the strategies). It opens,
    closes, commits and migrates nothing: the caller owns the connection and its transaction."""

    async def open(self) -> None:
        return None

    async def aclose(self) -> None:
        return None

    async def migrate(self) -> list[str]:
        raise InvalidInput("migrate through the engine's store, not inside a caller's transaction")

    async def commit_many(self, batches: Sequence[Entries]) -> list[Instance | None]:
        # One by one, each in its savepoint when it carries request ids: in a transaction
        # flowlock does not end, a failed statement must undo that batch only, and the caller
        # already holds whatever rows it locked in whatever order.
        return [await self.commit_batch(batch) for batch in _batches_of(batches)]


async def _guarded_cas(
    conn: Conn, sql: str, args: tuple[Any, ...], bound: float
) -> asyncpg.Record | None:
    """The compare-and-swap `sql` in a savepoint of its own. In a transaction flowlock does not
    end, a duplicate request id must undo this statement only, leaving the transaction usable for
    the re-read that answers the request idempotently."""
    await conn.execute("SAVEPOINT flowlock_cas", timeout=bound)
    try:
        row = await conn.fetchrow(sql, *args, timeout=bound)
    except asyncpg.UniqueViolationError:
        await conn.execute(
            "ROLLBACK TO SAVEPOINT flowlock_cas; RELEASE SAVEPOINT flowlock_cas", timeout=bound
        )
        raise
    await conn.execute("RELEASE SAVEPOINT flowlock_cas", timeout=bound)
    return row


async def _own_transaction(
    conn: Conn,
    instance_id: str,
    request_id: RequestIds,
    plan: Plan,
    lock: RowLock,
    wanted: str,
    context: Context,
    bound: float,
) -> tuple[Snapshot, Instance | None, float]:
    """The pessimistic path in a transaction of its own on a connection of flowlock's pool;
    `context`: what the driver errors of its COMMIT mean."""
    # Why BEGIN and SET LOCAL in one simple-protocol round trip: the timeout must be in
    # force before the FOR UPDATE, and a separate BEGIN would cost a round trip per call.
    await conn.execute(
        "BEGIN" if lock.nowait else f"BEGIN; SET LOCAL lock_timeout = '{wanted}'",
        timeout=bound,
    )
    try:
        done = await _locked_step(conn, instance_id, request_id, plan, lock, wanted, bound)
        # A session lost once COMMIT is on its way may have committed: OutcomeUnknown. So is
        # a COMMIT that outlived its bound: the server may have committed it meanwhile.
        with in_doubt(context):
            await conn.execute("COMMIT", timeout=bound)
    except asyncio.CancelledError:
        # Cancelled mid-statement (waiting for the row lock, say): the connection is
        # busy and cannot take a ROLLBACK. Closing it ends the transaction and frees
        # the lock wait on the server; the pool opens a fresh connection later.
        conn.terminate()
        raise
    except BaseException as exc:
        await _roll_back(conn, exc, bound)
        raise
    return done


async def _roll_back(conn: Conn, exc: BaseException, bound: float) -> None:
    """End flowlock's own transaction on a pooled connection after `exc`."""
    if broken(exc):
        # The session is gone, asyncpg lost track of it, or a statement outlived its bound and
        # asyncpg gave up on it mid-protocol: a ROLLBACK would fail (or wait on a server that
        # does not answer) and hide this error; the server rolls back when the socket closes,
        # and the pool opens a fresh connection in its place.
        terminate(conn)
    elif not conn.is_closed() and conn.is_in_transaction():
        await conn.execute("ROLLBACK", timeout=bound)


async def _locked_step(
    conn: Conn,
    instance_id: str,
    request_id: RequestIds,
    plan: Plan,
    lock: RowLock,
    wanted: str,
    bound: float,
) -> tuple[Snapshot, Instance | None, float]:
    if lock.nowait:
        row = await conn.fetchrow(_LOCK_NOWAIT, instance_id, timeout=bound)
    else:
        row = await conn.fetchrow(_LOCK, instance_id, timeout=bound)
        if row is not None and _millis(row["lock_timeout"]) != _millis(wanted):
            raise StoreError(
                f"lock_timeout is {row['lock_timeout']!r} inside the transaction, not "
                f"{wanted!r}; a pooler or a server setting overrode it, refusing to "
                "wait unbounded"
            )
    locked_at = time.monotonic()
    if row is None:
        raise InstanceNotFound(instance_id)
    # The request-id lookup is its own statement, so its snapshot is taken after the lock was
    # granted and sees a duplicate request committed while this call waited.
    prior, priors = None, {}
    if isinstance(request_id, str):
        found = await conn.fetchrow(_PRIOR, instance_id, request_id, timeout=bound)
        prior = None if found is None else entry_from_row(found)
    elif request_id is not None and (request_ids := request_ids_of(request_id)):
        rows = await conn.fetch(_PRIORS, instance_id, list(request_ids), timeout=bound)
        priors = {r["request_id"]: entry_from_row(r) for r in rows}
    snap = Snapshot(instance_from_row(row), prior, priors)
    batch = planned_entries(instance_id, plan(snap))
    if not batch:
        return snap, None, locked_at
    sql, args = _cas_of(batch)
    try:
        moved = await conn.fetchrow(sql, *args, timeout=bound)
    except asyncpg.UniqueViolationError:
        # A request id the plan should have found applied: the plan's bug, as on every store.
        raise refused_plan(instance_id, batch, snap) from None
    if moved is None:
        raise _lost_under_lock(instance_id, batch, snap)
    return snap, instance_from_row(moved), locked_at


def _lost_under_lock(instance_id: str, batch: Batch, snap: Snapshot) -> FlowlockError:
    """The error of a compare-and-swap that matched no row although the row lock was held."""
    if batch[0].version != snap.instance.version + 1:
        return refused_plan(instance_id, batch, snap)
    return StoreError(
        f"instance {instance_id!r} changed while its row lock was held; "
        "something bypassed flowlock's locking. Nothing was written"
    )


def _locked_snapshot(
    row: asyncpg.Record, request_id: RequestIds, found: Mapping[tuple[str, str], HistoryEntry]
) -> Snapshot:
    """A group member's Snapshot, as _locked_step builds it: the instance locked, and the entry
    of its request id (`prior`, for one given as a str) or those found of its request ids
    (`priors`, for a sequence); `found`: the group's entries by (instance, request id)."""
    instance = instance_from_row(row)
    if isinstance(request_id, str):
        return Snapshot(instance, found.get((instance.id, request_id)))
    priors = {
        rid: found[(instance.id, rid)]
        for rid in request_ids_of(request_id)
        if (instance.id, rid) in found
    }
    return Snapshot(instance, None, priors)


def _wanted_request_ids(request_id: RequestIds) -> tuple[str, ...]:
    return (request_id,) if isinstance(request_id, str) else request_ids_of(request_id)


def _plan_each(
    calls: Sequence[_LockedCall],
    snaps: Mapping[int, Snapshot],
    answers: list[LockedResult | BaseException | None],
) -> dict[int, Batch]:
    """Each locked call's plan run on its snapshot, in order: the batches to write, by call. A
    plan that raises (or returns a malformed batch) gives its call that error in `answers`;
    nothing of it is written and the others go on."""
    planned: dict[int, Batch] = {}
    for i, snap in snaps.items():
        call = calls[i]
        try:
            batch = planned_entries(call.instance_id, call.plan(snap))
        except Exception as exc:  # the plan's own error, to its call alone
            answers[i] = exc
            continue
        if batch:
            planned[i] = batch
    return planned


async def _priors_of(
    conn: Conn, calls: Sequence[_LockedCall], bound: float
) -> dict[tuple[str, str], HistoryEntry]:
    """The entries of the request ids of `calls` (locked already), by (instance, request id):
    one statement, its snapshot taken after the locks were granted, or none when no call has a
    request id."""
    pairs = [(c.instance_id, rid) for c in calls for rid in _wanted_request_ids(c.request_id)]
    if not pairs:
        return {}
    rows = await conn.fetch(
        _PRIORS_MANY, [iid for iid, _ in pairs], [rid for _, rid in pairs], timeout=bound
    )
    return {(r["instance_id"], r["request_id"]): entry_from_row(r) for r in rows}


def _caller_connection(connection: object) -> Conn:
    """`connection=` checked: an open asyncpg connection inside an open transaction."""
    if not isinstance(connection, asyncpg.Connection | asyncpg.pool.PoolConnectionProxy):
        raise InvalidInput(
            "connection= takes an asyncpg connection (from asyncpg.connect() or pool.acquire()) "
            f"inside an open transaction, not {type(connection).__name__}"
        )
    try:
        closed = connection.is_closed()
        in_transaction = connection.is_in_transaction()
    except asyncpg.InterfaceError as exc:  # a pool connection already released
        raise InvalidInput(f"the connection given as connection= is not usable: {exc}") from exc
    if closed:
        raise InvalidInput("the connection given as connection= is closed")
    if not in_transaction:
        raise InvalidInput(
            "connection= must be inside an open transaction (async with conn.transaction(): "
            "...): flowlock runs its statements in that transaction and never commits it; "
            "nothing was read or written"
        )
    return connection


async def _enter(conn: Conn, settings: str, bound: float) -> tuple[str, str]:
    """Read the caller's settings, open flowlock's savepoint and set flowlock's for it."""
    try:
        prior = await conn.fetchrow(_CALLERS_SETTINGS, timeout=bound)
    except asyncpg.InFailedSQLTransactionError as exc:
        raise InvalidInput(
            "the transaction on connection= has already failed (an earlier statement raised); "
            "roll it back first. Nothing was read or written"
        ) from exc
    assert prior is not None  # a SELECT of settings has one row
    if prior["read_only"] == "on":
        # Refused here: the write would fail with 25006, which elsewhere means a demoted
        # primary (ConnectionLost), not a caller's own read-only transaction.
        raise InvalidInput(
            "the transaction on connection= is read-only (transaction(readonly=True), or a "
            "standby); flowlock writes in it. Nothing was read or written"
        )
    await conn.execute(f"SAVEPOINT {_SAVEPOINT}; {settings}", timeout=bound)
    return prior["search_path"], prior["lock_timeout"]


async def _leave(conn: Conn, prior: tuple[str, str], bound: float) -> None:
    await conn.execute(_RESTORE, *prior, timeout=bound)
    await conn.execute(f"RELEASE SAVEPOINT {_SAVEPOINT}", timeout=bound)


async def _undo(conn: Conn, bound: float) -> None:
    """Roll flowlock's part back, and its settings with it; the caller's transaction goes on as it
    was before. A connection that cannot take that (closed, lost) is the caller's to deal with:
    the error they see is the one that ended flowlock's part."""
    if conn.is_closed():
        return
    with contextlib.suppress(*DRIVER_ERRORS):
        await conn.execute(
            f"ROLLBACK TO SAVEPOINT {_SAVEPOINT}; RELEASE SAVEPOINT {_SAVEPOINT}", timeout=bound
        )


class PostgresStore:
    """Instances and history in PostgreSQL.

    `dsn`: a `postgresql://` URL; flowlock builds its pool, of at most `pool_size`
    connections (pessimistic callers hold one each while they wait for a row lock), `min_size`
    of them opened up front, each opened within `connect_timeout` seconds and shown in
    `pg_stat_activity` as `application_name`. Or `pool`: an application's own asyncpg pool
    instead, which flowlock uses as it is (no codec, setting or search_path of its connections
    changes) and does not close.

    `pipeline` (on by default, flowlock's own pool only): the unlocked reads and the
    compare-and-swaps of calls on different instances that become ready while a few such round
    trips are already in flight are sent together, one statement for many instances, each
    instance's compare-and-swap still standing alone (see
    [`commit_many`][flowlock.stores.postgres.PostgresStore.commit_many]); so do the pessimistic
    calls, a group in one transaction that locks its rows with SKIP LOCKED and never waits (a call
    whose row is held elsewhere runs alone afterwards, with its own lock bound). An idle store sends
    each at once.

    `acquire_timeout`: seconds to wait for a free connection before StoreBusy. `schema`: put
    the tables in this schema (created if missing) instead of the connection's default.
    `auto_migrate`: migrate on open. `lock_timeout`: seconds any statement outside a
    pessimistic transaction may wait for a row lock (the optimistic compare-and-swap waits for a
    concurrent writer to commit) before LockTimeout. `command_timeout`: seconds one round trip
    may take on the client's clock beyond that lock wait (a pessimistic FOR UPDATE: beyond the
    strategy's lock_timeout); past it the connection is terminated and the call raises
    ConnectionLost, or OutcomeUnknown when a write may have been sent. `round_trip` is
    the resulting bound of an ordinary statement.

    [`in_transaction`][flowlock.stores.postgres.PostgresStore.in_transaction] runs the store's
    statements inside a transaction the caller opened on a connection of its own
    (`engine.fire(..., connection=conn)`).
    """

    def __init__(
        self,
        dsn: str | None = None,
        *,
        pool: asyncpg.Pool | None = None,
        pool_size: int = DEFAULT_MAX_SIZE,
        min_size: int = DEFAULT_MIN_SIZE,
        acquire_timeout: float = DEFAULT_ACQUIRE_TIMEOUT,
        schema: str | None = None,
        auto_migrate: bool = True,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
        application_name: str = DEFAULT_APPLICATION_NAME,
        command_timeout: float = DEFAULT_COMMAND_TIMEOUT,
        pipeline: bool = True,
    ) -> None:
        check_schema(schema)
        if not isinstance(pipeline, bool):
            raise InvalidInput(f"pipeline must be True or False, not {pipeline!r}")
        if (dsn is None) == (pool is None):
            raise InvalidInput(
                "PostgresStore takes a postgresql:// dsn or an application's asyncpg pool "
                "(pool=...): one of the two"
            )
        if pool is not None and not isinstance(pool, asyncpg.Pool):
            raise InvalidInput(f"pool= takes an asyncpg.Pool, not {type(pool).__name__}")
        if dsn is not None:
            check_url("dsn", dsn, POSTGRES_SCHEMES)
        check_size("pool_size", pool_size)
        check_size("min_size", min_size, least=0)
        self.acquire_timeout = check_seconds("acquire_timeout", acquire_timeout)
        self._connect_timeout = check_seconds("connect_timeout", connect_timeout)
        self.lock_timeout = check_seconds("lock_timeout", lock_timeout)
        self.command_timeout = check_seconds("command_timeout", command_timeout)
        # Any statement may wait lock_timeout for a lock on the server (a row lock for a write,
        # a table lock behind a migration): the client waits that long and command_timeout more.
        self.round_trip = self.lock_timeout + self.command_timeout
        self.application_name = check_application_name(application_name)
        self.dsn = dsn
        self.schema = schema
        self._given = pool
        self.pool_size = pool_size if pool is None else pool.get_max_size()
        self._min_size = min(min_size, pool_size)
        self._auto_migrate = auto_migrate
        self._pool: asyncpg.Pool | None = None
        self._ops = _Operations(_Session(self))
        # Pipelining (flowlock's own pool only: an application's pool runs a call's statements
        # in a transaction of their own): reads and compare-and-swaps of calls on different
        # instances that are ready while others are in flight go together in one round trip.
        self._reads: Coalescer[tuple[str, str | None], Snapshot] | None = None
        self._writes: Coalescer[Batch, Instance | None] | None = None
        # ... and so do the pessimistic calls, each group in one transaction.
        self._locked: Coalescer[_LockedCall, LockedResult] | None = None
        if pipeline and pool is None:
            depth = max(1, min(_PIPELINE_DEPTH, pool_size // 2))
            self._reads = Coalescer(self._read_together, depth=depth, max_batch=_PIPELINE_BATCH)
            self._writes = Coalescer(self._commit_together, depth=depth, max_batch=_PIPELINE_BATCH)
            self._locked = Coalescer(
                self._apply_locked_together, depth=depth, max_batch=_PIPELINE_BATCH
            )
        # Qualified with the schema: an application's pool does not have it on search_path.
        self._fence_epochs = PostgresFenceEpochs(
            lambda: self.pool,
            schema=schema,
            acquire_timeout=self.acquire_timeout,
            size=self.pool_size,
        )
        # flowlock's settings for a transaction on a connection it does not own.
        self._settings = f"SET LOCAL lock_timeout = '{_pg_interval(self.lock_timeout)}'"
        if schema is not None:
            self._settings += f'; SET LOCAL search_path = "{schema}"'

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def owns_pool(self) -> bool:
        """Whether flowlock built the pool (and closes it), or the application gave it."""
        return self._given is None

    async def open(self) -> None:
        if self._pool is not None:
            return
        if self._given is not None:
            if self._given.is_closing():
                raise InvalidInput("the asyncpg pool given as pool= is closed")
            self._pool = self._given
        else:
            self._pool = await self._create_pool(self.dsn or "")
        if self._auto_migrate:
            try:
                await self.migrate()
            except BaseException:
                await self.aclose()
                raise

    async def _create_pool(self, dsn: str) -> asyncpg.Pool:
        # Every statement outside a pessimistic transaction (the optimistic compare-and-swap
        # above all) waits at most lock_timeout for a row lock: no wait in flowlock is unbounded.
        with wrap_connect(dsn):
            return await create_pool(
                dsn,
                min_size=self._min_size,
                max_size=self.pool_size,
                schema=self.schema,
                create_schema=True,
                application_name=self.application_name,
                server_settings={"lock_timeout": _pg_interval(self.lock_timeout)},
                connect_timeout=self._connect_timeout,
                # For asyncpg's own statements; flowlock's pass timeout=round_trip each.
                command_timeout=self.round_trip,
            )

    async def aclose(self) -> None:
        """Close flowlock's pool; an application's pool (`pool=`) is left open, only no longer
        used."""
        for coalescer in (self._reads, self._writes, self._locked):
            if coalescer is not None:
                await coalescer.drain()
        pool, self._pool = self._pool, None
        if pool is not None and self._given is None:
            await close_pool(pool)

    @property
    def pool(self) -> asyncpg.Pool:
        if self._pool is None:
            raise EngineClosed("the PostgreSQL store is closed; open it first")
        return self._pool

    @property
    def fence_epochs(self) -> PostgresFenceEpochs:
        """The fencing epochs of Redis lock keys, in this store's `flowlock_fence_epochs`: give
        them to [`RedisLocks`][flowlock.locks.redis.RedisLocks] (`fence_epochs=`) for tokens that
        never repeat across Redis data losses (`Engine.connect` does)."""
        return self._fence_epochs

    async def migrate(self) -> list[str]:
        """Apply the migrations not yet applied; their names (see `flowlock._pg.migrations`).
        MigrationError if that fails, EngineClosed if the store is not open."""
        return await migrations.migrate(
            self.pool,
            acquire_timeout=self.acquire_timeout,
            pool_size=self.pool_size,
            command_timeout=self.command_timeout,
            # An application's connections keep their search_path: the schema is set for the
            # migration's transaction only.
            schema=self.schema if self._given is not None else None,
        )

    # -- where a call's statements run ------------------------------------------------------

    async def _call(
        self,
        op: Callable[[_Operations], Awaitable[T]],
        key: str = "",
        *,
        waits: bool = True,
        writes: bool = False,
    ) -> T:
        """`op` on flowlock's pool; on an application's pool, in a transaction of its own
        when it may wait for a lock or needs the schema on search_path. `key`: what the
        errors of that transaction's own statements quote; `writes`: `op` may write, so a
        session lost while its COMMIT is in flight leaves the outcome unknown."""
        if self._given is None or (not waits and self.schema is None):
            return await op(self._ops)
        async with self._app_transaction(key, writes=writes) as ops:
            return await op(ops)

    @asynccontextmanager
    async def _app_transaction(
        self, key: str = "", *, writes: bool = False
    ) -> AsyncIterator[_Operations]:
        """A connection of the application's pool in a transaction of flowlock's, with
        flowlock's lock_timeout and schema set LOCAL: they end with it, and the connection goes
        back to the pool as it came (or is terminated, when its session failed under it)."""
        async with _Session(self).conn(key) as conn:
            await conn.execute(f"BEGIN; {self._settings}", timeout=self.round_trip)
            try:
                yield _Operations(_Session(self, joined=conn))
                with in_doubt(_errors(key)) if writes else contextlib.nullcontext():
                    await conn.execute("COMMIT", timeout=self.round_trip)
            except asyncio.CancelledError:
                conn.terminate()  # it may be mid-statement: see _own_transaction
                raise
            except BaseException as exc:
                await _roll_back(conn, exc, self.round_trip)
                raise

    @asynccontextmanager
    async def in_transaction(self, connection: object) -> AsyncIterator[Store]:
        """This store on `connection` (an asyncpg connection inside a transaction the caller
        opened and will commit or roll back), for the length of the `async with`.

        Everything runs in a savepoint with flowlock's `lock_timeout` and `schema` set for
        it. On an error inside, flowlock's part is rolled back to the savepoint (its settings
        with it) and the caller's transaction goes on, usable; on the way out the caller's own
        `search_path` and `lock_timeout` are put back. Cancelled mid-statement, the
        connection is left to the caller (roll the transaction back). InvalidInput, before any
        statement, when `connection` is not an open asyncpg connection in a transaction (or in
        one that has already failed)."""
        conn = _caller_connection(connection)
        context = _errors("")
        with wrap_errors(context):
            prior = await _enter(conn, self._settings, self.round_trip)
        try:
            yield _CallerTransaction(_Session(self, joined=conn))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            # A connection whose session failed cannot take the rollback to the savepoint (it
            # would only hide this error behind its own): the caller's transaction is lost with
            # it, and the connection is the caller's to close or give back.
            if not broken(exc):
                await _undo(conn, self.round_trip)
            raise
        with wrap_errors(context):
            await _leave(conn, prior, self.round_trip)

    # -- operations ------------------------------------------------------------------------

    async def create(self, instance: Instance) -> Instance:
        return await self._call(lambda ops: ops.create(instance), instance.id, writes=True)

    async def get(self, instance_id: str) -> Instance:
        return await self._call(lambda ops: ops.get(instance_id), instance_id, waits=False)

    async def read(self, instance_id: str, request_id: RequestIds) -> Snapshot:
        reads = self._reads
        if reads is None or not (request_id is None or isinstance(request_id, str)):
            return await self._call(
                lambda ops: ops.read(instance_id, request_id), instance_id, waits=False
            )
        return await reads.submit((instance_id, request_id), self._read_one)

    async def _read_one(self, call: tuple[str, str | None]) -> Snapshot:
        return await self._ops.read(*call)

    async def _read_together(
        self, calls: Sequence[tuple[str, str | None]]
    ) -> list[Snapshot | FlowlockError]:
        return await self._ops.read_together(calls)

    async def commit(self, entries: Entries) -> Instance | None:
        batch = entries_of(entries)
        if self._writes is None:
            return await self._commit(batch)
        return await self._writes.submit(batch, self._commit)

    async def _commit_together(
        self, batches: Sequence[Batch]
    ) -> list[Instance | BaseException | None]:
        """The compare-and-swaps of calls that queued together: one statement per round of
        distinct instances (two batches for one instance, from two strategies or two engines,
        cannot share a statement). A round that fails whole fails each of its calls."""
        answers: list[Instance | BaseException | None] = [None] * len(batches)
        pending = list(range(len(batches)))
        while pending:
            seen: set[str] = set()
            now: list[int] = []
            later: list[int] = []
            for i in pending:
                instance_id = batches[i][0].instance_id
                (later if instance_id in seen else now).append(i)
                seen.add(instance_id)
            try:
                done: list[Instance | BaseException | None] = list(
                    await self.commit_many([batches[i] for i in now])
                )
            except FlowlockError as exc:
                done = [exc] * len(now)
            for i, answer in zip(now, done, strict=True):
                answers[i] = answer
            pending = later
        return answers

    async def _commit(self, batch: Batch) -> Instance | None:
        key = batch[0].instance_id
        return await self._call(lambda ops: ops.commit_batch(batch), key, writes=True)

    async def commit_many(self, batches: Sequence[Entries]) -> list[Instance | None]:
        """Every batch checked first (InvalidInput, nothing written), then one statement for
        all of them (see _CAS_MANY). When that statement fails whole, on a request id applied
        before or a deadlock or serialization failure, each batch is committed alone, so only
        the batch at fault answers None. A lock wait past lock_timeout is LockTimeout for all
        of them; a connection lost while the statement was in flight, OutcomeUnknown."""
        checked = _batches_of(batches)
        if not checked:
            self.pool  # noqa: B018 - a closed store refuses even an empty commit (EngineClosed)
            return []
        if len(checked) < 2:
            return [await self._commit(batch) for batch in checked]
        try:
            return await self._call(
                lambda ops: ops.commit_together(checked), _keys(checked), writes=True
            )
        except (_DuplicateRequest, _Contended):
            return await self._commit_each(checked)

    async def _commit_each(self, batches: Sequence[Batch]) -> list[Instance | None]:
        # One after another: each locks one row, so they cannot deadlock with anything.
        return [await self._commit(batch) for batch in batches]

    async def apply_locked(
        self, instance_id: str, request_id: RequestIds, plan: Plan, lock: RowLock
    ) -> LockedResult:
        call = _LockedCall(instance_id, request_id, plan, lock)
        if self._locked is None:
            return await self._apply_locked_alone(call)
        return await self._locked.submit(call, self._apply_locked_alone)

    async def _apply_locked_alone(self, call: _LockedCall) -> LockedResult:
        """A pessimistic call in a transaction of its own, waiting for its row lock as its
        `lock` says."""
        return await self._call(
            lambda ops: ops.apply_locked(call.instance_id, call.request_id, call.plan, call.lock),
            call.instance_id,
            writes=True,
        )

    async def _apply_locked_together(
        self, calls: Sequence[_LockedCall]
    ) -> list[LockedResult | BaseException]:
        """The pessimistic calls that queued together: the first call on each instance in one
        transaction (`_Operations.apply_locked_together`); the calls it did not serve (a
        row held elsewhere or missing, a second call on an instance, or all of them when its
        write failed whole) alone afterwards, as today: each instance's calls one after
        another, the instances concurrently. So only a call that ran alone ever waited for a
        lock, with its own bound, and raises InstanceNotFound, LockTimeout or LockBusy as
        before."""
        answers: list[LockedResult | BaseException | None] = [None] * len(calls)
        firsts: dict[str, int] = {}
        for i, call in enumerate(calls):
            firsts.setdefault(call.instance_id, i)
        if len(firsts) > 1:
            group = list(firsts.values())
            try:
                done = await self._ops.apply_locked_together([calls[i] for i in group])
            except (_DuplicateRequest, _Contended):
                done = [None] * len(group)
            for i, answer in zip(group, done, strict=True):
                answers[i] = answer
        alone: dict[str, list[int]] = {}
        for i, answer in enumerate(answers):
            if answer is None:
                alone.setdefault(calls[i].instance_id, []).append(i)

        async def run(indices: list[int]) -> None:
            for i in indices:
                try:
                    answers[i] = await self._apply_locked_alone(calls[i])
                except Exception as exc:  # that call's own error, to that call alone
                    answers[i] = exc

        await asyncio.gather(*(run(indices) for indices in alone.values()))
        return _filled(answers)

    async def publish(self, escalation: Escalation) -> None:
        await self._call(lambda ops: ops.publish(escalation), escalation.key, writes=True)

    async def active(self, now: float) -> list[Escalation]:
        return await self._call(lambda ops: ops.active(now), waits=False)

    async def now(self) -> float:
        return await self._call(lambda ops: ops.now(), waits=False)

    async def fencing_floor(self, instance_id: str) -> int:
        return await self._call(
            lambda ops: ops.fencing_floor(instance_id), instance_id, waits=False
        )

    async def list_instances(
        self, query: InstanceQuery, *, after: str | None, limit: int
    ) -> list[Instance]:
        return await self._call(
            lambda ops: ops.list_instances(query, after=after, limit=limit), waits=False
        )

    async def ping(self) -> None:
        """One round trip on a pool connection, a readiness probe: StoreBusy when no connection
        frees within `acquire_timeout`, ConnectionLost when PostgreSQL does not answer within
        the store's bounds, StoreError when it answers but is read-only (a standby)."""
        await self._call(lambda ops: ops.ping(), waits=False)

    async def count_instances(self, query: InstanceQuery) -> int:
        return await self._call(lambda ops: ops.count_instances(query), waits=False)

    async def history(self, instance_id: str) -> list[HistoryEntry]:
        return await self._call(lambda ops: ops.history(instance_id), instance_id, waits=False)


def _filled(
    answers: list[LockedResult | BaseException | None],
) -> list[LockedResult | BaseException]:
    """`answers` once every call has one."""
    done: list[LockedResult | BaseException] = []
    for answer in answers:
        if answer is None:  # pragma: no cover - every call not served by the group ran alone
            raise StoreError("a pipelined pessimistic call was left without an answer")
        done.append(answer)
    return done


def _errors(key: str, busy: Callable[[BaseException], FlowlockError] | None = None) -> Context:
    """What the driver errors of a statement about `key` mean to the store."""
    return Context(
        what=f"PostgreSQL error for {key!r}",
        tables="flowlock tables are",
        opener="the engine",
        key=key,
        busy=busy or _unavailable,
        duplicate=_DuplicateRequest.of,
    )


def _unavailable(exc: BaseException) -> FlowlockError:
    # SQLSTATE 55P03 outside commit and apply_locked (an INSERT waiting behind a concurrent
    # one, say): the lock_timeout of the session ran out.
    return StoreError(str(exc))


class _DuplicateRequest(StoreError):
    """The (instance, request_id) unique constraint fired (a signal commit() catches)."""

    @classmethod
    def of(cls, exc: BaseException) -> FlowlockError:
        return cls(str(exc))


class _Contended(StoreError):
    """The statement of several instances met a deadlock or a serialization failure and was
    rolled back whole (a signal commit_many() catches)."""

    def __init__(self, key: str, exc: BaseException) -> None:
        super().__init__(
            f"the compare-and-swaps of {key!r} were rolled back together "
            f"({type(exc).__name__}: {exc}); nothing of them was written"
        )
