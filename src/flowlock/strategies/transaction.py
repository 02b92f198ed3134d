"""The strategies inside a transaction the caller opened (`engine.fire(..., connection=conn)`).

flowlock cannot retry, commit or outlast a transaction it does not own, so each strategy keeps its
meaning in the form that fits in one:

- optimistic: one read and ONE compare-and-swap. A lost race raises ConflictRetriesExhausted with
  `attempts=1` (retrying would be the caller's transaction's job), unless a fresh read shows the
  winner already did what this call asked (the same request id, or the two-admins case): then the
  answer is idempotent, as always.
- pessimistic: unchanged: the row lock is taken inside the caller's transaction (bounded by the
  strategy's lock_timeout) and held until the caller commits or rolls back.
- adaptive: its current choice for the instance: the escalated strategy when the instance is
  escalated, otherwise optimistic's one compare-and-swap (its outcome reported to the monitor, so
  a hot instance still escalates).
- distributed (and an adaptive that escalates to it): refused. A lease around a transaction the
  caller commits later would be released before that commit, protecting nothing.
- any other strategy: refused, since flowlock cannot know whether it retries or outlives the call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from flowlock import tracing
from flowlock.core.errors import (
    ConflictRetriesExhausted,
    InvalidInput,
    TransitionRefused,
    VersionMismatch,
)
from flowlock.core.step import Call, Idempotent
from flowlock.stores.base import Store
from flowlock.strategies.adaptive import Adaptive, _as
from flowlock.strategies.base import Decide, Strategy, StrategyResult, looked_up
from flowlock.strategies.distributed import Distributed
from flowlock.strategies.optimistic import Optimistic
from flowlock.strategies.pessimistic import Pessimistic

__all__ = ["in_transaction"]

_DISTRIBUTED = (
    "the distributed strategy cannot run inside a transaction you opened: its lease would be "
    "released before your transaction commits, protecting nothing. Use 'pessimistic' (a row lock "
    "held until your commit) or 'optimistic' with connection=, or fire without connection="
)


def in_transaction(strategy: Strategy) -> Strategy:
    """`strategy` as it runs inside a caller's transaction (see the module), or InvalidInput
    when it cannot."""
    if isinstance(strategy, Pessimistic | SingleSwap | AdaptiveInTransaction):
        return strategy
    if isinstance(strategy, Optimistic):
        return SingleSwap()
    if isinstance(strategy, Adaptive):
        if isinstance(strategy.escalated, Distributed):
            raise InvalidInput(
                "this engine's adaptive strategy escalates to distributed, and " + _DISTRIBUTED
            )
        escalated = in_transaction(strategy.escalated)
        return AdaptiveInTransaction(adaptive=strategy, escalated=escalated)
    if isinstance(strategy, Distributed):
        raise InvalidInput(_DISTRIBUTED)
    raise InvalidInput(
        f"strategy {strategy.name!r} ({type(strategy).__name__}) has no defined meaning inside a "
        "transaction you opened; use 'optimistic', 'pessimistic' or 'adaptive' with connection="
    )


@dataclass(frozen=True, slots=True)
class SingleSwap:
    """Optimistic inside a caller's transaction: one compare-and-swap, never a retry.
    `record` hears whether the compare-and-swap won (the adaptive monitor)."""

    record: Callable[[bool], object] | None = None

    @property
    def name(self) -> str:
        return "optimistic"

    async def run(self, store: Store, calls: Sequence[Call], decide: Decide) -> StrategyResult:
        call, request_ids = calls[0], looked_up(calls)
        planned = decide(await store.read(call.instance_id, request_ids))
        if isinstance(planned, Idempotent):
            return StrategyResult(planned.instance, applied=False, attempts=1)
        with tracing.commit_span(planned, 1) as span:
            committed = await store.commit(planned)
            tracing.commit_done(span, committed is not None)
        if self.record is not None:
            self.record(committed is not None)
        if committed is not None:
            return StrategyResult(committed, applied=True, attempts=1)
        # Lost. The winner may have done this very thing (the same request id committed by a
        # concurrent transaction, or the same event): a fresh read, never a second write, says.
        try:
            again = decide(await store.read(call.instance_id, request_ids))
        except (TransitionRefused, VersionMismatch) as exc:  # refused now: still a lost race
            raise ConflictRetriesExhausted(call.instance_id, call.event, 1) from exc
        if isinstance(again, Idempotent):
            return StrategyResult(again.instance, applied=False, attempts=1)
        raise ConflictRetriesExhausted(call.instance_id, call.event, 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class AdaptiveInTransaction:
    """Adaptive inside a caller's transaction: the escalated strategy for an escalated instance,
    otherwise one optimistic compare-and-swap reported to the monitor."""

    adaptive: Adaptive
    escalated: Strategy

    @property
    def name(self) -> str:
        return "adaptive"

    async def run(self, store: Store, calls: Sequence[Call], decide: Decide) -> StrategyResult:
        monitor, key = self.adaptive.monitor, calls[0].instance_id
        crowded = monitor.enter(key)
        try:
            escalation = monitor.escalated(key)
            if escalation is not None:
                if crowded:
                    monitor.contended(key)
                inner = self.escalated
                result = await inner.run(store, calls, _as(decide, inner.name))
                why = f"adaptive: escalated to {inner.name}: {escalation.reason}"
                return dataclasses.replace(result, strategy=inner.name, reason=why)
            single = SingleSwap(record=lambda won: monitor.record(key, conflict=not won))
            result = await single.run(store, calls, _as(decide, single.name))
            why = "adaptive: optimistic (instance not escalated), one compare-and-swap inside the "
            why += "caller's transaction"
            return dataclasses.replace(result, strategy=single.name, reason=why)
        finally:
            monitor.leave(key)
