"""The timers' SQL: what a commit does to timers, and the statements of the timer service.

A commit's timers are written by the same statement as its compare-and-swap: data-modifying CTEs
joined to `moved` (the instances whose compare-and-swap won), so a lost compare-and-swap writes
no timer either. Only commits that touch timers use them (see `timer_args`): the statements of
workflows without timers stay as they were.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flowlock._pg.rows import INSTANCE_COLUMNS, TIMER_COLUMNS
from flowlock.core.models import HistoryEntry
from flowlock.stores._batch import entering
from flowlock.stores.postgres.listen import channel_name

__all__ = [
    "CANCEL",
    "CLAIM",
    "COUNT",
    "DROP",
    "DUE",
    "NEXT_DUE",
    "RELEASE",
    "TIMERS",
    "TIMER_ARRAYS",
    "armed_create",
    "channel",
    "create_arm_args",
    "stay_of",
    "timer_args",
    "timer_ctes",
]

# Whether a timer fires again after the firing it is at: a reminder with firings left.
_REPEATS = "(t.every IS NOT NULL AND (t.lim IS NULL OR t.n + 1 < t.lim))"
# A reminder's next firing: one period after the last due time (not after the firing), unclaimed.
_MOVE_ON = """n = t.n + 1, due_at = t.due_at + t.every * interval '1 second',
           claimed_until = NULL, claimed_by = NULL"""


TIMER_ARRAYS = 11
"""How many parameters `timer_ctes` reads (one array each)."""


def timer_ctes(k: int) -> str:
    """The CTEs that do a committed batch's timers, after a statement's `moved` CTE (the
    instances written, with `id`, `workflow` and their new `version`), reading the arrays of
    `timer_args` as parameters $k to $k+10.

    In a batch, voids come first (the instance's timers are all deleted), then the firings
    move their timers on (a reminder with firings left) or delete them, only where the row is
    still at that firing (`n`), then the stay the last entering entry began is armed, due
    `after` seconds from now() on the server. Why no two CTEs touch one row (PostgreSQL does not
    say which would win): firings are dropped for an instance whose timers are voided, the move
    and the delete of a firing have opposite conditions, and the stay armed is newer than every
    row there (ON CONFLICT only for safety).
    """
    voids = f"${k}::text[]"
    return f"""
, fired AS (
    SELECT f.instance_id, f.stay, f.event, f.n
      FROM unnest(${k + 1}::text[], ${k + 2}::bigint[], ${k + 3}::text[], ${k + 4}::bigint[])
           AS f(instance_id, stay, event, n)
      JOIN moved m ON m.id = f.instance_id
     WHERE f.instance_id <> ALL({voids})
), timers_dropped AS (
    DELETE FROM flowlock_timers t
     USING moved m
     WHERE t.instance_id = m.id
       AND (t.instance_id = ANY({voids})
            OR ((t.instance_id, t.stay, t.event, t.n) IN (SELECT * FROM fired)
                AND NOT {_REPEATS}))
), timers_moved AS (
    UPDATE flowlock_timers t
       SET {_MOVE_ON}
      FROM fired f
     WHERE (t.instance_id, t.stay, t.event, t.n) = (f.instance_id, f.stay, f.event, f.n)
       AND {_REPEATS}
), timers_armed AS (
    INSERT INTO flowlock_timers (instance_id, stay, event, workflow, due_at, every, lim)
    SELECT m.id, a.stay, a.event, m.workflow, now() + a.after * interval '1 second', a.every,
           a.lim
      FROM unnest(${k + 5}::text[], ${k + 6}::bigint[], ${k + 7}::text[], ${k + 8}::float8[],
                  ${k + 9}::float8[], ${k + 10}::bigint[])
           AS a(instance_id, stay, event, after, every, lim)
      JOIN moved m ON m.id = a.instance_id
    ON CONFLICT (instance_id, stay, event) DO NOTHING
)
"""


def armed_create(insert: str, k: int, keyed: str = "") -> str:
    """A create (`insert`, the INSERT of the instance) that arms the initial state's timers in
    the same statement, with stay 1, from the arrays $k to $k+3 (events, after, every, limit).
    `keyed`: more CTEs after `made` (the create's key)."""
    return f"""
WITH made AS (
{insert.strip()}
){keyed}, timers_armed AS (
    INSERT INTO flowlock_timers (instance_id, stay, event, workflow, due_at, every, lim)
    SELECT m.id, 1, a.event, m.workflow, now() + a.after * interval '1 second', a.every, a.lim
      FROM made m,
           unnest(${k}::text[], ${k + 1}::float8[], ${k + 2}::float8[], ${k + 3}::bigint[])
           AS a(event, after, every, lim)
)
SELECT {INSTANCE_COLUMNS} FROM made
"""


def stay_of(batch: Sequence[HistoryEntry]) -> int | None:
    """The stay a batch leaves its instance in when it begins one: the version of its last
    entry that changes the state (None: the stay goes on)."""
    entered = entering(batch)
    return None if entered is None else entered.version


def timer_args(batches: Sequence[Sequence[HistoryEntry]]) -> tuple[list[Any], ...] | None:
    """The parameters of `timer_ctes` for one batch per instance, or None when no batch
    touches a timer (the statement without them is used then): the instances whose timers are
    voided; the firings to move on (instance, stay, event, n); the timers to arm (instance,
    stay, event, after, every, limit)."""
    voids: list[str] = []
    fired: tuple[list[Any], ...] = ([], [], [], [])
    armed: tuple[list[Any], ...] = ([], [], [], [], [], [])
    for batch in batches:
        iid = batch[0].instance_id
        if any(e.voids for e in batch):
            voids.append(iid)  # the fired timers go with the rest
        else:
            for e in batch:
                if e.timer is not None:
                    for column, value in zip(fired, (iid, *_firing(e)), strict=True):
                        column.append(value)
        last = entering(batch)
        if last is not None:
            for timing in last.arm:
                row = (iid, last.version, timing.event, timing.after, timing.every, timing.limit)
                for column, value in zip(armed, row, strict=True):
                    column.append(value)
    if not (voids or fired[0] or armed[0]):
        return None
    return (voids, *fired, *armed)


def _firing(entry: HistoryEntry) -> tuple[int, str, int]:
    timer = entry.timer
    assert timer is not None
    return timer.stay, timer.event, timer.n


def create_arm_args(arm: Sequence[Any]) -> tuple[list[Any], ...]:
    """The arrays of `armed_create`: events, after, every, limit."""
    return (
        [t.event for t in arm],
        [t.after for t in arm],
        [t.every for t in arm],
        [t.limit for t in arm],
    )


# -- the timer service's statements (flowlock.stores.base.TimerStore) --------------------------

# The due timers of the workflows an engine runs that nobody holds, earliest first, claimed for
# a lease. Per workflow, a LATERAL subquery walks the (workflow, due_at) index in due order and
# stops after $2 rows that fit; the top $2 of those are claimed. One `workflow = ANY($1)` scan
# instead would give the rows of several workflows in no due order, so PostgreSQL would read
# and sort every due row (after downtime, 100,000 overdue: all read by each claim of 64).
# SKIP LOCKED: a row another claimer is taking is left to it, so two claimers never get the
# same timer and never wait for each other. READ COMMITTED re-checks a row that changed since
# the snapshot (claimed and committed by another) against the WHERE before locking it.
# The subqueries lock up to $2 rows each, and the rows not among the top $2 stay locked (not
# claimed) until the transaction ends. The claim is the only statement of its transaction (on
# an application's pool, between a BEGIN and a COMMIT of its own), so they are let go at once,
# and another claimer skips them only for that instant (its next round sees them). Never run
# it inside a longer transaction. DISTINCT: a workflow named twice is walked once.
# $1 workflows, $2 limit, $3 lease seconds, $4 owner.
CLAIM = """
WITH due AS (
    SELECT c.instance_id, c.stay, c.event
      FROM (SELECT DISTINCT unnest($1::text[])) AS w(name)
      CROSS JOIN LATERAL (
          SELECT t.instance_id, t.stay, t.event, t.due_at FROM flowlock_timers t
           WHERE t.workflow = w.name AND t.due_at <= now()
             AND (t.claimed_until IS NULL OR t.claimed_until <= now())
           ORDER BY t.due_at
           LIMIT $2
             FOR UPDATE SKIP LOCKED) AS c
     ORDER BY c.due_at
     LIMIT $2
), claimed AS (
    UPDATE flowlock_timers t
       SET claimed_until = now() + $3::float8 * interval '1 second', claimed_by = $4
      FROM due d
     WHERE (t.instance_id, t.stay, t.event) = (d.instance_id, d.stay, d.event)
 RETURNING t.instance_id, t.workflow, t.event, t.stay, t.due_at, t.n, t.every, t.lim
)
SELECT instance_id, workflow, event, stay, due_at, n, every, lim,
       NULL::timestamptz AS claimed_until,
       greatest(0, extract(epoch FROM now() - due_at))::float8 AS lag
  FROM claimed ORDER BY due_at
"""
_ONE = "(instance_id, stay, event, n) = ($1, $2, $3, $4)"
_ONE_T = "(t.instance_id, t.stay, t.event, t.n) = ($1, $2, $3, $4)"
# $1 instance id, $2 stay, $3 event, $4 firing number, $5 owner.
RELEASE = f"""
UPDATE flowlock_timers SET claimed_until = NULL, claimed_by = NULL
 WHERE {_ONE} AND claimed_by = $5
"""
# A firing that applied nothing, ended as its commit would have: a compare-and-swap on the
# stay and firing number. Two CTEs with opposite conditions, so at most one touches the row.
# $1 instance id, $2 stay, $3 event, $4 firing number.
CANCEL = f"""
WITH dropped AS (
    DELETE FROM flowlock_timers t WHERE {_ONE_T}
       AND NOT {_REPEATS}
 RETURNING 1
), moved_on AS (
    UPDATE flowlock_timers t SET {_MOVE_ON}
     WHERE {_ONE_T} AND {_REPEATS}
 RETURNING 1
)
SELECT (SELECT count(*) FROM dropped) + (SELECT count(*) FROM moved_on)
"""
# A stale or cancelled firing: its timer is deleted, a reminder with firings left too, only
# while the row is still at that stay and firing (a compare-and-swap). $1 to $4 as CANCEL's.
DROP = f"DELETE FROM flowlock_timers WHERE {_ONE}"
# Seconds until a timer of the workflows can be claimed: the earliest due time of a timer
# nobody holds, or the end of a claim (a claimer that died) when that is later than its due
# time. Both halves walk the (workflow, due_at) index: the first per workflow, in due order,
# stopping at the first row nobody holds; the second only the due range, since a timer is
# claimed only once due (and a move on or a release clears the claim). None: none armed.
# $1 workflows.
NEXT_DUE = """
SELECT extract(epoch FROM least(
    (SELECT min(f.due_at)
       FROM unnest($1::text[]) AS w(name)
       CROSS JOIN LATERAL (
           SELECT due_at FROM flowlock_timers t
            WHERE t.workflow = w.name
              AND (t.claimed_until IS NULL OR t.claimed_until <= now())
            ORDER BY t.due_at LIMIT 1) AS f),
    (SELECT min(greatest(due_at, claimed_until)) FROM flowlock_timers
      WHERE workflow = ANY($1::text[]) AND due_at <= now() AND claimed_until > now())
) - now())::float8
"""
TIMERS = f"""
SELECT {TIMER_COLUMNS} FROM flowlock_timers WHERE instance_id = $1 ORDER BY due_at, event
"""
# $1 seconds ahead, $2 limit.
DUE = f"""
SELECT {TIMER_COLUMNS} FROM flowlock_timers
 WHERE due_at <= now() + $1::float8 * interval '1 second'
 ORDER BY due_at, instance_id, event LIMIT $2
"""
COUNT = "SELECT count(*) FROM flowlock_timers"


def channel(schema: str) -> str:
    """The NOTIFY channel of the timers table in `schema`, as its trigger names it."""
    return channel_name("flowlock_timers", schema)
