"""The SQLite store's outbox (see [`OutboxStore`][flowlock.stores.base.OutboxStore]): statements
and the transaction bodies, each run on a connection's thread.

Times are epoch seconds on this host's wall clock (`time.time()`), as for the timers: SQLite
has no server clock, and every process sharing the file reads the same host clock.

Why the claim needs no SKIP LOCKED: it runs in one write transaction (`BEGIN IMMEDIATE`), and
SQLite lets one writer at a time into a database, so claimers (in this process or another)
take turns; each sees the claims of those before it.
"""

from __future__ import annotations

import dataclasses
import sqlite3
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Final, NamedTuple

from flowlock.core.models import HistoryEntry, Instance
from flowlock.core.outbox import MESSAGE_STATUSES, Message, key_cursor, message_key
from flowlock.stores.sqlite.sql import IDS_PER_SELECT, dump_json, load_json

__all__ = [
    "MessageRow",
    "any_claimable_txn",
    "claim_txn",
    "count_txn",
    "drop_txn",
    "fail_txn",
    "find_txn",
    "finish_txn",
    "get_txn",
    "message_rows",
    "messages_txn",
    "next_due_txn",
    "purge_txn",
    "release_txn",
    "retry_txn",
    "write_messages",
]

_COLUMNS: Final = (
    "key, instance_id, workflow, version, n, kind, payload, status, attempts, fencing_token, "
    "last_error, due_at, created_at, done_at, claimed_until, trace"
)
_INSERT: Final = (
    "INSERT INTO flowlock_outbox (instance_id, version, n, key, workflow, kind, payload, "
    "status, attempts, fencing_token, due_at, created_at, trace) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, 'pending', 0, ?, ?, ?, ?)"
)
# Claimable: pending, due, not held by a live claim, and the earliest pending message of its
# instance (done and dead ones do not hold it back). The due index walks a kind's pending
# messages in due order; the order index answers NOT EXISTS with one probe.
_CLAIMABLE: Final = (
    "o.status = 'pending' AND o.due_at <= :now "
    "AND (o.claimed_until IS NULL OR o.claimed_until <= :now) "
    "AND NOT EXISTS (SELECT 1 FROM flowlock_outbox e WHERE e.status = 'pending' "
    "AND e.instance_id = o.instance_id AND (e.version, e.n) < (o.version, o.n))"
)
# Oldest due first, as on PostgreSQL (a message due again after a failure takes its turn by
# its new due time); the index's order, so the walk stops after `limit`.
_CLAIM_ONE_KIND: Final = (
    f"SELECT {', '.join(f'o.{c}' for c in _COLUMNS.split(', '))} FROM flowlock_outbox o "
    f"WHERE o.kind = :kind AND {_CLAIMABLE} "
    "ORDER BY o.due_at, o.instance_id, o.version, o.n LIMIT :limit"
)
_ANY_CLAIMABLE: Final = (
    f"SELECT 1 FROM flowlock_outbox o WHERE o.kind = :kind AND {_CLAIMABLE} LIMIT 1"
)
# The messages right behind a run's head, in order: the instance's pending ones after it (the
# order index), of which the claim keeps the contiguous prefix it may take.
_FOLLOWERS: Final = (
    f"SELECT {_COLUMNS} FROM flowlock_outbox WHERE instance_id = ? AND status = 'pending' "
    "AND (version, n) > (?, ?) ORDER BY version, n LIMIT ?"
)
_CLAIM: Final = (
    "UPDATE flowlock_outbox SET claimed_until = ?, claimed_by = ?, attempts = attempts + 1 "
    "WHERE key = ?"
)
# The compare-and-swap of fail and release: still pending, held by `owner`, same attempt.
_HELD: Final = "key = ? AND status = 'pending' AND claimed_by = ? AND attempts = ?"
_FAIL: Final = (
    "UPDATE flowlock_outbox SET status = ?, last_error = ?, due_at = coalesce(?, due_at), "
    f"attempts = max(0, attempts - ?), claimed_until = NULL, claimed_by = NULL WHERE {_HELD}"
)
# A claim given back; its attempt counted back down when its delivery never began.
_RELEASE: Final = (
    "UPDATE flowlock_outbox SET claimed_until = NULL, claimed_by = NULL, "
    f"attempts = max(0, attempts - ?) WHERE {_HELD}"
)
_FINISH: Final = (
    "UPDATE flowlock_outbox SET status = 'done', done_at = ?, claimed_until = NULL, "
    "claimed_by = NULL, attempts = max(attempts, 1) WHERE status = 'pending' AND key IN "
)
_RETRY: Final = (
    "UPDATE flowlock_outbox SET status = 'pending', attempts = 0, due_at = ?, "
    "claimed_until = NULL, claimed_by = NULL WHERE key = ? AND status != 'done' "
    "AND (claimed_until IS NULL OR claimed_until <= ?)"
)
_GET: Final = f"SELECT {_COLUMNS} FROM flowlock_outbox WHERE key = ?"
# Why a sub-select with its own ORDER BY ... LIMIT: it walks the purge index oldest first and
# stops after `limit` rows, instead of sorting every done message.
_PURGE: Final = (
    "DELETE FROM flowlock_outbox WHERE rowid IN (SELECT rowid FROM flowlock_outbox "
    "WHERE status = 'done' AND done_at < ? ORDER BY done_at LIMIT ?)"
)
# The statuses a filter asks for: running is pending and held by a live claim.
_STATUS: Final[Mapping[str, str]] = {
    "pending": "status = 'pending' AND (claimed_until IS NULL OR claimed_until <= :now)",
    "running": "status = 'pending' AND claimed_until > :now",
    "done": "status = 'done'",
    "dead": "status = 'dead'",
}


