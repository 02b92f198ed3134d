"""An in-process store for unit tests and examples. Same contract as the SQL stores.

Data is round-tripped through JSON on every write and read, as a database would, so a test on the
memory store catches non-JSON data and aliasing bugs the SQL stores would catch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

from flowlock.core.admin import WorkflowPause, refuse_paused
from flowlock.core.constraints import Claim, ConstraintRefused
from flowlock.core.errors import (
    EngineClosed,
    InstanceExists,
    InstanceNotFound,
    LockBusy,
    LockTimeout,
)
from flowlock.core.models import (
    RESERVED_EVENTS,
    Escalation,
    HistoryEntry,
    Instance,
    InstanceQuery,
    Snapshot,
    Timer,
    Timing,
    paused_after,
)
from flowlock.core.settings import check_seconds
from flowlock.stores._batch import distinct_batches, entering, planned_entries, refused_plan
from flowlock.stores._claims import Claimed, claims_of
from flowlock.stores.base import ArmedSignal, LockedResult, Plan, RowLock, entries_of
from flowlock.stores.memory_constraints import MemoryConstraints
from flowlock.stores.memory_definitions import MemoryDefinitions
from flowlock.stores.memory_outbox import MemoryOutbox
from flowlock.stores.memory_outbox import copy_json as _copy
from flowlock.stores.memory_outbox import wall as _wall
from flowlock.stores.memory_replay import MemoryReplay
from flowlock.stores.memory_retention import MemoryRetention

__all__ = ["MemoryBoard", "MemoryStore"]


def _copy_entry(entry: HistoryEntry) -> HistoryEntry:
    return dataclasses.replace(entry, data=_copy(entry.data), payload=_copy(entry.payload))


def _rows(batch: tuple[HistoryEntry, ...]) -> tuple[HistoryEntry, ...]:
    """The history rows of a checked batch, their data and payload copied through JSON: done
    before the compare-and-swap, so data that is not JSON raises before anything is written."""
    return tuple(_copy_entry(entry) for entry in batch)


def _now() -> datetime:
    return datetime.now(UTC)


class MemoryBoard:
    """An in-process [`EscalationBoard`][flowlock.stores.base.EscalationBoard] (one engine, or
    tests). Its clock is the process's monotonic clock (`clock`, injectable): every engine sharing
    it runs in this process, and a change of the wall clock moves no escalation's end."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._rows: dict[str, Escalation] = {}
        self._clock = clock

    async def now(self) -> float:
        return self._clock()

    async def publish(self, escalation: Escalation) -> None:
        old = self._rows.get(escalation.key)
        if old is None or old.until < escalation.until:
            self._rows[escalation.key] = escalation

    async def active(self, now: float) -> list[Escalation]:
        return [e for e in self._rows.values() if e.until > now]


@dataclasses.dataclass(slots=True)
class _Armed:
    """A timer as the memory store keeps it: due and claimed on the monotonic clock."""

    timer: Timer
    due: float
    claimed_until: float | None = None
    owner: str | None = None


