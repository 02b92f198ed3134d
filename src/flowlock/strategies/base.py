"""The port every concurrency strategy implements.

A strategy decides how the pure step (``decide``) meets the store: read-then-compare-and-swap with
retries (optimistic), under a row lock (pessimistic), and later under a lease or an escalation
policy. It sees only the Store Protocol, never a concrete backend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from flowlock.models import HistoryEntry, Instance, Snapshot
from flowlock.step import Call, Idempotent
from flowlock.stores.base import Store

__all__ = ["MAX_ATTEMPTS", "Decide", "Strategy", "StrategyResult"]

MAX_ATTEMPTS = 1000
"""The most attempts a strategy may make for one call (``max_attempts``: a retry loop ends)."""

Decide = Callable[[Snapshot], HistoryEntry | Idempotent]
"""The pure step bound to one call: what was read -> what to write (or the idempotent answer)."""


@dataclass(frozen=True, slots=True)
class StrategyResult:
    """The instance to report, whether this call applied the transition, how many attempts;
    which strategy actually ran and why, when that is not simply the one chosen (adaptive); and
    how long the call waited for and held a lock, when it took one (seconds)."""

    instance: Instance
    applied: bool
    attempts: int
    strategy: str | None = None
    reason: str | None = None
    lock_wait: float | None = None
    lock_hold: float | None = None


@runtime_checkable
class Strategy(Protocol):
    """A concurrency policy. ``name`` is what history rows and outcomes record."""

    @property
    def name(self) -> str: ...

    async def run(self, store: Store, call: Call, decide: Decide) -> StrategyResult:
        """Apply ``call`` exactly once or answer it idempotently, or raise a FlowlockError."""
        ...