class MessageRow(NamedTuple):
    """One emitted message encoded before the transaction starts (a payload that cannot be
    stored raises InvalidInput before anything is written)."""

    version: int
    n: int
    key: str
    kind: str
    payload: str
    fencing_token: int | None
    trace: str | None


def message_rows(batch: Sequence[HistoryEntry]) -> tuple[MessageRow, ...]:
    """The outbox rows of `batch`'s emits, message n of each entry keyed by its version and n."""
    rows: list[MessageRow] = []
    for entry in batch:
        for n, emit in enumerate(entry.emits):
            key = message_key(entry.instance_id, entry.version, n)
            payload = dump_json(emit.payload, f"payload of message {key!r}")
            token, trace = entry.fencing_token, entry.trace
            rows.append(MessageRow(entry.version, n, key, emit.kind, payload, token, trace))
    return tuple(rows)


def write_messages(
    conn: sqlite3.Connection, committed: Instance, rows: Sequence[MessageRow]
) -> None:
    """Insert `rows` as pending messages due now, in the transaction of the commit that won."""
    now = time.time()
    conn.executemany(
        _INSERT,
        [
            (
                committed.id,
                r.version,
                r.n,
                r.key,
                committed.workflow,
                r.kind,
                r.payload,
                r.fencing_token,
                now,
                now,
                r.trace,
            )
            for r in rows
        ],
    )


def _moment(seconds: float | None) -> datetime | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, UTC)


def message_of(row: Sequence[Any], now: float) -> Message:
    """A `_COLUMNS` row as a Message read at `now`: a pending row held by a live claim is
    running; a claim that ran out shows as none."""
    status, claimed = row[7], row[14]
    held = status == "pending" and claimed is not None and claimed > now
    return Message(
        key=row[0],
        instance_id=row[1],
        workflow=row[2],
        version=row[3],
        n=row[4],
        kind=row[5],
        payload=load_json(row[6], f"message {row[0]!r}"),
        status="running" if held else status,
        attempts=row[8],
        fencing_token=row[9],
        last_error=row[10],
        next_attempt_at=_moment(row[11]) if status == "pending" else None,
        created_at=_moment(row[12]),
        done_at=_moment(row[13]),
        claimed_until=_moment(claimed) if held else None,
        trace=row[15],
    )


def _marks(count: int) -> str:
    return ", ".join("?" * count)


# -- the dispatcher's questions -------------------------------------------------------------------


