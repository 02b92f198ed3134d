"""The store's transactions; each runs whole on its connection's thread, never across an await."""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from flowlock.core import migrations
from flowlock.core.admin import WorkflowPause
from flowlock.core.constraints import Claim, ConstraintRefused
from flowlock.core.errors import InstanceExists, InstanceNotFound
from flowlock.core.models import HistoryEntry, Instance, InstanceQuery, Snapshot, Timing
from flowlock.stores._batch import entering, planned_entries, refused_plan
from flowlock.stores._claims import Claimed, claims_of
from flowlock.stores.base import LockedResult, Plan
from flowlock.stores.sqlite.constraints_sql import apply_claims
from flowlock.stores.sqlite.outbox_sql import MessageRow, message_rows, write_messages
from flowlock.stores.sqlite.sql import (
    CAS_UPDATE,
    HISTORY_COLUMNS,
    IDS_PER_SELECT,
    INSERT_CREATE_REQUEST,
    INSERT_HISTORY,
    INSTANCE_COLUMNS,
    MIGRATIONS_TABLE,
    SELECT_AS_CREATED,
    SELECT_INSTANCE,
    SELECT_PRIORS,
    count_statement,
    dump_json,
    entry_of,
    history_params,
    instance_of,
    is_repair,
    list_statement,
    millis,
    now_text,
    parse_timestamp,
    paused_column,
    statements_of,
)
from flowlock.stores.sqlite.timers import after_commit, arm


@dataclass(slots=True)
class Wake:
    """What a write transaction asks the store to wake once it committed (never before: a
    rolled back write wakes nobody). `timers`: the soonest `after` of each arm, for this
    process's timer services (`armed()`); `messages`: it wrote a claimable message, for this
    process's outbox dispatchers (`pending()`); `released`: the (kind, key) of each slot it
    released, for this store's `slot_releases` listeners."""

    timers: list[float] = field(default_factory=list)
    messages: bool = False
    released: list[tuple[str, str]] = field(default_factory=list)


T = TypeVar("T")
A = TypeVar("A")


def bounded(
    busy_ms: int,
    default: float,
    txn: Callable[[sqlite3.Connection, A], T],
    arg: A,
) -> Callable[[sqlite3.Connection], T]:
    """`txn` with the connection's busy timeout set to `busy_ms` for its duration only."""
    default_ms = millis(default)

    def run(conn: sqlite3.Connection) -> T:
        if busy_ms == default_ms:
            return txn(conn, arg)
        conn.execute(f"PRAGMA busy_timeout = {busy_ms}")
        try:
            return txn(conn, arg)
        finally:
            conn.execute(f"PRAGMA busy_timeout = {default_ms}")

    return run


def immediate(conn: sqlite3.Connection, body: Callable[[sqlite3.Connection], T]) -> T:
    """`body` in a `BEGIN IMMEDIATE` transaction: committed when it returns, rolled back when
    it raises (including `_Discard`, which makes the transaction return its value)."""
    _begin(conn, "BEGIN IMMEDIATE")
    try:
        result = body(conn)
    except _Discard as discard:
        _rollback(conn)
        value: T = discard.value
        return value
    except BaseException:
        _rollback(conn)
        raise
    try:
        conn.execute("COMMIT")
    except BaseException:
        _rollback(conn)
        raise
    return result


def _deferred(conn: sqlite3.Connection, body: Callable[[sqlite3.Connection], T]) -> T:
    # Both selects of a read must see one snapshot; a deferred transaction takes no write lock.
    _begin(conn, "BEGIN DEFERRED")
    try:
        result = body(conn)
        conn.execute("COMMIT")
    except BaseException:
        _rollback(conn)
        raise
    return result


class _Discard(Exception):
    """Roll the transaction back and return `value` (a lost compare-and-swap, or a plan that
    asked for no write)."""

    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value


def _begin(conn: sqlite3.Connection, statement: str) -> None:
    if conn.in_transaction:
        # Only after a failed ROLLBACK; a stale transaction would make BEGIN fail forever.
        conn.execute("ROLLBACK")
    conn.execute(statement)


def _rollback(conn: sqlite3.Connection) -> None:
    if conn.in_transaction:
        # A failure here means SQLite already rolled back (some errors end the transaction
        # themselves); the original exception is the one worth reporting.
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")


