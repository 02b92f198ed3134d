"""Pipelining across instances: calls ready together share one round trip.

Reads and compare-and-swaps go as one statement; pessimistic calls as one transaction.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

import asyncpg

from flowlock._pg.errors import in_doubt
from flowlock._pg.rows import entry_from_row, instance_from_row
from flowlock.core.admin import refuse_paused
from flowlock.core.constraints import ConstraintRefused
from flowlock.core.errors import FlowlockError, InstanceNotFound, LockTimeout, StoreError
from flowlock.core.models import RESERVED_EVENTS, HistoryEntry, Instance, Snapshot
from flowlock.stores._batch import planned_entries, refused_plan
from flowlock.stores.base import LockedResult, Plan, RowLock
from flowlock.stores.postgres.refusals import Aside, settle_locked, write_group
from flowlock.stores.postgres.session import (
    Conn,
    Contended,
    DuplicateRequest,
    Session,
    context_of,
    roll_back,
)
from flowlock.stores.postgres.sql import (
    LOCK_SKIP,
    PRIORS_MANY,
    READ_MANY,
    Batch,
    keys_of,
    keys_text,
    many_of,
    snapshot_of,
)

# At most this many pipelined reads (and as many writes) in flight per store; more calls queue
# and go together in the next free one. A few, so that one statement waiting for a row lock
# holds up the calls that share it, not every call of the process.
DEPTH = 4
MAX_BATCH = 500


@dataclasses.dataclass(frozen=True, slots=True)
class LockedCall:
    """One `apply_locked` call, as the pessimistic pipeline queues it."""

    instance_id: str
    request_ids: tuple[str, ...]
    plan: Plan
    lock: RowLock


def lost_under_lock(instance_id: str, batch: Batch, snap: Snapshot) -> FlowlockError:
    """The error of a compare-and-swap that matched no row although the row lock was held."""
    if batch[0].version != snap.instance.version + 1:
        return refused_plan(instance_id, batch, snap)
    if batch[-1].event not in RESERVED_EVENTS and batch[-1].fencing_token is None:
        # Under the lock at the version read, with no lease's token to compare, the one check
        # left that can fail is the workflow's pause: it committed after the row was locked.
        return refuse_paused(snap.instance.evolve(workflow_paused=True))
    return StoreError(
        f"instance {instance_id!r} changed while its row lock was held; "
        "something bypassed flowlock's locking. Nothing was written"
    )


def _locked_snapshot(
    row: asyncpg.Record,
    request_ids: Sequence[str],
    found: Mapping[tuple[str, str], HistoryEntry],
) -> Snapshot:
    """A group member's Snapshot, as _locked_step builds it: the instance locked, and the entries
    found of its request ids; `found`: the group's entries by (instance, request id)."""
    instance = instance_from_row(row)
    own = {rid: found[(instance.id, rid)] for rid in request_ids if (instance.id, rid) in found}
    return Snapshot(instance, own)


def _plan_each(
    calls: Sequence[LockedCall],
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
    conn: Conn, s: Session, calls: Sequence[LockedCall], bound: float
) -> dict[tuple[str, str], HistoryEntry]:
    """The entries of the request ids of `calls` (locked already), by (instance, request id):
    one statement, its snapshot taken after the locks were granted, or none when no call has a
    request id."""
    pairs = [(c.instance_id, rid) for c in calls for rid in dict.fromkeys(c.request_ids)]
    if not pairs:
        return {}
    rows = await conn.fetch(
        s.sql(PRIORS_MANY), [iid for iid, _ in pairs], [rid for _, rid in pairs], timeout=bound
    )
    return {(r["instance_id"], r["request_id"]): entry_from_row(r) for r in rows}


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


async def read_together(
    s: Session, calls: Sequence[tuple[str, str | None]]
) -> list[Snapshot | FlowlockError]:
    """The unlocked reads of several calls (instance id, request id or None) in one round
    trip: each call's Snapshot, or InstanceNotFound, in the calls' order."""
    key = keys_of([instance_id for instance_id, _ in calls])
    ids = [instance_id for instance_id, _ in calls]
    request_ids = [request_id for _, request_id in calls]
    async with s.conn(key) as conn:
        rows = await conn.fetch(s.sql(READ_MANY), ids, request_ids, timeout=s.timeout)
    found = {row["n"]: row for row in rows}
    answers: list[Snapshot | FlowlockError] = []
    for n, (instance_id, request_id) in enumerate(calls, start=1):
        row = found.get(n)
        if row is None:
            answers.append(InstanceNotFound(instance_id))
        elif request_id is None:
            answers.append(Snapshot(instance_from_row(row)))
        else:
            answers.append(snapshot_of(row))
    return answers


async def commit_together(s: Session, batches: Sequence[Batch]) -> list[Instance | None]:
    """The batches of several instances (checked by `batches_of`) in one statement,
    each instance's compare-and-swap on its own. Raises DuplicateRequest or Contended when
    the statement failed whole (nothing of it written): the caller then commits each batch
    alone."""
    key = keys_text(batches)
    started = time.monotonic()
    async with s.conn(
        key, busy=lambda _: LockTimeout(key, time.monotonic() - started), writes=True
    ) as conn:
        try:
            text, args = many_of(batches)
            rows = await conn.fetch(s.sql(text), *args, timeout=s.timeout)
        except asyncpg.TransactionRollbackError as exc:
            # 40P01 / 40001: not between two of these statements (they lock in one order),
            # but with a caller's transaction holding rows in another order, or on an
            # application's connection at a stricter isolation level. The statement rolled
            # back whole; caught before the edge, which would make it a plain StoreError.
            raise Contended(key, exc) from exc
    moved = {row["id"]: instance_from_row(row) for row in rows}
    return [moved.get(batch[0].instance_id) for batch in batches]