def any_claimable_txn(conn: sqlite3.Connection, kinds: Sequence[str]) -> bool:
    """Whether a message of `kinds` can be claimed now (a read: no write lock taken)."""
    now = time.time()
    for kind in kinds:
        found = conn.execute(_ANY_CLAIMABLE, {"kind": kind, "now": now}).fetchone()
        if found is not None:
            return True
    return False


def claim_txn(
    conn: sqlite3.Connection, kinds: Mapping[str, int], lease: float, owner: str, run: int = 1
) -> list[Message]:
    """Claim, for each kind, at most its limit of runs (a claimable head, oldest due first, and
    at most `run` - 1 messages right behind it that may go with it) for `owner` until `lease`
    seconds from now. Run in a write transaction: no other claimer, in this process or
    another, runs between the reads and the updates."""
    now = time.time()
    until = now + lease
    claimed: list[Message] = []
    for kind, limit in kinds.items():
        if limit <= 0:
            continue
        heads = conn.execute(_CLAIM_ONE_KIND, {"kind": kind, "now": now, "limit": limit})
        rows: list[Any] = []
        for head in heads.fetchall():
            rows.append(head)
            if run > 1:
                rows.extend(_followers(conn, head, kind, now, run - 1))
        if not rows:
            continue
        conn.executemany(_CLAIM, [(until, owner, row[0]) for row in rows])
        for row in rows:
            # As the update left it: one attempt more, held by `owner` until `until`.
            shown = (*row[:8], row[8] + 1, *row[9:14], until, row[15])
            message = message_of(shown, now)
            claimed.append(dataclasses.replace(message, lag=max(0.0, now - row[12])))
    return claimed


def _followers(
    conn: sqlite3.Connection, head: Sequence[Any], kind: str, now: float, most: int
) -> list[Any]:
    """The pending messages right behind `head` of its instance that go in its run: of `kind`,
    due and not held, up to the first that is not (a run has no gap), at most `most`."""
    taken: list[Any] = []
    for row in conn.execute(_FOLLOWERS, (head[1], head[3], head[4], most)).fetchall():
        # Columns: 5 kind, 11 due_at, 14 claimed_until.
        if row[5] != kind or row[11] > now or (row[14] is not None and row[14] > now):
            break
        taken.append(row)
    return taken


def fail_txn(
    conn: sqlite3.Connection,
    message: Message,
    owner: str,
    error: str,
    retry_in: float | None,
    counted: bool = True,
) -> bool:
    status = "dead" if retry_in is None else "pending"
    due = None if retry_in is None else time.time() + max(0.0, retry_in)
    back = 0 if counted else 1
    cur = conn.execute(_FAIL, (status, error, due, back, message.key, owner, message.attempts))
    return cur.rowcount > 0


def release_txn(conn: sqlite3.Connection, message: Message, owner: str, begun: bool = True) -> bool:
    back = 0 if begun else 1
    return conn.execute(_RELEASE, (back, message.key, owner, message.attempts)).rowcount > 0


def finish_txn(conn: sqlite3.Connection, keys: Sequence[str]) -> int:
    """Mark the pending messages of `keys` done, whoever holds them; how many were marked."""
    now = time.time()
    unique = tuple(dict.fromkeys(keys))
    marked = 0
    for at in range(0, len(unique), IDS_PER_SELECT):
        chunk = unique[at : at + IDS_PER_SELECT]
        marked += conn.execute(f"{_FINISH}({_marks(len(chunk))})", (now, *chunk)).rowcount
    return marked


def next_due_txn(conn: sqlite3.Connection, kinds: Sequence[str]) -> float | None:
    """Seconds until a pending message of `kinds` is due or its claim runs out (0: now); None
    when none is pending. Per kind, the due index gives the earliest unclaimed one at once;
    the held claims are few (a dispatcher's concurrency)."""
    # Chunks: a statement holds at most 500 SELECTs joined by UNION ALL (SQLite's limit).
    found = [
        at
        for start in range(0, len(kinds), _KINDS_PER_SELECT)
        if (at := _earliest(conn, kinds[start : start + _KINDS_PER_SELECT])) is not None
    ]
    return None if not found else max(0.0, min(found) - time.time())


