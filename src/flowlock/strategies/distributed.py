"""Distributed concurrency: a lease per instance (Redis or PostgreSQL advisory locks), then read,
step, and a version compare-and-swap that also carries the lease's fencing token.

The lease cuts wasted work across processes and machines; it does not carry correctness alone.
A holder paused past its ttl, or a lease lost in a Redis failover, can still reach the database:
its write then fails the version check or the fencing check (a token lower than the last one
written is refused), so two holders can never both write. The step reads the fencing token with
[`flowlock.fencing_token`][flowlock.fencing_token] to hand it to side effects outside the database.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace

from flowlock import tracing
from flowlock.core.errors import (
    ConflictRetriesExhausted,
    InvalidInput,
    LockBusy,
    LockError,
    LockLost,
    LockTimeout,
)
from flowlock.core.settings import check_count
from flowlock.core.step import Call, Idempotent
from flowlock.locks.base import Held, LockBackend, check_ttl, check_wait
from flowlock.stores.base import Store
from flowlock.strategies.base import MAX_ATTEMPTS, Decide, StrategyResult, looked_up, stamped

__all__ = ["Distributed", "fencing_token"]

log = logging.getLogger("flowlock")

UNBOUND = (
    "this Distributed strategy has no lock backend: give it one with Distributed(locks=...), or "
    "give the engine one (Engine(store, locks=...), Engine.connect(..., redis_url=...) or "
    'Engine.connect(..., locks="advisory") on PostgreSQL) and it binds Distributed() to it'
)

_FENCING: ContextVar[int | None] = ContextVar("flowlock_fencing_token", default=None)


def fencing_token() -> int | None:
    """The fencing token of the lease the current step runs under (distributed strategy), or
    None. Pass it to anything outside the database that must refuse a stale holder."""
    return _FENCING.get()


@contextmanager
def _fenced(token: int) -> Iterator[None]:
    reset = _FENCING.set(token)
    try:
        yield
    finally:
        _FENCING.reset(reset)


@dataclass(frozen=True, slots=True, kw_only=True)
class Distributed:
    """A lease on the instance's key from `locks` for `ttl` seconds (renewed every ttl/3
    while the step runs), waiting at most `wait` seconds for it (LockTimeout after).

    `locks` may be left out when the strategy is given to an engine: the engine binds it to
    its own lock backend (`Engine(store, locks=...)`, or the one `Engine.connect` builds), so
    `Distributed(ttl=30)` is enough. Run unbound, it raises InvalidInput.

    Under the lease a lost compare-and-swap can only come from a writer that bypassed the lock
    (an optimistic caller on the same instance); it is retried on a fresh read, at most
    `max_attempts` times, within the same lease.
    """

    locks: LockBackend | None = None
    ttl: float = 10.0
    wait: float = 5.0
    max_attempts: int = 3

    def __post_init__(self) -> None:
        check_ttl(self.ttl)
        check_wait(self.wait)
        check_count("max_attempts", self.max_attempts, most=MAX_ATTEMPTS, unit="attempts")

    @property
    def name(self) -> str:
        return "distributed"

    def bound(self, locks: LockBackend | None) -> Distributed:
        """This strategy, leasing from `locks` unless it already has a backend of its own.
        Raises InvalidInput when neither is there."""
        if self.locks is not None:
            return self
        if locks is None:
            raise InvalidInput(UNBOUND)
        return replace(self, locks=locks)

    async def run(self, store: Store, calls: Sequence[Call], decide: Decide) -> StrategyResult:
        asked = time.monotonic()
        call = calls[0]
        key = call.instance_id
        locks = self.locks
        if locks is None:
            raise InvalidInput(UNBOUND)
        try:
            try:
                lease = await locks.acquire(key, ttl=self.ttl, wait=0.0)
            except LockBusy:
                # Why wait for the release before queueing: the holder may be doing this very
                # transition (the two-admins storm). Once it releases, a fresh read answers
                # every such caller at once, without each of them taking the lease in turn.
                if self.wait <= 0:
                    raise
                released = await locks.wait_released(key, self.wait)
                if released:
                    planned = decide(await store.read(key, looked_up(calls)))
                    if isinstance(planned, Idempotent):
                        answered = time.monotonic()
                        tracing.lock_wait(asked, answered, lock="lease", acquired=False)
                        return StrategyResult(
                            planned.instance, False, 1, lock_wait=answered - asked
                        )
                left = asked + self.wait - time.monotonic()
                if left <= 0:
                    raise LockTimeout(key, time.monotonic() - asked) from None
                lease = await locks.acquire(key, ttl=self.ttl, wait=left)
        except LockError as exc:
            tracing.lock_failed(asked, exc, lock="lease")
            raise
        got = time.monotonic()
        tracing.lock_wait(asked, got, lock="lease")
        held = Held(locks, lease)
        try:
            result = await self._under_lease(held, store, calls, decide)
        except BaseException:
            await held.close(raise_errors=False)
            raise
        result = replace(result, lock_wait=got - asked, lock_hold=time.monotonic() - got)
        try:
            await held.close()
        except LockError as exc:
            # The transition is committed (and fenced); a release that fails only leaves the key
            # to expire at its ttl. Report it, do not turn a success into an error.
            log.warning(
                "flowlock: %s applied on %r but releasing its lease failed (%s); the key "
                "expires within %.1f s",
                call.event,
                call.instance_id,
                exc,
                self.ttl,
            )
        return result

    async def _under_lease(
        self, held: Held, store: Store, calls: Sequence[Call], decide: Decide
    ) -> StrategyResult:
        fence, call, request_ids = held.lease.fencing, calls[0], looked_up(calls)
        for attempt in range(1, self.max_attempts + 1):
            snap = await store.read(call.instance_id, request_ids)
            with _fenced(fence):
                planned = decide(snap)
            if isinstance(planned, Idempotent):
                return StrategyResult(planned.instance, applied=False, attempts=attempt)
            # Why check here: the watchdog may have lost the lease while we read and stepped;
            # a lost lease must not write (the fencing check would refuse it anyway once a
            # newer holder has written, but not before).
            held.check()
            fenced = stamped(planned, fencing_token=fence)
            with tracing.commit_span(fenced, attempt) as span:
                committed = await store.commit(fenced)
                tracing.commit_done(span, committed is not None)
            if committed is not None:
                return StrategyResult(committed, applied=True, attempts=attempt)
            held.check()
            if await store.fencing_floor(call.instance_id) > fence:
                raise LockLost(
                    call.instance_id, f"a newer lease (fencing token above {fence}) has written"
                )
        raise ConflictRetriesExhausted(call.instance_id, call.event, self.max_attempts)
