"""Running calls under a strategy: the pure step bound, outcomes and failures recorded."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, TypeAlias

from flowlock import tracing
from flowlock.core.definition import Workflow
from flowlock.core.errors import ConflictRetriesExhausted, FlowlockError
from flowlock.core.models import HistoryEntry, Outcome, Snapshot
from flowlock.core.outcomes import failure_outcome
from flowlock.core.step import Batched, Call, Idempotent, decide, decide_batch
from flowlock.stores.base import Store
from flowlock.strategies.base import Strategy, StrategyResult

if TYPE_CHECKING:
    from flowlock.metrics import Metrics

__all__ = ["Answers", "Item", "Runner", "failure_label"]

Answers: TypeAlias = list[Outcome | BaseException]

Item: TypeAlias = tuple[Call, float, "tracing.FireSpan | None"]
"""A call the batcher holds: the call, when it started (perf_counter), its span if traced."""


class Runner:
    """Runs one call, or a batch, under a strategy on a store.

    The workflows mapping is the engine's own, so registrations are seen at once.
    """

    def __init__(
        self, workflows: Mapping[str, Workflow], max_payload: int, metrics: Metrics | None
    ) -> None:
        self._workflows = workflows
        self._max_payload = max_payload
        self._metrics = metrics

    def outcome(
        self, call: Call, result: StrategyResult, started: float, batch_size: int = 1
    ) -> Outcome:
        """The Outcome of `call` from what its strategy did, recorded in the metrics."""
        outcome = Outcome(
            applied=result.applied,
            idempotent=not result.applied,
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
        if self._metrics is not None:
            self._metrics.record_outcome(
                outcome, lock_wait=result.lock_wait, lock_hold=result.lock_hold
            )
        return outcome

    async def run_batch(self, chosen: Strategy, store: Store, items: Sequence[Item]) -> Answers:
        """The calls of `items` (one instance, one strategy) as one batch under `chosen`:
        one read, the calls decided in order, one write; each call's Outcome or error."""
        calls = tuple(call for call, _, _ in items)
        first = calls[0]
        batch = dataclasses.replace(first, batch=calls)
        workflows, limit = self._workflows, self._max_payload
        last: list[Batched] = []

        def bound(snap: Snapshot) -> tuple[HistoryEntry, ...] | Idempotent:
            # A strategy may decide again (a lost compare-and-swap, an escalation): the answers
            # are those of the last decision, the one that was written or had nothing to write.
            decided = decide_batch(workflows, snap, calls, max_payload_bytes=limit)
            last[:] = [decided]
            return decided.entries or Idempotent(snap.instance)

        # The batch runs in the driver task, not in its callers': its lock_wait and commit spans
        # hang under a batch span of their own, linked to every caller's fire span.
        lead = items[0][2]
        scope = (
            tracing.NO_SPAN
            if lead is None
            else tracing.batch_span(lead, [i[2] for i in items], first.instance_id, chosen.name)
        )
        try:
            with scope:
                result = await chosen.run(store, batch, bound)
        except FlowlockError as exc:
            workflow = last[0].read.workflow if last else ""
            return [self._batch_failure(exc, item, chosen, workflow, len(calls)) for item in items]
        decided = last[0]
        committed = result.instance if result.applied else None
        answers: Answers = []
        for item, decision in zip(items, decided.decisions, strict=True):
            call, started, _ = item
            if isinstance(decision, FlowlockError):
                answers.append(
                    self._batch_failure(decision, item, chosen, decided.read.workflow, len(calls))
                )
                continue
            if isinstance(decision, HistoryEntry):
                assert committed is not None  # entries were planned, so the batch wrote them
                inst = committed.evolve(
                    state=decision.to_state,
                    version=decision.version,
                    data=decision.data,
                    last_event=decision.event,
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
            answers.append(self.outcome(call, own, started, len(calls)))
        return answers

    def _batch_failure(
        self, exc: FlowlockError, item: Item, chosen: Strategy, workflow: str, size: int
    ) -> FlowlockError:
        """`exc` as the error of the call of `item` in a batch of `size` calls (its own
        event in a retries-exhausted error), recorded in the metrics and on its span (which its
        caller ends)."""
        call, started, span = item
        if span is not None:
            if workflow:
                span.read(workflow)
            span.batched(size)
        if isinstance(exc, ConflictRetriesExhausted):
            exc = ConflictRetriesExhausted(call.instance_id, call.event, exc.attempts)
        if self._metrics is not None:
            self._metrics.record_failure(
                exc,
                workflow=workflow,
                event=call.event,
                strategy=chosen.name,
                elapsed=time.perf_counter() - started,
            )
        return exc

    async def run(
        self,
        chosen: Strategy,
        call: Call,
        started: float,
        store: Store,
        span: tracing.FireSpan | None,
    ) -> StrategyResult:
        """`call` under `chosen` on `store`, the pure step bound to the registered
        workflows; a failure is recorded in the metrics and on `span` (with the workflow, once
        the step has read the instance) and re-raised."""
        workflows = self._workflows
        limit = self._max_payload
        seen: list[str] = []
        # The last decision: a strategy may decide again, and the answer is the last one's.
        last: list[HistoryEntry | Idempotent] = []

        def bound(snap: Snapshot) -> HistoryEntry | Idempotent:
            if not seen:
                seen.append(snap.instance.workflow)
            decided = decide(workflows, snap, call, max_payload_bytes=limit)
            last[:] = [decided]
            return decided

        metrics = self._metrics
        try:
            result = await chosen.run(store, call, bound)
        except FlowlockError as exc:
            if span is not None and seen:
                span.read(seen[0])
            if metrics is not None:
                metrics.record_failure(
                    exc,
                    workflow=seen[0] if seen else "",
                    event=call.event,
                    strategy=chosen.name,
                    elapsed=time.perf_counter() - started,
                )
            raise
        if not result.applied and last and isinstance(last[0], Idempotent) and last[0].replayed:
            result = dataclasses.replace(result, replayed=True)
        return result


def failure_label(exc: BaseException) -> str:
    """The `flowlock.outcome` of a call that raised `exc`: the metrics' label for a flowlock
    error, "cancelled" for a cancelled call, "error" for anything else (a bug)."""
    if isinstance(exc, FlowlockError):
        return failure_outcome(exc)
    return "cancelled" if isinstance(exc, asyncio.CancelledError) else "error"
