"""What a refused claim means for the other batches written with it, in one statement.

A claim that does not fit rolls back the whole statement of several instances (see
`constraint_sql`). The refused batch answers its ConstraintRefused; the batches after it that
take a slot of the same key are set aside (the key was full when their turn came), and the
others go again together. Those set aside are then settled by one read: a batch whose instance
moved lost its race (None); one whose key is still full is refused as of that read, having
written nothing; any other runs alone. So a storm of callers on one full key costs a few
statements per round, not one per caller.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import asyncpg

from flowlock._pg.errors import refusal, refused
from flowlock._pg.rows import instance_from_row
from flowlock.core.constraints import CapacityReached, Claim, ConstraintRefused, UniqueViolation
from flowlock.core.models import HistoryEntry, Instance
from flowlock.stores.base import LockedResult
from flowlock.stores.postgres.session import Conn, Contended, DuplicateRequest, Session
from flowlock.stores.postgres.sql import Batch, keys_of, many_of

__all__ = [
    "Answer",
    "Aside",
    "commit_refusing",
    "refused_place",
    "settle",
    "settle_locked",
    "write_group",
]

# Per batch set aside: whether its instance is still at the version it was decided on, and
# the holders of the key it takes, oldest first, in one snapshot.
# $1 instance ids, $2 the versions read, $3 kinds, $4 keys.
STILL_FULL = """
SELECT u.n, i.version,
       ARRAY(SELECT s.instance_id FROM flowlock_slots s
              WHERE s.kind = u.kind AND s.key = u.key ORDER BY s.seq) AS holders
  FROM unnest($1::text[], $2::bigint[], $3::text[], $4::text[])
       WITH ORDINALITY AS u(id, version, kind, key, n)
  LEFT JOIN flowlock_instances i ON i.id = u.id
"""
# The counter rows of the keys set aside, locked (a pessimistic group's transaction: no
# release can commit between its read and its COMMIT) without waiting: its write may hold
# other counter rows already, so a wait here could close a circle with another group. A row
# another transaction holds is skipped, and its calls run alone. $1 kinds, $2 keys.
LOCK_KEYS = """
SELECT kind, key FROM flowlock_capacity
 WHERE (kind, key) IN (SELECT * FROM unnest($1::text[], $2::text[]))
 ORDER BY kind, key FOR UPDATE SKIP LOCKED
"""


@dataclass(frozen=True, slots=True)
class Aside:
    """A batch set aside after the refusal of `kind`'s `key` in the statement it was in."""

    batch: Batch
    kind: str
    key: str


Answer = Instance | ConstraintRefused | None


def refused_place(exc: ConstraintRefused, batches: Sequence[Batch]) -> int | None:
    """The place in `batches` (one per instance) of the batch whose claim `exc` refused."""
    return next(
        (i for i, batch in enumerate(batches) if batch[0].instance_id == exc.instance_id), None
    )


def _counts_key(batch: Batch, kind: str, key: str) -> bool:
    """Whether `batch` takes a slot of, or counts against, `key` of `kind`."""
    return any(
        c.op != "release" and c.kind == kind and c.key == key for e in batch for c in e.claims
    )


async def commit_refusing(
    batches: Sequence[Batch],
    together: Callable[[Sequence[Batch]], Awaitable[list[Instance | None]]],
    each: Callable[[Sequence[Batch]], Awaitable[list[Answer]]],
    recheck: Callable[[Sequence[Aside]], Awaitable[dict[int, Answer]]],
) -> list[Answer]:
    """`commit_many`'s rounds: the batches in one statement (`together`). A refusal answers
    its batch, sets aside the batches after it that take or count the same key, and the others
    go again (those before it fitted, and fit again). Those set aside are settled by `recheck`
    (by place among them); what it leaves, one batch left alone, or the batches of a statement
    that failed whole (a request id applied before, a deadlock): each alone (`each`)."""
    answers: dict[int, Answer] = {}
    left = list(range(len(batches)))
    aside: dict[int, Aside] = {}
    while len(left) > 1:
        now = [batches[i] for i in left]
        try:
            done = await together(now)
        except (DuplicateRequest, Contended):
            break
        except ConstraintRefused as exc:
            place = refused_place(exc, now)
            if place is None:
                raise
            answers[left.pop(place)] = exc
            for i in left[place:]:
                if _counts_key(batches[i], exc.kind, exc.key):
                    aside[i] = Aside(batches[i], exc.kind, exc.key)
            left = [i for i in left if i not in aside]
            continue
        answers.update(zip(left, done, strict=True))
        left = []
    if aside:
        places = list(aside)
        settled = await recheck([aside[i] for i in places])
        answers.update({places[n]: answer for n, answer in settled.items()})
        left += [i for n, i in enumerate(places) if n not in settled]
    rest = sorted(left)
    if rest:
        answers.update(zip(rest, await each([batches[i] for i in rest]), strict=True))
    return [answers[i] for i in range(len(batches))]


