"""The memory store's constraints: slots, counters and rate counts in dicts, changed by a
commit in the same step on the event loop as its compare-and-swap (a mixin of MemoryStore).

A commit's claims are applied one by one, each change noted in a journal; a refused claim
undoes the journal and raises, so nothing of that commit stays (see
[`flowlock.stores.constraint_store`][flowlock.stores.constraint_store]). Times are epoch
seconds on the process's monotonic clock, moved to the epoch once when the store is made
(`_constraint_clock`): a change of the wall clock moves no rate window.
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime

from flowlock.core.constraints import CapacityUsage
from flowlock.stores._claims import Claimed, rate_refusal, take_refusal
from flowlock.stores.constraint_store import (
    ConstraintRows,
    CounterRow,
    RateEvent,
    SlotEvent,
    SlotRow,
)

__all__ = ["MemoryConstraints"]

Heard = Callable[[str, str], None]


@dataclasses.dataclass(slots=True)
class _Counter:
    """A key's counter: its holders (instance id to the version that took the slot and the
    take's sequence number, which orders them oldest first), the last limit used and the last
    event's sequence number."""

    holders: dict[str, tuple[int, int]]
    limit: int
    seq: int = 0

    def oldest_first(self) -> list[tuple[str, int]]:
        """The holders' ids with the versions that took their slots, oldest first."""
        ordered = sorted(self.holders.items(), key=lambda held: held[1][1])
        return [(iid, version) for iid, (version, _) in ordered]


@dataclasses.dataclass(slots=True)
class _Journal:
    """What one commit changed, as the steps that undo it (run last first) when a later claim
    of the commit is refused; each step is O(1), whatever a key's limit."""

    undo: list[Callable[[], None]] = dataclasses.field(default_factory=list)
    log_length: int = 0
    released: list[tuple[str, str]] = dataclasses.field(default_factory=list)


