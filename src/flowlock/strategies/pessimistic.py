"""Pessimistic concurrency: take the instance's row lock, then read, step, write, commit.

On PostgreSQL this is one transaction with `SET LOCAL lock_timeout` and `SELECT ... FOR UPDATE`
(or `NOWAIT`); on SQLite `BEGIN IMMEDIATE` (a database-wide write lock). The write is still a
version compare-and-swap: the lock cuts wasted work, the version keeps a mistake harmless.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from flowlock import tracing
from flowlock.core.errors import LockError, StoreError
from flowlock.core.models import Instance, Snapshot
from flowlock.core.settings import check_flag, check_seconds
from flowlock.core.step import Call, Idempotent
from flowlock.stores.base import RowLock, Store
from flowlock.strategies.base import Decide, Planned, StrategyResult, looked_up

__all__ = ["Pessimistic"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Pessimistic:
    """Row lock held for the step. `lock_timeout` bounds the wait (seconds) and ends in
    LockTimeout; `nowait=True` fails at once with LockBusy when the row is held."""

    lock_timeout: float = 5.0
    nowait: bool = False

    def __post_init__(self) -> None:
        # Checked with nowait too: a NaN left in an object is a NaN used later.
        check_seconds("lock_timeout", self.lock_timeout)
        check_flag("nowait", self.nowait)

    @property
    def name(self) -> str:
        return "pessimistic"

    async def run(self, store: Store, calls: Sequence[Call], decide: Decide) -> StrategyResult:
        answer: Instance | None = None

        def plan(snap: Snapshot) -> Planned | None:
            nonlocal answer
            planned = decide(snap)
            if isinstance(planned, Idempotent):
                answer = planned.instance
                return None
            return planned

        lock = RowLock(timeout=self.lock_timeout, nowait=self.nowait)
        # The wait and the write happen inside the store: traced, they are spans made after the
        # fact from the store's own measures, counted from here. Untraced, no clock is read.
        traced = tracing.current() is not None
        started = time.monotonic() if traced else 0.0
        try:
            result = await store.apply_locked(calls[0].instance_id, looked_up(calls), plan, lock)
        except LockError as exc:
            if traced:
                tracing.lock_failed(started, exc, lock="row")
            raise
        instance = result.committed or answer
        if instance is None:  # pragma: no cover - a store that skipped plan() broke its contract
            raise StoreError("store returned from apply_locked without running the plan")
        if traced:
            written = (
                0
                if result.committed is None
                else instance.version - result.snapshot.instance.version
            )
            tracing.locked(started, result.waited, result.held, written)
        return StrategyResult(
            instance,
            applied=result.committed is not None,
            attempts=1,
            lock_wait=result.waited,
            lock_hold=result.held,
        )
