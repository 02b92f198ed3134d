"""The SQLite store's timer methods (a mixin of
[`SqliteStore`][flowlock.stores.sqlite.SqliteStore]): the
[`TimerStore`][flowlock.stores.base.TimerStore] port over the transactions of `timers`. Due times
are on this host's wall clock."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from flowlock.core.models import Timer
from flowlock.stores.base import ArmedSignal
from flowlock.stores.sqlite.part import StorePart
from flowlock.stores.sqlite.timers import (
    any_claimable_txn,
    cancel_txn,
    claim_txn,
    count_timers_txn,
    drop_txn,
    due_timers_txn,
    next_due_txn,
    release_txn,
    timers_txn,
)

__all__ = ["SqliteTimers"]


class SqliteTimers(StorePart):
    """SqliteStore's part as a TimerStore. `armed()` is set by this store object's commits."""

    _signals: set[ArmedSignal]

    def _init_timers(self) -> None:
        self._signals = set()

    def _wake_timers(self, soonest: float) -> None:
        for signal in self._signals:
            signal.due_in(soonest)

    async def claim_timers(
        self, workflows: Sequence[str], *, limit: int, lease: float, owner: str
    ) -> list[Timer]:
        """At most `limit` due, unclaimed timers of `workflows`, earliest due first, claimed by
        `owner` for `lease` seconds in one write transaction (no two claimers get one timer)."""
        names = tuple(workflows)
        if limit <= 0 or not names:
            self._live()
            return []
        # A read first: the write lock is taken only when something is due.
        if not await self._read(any_claimable_txn, names, what="claim_timers"):
            return []
        return await self._write_now(
            self.path,  # SQLite's write lock is the whole database's
            lambda conn, _: claim_txn(conn, names, limit, lease, owner),
            "claim_timers",
        )

    async def release_timer(self, timer: Timer, owner: str) -> None:
        """Give back `owner`'s claim on `timer` (nothing if the claim is not `owner`'s)."""
        await self._write_now(
            timer.instance_id,
            lambda conn, _: release_txn(conn, timer, owner),
            "release_timer",
        )

    async def cancel_timer(self, timer: Timer) -> bool:
        """End one firing of `timer` that applied nothing (a reminder moves on, the rest are
        deleted); False, with nothing changed, when it moved on or was voided meanwhile."""
        return await self._write_now(
            timer.instance_id,
            lambda conn, _: cancel_txn(conn, timer),
            "cancel_timer",
        )

    async def drop_timer(self, timer: Timer) -> bool:
        """Delete `timer` (a stale or cancelled firing: a reminder goes too) while it is still
        at that stay and firing; False, with nothing changed, when it moved on or was voided."""
        return await self._write_now(
            timer.instance_id,
            lambda conn, _: drop_txn(conn, timer),
            "drop_timer",
        )

    async def next_due(self, workflows: Sequence[str]) -> float | None:
        """Seconds until a timer of `workflows` can be claimed (0: now), None if none is armed."""
        names = tuple(workflows)
        if not names:
            self._live()
            return None
        return await self._read(next_due_txn, names, what="next_due")

    async def timers(self, instance_id: str) -> list[Timer]:
        """The instance's armed timers, earliest due first."""
        return await self._read(timers_txn, instance_id, what="timers")

    async def due_timers(self, *, within: float, limit: int) -> list[Timer]:
        """At most `limit` timers due within `within` seconds or overdue, with their lag."""
        return await self._read(due_timers_txn, within, max(limit, 0), what="due_timers")

    async def count_timers(self) -> int:
        """How many timers are armed."""
        return await self._read(count_timers_txn, what="count_timers")

    @asynccontextmanager
    async def armed(self) -> AsyncIterator[ArmedSignal]:
        """A signal set when a commit of this store object arms a timer (other processes'
        arms are not seen: see the class docstring)."""
        signal = ArmedSignal()
        self._signals.add(signal)
        try:
            yield signal
        finally:
            self._signals.discard(signal)