def get_txn(conn: sqlite3.Connection, instance_id: str) -> Instance:
    row = conn.execute(SELECT_INSTANCE, (instance_id,)).fetchone()
    if row is None:
        raise InstanceNotFound(instance_id)
    return instance_of(row)


def _snapshot(conn: sqlite3.Connection, instance_id: str, request_ids: Sequence[str]) -> Snapshot:
    instance = get_txn(conn, instance_id)
    ids = tuple(dict.fromkeys(request_ids))
    entries = (entry_of(row) for row in _rows_of_requests(conn, instance_id, ids))
    return Snapshot(instance, {e.request_id: e for e in entries if e.request_id})


def _rows_of_requests(
    conn: sqlite3.Connection, instance_id: str, request_ids: Sequence[str]
) -> list[tuple[Any, ...]]:
    """The history rows of `instance_id` that carry one of `request_ids`."""
    rows: list[tuple[Any, ...]] = []
    for at in range(0, len(request_ids), IDS_PER_SELECT):
        chunk = request_ids[at : at + IDS_PER_SELECT]
        marks = ", ".join("?" * len(chunk))
        rows += conn.execute(f"{SELECT_PRIORS}({marks})", (instance_id, *chunk)).fetchall()
    return rows


def read_txn(conn: sqlite3.Connection, instance_id: str, request_ids: Sequence[str]) -> Snapshot:
    return _deferred(conn, lambda c: _snapshot(c, instance_id, request_ids))


def fence_txn(conn: sqlite3.Connection, instance_id: str) -> int:
    def body(c: sqlite3.Connection) -> int:
        row = c.execute(
            "SELECT coalesce(fencing_token, 0) FROM flowlock_instances WHERE id = ?", (instance_id,)
        ).fetchone()
        return int(row[0]) if row else 0

    return _deferred(conn, body)


def history_txn(
    conn: sqlite3.Connection, instance_id: str, after: int, limit: int | None
) -> list[HistoryEntry]:
    def body(c: sqlite3.Connection) -> list[HistoryEntry]:
        if not c.execute(
            "SELECT 1 FROM flowlock_instances WHERE id = ?", (instance_id,)
        ).fetchone():
            raise InstanceNotFound(instance_id)
        # A range of the primary key (instance_id, version); LIMIT -1 is no limit.
        rows = c.execute(
            f"SELECT {HISTORY_COLUMNS} FROM flowlock_history WHERE instance_id = ? "
            "AND version > ? ORDER BY version LIMIT ?",
            (instance_id, after, -1 if limit is None else limit),
        ).fetchall()
        return [entry_of(row) for row in rows]

    return _deferred(conn, body)


def list_txn(
    conn: sqlite3.Connection, query: InstanceQuery, after: str | None, limit: int
) -> list[Instance]:
    sql, args = list_statement(query, after=after, limit=limit)
    return [instance_of(row) for row in conn.execute(sql, args).fetchall()]


def count_txn(conn: sqlite3.Connection, query: InstanceQuery) -> int:
    sql, args = count_statement(query)
    [(count,)] = conn.execute(sql, args).fetchall()
    return int(count)


def create_txn(
    conn: sqlite3.Connection,
    instance: Instance,
    data: str,
    request_id: str | None,
    timings: Sequence[Timing],
    claims: Sequence[Claim],
    wake: Wake,
) -> Instance:
    """Insert `instance` (and its create key, when given) at version 1 and stay 1, arming
    `timings`, in this write transaction; a key recorded before answers its first create instead
    (nothing written). The transaction holds the database's write lock, so nothing lands between
    the lookup and the inserts."""
    if request_id is not None:
        found = _as_created(conn, "r.request_id", request_id)
        if found is not None:
            return found[1]
    now = now_text()
    cur = conn.execute(
        f"INSERT INTO flowlock_instances ({INSTANCE_COLUMNS}, definition_version, initial_data) "
        "VALUES (?, ?, ?, 1, ?, NULL, ?, ?, 1, ?, ?) "
        "ON CONFLICT (id) DO NOTHING",
        (
            instance.id,
            instance.workflow,
            instance.state,
            data,
            now,
            now,
            instance.definition_version,
            data,
        ),
    )
    if cur.rowcount == 0:
        raise InstanceExists(instance.id)
    if request_id is not None:
        conn.execute(INSERT_CREATE_REQUEST, (request_id, instance.id, instance.state, data))
    # A refused claim raises: the store rolls the transaction back, the insert with it.
    apply_claims(conn, (Claimed(c, instance.id, 1, None) for c in claims), wake.released)
    made = get_txn(conn, instance.id)
    soonest = arm(conn, made, 1, timings, time.time())
    if soonest is not None:
        wake.timers.append(soonest)
    return made