def _take(batch: Batch, kind: str, key: str) -> tuple[HistoryEntry, Claim] | None:
    """The entry of `batch` that takes `key` of `kind`, and that take, when nothing before it
    in the batch gives back a slot of `kind` (then the key being full says the take does not
    fit); else None."""
    for entry in batch:
        for claim in entry.claims:
            if claim.kind != kind:
                continue
            if claim.op == "release":
                return None
            if claim.op == "take" and claim.key == key:
                return entry, claim
    return None


async def settle(s: Session, aside: Sequence[Aside]) -> dict[int, Answer]:
    """`_settle` on a connection of its own (after an optimistic round)."""
    ids = [a.batch[0].instance_id for a in aside]
    async with s.conn(keys_of(ids)) as conn:
        return await _settle(conn, s, aside)


async def _settle(conn: Conn, s: Session, aside: Sequence[Aside]) -> dict[int, Answer]:
    """The batches set aside that one read settles, by place: None where the instance moved
    from the version the batch was decided on (it lost its race), the refusal where the key it
    takes is full as of the read (it would not fit; nothing of it was written). The others
    (a rate count, a slot given back first, a free slot) are not settled: they run alone."""
    rows = await conn.fetch(
        s.sql(STILL_FULL),
        [a.batch[0].instance_id for a in aside],
        [a.batch[0].version - 1 for a in aside],
        [a.kind for a in aside],
        [a.key for a in aside],
        timeout=s.timeout,
    )
    settled: dict[int, Answer] = {}
    for row in rows:
        n = row["n"] - 1
        one = aside[n]
        found = _take(one.batch, one.kind, one.key)
        if found is None or row["version"] is None:
            continue
        entry, claim = found
        iid, holders = entry.instance_id, tuple(row["holders"])
        if row["version"] != one.batch[0].version - 1:
            settled[n] = None
        elif len(holders) >= claim.limit and iid not in holders:
            settled[n] = _refusal(entry, claim, holders)
    return settled


def _refusal(entry: HistoryEntry, claim: Claim, holders: tuple[str, ...]) -> ConstraintRefused:
    where = {"instance_id": entry.instance_id, "kind": claim.kind, "key": claim.key}
    if claim.unique:
        return UniqueViolation(**where, holder=holders[0], version=entry.version, event=entry.event)
    return CapacityReached(
        **where, limit=claim.limit, holders=holders, version=entry.version, event=entry.event
    )


async def write_group(
    conn: Conn,
    s: Session,
    key: str,
    planned: dict[int, Batch],
    answers: list[LockedResult | BaseException | None],
    aside: dict[int, Aside],
    bound: float,
) -> dict[str, Instance]:
    """A pessimistic group's planned batches in one CAS_MANY: the instances written. When a
    claim is refused, the write is undone to a savepoint (the rows stay locked): the refused
    call answers its refusal, the calls after it that take or count the same key are set
    `aside` (removed from `planned`) and the others are written again."""
    if any(e.claims for batch in planned.values() for e in batch):
        await conn.execute("SAVEPOINT flowlock_group", timeout=bound)
    while planned:
        text, args = many_of(list(planned.values()))
        try:
            written = await conn.fetch(s.sql(text), *args, timeout=bound)
        except asyncpg.TransactionRollbackError as exc:
            raise Contended(key, exc) from exc
        except asyncpg.PostgresError as exc:
            found = refusal(exc) if refused(exc) else None
            if not isinstance(found, ConstraintRefused):
                raise
            await conn.execute("ROLLBACK TO SAVEPOINT flowlock_group", timeout=bound)
            order = list(planned)
            place = next((i for i in order if planned[i][0].instance_id == found.instance_id), None)
            if place is None:
                raise Contended(key, exc) from exc
            answers[place] = found
            del planned[place]
            for i in order[order.index(place) + 1 :]:
                if _counts_key(planned[i], found.kind, found.key):
                    aside[i] = Aside(planned.pop(i), found.kind, found.key)
            continue
        return {row["id"]: instance_from_row(row) for row in written}
    return {}


async def settle_locked(
    conn: Conn,
    s: Session,
    aside: dict[int, Aside],
    answers: list[LockedResult | BaseException | None],
    bound: float,
) -> None:
    """The calls a pessimistic group set aside, settled in its transaction: the counter rows of
    their keys locked where free (no release commits before this transaction does), then
    `_settle` for the calls of those keys; a call settled answers its refusal and leaves
    `aside`, the others run alone after the group."""
    keys = sorted({(a.kind, a.key) for a in aside.values()})
    rows = await conn.fetch(
        s.sql(LOCK_KEYS), [k for k, _ in keys], [k for _, k in keys], timeout=bound
    )
    locked = {(r["kind"], r["key"]) for r in rows}
    places = [i for i, a in aside.items() if (a.kind, a.key) in locked]
    if not places:
        return
    for n, answer in (await _settle(conn, s, [aside[i] for i in places])).items():
        if isinstance(answer, ConstraintRefused):  # a locked row cannot have moved
            answers[places[n]] = answer
            del aside[places[n]]
