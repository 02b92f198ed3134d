"""The port every concurrency strategy implements.

A strategy decides how the pure step (`decide`) meets the store: read-then-compare-and-swap with
retries (optimistic), under a row lock (pessimistic), and later under a lease or an escalation
policy. It sees only the Store Protocol, never a concrete backend.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias, runtime_checkable

from flowlock.core.models import HistoryEntry, Instance, Snapshot
from flowlock.core.step import Call, Idempotent
from flowlock.stores.base import Store

__all__ = ["MAX_ATTEMPTS", "Decide", "Planned", "Strategy", "StrategyResult", "stamped", "writes"]

MAX_ATTEMPTS = 1000
"""The most attempts a strategy may make for one call (`max_attempts`: a retry loop ends)."""

Planned: TypeAlias = HistoryEntry | tuple[HistoryEntry, ...]
"""What a strategy hands the store to write: one call's entry, or a batch's entries (k >= 1)."""

Decide = Callable[[Snapshot], Planned | Idempotent]
"""The pure step bound to one call (or one batch of calls on an instance): what was read -> what
to write, or the idempotent answer when nothing is to be written. A strategy that only passes
what it plans to the store runs batches unchanged; one that edits the entries does it with
[`stamped`][flowlock.strategies.base.stamped], which edits every entry of a batch."""


def stamped(planned: Planned, **changes: Any) -> Planned:
    """`planned` with `changes` made to its entry, or to every entry of a batch."""
    if isinstance(planned, HistoryEntry):
        return dataclasses.replace(planned, **changes)
    return tuple(dataclasses.replace(e, **changes) for e in planned)


def writes(planned: Planned) -> int:
    """How many calls' transitions `planned` writes."""
    return 1 if isinstance(planned, HistoryEntry) else len(planned)


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

    async def run(self, store: Store, call: Call, decide: Decide) -> StrategyResult:
        """Apply `call` exactly once or answer it idempotently, or raise a FlowlockError."""
        ...
