"""Optimistic concurrency: read without a lock, run the step, compare-and-swap the version.

On a lost compare-and-swap the step runs again on a fresh read, at most `max_attempts` times,
sleeping between attempts for an exponential backoff with full jitter: a random delay in
`[0, min(cap, base * 2**(attempt-1))]`. Why full jitter: callers that collided once must not
collide again in lockstep; spreading them uniformly is what drains a hot spot fastest.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from flowlock import tracing
from flowlock.core.errors import ConflictRetriesExhausted
from flowlock.core.settings import check_count, check_seconds
from flowlock.core.step import Call, Idempotent
from flowlock.stores.base import Store
from flowlock.strategies.base import MAX_ATTEMPTS, Decide, StrategyResult, looked_up

__all__ = ["Optimistic"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Optimistic:
    """Version compare-and-swap with bounded, jittered retries.

    `rng` and `sleep` are injected so tests can make the backoff deterministic.
    """

    max_attempts: int = 3
    backoff_base: float = 0.005
    backoff_cap: float = 0.2
    rng: random.Random = field(default_factory=random.Random, repr=False)
    sleep: Callable[[float], Awaitable[None]] = field(default=asyncio.sleep, repr=False)

    def __post_init__(self) -> None:
        check_count("max_attempts", self.max_attempts, most=MAX_ATTEMPTS, unit="attempts")
        check_seconds("backoff_base", self.backoff_base, zero=True)
        check_seconds("backoff_cap", self.backoff_cap, zero=True)

    @property
    def name(self) -> str:
        return "optimistic"

    def backoff(self, attempt: int) -> float:
        """The delay after losing attempt number `attempt` (1-based): full jitter."""
        return self.rng.uniform(0.0, min(self.backoff_cap, self.backoff_base * 2 ** (attempt - 1)))

    async def run(self, store: Store, calls: Sequence[Call], decide: Decide) -> StrategyResult:
        call, request_ids = calls[0], looked_up(calls)
        for attempt in range(1, self.max_attempts + 1):
            snap = await store.read(call.instance_id, request_ids)
            planned = decide(snap)
            if isinstance(planned, Idempotent):
                return StrategyResult(planned.instance, applied=False, attempts=attempt)
            with tracing.commit_span(planned, attempt) as span:
                committed = await store.commit(planned)
                tracing.commit_done(span, committed is not None)
            if committed is not None:
                return StrategyResult(committed, applied=True, attempts=attempt)
            if attempt < self.max_attempts:
                await self.sleep(self.backoff(attempt))
        raise ConflictRetriesExhausted(call.instance_id, call.event, self.max_attempts)