def _as_created(conn: sqlite3.Connection, column: str, value: str) -> tuple[str, Instance] | None:
    """The create key found by `column` (`r.request_id` or `r.instance_id`) and the instance as
    that create made it."""
    row = conn.execute(f"{SELECT_AS_CREATED} WHERE {column} = ?", (value,)).fetchone()
    return None if row is None else (row[12], instance_of(row))


def create_request_txn(conn: sqlite3.Connection, instance_id: str) -> tuple[str, Instance] | None:
    return _as_created(conn, "r.instance_id", instance_id)


@dataclass(frozen=True, slots=True)
class _Batch:
    """One instance's checked batch with its JSON encoded before the transaction starts, so data
    that cannot be stored raises InvalidInput before anything is written."""

    entries: tuple[HistoryEntry, ...]
    data: tuple[str, ...]
    payloads: tuple[str, ...]
    # The version of the last entry that changes the state (the new stay), None if none does;
    # whether any entry arms, voids or fires a timer (if not, no timer statement runs).
    stay: int | None
    timed: bool
    # The outbox rows of the entries' emits (none: no outbox statement runs).
    messages: tuple[MessageRow, ...]
    # The entries' constraint claims, in order (none: no constraint statement runs).
    claims: tuple[Claimed, ...]

    @property
    def instance_id(self) -> str:
        return self.entries[0].instance_id


def encode(batch: tuple[HistoryEntry, ...]) -> _Batch:
    iid = batch[0].instance_id
    entered = entering(batch)
    return _Batch(
        batch,
        tuple(dump_json(e.data, f"data of the history entry for {iid!r}") for e in batch),
        tuple(dump_json(e.payload, f"payload of the history entry for {iid!r}") for e in batch),
        None if entered is None else entered.version,
        any(e.arm or e.voids or e.timer is not None for e in batch),
        message_rows(batch),
        tuple(claims_of(batch)),
    )


def _write_batch(conn: sqlite3.Connection, batch: _Batch, wake: Wake) -> Instance | None:
    """The compare-and-swap of one instance's batch, its constraint claims, its history rows,
    what it does to the instance's timers and the messages it emits; None when it lost, and
    then it wrote nothing (every check comes before the first write: this transaction holds the
    database's write lock, so nothing changes between them). A refused claim raises its
    ConstraintRefused after the update: the caller rolls back (see `_write_or_refused`)."""
    first, last = batch.entries[0], batch.entries[-1]
    request_ids = [e.request_id for e in batch.entries if e.request_id is not None]
    if request_ids and _rows_of_requests(conn, first.instance_id, request_ids):
        return None  # already applied (so the instance exists)
    now = now_text()
    cur = conn.execute(
        CAS_UPDATE,
        (
            last.to_state,
            last.version,
            batch.data[-1],
            last.event,
            now,
            last.fencing_token,
            batch.stay,
            paused_column(last),
            last.definition_version,
            first.instance_id,
            first.version - 1,
            last.fencing_token,
            last.fencing_token,
            is_repair(last),
        ),
    )
    if cur.rowcount == 0:
        get_txn(conn, first.instance_id)  # InstanceNotFound rather than a silent conflict
        return None
    if batch.claims:
        apply_claims(conn, batch.claims, wake.released)  # refused: raises, the caller undoes
    conn.executemany(
        INSERT_HISTORY,
        [
            history_params(e, data, payload, now)
            for e, data, payload in zip(batch.entries, batch.data, batch.payloads, strict=True)
        ],
    )
    committed = get_txn(conn, first.instance_id)
    if batch.timed:
        soonest = after_commit(conn, committed, batch.entries)
        if soonest is not None:
            wake.timers.append(soonest)
    if batch.messages:
        write_messages(conn, committed, batch.messages)
        wake.messages = True
    return committed


def commit_txn(conn: sqlite3.Connection, batch: _Batch, wake: Wake) -> Instance | None:
    committed = _write_batch(conn, batch, wake)
    if committed is None:
        raise _Discard(None)  # a lost compare-and-swap writes nothing
    return committed