class MemoryConstraints:
    """MemoryStore's part as a ConstraintStore; the store calls `_apply_claims` in its writes."""

    _counters: dict[tuple[str, str], _Counter]
    _held: dict[tuple[str, str], str]  # (kind, instance id) -> the key it holds a slot of
    _kinds: set[str]  # every kind a slot was ever taken of (an undone take may leave one)
    _slot_log: list[SlotEvent]
    _rate_log: dict[tuple[str, str], list[RateEvent]]
    _release_listeners: set[Heard]
    _constraint_clock: Callable[[], float]

    def _check(self) -> None: ...  # the store's

    def _init_constraints(self) -> None:
        self._counters = {}
        self._held = {}
        self._kinds = set()
        self._slot_log = []
        self._rate_log = {}
        self._release_listeners = set()
        epoch = datetime.now(UTC).timestamp() - time.monotonic()
        self._constraint_clock = lambda: epoch + time.monotonic()

    # -- writes: called by the store's commits, never across an await -------------------------

    def _apply_claims(self, claims: Iterable[Claimed]) -> list[tuple[str, str]]:
        """Apply `claims` (one commit's, in order). A refused one raises its ConstraintRefused
        with every change of this call undone. Answers the keys released, for `_heard` once
        the commit's other writes are done."""
        journal = _Journal(log_length=len(self._slot_log))
        now = 0.0
        try:
            for c in claims:
                now = now or self._constraint_clock()
                op = c.claim.op
                if op == "release":
                    self._release(c.claim.kind, c.instance_id, c.version, now, journal)
                elif op == "take":
                    self._take(c, now, journal)
                else:
                    self._count(c, now, journal)
        except BaseException:
            self._undo(journal)
            raise
        return journal.released

    def _heard(self, released: Sequence[tuple[str, str]]) -> None:
        """Tell every `slot_releases` listener of the keys a committed write released."""
        for kind, key in released:
            for heard in list(self._release_listeners):
                heard(kind, key)

    def _free_slots(self, instance_id: str, version: int) -> list[tuple[str, str]]:
        """Release every slot `instance_id` (at `version`) holds, as retention purges it; the
        keys released."""
        journal = _Journal(log_length=len(self._slot_log))
        now = self._constraint_clock()
        for kind in sorted(self._kinds):
            self._release(kind, instance_id, version, now, journal)
        return journal.released

    def _event(
        self, kind: str, key: str, counter: _Counter, iid: str, version: int, delta: int, now: float
    ) -> None:
        counter.seq += 1
        self._slot_log.append(
            SlotEvent(
                kind,
                key,
                counter.seq,
                iid,
                version,
                delta,
                len(counter.holders),
                counter.limit,
                now,
            )
        )

    def _release(
        self, kind: str, instance_id: str, version: int, now: float, journal: _Journal
    ) -> None:
        key = self._held.pop((kind, instance_id), None)
        if key is None:
            return  # holds none: nothing to give back
        counter = self._counters[(kind, key)]  # a held slot has its counter
        held = counter.holders.pop(instance_id)
        self._event(kind, key, counter, instance_id, version, -1, now)
        journal.released.append((kind, key))

        def undo() -> None:
            counter.seq -= 1
            counter.holders[instance_id] = held
            self._held[(kind, instance_id)] = key

        journal.undo.append(undo)

    def _take(self, c: Claimed, now: float, journal: _Journal) -> None:
        claim = c.claim
        kind, key, iid = claim.kind, claim.key, c.instance_id
        held = self._held.get((kind, iid))
        if held == key:
            return  # holds a slot of this key already
        if held is not None:
            self._release(kind, iid, c.version, now, journal)
        counter = self._counters.get((kind, key))
        if counter is not None and len(counter.holders) >= claim.limit:
            raise take_refusal(c, [holder for holder, _ in counter.oldest_first()])
        made = counter is None
        if counter is None:
            counter = self._counters[(kind, key)] = _Counter({}, claim.limit)
        limit, counter.limit = counter.limit, claim.limit
        counter.holders[iid] = (c.version, counter.seq + 1)
        self._held[(kind, iid)] = key
        self._kinds.add(kind)
        self._event(kind, key, counter, iid, c.version, 1, now)
        taken = counter

        def undo() -> None:
            taken.seq -= 1
            taken.limit = limit
            del taken.holders[iid]
            del self._held[(kind, iid)]
            if made:
                del self._counters[(kind, key)]

        journal.undo.append(undo)

    def _count(self, c: Claimed, now: float, journal: _Journal) -> None:
        claim = c.claim
        events = self._rate_log.setdefault((claim.kind, claim.key), [])
        if events and events[-1].at > now:
            now = events[-1].at  # the wall clock stepped back: keep the log in time order
        start = bisect.bisect_right(events, now - claim.per, key=_at)
        counted = len(events) - start
        oldest = events[-claim.limit].at if counted >= claim.limit else None
        refused = rate_refusal(c, counted, oldest, now)
        if refused is not None:
            raise refused
        events.append(
            RateEvent(claim.kind, claim.key, c.instance_id, c.version, now, claim.limit, claim.per)
        )
        journal.undo.append(lambda: _drop_last(events))

    def _undo(self, journal: _Journal) -> None:
        for step in reversed(journal.undo):
            step()
        del self._slot_log[journal.log_length :]
        journal.released.clear()

    # -- reads -----------------------------------------------------------------------------------

    async def capacity_usage(
        self, kind: str, key: str, window: float | None = None
    ) -> CapacityUsage:
        self._check()
        if window is not None:
            events = self._rate_log.get((kind, key), [])
            start = bisect.bisect_right(events, self._constraint_clock() - window, key=_at)
            counted = events[start:]
            limit = events[-1].limit if events else None
            return CapacityUsage(
                kind, key, limit, tuple(e.instance_id for e in counted), window=window
            )
        counter = self._counters.get((kind, key))
        if counter is None:
            return CapacityUsage(kind, key, None, ())
        return CapacityUsage(
            kind, key, counter.limit, tuple(iid for iid, _ in counter.oldest_first())
        )

    async def constraint_rows(self) -> ConstraintRows:
        self._check()
        log = sorted(self._slot_log, key=lambda e: (e.kind, e.key, e.seq))
        slots = [
            SlotRow(kind, key, iid, version)
            for (kind, key), counter in sorted(self._counters.items())
            for iid, version in counter.oldest_first()
        ]
        counters = [
            CounterRow(kind, key, len(c.holders), c.limit, c.seq)
            for (kind, key), c in sorted(self._counters.items())
        ]
        rates = [e for _, events in sorted(self._rate_log.items()) for e in events]
        return ConstraintRows(tuple(log), tuple(slots), tuple(counters), tuple(rates))

    @asynccontextmanager
    async def slot_releases(self, heard: Heard) -> AsyncIterator[None]:
        """While inside, `heard(kind, key)` for each release this store commits (every engine
        on a memory store shares it, so all are heard)."""
        self._release_listeners.add(heard)
        try:
            yield
        finally:
            self._release_listeners.discard(heard)


def _drop_last(events: list[RateEvent]) -> None:
    events.pop()


def _at(event: RateEvent) -> float:
    return event.at
