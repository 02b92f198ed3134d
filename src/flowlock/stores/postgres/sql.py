"""The store's SQL: fixed statement texts, the query builders, and argument marshalling.

Every hot statement is a fixed text, so asyncpg prepares it once per connection. The optimistic
write is one statement: a CTE that compare-and-swaps the instance and appends its history rows.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import asyncpg

from flowlock._pg.rows import (
    HISTORY_COLUMNS,
    INSTANCE_COLUMNS,
    PAUSED_FROM,
    entry_from_row,
    instance_from_row,
    timer_columns,
    workflow_paused,
)
from flowlock.core.errors import InvalidInput
from flowlock.core.models import (
    PAUSE_EVENT,
    RESERVED_EVENTS,
    RESUME_EVENT,
    HistoryEntry,
    InstanceQuery,
    Snapshot,
)
from flowlock.stores.postgres.constraint_sql import claim_args, claimed_creates, claimed_variants
from flowlock.stores.postgres.outbox_sql import outbox_args, outbox_cte
from flowlock.stores.postgres.timer_sql import (
    TIMER_ARRAYS,
    armed_create,
    stay_of,
    timer_args,
    timer_ctes,
)

# Every read that feeds a decision carries `workflow_paused` (PAUSED_FROM), in its snapshot.
READ = f"""
SELECT {INSTANCE_COLUMNS}, {PAUSED_FROM} FROM flowlock_instances WHERE id = $1
"""
# What `get` shows: the instance and its earliest armed timer (the `t_` columns, NULL with
# none), through the timers' primary key. Not the hot read: only `get` pays for the timer.
GET = f"""
SELECT {", ".join(f"i.{column}" for column in INSTANCE_COLUMNS.split(", "))},
       {workflow_paused("i")}, t.*
FROM flowlock_instances i
LEFT JOIN LATERAL (
    SELECT {timer_columns("t_")} FROM flowlock_timers
     WHERE instance_id = i.id ORDER BY due_at, event LIMIT 1
) AS t ON true
WHERE i.id = $1
"""
# The unlocked read with the request-id lookup in the same snapshot: one round trip.
_READ_JOINED = """
SELECT i.id, i.workflow, i.state, i.version, i.data, i.last_event, i.created_at, i.updated_at,
       i.stay_version, i.paused, i.definition_version, {paused},
       h.instance_id AS h_instance_id, h.version AS h_version, h.event AS h_event,
       h.from_state AS h_from_state, h.to_state AS h_to_state, h.actor AS h_actor,
       h.request_id AS h_request_id, h.strategy AS h_strategy, h.data AS h_data, h.at AS h_at,
       h.fencing_token AS h_fencing_token, h.payload AS h_payload,
       h.definition_version AS h_definition_version
FROM flowlock_instances i
LEFT JOIN flowlock_history h ON h.instance_id = i.id AND {match}
WHERE i.id = $1
"""
READ_WITH_REQUEST = _READ_JOINED.format(match="h.request_id = $2", paused=workflow_paused("i"))
# A batch's read: the instance and the entries of any of its request ids, one row per entry found
# (or one row with no entry), in one snapshot. The unique (instance_id, request_id) index finds
# each of them.
READ_WITH_REQUESTS = _READ_JOINED.format(
    match="h.request_id = ANY($2::text[])", paused=workflow_paused("i")
)
# The reads of several calls (on any instances, each with its request id or NULL) in one round
# trip, each row tagged with the place of its call; a call with no row read a missing instance.
READ_MANY = f"""
SELECT r.n, i.id, i.workflow, i.state, i.version, i.data, i.last_event, i.created_at,
       i.updated_at, i.stay_version, i.paused, i.definition_version, {workflow_paused("i")},
       h.instance_id AS h_instance_id, h.version AS h_version, h.event AS h_event,
       h.from_state AS h_from_state, h.to_state AS h_to_state, h.actor AS h_actor,
       h.request_id AS h_request_id, h.strategy AS h_strategy, h.data AS h_data, h.at AS h_at,
       h.fencing_token AS h_fencing_token, h.payload AS h_payload,
       h.definition_version AS h_definition_version
FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS r(id, request_id, n)
JOIN flowlock_instances i ON i.id = r.id
LEFT JOIN flowlock_history h ON h.instance_id = r.id AND h.request_id = r.request_id
"""
LOCK = f"""
SELECT {INSTANCE_COLUMNS}, {PAUSED_FROM}, current_setting('lock_timeout') AS lock_timeout
FROM flowlock_instances WHERE id = $1 FOR UPDATE
"""
LOCK_NOWAIT = LOCK.rstrip() + " NOWAIT\n"
PRIOR = f"""
SELECT {HISTORY_COLUMNS} FROM flowlock_history WHERE instance_id = $1 AND request_id = $2
"""
PRIORS = f"""
SELECT {HISTORY_COLUMNS} FROM flowlock_history
 WHERE instance_id = $1 AND request_id = ANY($2::text[])
"""
# A pipelined group of pessimistic calls (see PostgresStore._apply_locked_together): the rows
# of its instances locked in one statement, skipping any row another transaction holds, so the
# group never waits for a lock (it can neither deadlock nor make one call wait on another's
# contended row). A skipped row's call runs alone afterwards, with its own lock bound.
LOCK_SKIP = f"""
SELECT {INSTANCE_COLUMNS}, {PAUSED_FROM} FROM flowlock_instances
 WHERE id = ANY($1::text[]) ORDER BY id FOR UPDATE SKIP LOCKED
"""
# The entries of the group's (instance, request id) pairs, its own statement after the locks
# were granted (as PRIOR): $1 instance ids, $2 request ids, one element per pair.
PRIORS_MANY = f"""
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
# $11 the call's payload (JSON text), $12 the definition version it was decided with (NULL:
# unknown, the instance keeps its own). An entry that changes the state begins a stay.
_PAUSED = (
    f"CASE {{event}} WHEN '{PAUSE_EVENT}' THEN true WHEN '{RESUME_EVENT}' THEN false "
    "ELSE {paused} END"
)
# A fired event is written only while its workflow is not paused, checked by the write itself
# (its snapshot is taken once its table lock is granted): a fire that read before a workflow's
# pause committed loses its compare-and-swap, reads again and is refused. An operator's repair
# (a reserved event: the last of its batch, alone) goes through. See pauses.py for the rest.
_REPAIRS = ", ".join(f"'{event}'" for event in sorted(RESERVED_EVENTS))
_OPEN = (
    f"({{event}} IN ({_REPAIRS}) OR NOT EXISTS ("
    "SELECT 1 FROM flowlock_workflow_pauses wp WHERE wp.workflow = {table}.workflow))"
)
_CAS = f"""
WITH moved AS (
    UPDATE flowlock_instances
       SET state = $3, version = $2 + 1, data = $4::text::jsonb, last_event = $5,
           updated_at = now(), fencing_token = coalesce($10, fencing_token),
           stay_version = CASE WHEN $6 <> $3 THEN $2 + 1 ELSE stay_version END,
           paused = {_PAUSED.format(event="$5", paused="paused")},
           definition_version = coalesce($12::int, definition_version)
     WHERE id = $1 AND version = $2
       AND ($10::bigint IS NULL OR coalesce(fencing_token, 0) <= $10)
       AND {_OPEN.format(event="$5", table="flowlock_instances")}
 RETURNING {INSTANCE_COLUMNS}
), logged AS (
    INSERT INTO flowlock_history (instance_id, version, event, from_state, to_state, actor,
                                  request_id, strategy, data, at, fencing_token, payload,
                                  definition_version)
    SELECT id, version, $5, $6, state, $7, $8, $9, data, updated_at, $10, $11::text::jsonb, $12
      FROM moved
)"""
_MOVED = "\nSELECT * FROM moved\n"


def _variants(base: str, k: int) -> tuple[str, ...]:
    """`base` as it is; with its timers' CTEs (timer_sql.timer_ctes, from $k); with its
    messages' CTE (outbox_sql.outbox_cte, from $k); with both (the messages' after the
    timers'); then the same four applying claims (constraint_sql.claimed_variants). Each used
    only when the batches touch a timer, emit a message or carry a claim: fixed texts, so
    asyncpg prepares each once per connection."""
    return (
        base + _MOVED,
        base + timer_ctes(k) + _MOVED,
        base + outbox_cte(k) + _MOVED,
        base + timer_ctes(k) + outbox_cte(k + TIMER_ARRAYS) + _MOVED,
        *claimed_variants(base, k),
    )


