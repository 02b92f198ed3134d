"""The outbox's SQL: what a commit writes to `flowlock_outbox`, and the dispatcher's statements.

A commit's messages are written by the same statement as its compare-and-swap: a
data-modifying CTE joined to `moved` (the instances whose compare-and-swap won), so a lost
compare-and-swap writes no message either. Only commits whose entries emit use it (see
`outbox_args`): the statements of calls that emit nothing stay as they were.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from flowlock._pg.rows import MESSAGE_COLUMNS, message_columns
from flowlock.core.models import HistoryEntry
from flowlock.stores.postgres.listen import channel_name

__all__ = [
    "CLAIM_MESSAGES",
    "COUNT_MESSAGES",
    "DROP_MESSAGE",
    "FAIL_MESSAGE",
    "FIND_MESSAGES",
    "FINISH_MESSAGES",
    "GET_MESSAGE",
    "MESSAGES",
    "NEXT_MESSAGE_DUE",
    "OUTBOX_ARRAYS",
    "PURGE_MESSAGES",
    "RELEASE_MESSAGE",
    "RETRY_MESSAGE",
    "outbox_args",
    "outbox_channel",
    "outbox_cte",
]

OUTBOX_ARRAYS = 7
"""How many parameters `outbox_cte` reads (one array each)."""


def outbox_cte(k: int) -> str:
    """The CTE that writes a committed batch's messages, after a statement's `moved` CTE (the
    instances written, with `id` and `workflow`), reading the arrays of `outbox_args` as
    parameters $k to $k+6. Pending, due now and unclaimed by the table's defaults, created
    now() on the server's clock."""
    return f"""
, outboxed AS (
    INSERT INTO flowlock_outbox (instance_id, version, n, workflow, kind, payload,
                                 fencing_token, trace)
    SELECT m.id, o.version, o.n, m.workflow, o.kind, o.payload::jsonb, o.fencing_token, o.trace
      FROM unnest(${k}::text[], ${k + 1}::bigint[], ${k + 2}::int[], ${k + 3}::text[],
                  ${k + 4}::text[], ${k + 5}::bigint[], ${k + 6}::text[])
           AS o(instance_id, version, n, kind, payload, fencing_token, trace)
      JOIN moved m ON m.id = o.instance_id
)
"""


def outbox_args(
    batches: Sequence[Sequence[HistoryEntry]], to_json: Callable[[Mapping[str, Any]], str]
) -> tuple[list[Any], ...] | None:
    """The parameters of `outbox_cte` for one batch per instance, or None when no entry of
    them emits (the statement without the CTE is used then): per message, its instance,
    version, place, kind, payload (JSON text, by `to_json`), fencing token and trace."""
    if not any(entry.emits for batch in batches for entry in batch):
        return None  # the hot path: nothing to build
    columns: tuple[list[Any], ...] = tuple([] for _ in range(OUTBOX_ARRAYS))
    for batch in batches:
        for entry in batch:
            for n, emit in enumerate(entry.emits):
                row = (
                    entry.instance_id,
                    entry.version,
                    n,
                    emit.kind,
                    to_json(emit.payload),
                    entry.fencing_token,
                    entry.trace,
                )
                for column, value in zip(columns, row, strict=True):
                    column.append(value)
    return columns


# -- the dispatcher's statements (flowlock.stores.base.OutboxStore) ------------------------------

# Whether a pending message is held back by an earlier pending message of its instance (lower
# version, or the same version and a lower place): one probe of flowlock_outbox_order.
_BLOCKED = """EXISTS (
                 SELECT FROM flowlock_outbox e
                  WHERE e.instance_id = t.instance_id AND e.status = 'pending'
                    AND (e.version, e.n) < (t.version, t.n))"""
_FREE = "(t.claimed_until IS NULL OR t.claimed_until <= now())"
# One message by its primary key: $1 instance id, $2 version, $3 place (its key's three parts).
_ONE = "(instance_id, version, n) = ($1, $2, $3)"

