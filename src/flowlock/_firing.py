"""Running calls under a strategy: the pure step bound, outcomes and failures recorded.

The engine hands a fire down (one call, or a `Batch` of them on one instance); nothing
here calls back up into the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

from flowlock import tracing
from flowlock.core.constraints import ConstraintRefused
from flowlock.core.definition import Workflow
from flowlock.core.errors import ConflictRetriesExhausted, FlowlockError
from flowlock.core.models import HistoryEntry, Outcome, Snapshot
from flowlock.core.outcomes import failure_outcome
from flowlock.core.step import Batched, Call, Idempotent, decide, decide_batch
from flowlock.stores.base import Store
from flowlock.strategies.base import Strategy, StrategyResult

if TYPE_CHECKING:
    from flowlock.metrics import Metrics

__all__ = ["Answers", "Batch", "Fire", "Runner", "failure_label"]


@dataclass(frozen=True, slots=True)
class Fire:
    """One `fire` on its way: the call, when it started (perf_counter), its span if traced."""

    call: Call
    started: float
    span: tracing.FireSpan | None


@dataclass(frozen=True, slots=True)
class Batch:
    """The fires on one instance that one strategy run serves: one alone, or those queued."""

    fires: tuple[Fire, ...]

    @property
    def calls(self) -> tuple[Call, ...]:
        return tuple(fire.call for fire in self.fires)


Answers: TypeAlias = list[Outcome | BaseException]
"""Each fire's Outcome or error, in the batch's order."""


class Runner:
    """Runs one fire, or a batch, under a strategy on a store.

    The workflows mapping is the engine's own, so registrations are seen at once.
    """

    def __init__(
        self, workflows: Mapping[str, Workflow], max_payload: int, metrics: Metrics | None
    ) -> None:
        self.workflows = workflows
        self.max_payload = max_payload
        self.metrics = metrics

    async def alone(self, chosen: Strategy, store: Store, fire: Fire) -> Outcome:
        """One fire by itself: its Outcome, or its error raised."""
        result = await self.run(chosen, fire, store)
        return self.outcome(fire.call, result, fire.started)

    def outcome(
        self, call: Call, result: StrategyResult, started: float, batch_size: int = 1
    ) -> Outcome:
        """The Outcome of `call` from what its strategy did, recorded in the metrics."""
        outcome = Outcome(
            applied=result.applied,
            instance=result.instance,
            attempts=result.attempts,
            strategy=result.strategy or call.strategy,
            elapsed=time.perf_counter() - started,
            event=call.event,
            request_id=call.request_id,
            reason=result.reason,
            batch_size=batch_size,
            replayed=result.replayed,
        )
        if self.metrics is not None:
            self.metrics.record_outcome(
                outcome, lock_wait=result.lock_wait, lock_hold=result.lock_hold
            )
        return outcome

    async def together(self, chosen: Strategy, store: Store, queued: Sequence[Fire]) -> Answers:
        """The fires `queued` on one instance for one strategy, as one batch under
        `chosen`: one read, the calls decided in order, one write; each fire's answer."""
        batch = Batch(tuple(queued))
        fires, calls = batch.fires, batch.calls
        first = calls[0]
        workflows, limit = self.workflows, self.max_payload
        last: list[Batched] = []

        def bound(snap: Snapshot) -> tuple[HistoryEntry, ...] | Idempotent:
            # A strategy may decide again (a lost compare-and-swap, an escalation): the answers
            # are those of the last decision, the one that was written or had nothing to write.
            decided = decide_batch(workflows, snap, calls, max_payload_bytes=limit)
            last[:] = [decided]
            return decided.entries or Idempotent(snap.instance)

        # The batch runs in the driver task, not in its callers': its lock_wait and commit spans
        # hang under a batch span of their own, linked to every caller's fire span.
        lead = fires[0].span
        scope = (
            tracing.NO_SPAN
            if lead is None
            else tracing.batch_span(lead, [f.span for f in fires], first.instance_id, chosen.name)
        )
        try:
            with scope:
                result = await chosen.run(store, calls, bound)
        except ConstraintRefused as exc:
            refused = _refused_at(exc, last[0]) if last and len(fires) > 1 else None
            if refused is None:
                workflow = last[0].read.workflow if last else ""
                return [self._failure(exc, fire, chosen, workflow, len(calls)) for fire in fires]
            # One call's claim did not fit, and the batch wrote nothing: that call is refused,
            # the others run again without it (each round drops one, so this ends).
            rest = await self.together(chosen, store, fires[:refused] + fires[refused + 1 :])
            failed = self._failure(exc, fires[refused], chosen, last[0].read.workflow, len(calls))
            rest.insert(refused, failed)
            return rest
        except FlowlockError as exc:
            workflow = last[0].read.workflow if last else ""
            return [self._failure(exc, fire, chosen, workflow, len(calls)) for fire in fires]
        decided = last[0]
        committed = result.instance if result.applied else None
        answers: Answers = []
        stay = decided.read.stay_version
        for fire, decision in zip(fires, decided.decisions, strict=True):
            if isinstance(decision, HistoryEntry) and decision.enters:
                stay = decision.version
            if isinstance(decision, FlowlockError):
                answers.append(
                    self._failure(decision, fire, chosen, decided.read.workflow, len(calls))
                )
                continue
            if isinstance(decision, HistoryEntry):
                assert committed is not None  # entries were planned, so the batch wrote them
                inst = committed.evolve(
                    state=decision.to_state,
                    version=decision.version,
                    data=decision.data,
                    last_event=decision.event,
                    stay_version=stay,
                )
            else:
                inst = decision.instance
                if committed is not None and inst.version > decided.read.version:
                    # Answered from a state this batch wrote: it dates from the batch's commit.
                    inst = inst.evolve(updated_at=committed.updated_at)
            own = dataclasses.replace(
                result,
                instance=inst,
                applied=isinstance(decision, HistoryEntry),
                replayed=isinstance(decision, Idempotent) and decision.replayed,
            )
            answers.append(self.outcome(fire.call, own, fire.started, len(calls)))
        return answers

    def _failure(
        self, exc: FlowlockError, fire: Fire, chosen: Strategy, workflow: str, size: int
    ) -> FlowlockError:
        """`exc` as the error of `fire` in a batch of `size` calls (its own event in a
        retries-exhausted error), recorded in the metrics and on its span (which its caller
        ends)."""
        call, span = fire.call, fire.span
        if span is not None:
            if workflow:
                span.read(workflow)
            span.batched(size)
        if isinstance(exc, ConflictRetriesExhausted):
            exc = ConflictRetriesExhausted(call.instance_id, call.event, exc.attempts)
        if self.metrics is not None:
            self.metrics.record_failure(
                exc,
                workflow=workflow,
                event=call.event,
                strategy=chosen.name,
                elapsed=time.perf_counter() - fire.started,
            )
        return exc

    async def run(self, chosen: Strategy, fire: Fire, store: Store) -> StrategyResult:
        """`fire` under `chosen` on `store`, the pure step bound to the registered
        workflows; a failure is recorded in the metrics and on the fire's span (with the
        workflow, once the step has read the instance) and re-raised."""
        call, span = fire.call, fire.span
        workflows = self.workflows
        limit = self.max_payload
        seen: list[str] = []
        # The last decision: a strategy may decide again, and the answer is the last one's.
        last: list[HistoryEntry | Idempotent] = []

        def bound(snap: Snapshot) -> tuple[HistoryEntry, ...] | Idempotent:
            if not seen:
                seen.append(snap.instance.workflow)
            decided = decide(workflows, snap, call, max_payload_bytes=limit)
            last[:] = [decided]
            return decided if isinstance(decided, Idempotent) else (decided,)

        metrics = self.metrics
        try:
            result = await chosen.run(store, (call,), bound)
        except FlowlockError as exc:
            if span is not None and seen:
                span.read(seen[0])
            if metrics is not None:
                metrics.record_failure(
                    exc,
                    workflow=seen[0] if seen else "",
                    event=call.event,
                    strategy=chosen.name,
                    elapsed=time.perf_counter() - fire.started,
                )
            raise
        if not result.applied and last and isinstance(last[0], Idempotent) and last[0].replayed:
            result = dataclasses.replace(result, replayed=True)
        return result


def _refused_at(exc: ConstraintRefused, decided: Batched) -> int | None:
    """The place in the batch of the call whose entry the constraint refused, if known."""
    for i, decision in enumerate(decided.decisions):
        if isinstance(decision, HistoryEntry) and decision.version == exc.version:
            return i
    return None


def failure_label(exc: BaseException) -> str:
    """The `flowlock.outcome` of a call that raised `exc`: the metrics' label for a flowlock
    error, "cancelled" for a cancelled call, "error" for anything else (a bug)."""
    if isinstance(exc, FlowlockError):
        return failure_outcome(exc)
    return "cancelled" if isinstance(exc, asyncio.CancelledError) else "error"
