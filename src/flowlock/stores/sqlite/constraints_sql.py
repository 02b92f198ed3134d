"""The SQLite store's constraints in SQL: a commit's claims applied inside the write
transaction of its compare-and-swap, and the reads of the
[`ConstraintStore`][flowlock.stores.constraint_store] port (see `constraints` for the methods).

SQLite has one writer at a time: the write lock a commit holds serializes every key, so a
counter is read and written without a row lock. A refused claim raises its ConstraintRefused;
the caller rolls back (the whole transaction, or the batch's savepoint in `commit_many`), so
nothing of that commit stays. Times are epoch seconds on this host's wall clock.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Callable, Iterable
from typing import Final, TypeVar

from flowlock.core.constraints import CapacityUsage
from flowlock.stores._claims import Claimed, rate_refusal, take_refusal
from flowlock.stores.constraint_store import (
    ConstraintRows,
    CounterRow,
    RateEvent,
    SlotEvent,
    SlotRow,
)

__all__ = ["apply_claims", "consistent", "free_slots", "rows_txn", "usage_txn"]

T = TypeVar("T")
Released = list[tuple[str, str]]

_HELD: Final = "SELECT key FROM flowlock_slots WHERE kind = ? AND instance_id = ?"
_COUNTER: Final = "SELECT holders, lim, seq FROM flowlock_capacity WHERE kind = ? AND key = ?"
# Oldest first: a slot row's rowid grows with each insert.
_HOLDERS: Final = "SELECT instance_id FROM flowlock_slots WHERE kind = ? AND key = ? ORDER BY rowid"
_TAKE_COUNTER: Final = """
INSERT INTO flowlock_capacity (kind, key, holders, lim, seq) VALUES (?, ?, 1, ?, 1)
ON CONFLICT (kind, key) DO UPDATE SET holders = holders + 1, lim = excluded.lim, seq = seq + 1
"""
_RELEASE_COUNTER: Final = (
    "UPDATE flowlock_capacity SET holders = holders - 1, seq = seq + 1 WHERE kind = ? AND key = ?"
)
_INSERT_SLOT: Final = (
    "INSERT INTO flowlock_slots (kind, instance_id, key, version) VALUES (?, ?, ?, ?)"
)
_DELETE_SLOT: Final = "DELETE FROM flowlock_slots WHERE kind = ? AND instance_id = ?"
_INSERT_EVENT: Final = """
INSERT INTO flowlock_slot_log (kind, key, seq, instance_id, version, delta, holders, lim, at)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)
"""
_WINDOW_COUNT: Final = (
    "SELECT count(*) FROM flowlock_rate_log WHERE kind = ? AND key = ? AND at > ?"
)
# The oldest of the last `limit` applications: when it leaves the window, one more fits.
_WINDOW_NTH: Final = (
    "SELECT at FROM flowlock_rate_log WHERE kind = ? AND key = ? AND at > ? "
    "ORDER BY at DESC LIMIT 1 OFFSET ?"
)
_LAST_RATE: Final = "SELECT max(at) FROM flowlock_rate_log WHERE kind = ? AND key = ?"
_INSERT_RATE: Final = """
INSERT INTO flowlock_rate_log (kind, key, at, instance_id, version, lim, per)
VALUES (?, ?, ?, ?, ?, ?, ?)
"""


def apply_claims(conn: sqlite3.Connection, claims: Iterable[Claimed], released: Released) -> None:
    """Apply one commit's `claims` in order, in the open write transaction; the keys released
    are added to `released`. A refused claim raises: the caller rolls back."""
    now = 0.0
    for c in claims:
        now = now or time.time()
        op = c.claim.op
        if op == "release":
            _release(conn, c.claim.kind, c.instance_id, c.version, now, released)
        elif op == "take":
            _take(conn, c, now, released)
        else:
            _count(conn, c, now)


def free_slots(
    conn: sqlite3.Connection, instance_id: str, version: int, released: Released
) -> None:
    """Release every slot of `instance_id` (at `version`): retention deletes it."""
    now = time.time()
    kinds = conn.execute(
        "SELECT kind FROM flowlock_slots WHERE instance_id = ?", (instance_id,)
    ).fetchall()
    for (kind,) in kinds:
        _release(conn, kind, instance_id, version, now, released)


def _event(
    conn: sqlite3.Connection, kind: str, key: str, iid: str, version: int, delta: int, now: float
) -> None:
    holders, limit, seq = conn.execute(_COUNTER, (kind, key)).fetchone()
    conn.execute(_INSERT_EVENT, (kind, key, seq, iid, version, delta, holders, limit, now))


def _release(
    conn: sqlite3.Connection,
    kind: str,
    instance_id: str,
    version: int,
    now: float,
    released: Released,
) -> None:
    row = conn.execute(_HELD, (kind, instance_id)).fetchone()
    if row is None:
        return  # holds none: nothing to give back
    key = row[0]
    conn.execute(_DELETE_SLOT, (kind, instance_id))
    conn.execute(_RELEASE_COUNTER, (kind, key))
    _event(conn, kind, key, instance_id, version, -1, now)
    released.append((kind, key))


def _take(conn: sqlite3.Connection, c: Claimed, now: float, released: Released) -> None:
    claim = c.claim
    row = conn.execute(_HELD, (claim.kind, c.instance_id)).fetchone()
    if row is not None and row[0] == claim.key:
        return  # holds a slot of this key already
    if row is not None:
        _release(conn, claim.kind, c.instance_id, c.version, now, released)
    counter = conn.execute(_COUNTER, (claim.kind, claim.key)).fetchone()
    if counter is not None and counter[0] >= claim.limit:
        holders = [r[0] for r in conn.execute(_HOLDERS, (claim.kind, claim.key))]
        raise take_refusal(c, holders)
    conn.execute(_TAKE_COUNTER, (claim.kind, claim.key, claim.limit))
    conn.execute(_INSERT_SLOT, (claim.kind, c.instance_id, claim.key, c.version))
    _event(conn, claim.kind, claim.key, c.instance_id, c.version, 1, now)


def _count(conn: sqlite3.Connection, c: Claimed, now: float) -> None:
    claim = c.claim
    [(last,)] = conn.execute(_LAST_RATE, (claim.kind, claim.key)).fetchall()
    if last is not None and last > now:
        now = last  # this host's clock is behind the last writer's: keep the log in time order
    start = now - claim.per
    [(counted,)] = conn.execute(_WINDOW_COUNT, (claim.kind, claim.key, start)).fetchall()
    if counted >= claim.limit:
        [(oldest,)] = conn.execute(
            _WINDOW_NTH, (claim.kind, claim.key, start, claim.limit - 1)
        ).fetchall()
        refused = rate_refusal(c, counted, oldest, now)
        if refused is not None:
            raise refused
    conn.execute(
        _INSERT_RATE,
        (claim.kind, claim.key, now, c.instance_id, c.version, claim.limit, claim.per),
    )


# -- reads ---------------------------------------------------------------------------------------


def usage_txn(conn: sqlite3.Connection, kind: str, key: str, window: float | None) -> CapacityUsage:
    if window is not None:
        since = time.time() - window
        ids = conn.execute(
            "SELECT instance_id FROM flowlock_rate_log WHERE kind = ? AND key = ? AND at > ? "
            "ORDER BY at",
            (kind, key, since),
        ).fetchall()
        last = conn.execute(
            "SELECT lim FROM flowlock_rate_log WHERE kind = ? AND key = ? ORDER BY at DESC LIMIT 1",
            (kind, key),
        ).fetchone()
        return CapacityUsage(
            kind, key, None if last is None else last[0], tuple(r[0] for r in ids), window=window
        )
    counter = conn.execute(_COUNTER, (kind, key)).fetchone()
    holders = conn.execute(_HOLDERS, (kind, key)).fetchall()
    limit = None if counter is None else int(counter[1])
    return CapacityUsage(kind, key, limit, tuple(r[0] for r in holders))


def rows_txn(conn: sqlite3.Connection) -> ConstraintRows:
    log = conn.execute(
        "SELECT kind, key, seq, instance_id, version, delta, holders, lim, at "
        "FROM flowlock_slot_log ORDER BY kind, key, seq"
    ).fetchall()
    slots = conn.execute(
        "SELECT kind, key, instance_id, version FROM flowlock_slots ORDER BY kind, key, rowid"
    ).fetchall()
    counters = conn.execute(
        "SELECT kind, key, holders, lim, seq FROM flowlock_capacity ORDER BY kind, key"
    ).fetchall()
    rates = conn.execute(
        "SELECT kind, key, instance_id, version, at, lim, per FROM flowlock_rate_log "
        "ORDER BY kind, key, at"
    ).fetchall()
    return ConstraintRows(
        tuple(SlotEvent(*r) for r in log),
        tuple(SlotRow(*r) for r in slots),
        tuple(CounterRow(*r) for r in counters),
        tuple(RateEvent(*r) for r in rates),
    )


def consistent(txn: Callable[..., T]) -> Callable[..., T]:
    """`txn` inside one read transaction (one snapshot for all its selects)."""

    def run(conn: sqlite3.Connection, *args: object) -> T:
        conn.execute("BEGIN DEFERRED")
        try:
            result = txn(conn, *args)
            conn.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            raise
        return result

    return run
