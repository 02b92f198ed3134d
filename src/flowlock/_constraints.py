"""The engine's constraints across instances: `capacity()`, a create's claims, and the bounded
wait for a slot of `Capacity(wait=)` (a mixin of `flowlock.Engine`).

A wait is woken by the store's release notices (`ConstraintStore.slot_releases`), never by
polling: the waiter watches its key before each attempt, so a release that commits between a
refusal and the wait still wakes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Literal, TypeAlias

from flowlock._calls import create_with
from flowlock.core.constraints import (
    CapacityReached,
    CapacityUsage,
    Claim,
    ConstraintRefused,
    RateLimited,
    RateRule,
    Slots,
    UniqueViolation,
    checked_claims,
)
from flowlock.core.definition import Workflow
from flowlock.core.errors import InvalidInput
from flowlock.core.models import Instance, Outcome, Timing
from flowlock.core.versions import Registry
from flowlock.stores.base import Store
from flowlock.stores.constraint_store import ConstraintStore
from flowlock.strategies.monitor import ConflictMonitor

if TYPE_CHECKING:
    from flowlock.metrics import Metrics

__all__ = ["ConstraintMethods", "SlotWaits"]

log = logging.getLogger("flowlock")

RuleName: TypeAlias = Literal["capacity", "unique", "rate"]


class _Waiter:
    """One caller in a key's line: `freed` is set when a release notice is handed to it;
    `holding` while an attempt uses one (it passes it on if it leaves before the answer)."""

    __slots__ = ("freed", "holding")

    def __init__(self) -> None:
        self.freed = asyncio.Event()
        self.holding = False

    def use(self) -> None:
        """The next attempt uses the notice handed over, if any."""
        if self.freed.is_set():
            self.freed.clear()
            self.holding = True


class _Line:
    """The callers waiting on one key, first come first; wake-ups no waiter could take yet."""

    __slots__ = ("spare", "waiters")

    def __init__(self) -> None:
        self.waiters: deque[_Waiter] = deque()
        self.spare = 0


class SlotWaits:
    """The keys callers wait on. Each release notice wakes ONE waiter of its key, the first in
    line not woken yet: a freed slot fits one caller, and waking all of them would send every
    waiter to the database for one slot. A notice that finds every waiter already awake is kept
    for the next one to wait (`spare`); "anything may have been freed" wakes everyone."""

    def __init__(self) -> None:
        self._lines: dict[tuple[str, str], _Line] = {}

    def heard(self, kind: str, key: str) -> None:
        """A release of `key` committed (kind "": anything may have been released)."""
        if not kind:
            for every in self._lines.values():
                for waiter in every.waiters:
                    waiter.freed.set()
            return
        line = self._lines.get((kind, key))
        if line is None:
            return
        for waiter in line.waiters:
            if not waiter.freed.is_set():
                waiter.freed.set()
                return
        line.spare += 1

    def spare(self, kind: str, key: str) -> bool:
        """Take a wake-up that came while every waiter of `key` was awake, if there is one."""
        line = self._lines.get((kind, key))
        if line is None or not line.spare:
            return False
        line.spare -= 1
        return True

    @contextlib.contextmanager
    def watch(self, kind: str, key: str) -> Iterator[_Waiter]:
        """A place in `key`'s line for the whole wait, kept across refusals."""
        waiter = _Waiter()
        line = self._lines.setdefault((kind, key), _Line())
        line.waiters.append(waiter)
        try:
            yield waiter
        finally:
            line.waiters.remove(waiter)
            if not line.waiters:
                del self._lines[(kind, key)]
            # Notices it got and did not spend on an attempt's answer go to the next in line.
            for _ in range(waiter.freed.is_set() + waiter.holding):
                self.heard(kind, key)