_CAS_VARIANTS = _variants(_CAS, 13)
CAS, CAS_TIMED, CAS_EMITS, CAS_TIMED_EMITS = _CAS_VARIANTS[:4]
# A batch of k entries for one instance: the same compare-and-swap from version v to v + k, the
# instance left as the last entry leaves it (its fencing token checked and recorded), and the k
# history rows from one array per column, entry n (from 1) at version v + n, all stamped with the
# instance's updated_at. Still one statement, so atomic on its own and one round trip.
# $1 id, $2 version read, $3 last state, $4 last data (JSON text), $5 last event, $6 last fencing
# token; then per entry: $7 events, $8 from states, $9 to states, $10 actors, $11 request ids,
# $12 strategies, $13 data (JSON text), $14 fencing tokens, $15 payloads (JSON text); $16 the stay
# the batch begins (the version of its last entry that changes the state; NULL: none does); $17
# the last entry's definition version, $18 each entry's.
_CAS_BATCH = f"""
WITH moved AS (
    UPDATE flowlock_instances
       SET state = $3, version = $2::bigint + cardinality($7::text[]), data = $4::text::jsonb,
           last_event = $5, updated_at = now(), fencing_token = coalesce($6, fencing_token),
           stay_version = coalesce($16::bigint, stay_version),
           paused = {_PAUSED.format(event="$5", paused="paused")},
           definition_version = coalesce($17::int, definition_version)
     WHERE id = $1 AND version = $2::bigint
       AND ($6::bigint IS NULL OR coalesce(fencing_token, 0) <= $6)
       AND {_OPEN.format(event="$5", table="flowlock_instances")}
 RETURNING {INSTANCE_COLUMNS}
), logged AS (
    INSERT INTO flowlock_history (instance_id, version, event, from_state, to_state, actor,
                                  request_id, strategy, data, at, fencing_token, payload,
                                  definition_version)
    SELECT m.id, $2::bigint + e.n, e.event, e.from_state, e.to_state, e.actor, e.request_id,
           e.strategy, e.data::jsonb, m.updated_at, e.fencing_token, e.payload::jsonb, e.dv
      FROM moved m,
           unnest($7::text[], $8::text[], $9::text[], $10::text[], $11::text[], $12::text[],
                  $13::text[], $14::bigint[], $15::text[], $18::int[])
           WITH ORDINALITY AS e(event, from_state, to_state, actor, request_id, strategy, data,
                                fencing_token, payload, dv, n)
)"""
_BATCH_VARIANTS = _variants(_CAS_BATCH, 19)
CAS_BATCH, CAS_BATCH_TIMED, CAS_BATCH_EMITS, CAS_BATCH_TIMED_EMITS = _BATCH_VARIANTS[:4]
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
# entries one after another. $19 the stays the batches begin (NULL: none), one per instance. $20
# the last entries' definition versions, one per instance; $21 every entry's, one per entry.
_CAS_MANY = f"""
WITH wanted AS (
    SELECT * FROM unnest($1::text[], $2::bigint[], $3::bigint[], $4::text[], $5::text[],
                         $6::text[], $7::bigint[], $19::bigint[], $20::int[])
           AS w(id, version, top, state, data, last_event, fencing_token, stay, dv)
), locked AS MATERIALIZED (
    SELECT id FROM flowlock_instances WHERE id = ANY($1::text[]) ORDER BY id FOR UPDATE
), moved AS (
    UPDATE flowlock_instances i
       SET state = w.state, version = w.top, data = w.data::jsonb, last_event = w.last_event,
           updated_at = now(), fencing_token = coalesce(w.fencing_token, i.fencing_token),
           stay_version = coalesce(w.stay, i.stay_version),
           paused = {_PAUSED.format(event="w.last_event", paused="i.paused")},
           definition_version = coalesce(w.dv, i.definition_version)
      FROM locked l JOIN wanted w ON w.id = l.id
     WHERE i.id = ANY($1::text[]) AND i.id = l.id AND i.version = w.version
       AND (w.fencing_token IS NULL OR coalesce(i.fencing_token, 0) <= w.fencing_token)
       AND {_OPEN.format(event="w.last_event", table="i")}
 RETURNING {", ".join(f"i.{column}" for column in INSTANCE_COLUMNS.split(", "))}
), logged AS (
    INSERT INTO flowlock_history (instance_id, version, event, from_state, to_state, actor,
                                  request_id, strategy, data, at, fencing_token, payload,
                                  definition_version)
    SELECT e.instance_id, e.version, e.event, e.from_state, e.to_state, e.actor, e.request_id,
           e.strategy, e.data::jsonb, m.updated_at, e.fencing_token, e.payload::jsonb, e.dv
      FROM unnest($8::text[], $9::bigint[], $10::text[], $11::text[], $12::text[], $13::text[],
                  $14::text[], $15::text[], $16::text[], $17::bigint[], $18::text[], $21::int[])
           AS e(instance_id, version, event, from_state, to_state, actor, request_id, strategy,
                data, fencing_token, payload, dv)
      JOIN moved m ON m.id = e.instance_id
)"""
_MANY_VARIANTS = _variants(_CAS_MANY, 22)
CAS_MANY, CAS_MANY_TIMED, CAS_MANY_EMITS, CAS_MANY_TIMED_EMITS = _MANY_VARIANTS[:4]
# An escalation only ever grows longer; rows long past are pruned by the writers.
PUBLISH = """
WITH pruned AS (
    DELETE FROM flowlock_escalations WHERE until < now() - interval '1 hour'
)
INSERT INTO flowlock_escalations (key, strategy, until, reason)
VALUES ($1, $2, to_timestamp($3), $4)
ON CONFLICT (key) DO UPDATE
   SET until = greatest(flowlock_escalations.until, excluded.until),
       strategy = excluded.strategy, reason = excluded.reason
"""
ACTIVE = """
SELECT key, strategy, extract(epoch FROM until)::float8 AS until, reason
  FROM flowlock_escalations WHERE until > to_timestamp($1)
"""
# The board's clock is the server's: every engine reads the same one, whatever its host's says.
# clock_timestamp(), not now(): the time of the call, also inside a longer transaction.
NOW = "SELECT extract(epoch FROM clock_timestamp())::float8"
# $1 id, $2 workflow, $3 state, $4 data (JSON text), $5 the definition version it runs.
# initial_data: the data at creation, kept for engine.check_definition's replay (016).
CREATE = f"""
INSERT INTO flowlock_instances (id, workflow, state, version, data, stay_version,
                                definition_version, initial_data)
VALUES ($1, $2, $3, 1, $4::text::jsonb, 1, $5::int, $4::text::jsonb)
ON CONFLICT (id) DO NOTHING
RETURNING {INSTANCE_COLUMNS}
"""
# The same, arming the initial state's timers ($6 to $9: see timer_sql.armed_create).
CREATE_ARMED = armed_create(CREATE, 6)
# A create under an idempotency key: the instance and its key in one statement, so both commit
# or neither. An id already taken inserts nothing (no row back). A key already recorded makes the
# key's INSERT fail (23505 on flowlock_create_requests_pkey), which rolls the instance's INSERT
# back with it; an INSERT that meets a key (or an id) another transaction is inserting waits for
# it to end first. Either way the caller then reads the key: found, it answers the first create.
# $1 to $5 as CREATE, $6 request id.
_KEYED = """, keyed AS (
    INSERT INTO flowlock_create_requests (request_id, instance_id, state, data)
    SELECT $6, id, state, data FROM made
)"""
CREATE_KEYED = f"""
WITH made AS (
{CREATE.strip()}
){_KEYED}
SELECT * FROM made
"""
CREATE_KEYED_ARMED = armed_create(CREATE, 7, _KEYED)
# The four creates again, applying the create's claims (constraint_sql.claimed_creates).
CREATE_CLAIMED, CREATE_ARMED_CLAIMED, CREATE_KEYED_CLAIMED, CREATE_KEYED_ARMED_CLAIMED = (
    claimed_creates(CREATE, _KEYED)
)
CREATE_KEY_CONSTRAINT = "flowlock_create_requests_pkey"
# The instance as its create made it (version 1, its first state and data), and the create's key.
# Its definition version is the one it runs now (only a migration moves it).
_AS_CREATED = """
SELECT i.id, i.workflow, r.state, 1::bigint AS version, r.data, NULL::text AS last_event,
       i.created_at, i.created_at AS updated_at, 1::bigint AS stay_version, false AS paused,
       i.definition_version, r.request_id
FROM flowlock_create_requests r JOIN flowlock_instances i ON i.id = r.instance_id
"""
AS_CREATED_BY_KEY = _AS_CREATED + "WHERE r.request_id = $1\n"
AS_CREATED_BY_ID = _AS_CREATED + "WHERE r.instance_id = $1\n"
# A range of the primary key (instance_id, version): a page deep in a long history reads only
# the page ($2 the version to start after, $3 the limit, NULL for no limit).
HISTORY = f"""
SELECT {HISTORY_COLUMNS} FROM flowlock_history WHERE instance_id = $1 AND version > $2
 ORDER BY version LIMIT $3
"""
FENCING_FLOOR = "SELECT coalesce(fencing_token, 0) FROM flowlock_instances WHERE id = $1"
# flowlock's part of a caller's transaction: the caller's settings, read before the savepoint,
# are put back after it (a released savepoint keeps SET LOCAL's effect to the end of the
# transaction; a rolled-back one undoes it).
SAVEPOINT = "flowlock"
CALLERS_SETTINGS = (
    "SELECT current_setting('search_path') AS search_path, "
    "current_setting('lock_timeout') AS lock_timeout, "
    "current_setting('transaction_read_only') AS read_only"
)
READ_ONLY = "SELECT pg_is_in_recovery() OR current_setting('transaction_read_only') = 'on'"
RESTORE = "SELECT set_config('search_path', $1, true), set_config('lock_timeout', $2, true)"
# A table of flowlock's in a statement's text: not one already qualified, nor a column's table
# (`flowlock_escalations.until`), nor a longer name (a constraint, a savepoint), nor a word in
# a string literal (a workflow or state named "flowlock_history" in a list's filter).
_TABLE = re.compile(
    r"""(?<![\w."'])"""
    r"(flowlock_(?:instances|history|escalations|create_requests|timers|outbox|outbox_wake|"
    r"workflow_pauses|holds|definitions|capacity|slots|slot_log|rate_log|claims|free_slots))"
    r"""\b(?![.'])"""
)