def commit_many_txn(
    conn: sqlite3.Connection, batches: list[_Batch], wake: Wake
) -> list[Instance | ConstraintRefused | None]:
    # A lost compare-and-swap writes nothing before it returns None (see _write_batch), so the
    # winners commit with it; a refused claim undoes its batch only; an error rolls the whole
    # transaction back.
    return [
        _write_or_refused(conn, batch, wake) if batch.claims else _write_batch(conn, batch, wake)
        for batch in batches
    ]


def _write_or_refused(
    conn: sqlite3.Connection, batch: _Batch, wake: Wake
) -> Instance | ConstraintRefused | None:
    """`_write_batch` in a savepoint: a refused claim rolls back this batch's writes and is the
    answer at its place. The claims come before the timers and messages, so `wake` only holds
    releases of this batch to forget."""
    heard = len(wake.released)
    conn.execute("SAVEPOINT flowlock_claims")
    try:
        committed = _write_batch(conn, batch, wake)
    except ConstraintRefused as refused:
        conn.execute("ROLLBACK TO flowlock_claims")
        conn.execute("RELEASE flowlock_claims")
        del wake.released[heard:]
        return refused
    conn.execute("RELEASE flowlock_claims")
    return committed


def locked_txn(
    conn: sqlite3.Connection,
    instance_id: str,
    request_ids: Sequence[str],
    plan: Plan,
    wake: Wake,
) -> LockedResult:
    snapshot = _snapshot(conn, instance_id, request_ids)
    planned = planned_entries(instance_id, plan(snapshot))
    if not planned:
        raise _Discard(LockedResult(snapshot, None))
    committed = _write_batch(conn, encode(planned), wake)
    if committed is None:
        raise refused_plan(instance_id, planned, snapshot)
    return LockedResult(snapshot, committed)


_PAUSE_COLUMNS = "workflow, reason, actor, at"


def _pause_of(row: tuple[Any, ...]) -> WorkflowPause:
    return WorkflowPause(row[0], row[1], row[2], parse_timestamp(row[3]))


def _find_pause(conn: sqlite3.Connection, workflow: str) -> WorkflowPause | None:
    row = conn.execute(
        f"SELECT {_PAUSE_COLUMNS} FROM flowlock_workflow_pauses WHERE workflow = ?", (workflow,)
    ).fetchone()
    return None if row is None else _pause_of(row)


def pause_workflow_txn(
    conn: sqlite3.Connection, workflow: str, reason: str, actor: str | None
) -> WorkflowPause:
    """Pause `workflow` (one row), or answer the pause in place, in this write transaction."""
    conn.execute(
        f"INSERT INTO flowlock_workflow_pauses ({_PAUSE_COLUMNS}) VALUES (?, ?, ?, ?) "
        "ON CONFLICT (workflow) DO NOTHING",
        (workflow, reason, actor, now_text()),
    )
    found = _find_pause(conn, workflow)
    assert found is not None  # inserted, or there already, under the write lock
    return found


def resume_workflow_txn(conn: sqlite3.Connection, workflow: str) -> WorkflowPause | None:
    """Delete the pause of `workflow` and answer it (None: it was not paused)."""
    found = _find_pause(conn, workflow)
    if found is not None:
        conn.execute("DELETE FROM flowlock_workflow_pauses WHERE workflow = ?", (workflow,))
    return found


def pauses_txn(conn: sqlite3.Connection) -> list[WorkflowPause]:
    rows = conn.execute(
        f"SELECT {_PAUSE_COLUMNS} FROM flowlock_workflow_pauses ORDER BY workflow"
    ).fetchall()
    return [_pause_of(row) for row in rows]


def migrate_txn(conn: sqlite3.Connection, pending: list[migrations.Migration]) -> list[str]:
    def body(c: sqlite3.Connection) -> list[str]:
        c.execute(MIGRATIONS_TABLE)
        done = {row[0] for row in c.execute("SELECT name FROM flowlock_schema_migrations")}
        applied: list[str] = []
        for migration in pending:
            if migration.name in done:
                continue
            for statement in statements_of(migration.sql):
                c.execute(statement)
            c.execute(
                "INSERT INTO flowlock_schema_migrations (name, applied_at) VALUES (?, ?)",
                (migration.name, now_text()),
            )
            applied.append(migration.name)
        return applied

    return immediate(conn, body)
