"""The port every concurrency strategy implements.

A strategy decides how the pure step (`decide`) meets the store: read-then-compare-and-swap with
retries (optimistic), under a row lock (pessimistic), and later under a lease or an escalation
policy. It sees only the Store Protocol, never a concrete backend.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias, runtime_checkable

from flowlock.core.models import HistoryEntry, Instance, Snapshot
from flowlock.core.step import Call, Idempotent
from flowlock.stores.base import Store

__all__ = [
    "MAX_ATTEMPTS",
    "Decide",
    "Planned",
    "Strategy",
    "StrategyResult",
    "looked_up",
    "stamped",
]

MAX_ATTEMPTS = 1000
"""The most attempts a strategy may make for one call (`max_attempts`: a retry loop ends)."""

Planned: TypeAlias = tuple[HistoryEntry, ...]
"""What a strategy hands the store to write: one entry per call that writes (at least one)."""

Decide = Callable[[Snapshot], Planned | Idempotent]
"""The pure step bound to the calls a strategy runs: what was read -> what to write, or the
idempotent answer when nothing is to be written."""


def stamped(planned: Planned, **changes: Any) -> Planned:
    """`planned` with `changes` made to every entry."""
    return tuple(dataclasses.replace(e, **changes) for e in planned)


def looked_up(calls: Sequence[Call]) -> tuple[str, ...]:
    """The request ids a read for `calls` looks up: every call's that has one."""
    return tuple(c.request_id for c in calls if c.request_id is not None)


@dataclass(frozen=True, slots=True)
class StrategyResult:
    """The instance to report, whether this call applied the transition, how many attempts;
    which strategy actually ran and why, when that is not simply the one chosen (adaptive); and
    how long the call waited for and held a lock, when it took one (seconds). `replayed` is
    set by the engine, not the strategy: the answer repeats an earlier application of the call's
    request id."""

    instance: Instance
    applied: bool
    attempts: int
    strategy: str | None = None
    reason: str | None = None
    lock_wait: float | None = None
    lock_hold: float | None = None
    replayed: bool = False


@runtime_checkable
class Strategy(Protocol):
    """A concurrency policy. `name` is what history rows and outcomes record."""

    @property
    def name(self) -> str: ...

    async def run(self, store: Store, calls: Sequence[Call], decide: Decide) -> StrategyResult:
        """Apply `calls` (one instance's, in order; one or more) exactly once, or answer them
        idempotently, or raise a FlowlockError. Errors quote the first call."""
        ...