_KINDS_PER_SELECT: Final = 100


def _earliest(conn: sqlite3.Connection, kinds: Sequence[str]) -> float | None:
    earliest = " UNION ALL ".join(
        "SELECT * FROM (SELECT due_at AS t FROM flowlock_outbox WHERE status = 'pending' "
        "AND kind = ? AND claimed_until IS NULL ORDER BY due_at LIMIT 1)"
        for _ in kinds
    )
    [(at,)] = conn.execute(
        f"SELECT min(t) FROM ({earliest} UNION ALL "
        # "+kind": walk the few held claims (claimed index), not every pending message.
        "SELECT max(due_at, claimed_until) FROM flowlock_outbox WHERE claimed_until IS NOT NULL "
        f"AND status = 'pending' AND +kind IN ({_marks(len(kinds))}))",
        (*kinds, *kinds),
    ).fetchall()
    return None if at is None else float(at)


# -- reads and repairs ----------------------------------------------------------------------------


def messages_txn(conn: sqlite3.Connection, instance_id: str) -> list[Message]:
    now = time.time()
    rows = conn.execute(
        f"SELECT {_COLUMNS} FROM flowlock_outbox WHERE instance_id = ? ORDER BY version, n",
        (instance_id,),
    ).fetchall()
    return [message_of(row, now) for row in rows]


def _cursor(after: str | None) -> dict[str, object]:
    return dict(zip(("id", "version", "n"), key_cursor(after), strict=True))


def find_txn(
    conn: sqlite3.Connection, status: str | None, kind: str | None, after: str | None, limit: int
) -> list[Message]:
    """At most `limit` messages after key `after`, in message order (instance id, version,
    place; TEXT compares byte by byte of the UTF-8: code point order), of `status` and `kind`
    when given."""
    now = time.time()
    where = ["(instance_id, version, n) > (:id, :version, :n)"]
    if status is not None:
        if status not in MESSAGE_STATUSES:
            return []
        where.append(_STATUS[status])
    if kind is not None:
        where.append("kind = :kind")
    rows = conn.execute(
        f"SELECT {_COLUMNS} FROM flowlock_outbox WHERE {' AND '.join(where)} "
        "ORDER BY instance_id, version, n LIMIT :limit",
        {
            "kind": kind,
            "now": now,
            "limit": max(0, limit),
            **_cursor(after),
        },
    ).fetchall()
    return [message_of(row, now) for row in rows]


def get_txn(conn: sqlite3.Connection, key: str) -> Message | None:
    row = conn.execute(_GET, (key,)).fetchone()
    return None if row is None else message_of(row, time.time())


def retry_txn(conn: sqlite3.Connection, key: str) -> tuple[Message | None, bool]:
    """The message of `key` made due now, unclaimed, attempts back to 0 (a done one, or one
    held by a live claim, is left as it is); and whether it changed (so the store wakes its
    dispatchers)."""
    now = time.time()
    changed = conn.execute(_RETRY, (now, key, now)).rowcount > 0
    return get_txn(conn, key), changed


def drop_txn(conn: sqlite3.Connection, key: str) -> bool:
    return conn.execute("DELETE FROM flowlock_outbox WHERE key = ?", (key,)).rowcount > 0


def count_txn(conn: sqlite3.Connection) -> dict[str, int]:
    counts = dict.fromkeys(MESSAGE_STATUSES, 0)
    rows = conn.execute(
        "SELECT CASE WHEN status = 'pending' AND claimed_until > ? THEN 'running' "
        "ELSE status END AS shown, count(*) FROM flowlock_outbox GROUP BY shown",
        (time.time(),),
    ).fetchall()
    for shown, count in rows:
        counts[shown] = int(count)
    return counts


def purge_txn(conn: sqlite3.Connection, older_than: float, limit: int) -> int:
    if limit <= 0:
        return 0
    return conn.execute(_PURGE, (time.time() - older_than, limit)).rowcount