@functools.lru_cache(maxsize=512)
def qualified(sql: str, schema: str) -> str:
    """`sql` with flowlock's tables named with `schema`, for connections that do not have it
    on their `search_path`: behind a transaction pooler, where a session setting would
    not outlive the transaction that set it (and would be left on a server connection another
    client gets next). Cached: the hot statements are a few fixed texts."""
    return _TABLE.sub(rf'"{schema}".\1', sql)


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
        return (
            f"SELECT {INSTANCE_COLUMNS}, {PAUSED_FROM} FROM flowlock_instances "
            f"WHERE {conditions}{_PAGE}",
            args,
        )
    # Several states of one workflow: one branch per state, each an index range of
    # (workflow, state, id) already in id order, merged (Merge Append) so that a page reads
    # about as many rows as it returns. One "state = ANY(...)" would have to read every row
    # of those states, or walk the whole id index, to find the first ones in id order.
    branches = [
        f"(SELECT {INSTANCE_COLUMNS}, {PAUSED_FROM} FROM flowlock_instances "
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


def millis(setting: str) -> float:
    """A PostgreSQL time setting ('200ms', '5s', '1min', '0') in milliseconds."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]*)", setting.strip())
    if m is None:
        return -1.0
    return float(m.group(1)) * _UNITS.get(m.group(2) or "ms", -1.0)


def pg_interval(seconds: float) -> str:
    """Seconds as a PostgreSQL setting, in whole milliseconds (at least 1: '0' means no bound)."""
    return f"{max(1, round(seconds * 1000))}ms"


def to_json(data: Mapping[str, Any]) -> str:
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False)


def snapshot_of(row: asyncpg.Record) -> Snapshot:
    """A row of READ_WITH_REQUEST: the instance and the entry of the request id, if found."""
    return Snapshot(instance_from_row(row), priors_in([row]))


def priors_in(rows: Sequence[asyncpg.Record]) -> dict[str, HistoryEntry]:
    """The entries the joined rows of a read found, by request id (`h_` columns)."""
    return {
        row["h_request_id"]: entry_from_row(row, "h_")
        for row in rows
        if row["h_version"] is not None
    }


def _cas_args(entry: HistoryEntry) -> tuple[Any, ...]:
    return (
        entry.instance_id,
        entry.version - 1,
        entry.to_state,
        to_json(entry.data),
        entry.event,
        entry.from_state,
        entry.actor,
        entry.request_id,
        entry.strategy,
        entry.fencing_token,
        to_json(entry.payload),
        entry.definition_version,
    )


Batch = tuple[HistoryEntry, ...]  # one instance's entries, checked by entries_of


def _with_extras(
    variants: tuple[str, ...], args: tuple[Any, ...], batches: Sequence[Batch]
) -> tuple[str, tuple[Any, ...]]:
    """The variant of a compare-and-swap that writes what `batches` do to timers, the outbox
    and the constraints (nothing: the statement as it was), and its arguments."""
    timed = timer_args(batches)
    emits = outbox_args(batches, to_json)
    claims = claim_args(batches)
    if timed is None and emits is None and claims is None:
        return variants[0], args
    text = variants[(timed is not None) + 2 * (emits is not None) + 4 * (claims is not None)]
    return text, (*args, *(timed or ()), *(emits or ()), *(claims or ()))


def cas_of(batch: Batch) -> tuple[str, tuple[Any, ...]]:
    """The compare-and-swap of `batch` and its arguments: the one-entry statement for one
    entry (the common case, kept as it was), the array one for several; each with the
    batch's timers and messages in the same statement when it touches a timer or emits."""
    if len(batch) == 1:
        return _with_extras(_CAS_VARIANTS, _cas_args(batch[0]), (batch,))
    last = batch[-1]
    args = (
        last.instance_id,
        batch[0].version - 1,
        last.to_state,
        to_json(last.data),
        last.event,
        last.fencing_token,
        *_entry_columns(batch),
        stay_of(batch),
        last.definition_version,
        [e.definition_version for e in batch],
    )
    return _with_extras(_BATCH_VARIANTS, args, (batch,))


def many_of(batches: Sequence[Batch]) -> tuple[str, tuple[Any, ...]]:
    """CAS_MANY over `batches` and its arguments; with their timers and messages when any
    touches a timer or emits."""
    return _with_extras(_MANY_VARIANTS, many_args(batches), batches)


def _entry_columns(entries: Sequence[HistoryEntry]) -> tuple[list[Any], ...]:
    """The history rows to insert, one array per column (the order CAS_BATCH and CAS_MANY
    unnest them in): event, from, to, actor, request id, strategy, data, fencing, payload."""
    return (
        [e.event for e in entries],
        [e.from_state for e in entries],
        [e.to_state for e in entries],
        [e.actor for e in entries],
        [e.request_id for e in entries],
        [e.strategy for e in entries],
        [to_json(e.data) for e in entries],
        [e.fencing_token for e in entries],
        [to_json(e.payload) for e in entries],
    )


def many_args(batches: Sequence[Batch]) -> tuple[list[Any], ...]:
    """The arguments of CAS_MANY: one array per instance column, then one per entry column."""
    lasts = [batch[-1] for batch in batches]
    entries = [e for batch in batches for e in batch]
    return (
        [last.instance_id for last in lasts],
        [batch[0].version - 1 for batch in batches],
        [last.version for last in lasts],
        [last.to_state for last in lasts],
        [to_json(last.data) for last in lasts],
        [last.event for last in lasts],
        [last.fencing_token for last in lasts],
        [e.instance_id for e in entries],
        [e.version for e in entries],
        *_entry_columns(entries),
        [stay_of(batch) for batch in batches],
        [last.definition_version for last in lasts],
        [e.definition_version for e in entries],
    )


def keys_text(batches: Sequence[Batch]) -> str:
    """The instances of `batches` as the errors about all of them quote them."""
    return keys_of([batch[0].instance_id for batch in batches])


def keys_of(ids: Sequence[str]) -> str:
    shown = ", ".join(ids[:3])
    return shown if len(ids) <= 3 else f"{shown} and {len(ids) - 3} more"
