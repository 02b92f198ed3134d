"""The SQLite store's timers (see [`TimerStore`][flowlock.stores.base.TimerStore]): statements
and the transaction bodies, each run on a connection's thread.

SQLite has no server, so it has no server clock: due times and claims are epoch seconds on the
wall clock of this host (`time.time()`), the one clock every process sharing the file can read.
A change of that clock moves every timer with it (an hour back: timers fire an hour late).
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, Final

from flowlock.core.errors import InstanceNotFound
from flowlock.core.models import HistoryEntry, Instance, Timer, TimerFiring, Timing
from flowlock.stores._batch import entering
from flowlock.stores.sqlite.sql import READ_WIDTH, instance_of, read_columns

TIMER_COLUMNS: Final = "instance_id, workflow, event, stay, due_at, n, every, lim, claimed_until"
_KEY: Final = "instance_id = ? AND stay = ? AND event = ?"

# Arming the same stay's event again replaces the old row (as the memory store does).
_ARM: Final = (
    "INSERT OR REPLACE INTO flowlock_timers (instance_id, stay, event, workflow, due_at, n, "
    "every, lim, claimed_until, claimed_by) VALUES (?, ?, ?, ?, ?, 0, ?, ?, NULL, NULL)"
)
_VOID: Final = "DELETE FROM flowlock_timers WHERE instance_id = ?"
# A firing is done: the last one deletes the timer, a reminder with firings left moves one
# period on, unclaimed. Both only while the row still has that firing number (a compare-and-swap).
_DELETE_LAST: Final = (
    f"DELETE FROM flowlock_timers WHERE {_KEY} AND n = ? "
    "AND (every IS NULL OR (lim IS NOT NULL AND n + 1 >= lim))"
)
_MOVE_ON: Final = (
    "UPDATE flowlock_timers SET n = n + 1, due_at = due_at + every, claimed_until = NULL, "
    f"claimed_by = NULL WHERE {_KEY} AND n = ? AND every IS NOT NULL "
    "AND (lim IS NULL OR n + 1 < lim)"
)
# A stale or cancelled firing: the timer goes whatever its firings left, while still at it.
_DROP: Final = f"DELETE FROM flowlock_timers WHERE {_KEY} AND n = ?"
_RELEASE: Final = (
    "UPDATE flowlock_timers SET claimed_until = NULL, claimed_by = NULL "
    f"WHERE {_KEY} AND n = ? AND claimed_by = ?"
)
_CLAIM: Final = (
    f"UPDATE flowlock_timers SET claimed_until = ?, claimed_by = ? WHERE {_KEY} AND n = ?"
)
# The instance and its earliest timer in one statement (one snapshot, no transaction to open).
_INSTANCE_AND_TIMER: Final = (
    "SELECT {instance}, {timer} FROM flowlock_instances i LEFT JOIN ("
    f"SELECT {TIMER_COLUMNS} FROM flowlock_timers WHERE instance_id = ? ORDER BY due_at LIMIT 1"
    ") t ON 1 WHERE i.id = ?"
).format(
    instance=read_columns("i"),
    timer=", ".join(f"t.{c}" for c in TIMER_COLUMNS.split(", ")),
)
_INSTANCE_WIDTH: Final = READ_WIDTH


def _marks(names: Sequence[str]) -> str:
    return ", ".join("?" * len(names))


def _moment(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


def timer_of(row: Sequence[Any], now: float) -> Timer:
    """A `TIMER_COLUMNS` row as a Timer read at `now`: a claim that ran out shows as none."""
    due, claimed = float(row[4]), row[8]
    return Timer(
        instance_id=row[0],
        workflow=row[1],
        event=row[2],
        stay=row[3],
        due_at=_moment(due),
        n=row[5],
        every=row[6],
        limit=row[7],
        claimed_until=None if claimed is None or claimed <= now else _moment(claimed),
        lag=max(0.0, now - due),
    )


# -- what commits do to timers --------------------------------------------------------------------


def arm(
    conn: sqlite3.Connection, inst: Instance, stay: int, timings: Sequence[Timing], now: float
) -> float | None:
    """Arm `timings` for `inst`'s stay `stay`, due `after` seconds from `now`; the soonest
    `after` (None: nothing armed)."""
    if not timings:
        return None
    conn.executemany(
        _ARM,
        [(inst.id, stay, t.event, inst.workflow, now + t.after, t.every, t.limit) for t in timings],
    )
    return min(t.after for t in timings)


def move_on(conn: sqlite3.Connection, instance_id: str, firing: TimerFiring) -> bool:
    """End `firing` of its timer (a reminder moves on, the rest are deleted); False, with
    nothing changed, when the timer is gone or already past that firing."""
    key = (instance_id, firing.stay, firing.event, firing.n)
    deleted = conn.execute(_DELETE_LAST, key).rowcount
    return deleted + conn.execute(_MOVE_ON, key).rowcount > 0


def after_commit(
    conn: sqlite3.Connection, committed: Instance, entries: Sequence[HistoryEntry]
) -> float | None:
    """What a committed batch does to its instance's timers, in its transaction: voids first
    (any entry that ends a stay deletes them all), then the firings it applied move their
    timers on, then the stay of the last entry that changed the state is armed. The soonest
    `after` armed (None: nothing armed)."""
    if any(entry.voids for entry in entries):
        conn.execute(_VOID, (committed.id,))
    for entry in entries:
        if entry.timer is not None:
            move_on(conn, committed.id, entry.timer)
    entered = entering(entries)
    if entered is None:
        return None
    return arm(conn, committed, entered.version, entered.arm, time.time())


# -- the TimerStore's reads and writes ------------------------------------------------------------


def get_shown_txn(conn: sqlite3.Connection, instance_id: str) -> Instance:
    """The instance with its earliest armed timer (`next_timer`)."""
    row = conn.execute(_INSTANCE_AND_TIMER, (instance_id, instance_id)).fetchone()
    if row is None:
        raise InstanceNotFound(instance_id)
    inst = instance_of(row[:_INSTANCE_WIDTH])
    if row[_INSTANCE_WIDTH] is None:
        return inst
    return inst.evolve(next_timer=timer_of(row[_INSTANCE_WIDTH:], time.time()))


def _claimable(workflows: Sequence[str]) -> str:
    # The due_at index gives the rows in due order; the scan stops after `limit` that fit.
    return (
        f"SELECT {TIMER_COLUMNS} FROM flowlock_timers WHERE due_at <= ? "
        "AND (claimed_until IS NULL OR claimed_until <= ?) "
        f"AND workflow IN ({_marks(workflows)}) ORDER BY due_at LIMIT ?"
    )


def any_claimable_txn(conn: sqlite3.Connection, workflows: Sequence[str]) -> bool:
    """Whether a timer of `workflows` can be claimed now (a read: no write lock taken)."""
    now = time.time()
    return conn.execute(_claimable(workflows), (now, now, *workflows, 1)).fetchone() is not None


def claim_txn(
    conn: sqlite3.Connection, workflows: Sequence[str], limit: int, lease: float, owner: str
) -> list[Timer]:
    """Claim at most `limit` due timers of `workflows` for `owner` until `lease` seconds from
    now. Run in a write transaction: nobody else claims between the read and the update."""
    now = time.time()
    rows = conn.execute(_claimable(workflows), (now, now, *workflows, limit)).fetchall()
    conn.executemany(_CLAIM, [(now + lease, owner, row[0], row[3], row[2], row[5]) for row in rows])
    # As the memory store answers: the claim itself is the caller's, not shown on the timer.
    return [timer_of((*row[:8], None), now) for row in rows]


def release_txn(conn: sqlite3.Connection, timer: Timer, owner: str) -> None:
    conn.execute(_RELEASE, (timer.instance_id, timer.stay, timer.event, timer.n, owner))


def cancel_txn(conn: sqlite3.Connection, timer: Timer) -> bool:
    return move_on(conn, timer.instance_id, timer.firing)


def drop_txn(conn: sqlite3.Connection, timer: Timer) -> bool:
    key = (timer.instance_id, timer.stay, timer.event, timer.n)
    return conn.execute(_DROP, key).rowcount > 0


def next_due_txn(conn: sqlite3.Connection, workflows: Sequence[str]) -> float | None:
    """Seconds until a timer of `workflows` can be claimed: the earliest unclaimed one's due
    time, or when a claim runs out (0: now); None when none is armed. One statement."""
    marks = _marks(workflows)
    [(at,)] = conn.execute(
        "SELECT min(t) FROM ("
        "SELECT t FROM (SELECT due_at AS t FROM flowlock_timers WHERE claimed_until IS NULL "
        f"AND workflow IN ({marks}) ORDER BY due_at LIMIT 1) "
        "UNION ALL SELECT max(due_at, claimed_until) FROM flowlock_timers "
        f"WHERE claimed_until IS NOT NULL AND workflow IN ({marks}))",
        (*workflows, *workflows),
    ).fetchall()
    return None if at is None else max(0.0, float(at) - time.time())


def timers_txn(conn: sqlite3.Connection, instance_id: str) -> list[Timer]:
    now = time.time()
    rows = conn.execute(
        f"SELECT {TIMER_COLUMNS} FROM flowlock_timers WHERE instance_id = ? ORDER BY due_at",
        (instance_id,),
    ).fetchall()
    return [timer_of(row, now) for row in rows]


def due_timers_txn(conn: sqlite3.Connection, within: float, limit: int) -> list[Timer]:
    now = time.time()
    rows = conn.execute(
        f"SELECT {TIMER_COLUMNS} FROM flowlock_timers WHERE due_at <= ? ORDER BY due_at LIMIT ?",
        (now + within, limit),
    ).fetchall()
    return [timer_of(row, now) for row in rows]


def count_timers_txn(conn: sqlite3.Connection) -> int:
    [(count,)] = conn.execute("SELECT count(*) FROM flowlock_timers").fetchall()
    return int(count)
