"""The constraints' port: slots, counters and rate counts, read back (every store is one).

The writes are not here: a store applies each history entry's `claims` (and a create's) in the
commit's own transaction, in the order given, and refuses the whole commit with the claim's
typed error (CapacityReached, UniqueViolation, RateLimited; `version` and `event` of the
entry) when one does not fit. Claims of one commit see each other's effect.

- take: the instance holds at most one slot of a kind. Holding one of the same key already:
  nothing changes. Of another key: that one is released first. Then, when the key's counter is
  below `limit`, the counter goes up by one and a slot row is written; else refused, the
  holders named (a unique rule: UniqueViolation naming the one holder).
- release: the instance's slot of the kind, if any, is deleted and its counter goes down.
  Every release is heard by `slot_releases` listeners once it commits.
- count: refused with RateLimited when `limit` applications of the key are timed within the
  last `per` seconds; else one is timed now. `retry_after`: seconds until the oldest of those
  leaves the window. The time is the database server's clock (the store's clock on memory).

Counting is serialized per key by the key's counter row (a row lock held to commit on the SQL
stores), so two commits never both take the last slot. Every take and release appends a
`SlotEvent` with the key's next sequence number and the holder count after it, and every count
a `RateEvent`: the checker proves the limits from them.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Protocol, runtime_checkable

from flowlock.core.constraint_rows import (
    ConstraintRows,
    CounterRow,
    RateEvent,
    SlotEvent,
    SlotRow,
)
from flowlock.core.constraints import CapacityUsage

__all__ = [
    "ConstraintRows",
    "ConstraintStore",
    "CounterRow",
    "RateEvent",
    "SlotEvent",
    "SlotRow",
]


@runtime_checkable
class ConstraintStore(Protocol):
    """What an engine reads of its constraints (see the module's docstring for the writes)."""

    async def capacity_usage(
        self, kind: str, key: str, window: float | None = None
    ) -> CapacityUsage:
        """Who holds slots of `key` now, oldest first, and the limit last used (None: never
        counted). With `window` (seconds, a rate limit's), the instances of the applications
        counted in the last `window` seconds instead, oldest first."""
        ...

    async def constraint_rows(self) -> ConstraintRows:
        """Every slot event, slot, counter and rate event (for `flowlock check`)."""
        ...

    def slot_releases(self, heard: Callable[[str, str], None]) -> AbstractAsyncContextManager[None]:
        """While inside, `heard(kind, key)` is called for each release committed on this
        database: by any engine where the store can hear it (PostgreSQL: NOTIFY), else by this
        store's own commits. `heard("", "")`: anything may have been released (a LISTEN
        connection opened again; every POLL seconds where nothing can be heard from other
        processes)."""
        ...