class MemoryStore(
    MemoryRetention, MemoryOutbox, MemoryReplay, MemoryDefinitions, MemoryConstraints
):
    """Instances and history in dicts; row locks are one asyncio.Lock per instance.

    Timers and messages are due on the process's monotonic clock (a change of the wall clock
    moves none); `Timer.due_at` shows it as a wall-clock time.

    As on PostgreSQL, a compare-and-swap that finds the instance's row lock held waits for the
    holder, at most `lock_timeout` seconds (then LockTimeout), and then compares against what
    the holder committed. A commit's constraint claims are applied in the same step as its
    compare-and-swap (see `memory_constraints`); every engine on the store hears its releases."""

    def __init__(self, *, lock_timeout: float = 5.0) -> None:
        self._lock_timeout = check_seconds("lock_timeout", lock_timeout)
        self._instances: dict[str, Instance] = {}
        self._history: dict[str, list[HistoryEntry]] = {}
        # Per instance, each applied request id and the index of its history row.
        self._applied: dict[str, dict[str, int]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._fences: dict[str, int] = {}
        # Each create key's instance as that create made it, and each instance's create key.
        self._created: dict[str, Instance] = {}
        self._create_keys: dict[str, str] = {}
        self._initial_data: dict[str, Mapping[str, Any]] = {}  # what replay starts from
        self._board = MemoryBoard()
        # Armed timers by instance id, then (stay, event); the events of armed() waiters.
        self._timers: dict[str, dict[tuple[int, str], _Armed]] = {}
        self._armed_events: set[ArmedSignal] = set()
        self._pauses: dict[str, WorkflowPause] = {}
        self._init_outbox()
        self._init_retention()
        self._init_definitions()
        self._init_constraints()
        self._open = False

    async def open(self) -> None:
        self._open = True

    async def aclose(self) -> None:
        self._open = False

    async def migrate(self) -> list[str]:
        self._check()  # closed like the SQL stores: EngineClosed, not a silent no-op
        return []

    def _check(self) -> None:
        if not self._open:
            raise EngineClosed("the memory store is closed; open it first")

    def _load(self, instance_id: str) -> Instance:
        inst = self._instances.get(instance_id)
        if inst is None:
            raise InstanceNotFound(instance_id)
        return self._shown_instance(inst)

    def _shown_instance(self, inst: Instance) -> Instance:
        """A copy of a stored instance as a read answers it: with its workflow's pause."""
        return inst.evolve(data=_copy(inst.data), workflow_paused=inst.workflow in self._pauses)

    async def create(
        self,
        instance: Instance,
        request_id: str | None = None,
        arm: Sequence[Timing] = (),
        claims: Sequence[Claim] = (),
    ) -> Instance:
        self._check()
        if request_id is not None and request_id in self._created:
            return self._as_created(request_id)
        if instance.id in self._instances:
            raise InstanceExists(instance.id)
        data = _copy(instance.data)  # not JSON: raises before a claim is applied
        released = self._apply_claims(Claimed(c, instance.id, 1, None) for c in claims)
        now = datetime.now(UTC)
        stored = instance.evolve(
            version=1,
            data=data,
            last_event=None,
            created_at=now,
            updated_at=now,
            stay_version=1,
        )
        self._instances[instance.id] = stored
        self._initial_data[instance.id] = stored.data
        self._arm(stored, 1, arm)
        self._history[instance.id] = []
        self._applied[instance.id] = {}
        if request_id is not None:
            self._created[request_id] = stored
            self._create_keys[instance.id] = request_id
        self._heard(released)
        return stored.evolve(data=_copy(stored.data))

    def _as_created(self, request_id: str) -> Instance:
        made = self._created[request_id]
        return made.evolve(data=_copy(made.data))

    async def create_request(self, instance_id: str) -> tuple[str, Instance] | None:
        self._check()
        key = self._create_keys.get(instance_id)
        return None if key is None else (key, self._as_created(key))

    async def get(self, instance_id: str) -> Instance:
        self._check()
        inst = self._load(instance_id)
        now = time.monotonic()
        armed = list(self._timers.get(instance_id, {}).values())
        if not armed:
            return inst
        return inst.evolve(next_timer=self._shown(min(armed, key=lambda a: a.due), now))

    def _snapshot(self, instance_id: str, request_ids: Sequence[str]) -> Snapshot:
        inst = self._load(instance_id)
        history, applied = self._history[instance_id], self._applied[instance_id]
        found = {
            rid: _copy_entry(history[at])
            for rid in request_ids
            if (at := applied.get(rid)) is not None
        }
        return Snapshot(inst, found)

    async def read(self, instance_id: str, request_ids: Sequence[str]) -> Snapshot:
        self._check()
        snap = self._snapshot(instance_id, request_ids)
        # A real database round trip yields to the loop; so does this, so that concurrency
        # tests on the memory store interleave readers and writers as they would in production.
        await asyncio.sleep(0)
        return snap

    def _write(self, rows: tuple[HistoryEntry, ...]) -> Instance | None:
        """The compare-and-swap of one instance's batch (`rows` from `_rows`): None,
        with nothing written, when it lost. Never awaits, so the check and the write are one
        step on the event loop."""
        first, last = rows[0], rows[-1]
        current = self._instances.get(first.instance_id)
        if current is None:
            raise InstanceNotFound(first.instance_id)
        if current.version != first.version - 1:
            return None
        # The batch is one writer's (one lease): its last token is the one the floor moves to.
        last_fence = self._fences.get(first.instance_id, 0)
        if last.fencing_token is not None and last.fencing_token < last_fence:
            return None
        applied = self._applied[first.instance_id]
        if any(row.request_id is not None and row.request_id in applied for row in rows):
            return None
        if last.event not in RESERVED_EVENTS and current.workflow in self._pauses:
            return None  # a fire decided before its workflow's pause: it reads again, refused
        # Raises ConstraintRefused, with nothing written, when a claim does not fit.
        released = self._apply_claims(claims_of(rows))
        now = datetime.now(UTC)
        history = self._history[first.instance_id]
        for row in rows:
            if row.request_id is not None:
                applied[row.request_id] = len(history)
            history.append(dataclasses.replace(row, at=now))
        if last.fencing_token is not None:
            self._fences[first.instance_id] = last.fencing_token
        entered = entering(rows)
        new = current.evolve(
            state=last.to_state,
            version=last.version,
            data=last.data,
            last_event=last.event,
            updated_at=now,
            stay_version=current.stay_version if entered is None else entered.version,
            paused=paused_after(current.paused, last.event),
            definition_version=(
                current.definition_version
                if last.definition_version is None
                else last.definition_version
            ),
        )
        self._instances[first.instance_id] = new
        self._timers_after(new, rows)
        self._write_messages(new, rows)
        self._heard(released)
        return new.evolve(data=_copy(new.data))

    # -- timers -------------------------------------------------------------------------------

    def _timers_after(self, new: Instance, rows: tuple[HistoryEntry, ...]) -> None:
        """What a committed batch does to the instance's timers (see TimerStore)."""
        own = self._timers.get(new.id)
        if own and any(row.voids for row in rows):
            own.clear()
        for row in rows:
            fired = row.timer
            armed = None if fired is None or not own else own.get((fired.stay, fired.event))
            if armed is not None and fired is not None and armed.timer.n == fired.n:
                self._move_on(armed)
        entered = entering(rows)
        if entered is not None:
            self._arm(new, entered.version, entered.arm)

    def _arm(self, inst: Instance, stay: int, arm: Sequence[Timing]) -> None:
        if not arm:
            return
        now = time.monotonic()
        own = self._timers.setdefault(inst.id, {})
        for timing in arm:
            due = now + timing.after
            own[(stay, timing.event)] = _Armed(
                Timer(
                    instance_id=inst.id,
                    workflow=inst.workflow,
                    event=timing.event,
                    stay=stay,
                    due_at=_wall(due),
                    every=timing.every,
                    limit=timing.limit,
                ),
                due,
            )
        soonest = min(timing.after for timing in arm)
        for signal in self._armed_events:
            signal.due_in(soonest)

    def _move_on(self, armed: _Armed) -> None:
        """A firing of `armed` is done: a reminder with firings left is due one period later,
        unclaimed; anything else is deleted."""
        timer = armed.timer
        n = timer.n + 1
        if timer.every is None or (timer.limit is not None and n >= timer.limit):
            self._delete(timer)
            return
        armed.due += timer.every
        armed.timer = dataclasses.replace(timer, n=n, due_at=_wall(armed.due))
        armed.claimed_until = armed.owner = None

    def _delete(self, timer: Timer) -> None:
        own = self._timers[timer.instance_id]
        del own[(timer.stay, timer.event)]
        if not own:
            del self._timers[timer.instance_id]

    def _all(self) -> list[_Armed]:
        return [a for own in self._timers.values() for a in own.values()]

    def _find(self, timer: Timer) -> _Armed | None:
        armed = self._timers.get(timer.instance_id, {}).get((timer.stay, timer.event))
        return armed if armed is not None and armed.timer.n == timer.n else None

    def _shown(self, armed: _Armed, now: float) -> Timer:
        claimed = armed.claimed_until
        return dataclasses.replace(
            armed.timer,
            claimed_until=None if claimed is None or claimed <= now else _wall(claimed),
            lag=max(0.0, now - armed.due),
        )

    async def claim_timers(
        self, workflows: Sequence[str], *, limit: int, lease: float, owner: str
    ) -> list[Timer]:
        self._check()
        await asyncio.sleep(0)
        now = time.monotonic()
        names = set(workflows)
        due = heapq.nsmallest(
            limit,
            (
                a
                for a in self._all()
                if a.due <= now
                and a.timer.workflow in names
                and (a.claimed_until is None or a.claimed_until <= now)
            ),
            key=lambda a: a.due,
        )
        for armed in due:
            armed.claimed_until, armed.owner = now + lease, owner
        return [dataclasses.replace(self._shown(a, now), claimed_until=None) for a in due]

    async def release_timer(self, timer: Timer, owner: str) -> None:
        self._check()
        armed = self._find(timer)
        if armed is not None and armed.owner == owner:
            armed.claimed_until = armed.owner = None

    async def cancel_timer(self, timer: Timer) -> bool:
        self._check()
        armed = self._find(timer)
        if armed is None:
            return False
        self._move_on(armed)
        return True

    async def drop_timer(self, timer: Timer) -> bool:
        self._check()
        armed = self._find(timer)
        if armed is None:
            return False
        self._delete(timer)
        return True

    async def next_due(self, workflows: Sequence[str]) -> float | None:
        self._check()
        names = set(workflows)
        times = [
            max(a.due, a.claimed_until or a.due) for a in self._all() if a.timer.workflow in names
        ]
        return None if not times else max(0.0, min(times) - time.monotonic())

    async def timers(self, instance_id: str) -> list[Timer]:
        self._check()
        now = time.monotonic()
        found = self._timers.get(instance_id, {}).values()
        return [self._shown(a, now) for a in sorted(found, key=lambda a: a.due)]

    async def due_timers(self, *, within: float, limit: int) -> list[Timer]:
        self._check()
        now = time.monotonic()
        found = heapq.nsmallest(
            limit, (a for a in self._all() if a.due <= now + within), key=lambda a: a.due
        )
        return [self._shown(a, now) for a in found]

    async def count_timers(self) -> int:
        self._check()
        return sum(len(own) for own in self._timers.values())

    @asynccontextmanager
    async def armed(self) -> AsyncIterator[ArmedSignal]:
        event = ArmedSignal()
        self._armed_events.add(event)
        try:
            yield event
        finally:
            self._armed_events.discard(event)

    async def commit(self, entries: Sequence[HistoryEntry]) -> Instance | None:
        rows = _rows(entries_of(entries))
        self._check()
        await asyncio.sleep(0)
        instance_id = rows[0].instance_id
        row_lock = self._locks.get(instance_id)
        if row_lock is None or not row_lock.locked():
            return self._write(rows)  # no await between the check and the write
        # Why wait: a pessimistic holder reads, steps and writes under the row lock; a write
        # slipped in between would make its compare-and-swap fail (PostgreSQL's UPDATE waits too).
        started = time.monotonic()
        try:
            await asyncio.wait_for(row_lock.acquire(), self._lock_timeout)
        except TimeoutError:
            raise LockTimeout(instance_id, time.monotonic() - started) from None
        try:
            return self._write(rows)
        finally:
            row_lock.release()

    async def commit_many(
        self, batches: Sequence[Sequence[HistoryEntry]]
    ) -> list[Instance | ConstraintRefused | None]:
        """Each batch's compare-and-swap, all in one pass on the event loop once the row locks
        of every instance written are held (taken in id order, so two such calls never wait on
        each other in a circle; a free lock is taken without yielding). A lost compare-and-swap
        is None at its place and writes nothing; a batch whose claim is refused, its
        ConstraintRefused. InstanceNotFound or LockTimeout: nothing was written."""
        prepared = [_rows(batch) for batch in distinct_batches(batches)]
        self._check()
        await asyncio.sleep(0)
        for rows in prepared:
            if rows[0].instance_id not in self._instances:
                raise InstanceNotFound(rows[0].instance_id)
        held: list[asyncio.Lock] = []
        started = time.monotonic()
        waiting_for = ""
        try:
            async with asyncio.timeout(self._lock_timeout):
                for instance_id in sorted(rows[0].instance_id for rows in prepared):
                    waiting_for = instance_id
                    row_lock = self._locks.setdefault(instance_id, asyncio.Lock())
                    await row_lock.acquire()
                    held.append(row_lock)
            return [self._write_or_refused(rows) for rows in prepared]  # no await: one pass
        except TimeoutError:
            raise LockTimeout(waiting_for, time.monotonic() - started) from None
        finally:
            for row_lock in held:
                row_lock.release()

    def _write_or_refused(
        self, rows: tuple[HistoryEntry, ...]
    ) -> Instance | ConstraintRefused | None:
        try:
            return self._write(rows)
        except ConstraintRefused as refused:
            return refused

    async def apply_locked(
        self, instance_id: str, request_ids: Sequence[str], plan: Plan, lock: RowLock
    ) -> LockedResult:
        self._check()
        if instance_id not in self._instances:
            raise InstanceNotFound(instance_id)
        row_lock = self._locks.setdefault(instance_id, asyncio.Lock())
        if lock.nowait and row_lock.locked():
            raise LockBusy(instance_id)
        started = time.monotonic()
        try:
            await asyncio.wait_for(row_lock.acquire(), lock.timeout)
        except TimeoutError:
            raise LockTimeout(instance_id, time.monotonic() - started) from None
        locked_at = time.monotonic()
        try:
            snap = self._snapshot(instance_id, request_ids)
            planned = planned_entries(instance_id, plan(snap))
            committed = None
            if planned:
                rows = _rows(planned)
                await asyncio.sleep(0)
                committed = self._write(rows)
                if committed is None and snap.instance.workflow in self._pauses:
                    raise refuse_paused(snap.instance.evolve(workflow_paused=True))
                if committed is None:
                    raise refused_plan(instance_id, planned, snap)
            return LockedResult(snap, committed, locked_at - started, time.monotonic() - locked_at)
        finally:
            row_lock.release()

    async def history(
        self, instance_id: str, *, after: int = 0, limit: int | None = None
    ) -> list[HistoryEntry]:
        self._check()
        if instance_id not in self._instances:
            raise InstanceNotFound(instance_id)
        found = [h for h in self._history[instance_id] if h.version > after][:limit]
        return [_copy_entry(h) for h in found]

    # -- queries ------------------------------------------------------------------------------

    async def list_instances(
        self, query: InstanceQuery, *, after: str | None, limit: int
    ) -> list[Instance]:
        self._check()
        await asyncio.sleep(0)  # a round trip yields to the loop; so does this (see read)
        start = after or ""
        # No await from here to the return: the page is one consistent read, as on the SQL stores.
        found = heapq.nsmallest(
            limit,
            (i for i in self._instances.values() if i.id > start and query.matches(i)),
            key=lambda i: i.id,
        )
        return [self._shown_instance(i) for i in found]

    async def count_instances(self, query: InstanceQuery) -> int:
        self._check()
        await asyncio.sleep(0)
        return sum(1 for i in self._instances.values() if query.matches(i))

    # -- workflow pauses ----------------------------------------------------------------------

    async def pause_workflow(self, workflow: str, reason: str, actor: str | None) -> WorkflowPause:
        self._check()
        await asyncio.sleep(0)
        return self._pauses.setdefault(workflow, WorkflowPause(workflow, reason, actor, _now()))

    async def resume_workflow(self, workflow: str) -> WorkflowPause | None:
        self._check()
        await asyncio.sleep(0)
        return self._pauses.pop(workflow, None)

    async def workflow_pauses(self) -> list[WorkflowPause]:
        self._check()
        return [self._pauses[name] for name in sorted(self._pauses)]

    # -- the adaptive strategy's escalation board: engines sharing this store share it --------

    async def publish(self, escalation: Escalation) -> None:
        self._check()
        await self._board.publish(escalation)

    async def active(self, now: float) -> list[Escalation]:
        self._check()
        return await self._board.active(now)

    async def now(self) -> float:
        self._check()
        return await self._board.now()

    async def fencing_floor(self, instance_id: str) -> int:
        self._check()
        return self._fences.get(instance_id, 0)