async def apply_locked_together(
    s: Session, calls: Sequence[LockedCall]
) -> list[LockedResult | BaseException | None]:
    """The calls of a pessimistic group (one per instance) in ONE transaction: their rows
    locked without waiting (SKIP LOCKED), their request ids looked up in one statement,
    each call's plan run in order, every planned batch written by one CAS_MANY, COMMIT.
    Each call's answer: its LockedResult, its own error (its plan raised, or its
    compare-and-swap matched no row under the lock: nothing of it written, the others go
    on), or None when its row was not locked by the group (held elsewhere, or missing): the
    caller runs it alone. An error of the transaction itself (the connection lost, COMMIT
    in doubt: OutcomeUnknown) is the answer of every call it served, or of every call when
    it came before the rows were locked. Raises DuplicateRequest or Contended when the
    write failed whole (rolled back): the caller then runs every call alone."""
    key = keys_of([call.instance_id for call in calls])
    started = time.monotonic()
    bound = s.timeout

    def contended(exc: BaseException) -> FlowlockError:
        # A lock wait in the write (an INSERT behind a concurrent one of the same request
        # id) past the session's lock_timeout: let each call wait alone, with its own bound.
        return Contended(key, exc)

    context = context_of(key, contended)
    answers: list[LockedResult | BaseException | None] = [None] * len(calls)
    served: list[int] | None = None  # the calls whose rows the group locked, once known
    aside: dict[int, Aside] = {}  # calls its write set aside, to run alone after it
    try:
        async with s.conn(key, busy=contended) as conn:
            # The store's lock_timeout bounds the INSERT's wait behind a concurrent one of the
            # same request id (`s.begin` sets it where the session has none).
            await conn.execute(s.begin, timeout=bound)
            try:
                rows = await conn.fetch(
                    s.sql(LOCK_SKIP), [call.instance_id for call in calls], timeout=bound
                )
                locked_at = time.monotonic()
                locked = {row["id"]: row for row in rows}
                served = [i for i, call in enumerate(calls) if call.instance_id in locked]
                found = await _priors_of(conn, s, [calls[i] for i in served], bound)
                snaps = {
                    i: _locked_snapshot(locked[calls[i].instance_id], calls[i].request_ids, found)
                    for i in served
                }
                planned = _plan_each(calls, snaps, answers)
                moved = await write_group(conn, s, key, planned, answers, aside, bound)
                if aside:
                    await settle_locked(conn, s, aside, answers, bound)
                with in_doubt(context):
                    await conn.execute("COMMIT", timeout=bound)
            except asyncio.CancelledError:
                conn.terminate()  # it may be mid-statement: see _own_transaction
                raise
            except BaseException as exc:
                await roll_back(conn, exc, bound)
                raise
            released_at = time.monotonic()
    except (DuplicateRequest, Contended):
        raise
    except FlowlockError as exc:
        for i in range(len(calls)) if served is None else served:
            if answers[i] is None:
                answers[i] = exc
        return answers
    for i, snap in snaps.items():
        if answers[i] is not None or i in aside:
            continue
        iid, batch = calls[i].instance_id, planned.get(i)
        committed = None if batch is None else moved.get(iid)
        if batch is not None and committed is None:
            answers[i] = lost_under_lock(iid, batch, snap)
        else:
            answers[i] = LockedResult(snap, committed, locked_at - started, released_at - locked_at)
    return answers


# -- the adaptive strategy's escalation board (flowlock.stores.base.EscalationBoard) -----


async def commit_in_rounds(
    batches: Sequence[Batch],
    commit_many: Callable[[Sequence[Batch]], Awaitable[list[Instance | ConstraintRefused | None]]],
) -> list[Instance | BaseException | None]:
    """The compare-and-swaps of calls that queued together: one statement per round of
    distinct instances (two batches for one instance, from two strategies or two engines,
    cannot share a statement). A round that fails whole fails each of its calls; a batch
    whose claim was refused gets its ConstraintRefused, raised to its call alone."""
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
                await commit_many([batches[i] for i in now])
            )
        except FlowlockError as exc:
            done = [exc] * len(now)
        for i, answer in zip(now, done, strict=True):
            answers[i] = answer
        pending = later
    return answers


async def locked_in_groups(
    calls: Sequence[LockedCall],
    together: Callable[
        [Sequence[LockedCall]], Awaitable[list[LockedResult | BaseException | None]]
    ],
    alone: Callable[[LockedCall], Awaitable[LockedResult]],
) -> list[LockedResult | BaseException]:
    """The pessimistic calls that queued together: the first call on each instance in one
    transaction (`Operations.apply_locked_together`); the calls it did not serve (a
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
            done = await together([calls[i] for i in group])
        except (DuplicateRequest, Contended):
            done = [None] * len(group)
        for i, answer in zip(group, done, strict=True):
            answers[i] = answer
    left: dict[str, list[int]] = {}
    for i, answer in enumerate(answers):
        if answer is None:
            left.setdefault(calls[i].instance_id, []).append(i)

    async def run(indices: list[int]) -> None:
        for i in indices:
            try:
                answers[i] = await alone(calls[i])
            except Exception as exc:  # that call's own error, to that call alone
                answers[i] = exc

    await asyncio.gather(*(run(indices) for indices in left.values()))
    return _filled(answers)