class ConstraintMethods:
    """`flowlock.Engine`'s constraints; the engine is `self`."""

    _store: Store
    _workflows: Registry
    _monitor: ConflictMonitor
    _metrics: Metrics | None
    _slot_waits: SlotWaits | None = None
    _slot_listener: asyncio.Task[None] | None = None

    def _check_open(self) -> None: ...  # the engine's

    async def capacity(self, kind: str, key: str) -> CapacityUsage:
        """Who holds the slots of `key` under the constraint `kind`, and its limit.

        `kind` is a rule's name: `<workflow>.<state>` for a capacity, `<workflow>.unique`,
        `<workflow>.<transition>.rate`, or the `kind=` it was given; a state's, transition's or
        workflow's own name also finds its one rule (the answer names the rule's kind). For a
        rate limit, the holders are the instances whose transitions count in the current
        window."""
        self._check_open()
        for name, value in (("kind", kind), ("key", key)):
            if not isinstance(value, str) or not value:
                raise InvalidInput(f"capacity() takes {name} as a non-empty text, not {value!r}")
        store = self._store
        if not isinstance(store, ConstraintStore):
            raise InvalidInput(f"{type(store).__name__} keeps no constraints")
        rule = self._rule(kind)
        kind = kind if rule is None else rule.kind
        window = rule.per if isinstance(rule, RateRule) else None
        usage = await store.capacity_usage(kind, key, window)
        if rule is None:
            return usage
        named: RuleName = (
            "rate" if isinstance(rule, RateRule) else "unique" if rule.unique else "capacity"
        )
        limit = usage.limit if usage.limit is not None else rule.limit
        return CapacityUsage(kind, key, limit, usage.holders, named, window)

    def _rule(self, kind: str) -> Slots | RateRule | None:
        """The newest registered rule counted under `kind` (None: no workflow here has one).
        A name that is no rule's kind may name one by where it is declared: a state with a
        capacity, a rate-limited transition, or a workflow with a unique rule."""
        workflows = list(self._workflows.values())
        for wf in workflows:
            found = wf.constraints.kind(kind)
            if found is not None:
                return found
        aliases: list[Slots | RateRule] = []
        for wf in workflows:
            rules = wf.constraints
            aliases += [r for r in rules.slots if not r.unique and r.states == {kind}]
            aliases += [r for r in rules.rates if r.transition == kind]
            aliases += [r for r in rules.slots if r.unique and wf.name == kind]
        return aliases[0] if len({r.kind for r in aliases}) == 1 else None

    def _create_claims(self, wf: Workflow, new: Instance) -> tuple[Claim, ...]:
        """What creating `new` takes of its workflow's constraints (usually nothing)."""
        if not wf.constraints:
            return ()
        return checked_claims(wf.name, wf.constraints, None, new, "create")

    async def _created(
        self,
        store: Store,
        new: Instance,
        request_id: str | None,
        arm: Sequence[Timing],
        claims: Sequence[Claim],
    ) -> Instance:
        """The store's create of `new`, a refusal by a constraint counted."""
        try:
            return await create_with(store, new, request_id, arm, claims)
        except ConstraintRefused as exc:
            self._refused(exc)
            raise

    def _refused(self, exc: ConstraintRefused, waited: float | None = None) -> None:
        """Count a refusal in the metrics and with the monitor's hot keys."""
        rule = (
            "unique"
            if isinstance(exc, UniqueViolation)
            else "rate"
            if isinstance(exc, RateLimited)
            else "capacity"
        )
        # Shown with the monitor's hot keys, never escalated: a lock cannot free a full key.
        self._monitor.record(f"{exc.kind}:{exc.key}", conflict=True, escalate=False)
        if self._metrics is not None:
            self._metrics.record_constraint(exc.kind, rule, "refused", waited)

    def _wait_for(self, exc: CapacityReached) -> float | None:
        rule = self._rule(exc.kind)
        return rule.wait if isinstance(rule, Slots) else None

    async def _waiting(self, attempt: Callable[[], Awaitable[Outcome]]) -> Outcome:
        """`attempt()`; when a Capacity with `wait=` refuses it, tried again as slots of its key
        free, until it fits or the wait is over (then its last CapacityReached)."""
        try:
            return await attempt()
        except ConstraintRefused as exc:
            wait = self._wait_for(exc) if isinstance(exc, CapacityReached) else None
            if wait is None or not isinstance(self._store, ConstraintStore):
                self._refused(exc)
                raise
            refused = exc
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        deadline = loop.time() + wait
        waits = self._listen_for_slots()
        while True:
            with waits.watch(refused.kind, refused.key) as waiter:
                freed = waiter.freed
                while True:
                    waiter.use()
                    try:
                        outcome = await attempt()
                    except CapacityReached as exc:
                        waiter.holding = False  # spent: the slot went to someone else
                        if (exc.kind, exc.key) != (refused.kind, refused.key):
                            refused = exc  # another key now (a changed key): line up there
                            break
                        refused = exc
                        if freed.is_set() or waits.spare(exc.kind, exc.key):
                            continue
                        left = deadline - loop.time()
                        if left > 0:
                            with contextlib.suppress(TimeoutError):
                                await asyncio.wait_for(freed.wait(), left)
                        if loop.time() < deadline:
                            continue
                        self._refused(refused, time.perf_counter() - started)
                        raise
                    waiter.holding = False
                    if self._metrics is not None:
                        waited = time.perf_counter() - started
                        self._metrics.record_constraint(refused.kind, "capacity", "waited", waited)
                    return outcome
            if loop.time() >= deadline:
                self._refused(refused, time.perf_counter() - started)
                raise refused

    def _listen_for_slots(self) -> SlotWaits:
        """The engine's waiters, with the store's release notices heard from now on."""
        waits = self._slot_waits
        if waits is None:
            waits = self._slot_waits = SlotWaits()
        task = self._slot_listener
        if task is None or task.done():
            self._slot_listener = asyncio.get_running_loop().create_task(
                self._listen(waits), name="flowlock-slot-releases"
            )
        return waits

    async def _listen(self, waits: SlotWaits) -> None:
        store = self._store
        assert isinstance(store, ConstraintStore)
        try:
            async with store.slot_releases(waits.heard):
                await asyncio.Event().wait()  # until the engine closes
        except Exception:
            # Waiters still end at their deadline; the next wait starts listening again.
            log.warning("flowlock: hearing slot releases failed", exc_info=True)

    async def _stop_slot_listener(self) -> None:
        task, self._slot_listener = self._slot_listener, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