# For each kind, at most its limit of runs: a claimable head and the messages right behind it
# that may go with it, claimed for a lease and their attempts counted.
#
# The heads: per kind, a LATERAL subquery walks the (kind, due_at) index of the pending messages in
# due order, probing each for an earlier pending message of its instance, and stops at its limit of
# heads, or after 4 x limit + 64 rows (`cap`). Why the cap: a hot instance's backlog lies in the
# walk, each of its messages held back by the one before, so an uncapped walk read the whole
# backlog to find the heads behind it (14 ms a claim at 2,000). A walk cut short (`short`) finds
# the rest instance by instance instead: a skip scan of the order index gives each instance with a
# pending message once, and its first pending message is its head. So a claim reads about what it
# claims, or, past the cap, one probe per instance with a pending message; never a backlog. The
# heads chosen (oldest due first) are then locked by their row addresses with SKIP LOCKED, every
# condition checked again on the row as locked: a row another claimer is taking is left to it, so
# two claimers never get the same message and never wait for each other; READ COMMITTED re-checks a
# row claimed and committed by another since the snapshot against the WHERE before locking it.
#
# The followers: per head, a LATERAL reads the order index from the head, at most $5 - 1 rows of
# its instance (the run's length), and a running bool_and keeps the contiguous prefix that may go
# (same kind, due, not held). Why the versions are bounded too: the planner, guessing a few rows an
# instance, may read the range as a bitmap and sort it, which would read a hot instance's whole
# backlog; the bound keeps any plan to the $5 - 1 versions after the head (a run comes out shorter
# when some of them emitted nothing, never with a gap). Why FOR UPDATE without SKIP LOCKED there:
# nobody else claims behind a pending head, so only a short write (a done mark, an operator's
# retry) can hold such a row, and a skipped row would leave a gap in the run. The lock comes before
# the bool_and, so the prefix is judged on the rows as they are once locked.
#
# The claim is the only statement of its transaction (never run it inside a longer one), so
# the rows it locks are let go at once. The rows are updated by the row addresses (ctid) the
# subqueries locked: a TID scan, whatever the planner guesses of how many rows the LATERAL
# limits let through (a join on the key, guessed at thousands, read the whole table, done
# messages too). A row locked by this statement cannot move before the update. A claim never
# changes the status: an earlier message being delivered still holds the later ones of its
# instance back. Returned run by run (the oldest due head first), each in order.
# $1 kinds, $2 their limits, $3 lease seconds, $4 owner, $5 the longest run.
CLAIM_MESSAGES = f"""
WITH RECURSIVE wanted AS (
    SELECT k.kind, k.lim, 4 * k.lim + 64 AS cap
      FROM unnest($1::text[], $2::int[]) AS k(kind, lim)
     WHERE k.lim > 0
), walked AS (
    SELECT k.kind, w.ctid, w.due_at, w.ok, w.rn = k.cap AS capped
      FROM wanted k
      CROSS JOIN LATERAL (
          SELECT s.ctid, s.due_at, s.ok, s.rn FROM (
              SELECT t.ctid, t.due_at, {_FREE} AND NOT {_BLOCKED} AS ok,
                     row_number() OVER (ORDER BY t.due_at) AS rn
                FROM flowlock_outbox t
               WHERE t.kind = k.kind AND t.status = 'pending' AND t.due_at <= now()
               ORDER BY t.due_at
               LIMIT k.cap) AS s
           WHERE s.ok OR s.rn = k.cap
           LIMIT k.lim) AS w
), short AS (
    SELECT w.kind FROM walked w JOIN wanted k ON k.kind = w.kind
     GROUP BY w.kind, k.lim
    HAVING bool_or(w.capped) AND count(*) FILTER (WHERE w.ok) < k.lim
), instances AS (
    (SELECT t.instance_id FROM flowlock_outbox t
      WHERE t.status = 'pending' AND EXISTS (SELECT FROM short)
      ORDER BY t.instance_id LIMIT 1)
    UNION ALL
    SELECT nx.instance_id
      FROM instances i
      CROSS JOIN LATERAL (
          SELECT t.instance_id FROM flowlock_outbox t
           WHERE t.status = 'pending' AND t.instance_id > i.instance_id
           ORDER BY t.instance_id LIMIT 1) AS nx
), found AS (
    SELECT h.kind, h.ctid, h.due_at
      FROM instances i
      CROSS JOIN LATERAL (
          SELECT t.kind, t.ctid, t.due_at, t.due_at <= now() AND {_FREE} AS ok
            FROM flowlock_outbox t
           WHERE t.instance_id = i.instance_id AND t.status = 'pending'
           ORDER BY t.version, t.n LIMIT 1) AS h
     WHERE h.ok AND h.kind IN (SELECT kind FROM short)
), chosen AS (
    SELECT c.ctid
      FROM (SELECT u.kind, u.ctid,
                   row_number() OVER (PARTITION BY u.kind ORDER BY u.due_at) AS rank
              FROM (SELECT kind, ctid, due_at FROM walked WHERE ok
                    UNION
                    SELECT kind, ctid, due_at FROM found) AS u) AS c
      JOIN wanted k ON k.kind = c.kind
     WHERE c.rank <= k.lim
), heads AS (
    SELECT t.ctid, t.instance_id, t.version, t.n, t.kind
      FROM flowlock_outbox t
     WHERE t.ctid = ANY(ARRAY(SELECT ctid FROM chosen))
       AND t.status = 'pending' AND t.due_at <= now() AND {_FREE}
       AND NOT {_BLOCKED}
       FOR UPDATE SKIP LOCKED
), followers AS (
    SELECT f.ctid
      FROM heads h
      CROSS JOIN LATERAL (
          SELECT w.ctid FROM (
              SELECT l.ctid, bool_and(l.fits) OVER (ORDER BY l.version, l.n) AS prefix
                FROM (
                    SELECT t.ctid, t.version, t.n,
                           t.kind = h.kind AND t.due_at <= now() AND {_FREE} AS fits
                      FROM flowlock_outbox t
                     WHERE t.instance_id = h.instance_id AND t.status = 'pending'
                       AND (t.version, t.n) > (h.version, h.n)
                       AND t.version < h.version + $5::int
                     ORDER BY t.version, t.n
                     LIMIT greatest($5::int - 1, 0)
                       FOR UPDATE) AS l) AS w
           WHERE w.prefix) AS f
), claimed AS (
    UPDATE flowlock_outbox t
       SET claimed_until = now() + $3::float8 * interval '1 second', claimed_by = $4,
           attempts = t.attempts + 1
     WHERE t.ctid = ANY(ARRAY(SELECT ctid FROM heads UNION ALL SELECT ctid FROM followers))
 RETURNING t.*
)
SELECT {message_columns("greatest(0, extract(epoch FROM now() - created_at))::float8")}
  FROM claimed
 ORDER BY min(due_at) OVER (PARTITION BY instance_id), instance_id, version, n
"""
# Done, whoever holds them now; those no longer pending are left as they are. A done message was
# delivered at least once, also when an operator's retry reset its attempts under a late mark.
# $1 instance ids, $2 versions, $3 places (one element per message).
FINISH_MESSAGES = """
UPDATE flowlock_outbox
   SET status = 'done', done_at = now(), claimed_until = NULL, claimed_by = NULL,
       attempts = greatest(attempts, 1)
 WHERE (instance_id, version, n) IN (SELECT * FROM unnest($1::text[], $2::bigint[], $3::int[]))
   AND status = 'pending'
"""
# Only while the owner still holds that attempt (a compare-and-swap on owner and attempts):
# due again `retry_in` seconds from now, unclaimed, or dead when it is NULL.
# $1-$3 the message, $4 owner, $5 attempts, $6 error, $7 retry in seconds (NULL: dead),
# $8 attempts to count back (0 or 1: a wait that is not a failure).
FAIL_MESSAGE = f"""
UPDATE flowlock_outbox
   SET status = CASE WHEN $7::float8 IS NULL THEN 'dead' ELSE 'pending' END,
       due_at = CASE WHEN $7::float8 IS NULL THEN due_at
                     ELSE now() + greatest($7::float8, 0) * interval '1 second' END,
       attempts = greatest(attempts - $8::int, 0),
       last_error = $6, claimed_until = NULL, claimed_by = NULL
 WHERE {_ONE} AND status = 'pending' AND claimed_by = $4 AND attempts = $5
"""
# Given back by an engine that is closing, or behind a failed message of its run: claimable at
# once, so the dispatchers of the other engines are woken (they would otherwise wait for the
# lease to run out). A claim whose delivery never began has its attempt counted back down.
# $1-$3 the message, $4 owner, $5 attempts, $6 attempts to count back (0 or 1).
RELEASE_MESSAGE = f"""
WITH released AS (
    UPDATE flowlock_outbox
       SET claimed_until = NULL, claimed_by = NULL, attempts = greatest(attempts - $6::int, 0)
     WHERE {_ONE} AND status = 'pending' AND claimed_by = $4 AND attempts = $5
 RETURNING 1
), woken AS (
    SELECT flowlock_outbox_wake() FROM released
)
SELECT count(*) FROM released WHERE (SELECT count(*) FROM woken) >= 0
"""
# Seconds until a pending message of the kinds is due and free: the earliest due time of one
# nobody holds, or the end of a claim (a claimer that died) when that comes first. The first
# half walks the due index per kind, stopping at the first row nobody holds; the second (only
# asked when nothing is free now) reads the due range only, since a message is claimed only
# once due (and a failure or a retry clears the claim). None: none pending. $1 kinds.
NEXT_MESSAGE_DUE = f"""
WITH free AS (
    SELECT min(f.due_at) AS at
      FROM unnest($1::text[]) AS k(kind)
      CROSS JOIN LATERAL (
          SELECT t.due_at FROM flowlock_outbox t
           WHERE t.kind = k.kind AND t.status = 'pending' AND {_FREE}
           ORDER BY t.due_at LIMIT 1) AS f
)
SELECT extract(epoch FROM (
    CASE WHEN free.at <= now() THEN now()
         ELSE least(free.at,
                    (SELECT min(claimed_until) FROM flowlock_outbox
                      WHERE kind = ANY($1::text[]) AND status = 'pending'
                        AND due_at <= now() AND claimed_until > now()))
    END) - now())::float8
  FROM free
"""
# $1 instance id.
MESSAGES = f"""
SELECT {MESSAGE_COLUMNS} FROM flowlock_outbox WHERE instance_id = $1 ORDER BY version, n
"""
# Walks the primary key (instance id in code point order, then version and place) from the
# cursor. A status of "running" is a pending message whose claim has not run out; "pending" one
# that nobody holds. $1-$3 the cursor's message (('', 0, -1): below every message, the first
# page), $4 status or NULL, $5 kind or NULL, $6 limit.
FIND_MESSAGES = f"""
SELECT {MESSAGE_COLUMNS} FROM flowlock_outbox
 WHERE (instance_id, version, n) > ($1, $2, $3)
   AND ($5::text IS NULL OR kind = $5)
   AND CASE $4::text
           WHEN 'running' THEN status = 'pending' AND claimed_until > now()
           WHEN 'pending' THEN status = 'pending'
                               AND (claimed_until IS NULL OR claimed_until <= now())
           ELSE $4::text IS NULL OR status = $4::text
       END
 ORDER BY instance_id, version, n LIMIT $6
"""
GET_MESSAGE = f"SELECT {MESSAGE_COLUMNS} FROM flowlock_outbox WHERE {_ONE}"
# A dead or pending message due now, unclaimed, its attempts back to 0 (the last error kept),
# and the dispatchers of every engine woken (flowlock_outbox_wake, sent at commit); a done one
# returned as it is. No row: no such message. $1-$3 the message.
RETRY_MESSAGE = f"""
WITH retried AS (
    UPDATE flowlock_outbox
       SET status = 'pending', due_at = now(), attempts = 0, claimed_until = NULL,
           claimed_by = NULL
     WHERE {_ONE} AND status <> 'done'
       AND (claimed_until IS NULL OR claimed_until <= now())
 RETURNING *
), woken AS (
    SELECT flowlock_outbox_wake() FROM retried
)
SELECT {MESSAGE_COLUMNS} FROM retried WHERE (SELECT count(*) FROM woken) >= 0
UNION ALL
SELECT {MESSAGE_COLUMNS} FROM flowlock_outbox
 WHERE {_ONE} AND NOT EXISTS (SELECT 1 FROM retried)
"""
# Deleted by an operator; a later message of its instance may go now, so the dispatchers are
# woken. $1-$3 the message.
DROP_MESSAGE = f"""
WITH dropped AS (
    DELETE FROM flowlock_outbox WHERE {_ONE} RETURNING 1
), woken AS (
    SELECT flowlock_outbox_wake() FROM dropped
)
SELECT count(*) FROM dropped WHERE (SELECT count(*) FROM woken) >= 0
"""
COUNT_MESSAGES = """
SELECT count(*) FILTER (WHERE status = 'pending'
                          AND (claimed_until IS NULL OR claimed_until <= now())) AS pending,
       count(*) FILTER (WHERE status = 'pending' AND claimed_until > now()) AS running,
       count(*) FILTER (WHERE status = 'done') AS done,
       count(*) FILTER (WHERE status = 'dead') AS dead
  FROM flowlock_outbox
"""
# One keyset batch of retention: the oldest done messages done before the cutoff, through the
# done index, deleted by the row addresses the subquery locked (a TID scan, as the claim's);
# SKIP LOCKED, so two engines purging at once never wait for each other. $1 seconds, $2 limit.
PURGE_MESSAGES = """
DELETE FROM flowlock_outbox
 WHERE ctid = ANY(ARRAY(
       SELECT ctid FROM flowlock_outbox
        WHERE status = 'done' AND done_at < now() - $1::float8 * interval '1 second'
        ORDER BY done_at LIMIT $2
          FOR UPDATE SKIP LOCKED))
"""


def outbox_channel(schema: str) -> str:
    """The NOTIFY channel of the outbox table in `schema`, as its trigger names it."""
    return channel_name("flowlock_outbox", schema)
