"""Adaptive concurrency: optimistic by default, escalated per instance when it runs hot.

Each call asks the
[`flowlock.strategies.monitor.ConflictMonitor`][flowlock.strategies.monitor.ConflictMonitor] whether
its instance is escalated. A calm instance runs the optimistic loop, every compare-and-swap attempt
reported to the monitor; when the monitor escalates the instance (conflict rate over the threshold),
a call that is mid-retry finishes under the escalated strategy (pessimistic, or distributed) instead
of exhausting its attempts, and so does a call that lost its compare-and-swap again after
`retries_before_lock` retries on an instance not (yet) escalated. Escalated instances run under that
strategy until they calm down.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from flowlock import tracing
from flowlock.core.models import Snapshot
from flowlock.core.settings import check_count
from flowlock.core.step import Call, Idempotent
from flowlock.stores.base import Store
from flowlock.strategies.base import (
    MAX_ATTEMPTS,
    Decide,
    Planned,
    Strategy,
    StrategyResult,
    looked_up,
    stamped,
)
from flowlock.strategies.monitor import ConflictMonitor
from flowlock.strategies.optimistic import Optimistic

__all__ = ["Adaptive"]


def _as(decide: Decide, name: str) -> Decide:
    """`decide` whose history entries record `name` as the strategy that wrote them."""

    def recorded_as(snap: Snapshot) -> Planned | Idempotent:
        planned = decide(snap)
        if isinstance(planned, Idempotent):
            return planned
        return stamped(planned, strategy=name)

    return recorded_as


@dataclass(frozen=True, slots=True, kw_only=True)
class Adaptive:
    """Optimistic until the monitor escalates an instance, then `escalated`.

    `retries_before_lock`: how many optimistic retries a call makes after losing a
    compare-and-swap before it finishes under `escalated` (at most the optimistic strategy's
    attempts allow). Few: a lost race on a calm instance means writers from other processes,
    which the monitor of this one sees only in part; each retry costs a backoff and a read.
    The engine's own "adaptive" preset keeps the default; for another value, give your own
    `Adaptive(..., retries_before_lock=n)` in `strategies=` (with the engine's `monitor`).
    """

    optimistic: Optimistic
    escalated: Strategy
    monitor: ConflictMonitor
    retries_before_lock: int = 1

    def __post_init__(self) -> None:
        check_count("retries_before_lock", self.retries_before_lock, least=0, most=MAX_ATTEMPTS)

    @property
    def name(self) -> str:
        return "adaptive"

    async def run(self, store: Store, calls: Sequence[Call], decide: Decide) -> StrategyResult:
        key = calls[0].instance_id
        monitor = self.monitor
        # A batch is several callers crowding the key in this process, as calls in flight
        # together were before batching.
        crowded = monitor.enter(key) or len(calls) > 1
        try:
            escalation = monitor.escalated(key)
            if escalation is not None:
                if crowded:
                    monitor.contended(key)
                return await self._escalated(store, calls, decide, 0, escalation.reason)
            return await self._optimistic(store, calls, decide)
        finally:
            monitor.leave(key)

    async def _escalated(
        self, store: Store, calls: Sequence[Call], decide: Decide, spent: int, why: str
    ) -> StrategyResult:
        inner = self.escalated
        result = await inner.run(store, calls, _as(decide, inner.name))
        return dataclasses.replace(
            result,
            attempts=result.attempts + spent,
            strategy=result.strategy or inner.name,
            reason=f"adaptive: escalated to {inner.name}: {why}",
        )

    async def _optimistic(
        self, store: Store, calls: Sequence[Call], decide: Decide
    ) -> StrategyResult:
        opt, monitor, key = self.optimistic, self.monitor, calls[0].instance_id
        request_ids = looked_up(calls)
        decide = _as(decide, opt.name)
        calm = "adaptive: optimistic (instance not escalated)"
        snap = await store.read(key, request_ids)
        for attempt in range(1, opt.max_attempts + 1):
            planned = decide(snap)
            if isinstance(planned, Idempotent):
                return StrategyResult(planned.instance, False, attempt, opt.name, calm)
            escalation = monitor.escalated(key) if attempt > 1 else None
            if escalation is not None:
                # Escalated while this call was retrying, and the fresh read says it still has
                # to write: finish under the lock rather than keep losing the same race. (A
                # call with nothing left to write was answered just above, without the lock.)
                return await self._escalated(store, calls, decide, attempt - 1, escalation.reason)
            with tracing.commit_span(planned, attempt) as span:
                committed = await store.commit(planned)
                tracing.commit_done(span, committed is not None)
            # Counted per call: a batch that loses its compare-and-swap lost it for every call
            # in it, and one that wins won it for each of them.
            for _ in planned:
                monitor.record(key, conflict=committed is None)
            if committed is not None:
                return StrategyResult(committed, True, attempt, opt.name, calm)
            if attempt > self.retries_before_lock or attempt == opt.max_attempts:
                break  # no backoff nor read before the lock: it reads for itself
            await opt.sleep(opt.backoff(attempt))
            snap = await store.read(key, request_ids)
        escalation = monitor.escalated(key)
        spent = attempt
        why = (
            escalation.reason
            if escalation is not None
            else f"this call lost its compare-and-swap {spent} time(s)"
        )
        # Why not ConflictRetriesExhausted: a warm instance (conflicts spread over processes,
        # too few in any one window to escalate it) still must not fail a call for losing
        # races; the lock makes this one call certain.
        return await self._escalated(store, calls, decide, spent, why)
