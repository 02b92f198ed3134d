"""The lock-backend port, the Lease value, and the watchdog every backend shares.


    lease = await backend.acquire("key", ttl=5, wait=1)          # just take it
    async with backend.acquire("key", ttl=5, wait=1) as held:     # take, renew, release
        ...
        held.check()            # raises LockLost if the lease was lost: call it before committing
        fence = held.lease.fencing

The owner token belongs to the Lease, never to the backend. So many tasks can share one
backend.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Generator, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Protocol, runtime_checkable

from flowlock.core.errors import FlowlockError, LockLost, LockNotOwned
from flowlock.core.settings import check_seconds, check_text

__all__ = [
    "MAX_KEY_LENGTH",
    "MAX_TTL",
    "BorrowsFenceEpochs",
    "BulkLockBackend",
    "FenceEpochs",
    "Held",
    "Lease",
    "LeaseContext",
    "LockBackend",
    "check_lock_args",
    "check_lock_key",
    "check_ttl",
    "check_wait",
]

log = logging.getLogger("flowlock")

MAX_TTL = 3600.0
"""The longest `ttl` and `wait` of a lease, in seconds."""
MAX_KEY_LENGTH = 512
"""The longest lock key, in characters."""


@dataclass(frozen=True, slots=True)
class Lease:
    """One acquisition of a lock.

    - `token`: the owner's 128-bit random token, in hex.
    - `fencing`: greater than every fencing number handed out before for `key`. Pass it
      to anything outside the lock that must refuse a stale holder.
    - `expires_at`: a deadline on the local monotonic clock. It counts from before the
      request was sent, so it never overestimates the lease.
    """

    key: str
    token: str
    fencing: int
    ttl: float
    expires_at: float
    backend: str

    def remaining(self, now: float | None = None) -> float:
        """Seconds left before the lease may have expired (local clock, conservative)."""
        return self.expires_at - (time.monotonic() if now is None else now)

    def renewed(self, expires_at: float, ttl: float | None = None) -> Lease:
        """The same lease with a later deadline."""
        return replace(self, expires_at=expires_at, ttl=self.ttl if ttl is None else ttl)


def check_lock_key(key: object) -> str:
    """A lock key every backend can hold, so code can move between backends.

    A non-empty str of at most [`MAX_KEY_LENGTH`][flowlock.locks.base.MAX_KEY_LENGTH] characters. No
    NUL, since the advisory backend stores keys as PostgreSQL `text`, and no lone surrogates.
    """
    return check_text("lock key", key, most=MAX_KEY_LENGTH, allow_control=True)


def check_ttl(ttl: object) -> float:
    """A lease's ttl: more than 0 and at most [`MAX_TTL`][flowlock.locks.base.MAX_TTL] seconds
    (every lock has a TTL)."""
    return check_seconds("ttl", ttl, most=MAX_TTL)


def check_wait(wait: object) -> float:
    """A wait for a lock: 0 (try once) to [`MAX_TTL`][flowlock.locks.base.MAX_TTL] seconds (every
    wait has a bound)."""
    return check_seconds("wait", wait, zero=True, most=MAX_TTL)


def check_lock_args(key: object, ttl: object, wait: object) -> None:
    """Refuse nonsense before any I/O: a key every backend holds, a TTL, a bounded wait."""
    check_lock_key(key)
    check_ttl(ttl)
    check_wait(wait)


@runtime_checkable
class LockBackend(Protocol):
    """A lease-lock backend (Redis, PostgreSQL advisory locks, memory)."""

    @property
    def name(self) -> str: ...

    def acquire(self, key: str, *, ttl: float, wait: float = 0.0) -> LeaseContext:
        """Take the lock on `key` for `ttl` seconds, waiting at most `wait` seconds.

        `wait=0` tries once. Await it for a Lease, or `async with` it for a renewed Held that
        is released on exit. Raises LockTimeout, LockBusy (`wait=0`) or LockUnavailable.
        """
        ...

    async def release(self, lease: Lease) -> None:
        """Release `lease`.

        Raises LockNotOwned when it is no longer the owner. A new holder's lock is left alone.
        """
        ...

    async def extend(self, lease: Lease, ttl: float | None = None) -> Lease:
        """Push the lease's expiry to `ttl` from now; the default is its own ttl.

        Raises LockNotOwned when it is no longer the owner.
        """
        ...

    async def owned(self, lease: Lease) -> bool:
        """Whether `lease` still holds its key."""
        ...

    async def wait_released(self, key: str, wait: float) -> bool:
        """Wait, without taking the lock, until `key` is free.

        True once its holder released it or the lease expired; False when `wait` seconds pass
        first. Every watcher is woken by a release, and none competes for the lock.
        """
        ...

    async def locked(self, key: str) -> bool:
        """Whether anyone holds `key`."""
        ...

    async def open(self) -> None:
        """Connect. Idempotent."""
        ...

    async def aclose(self) -> None:
        """Release connections. Idempotent."""
        ...


@runtime_checkable
class BulkLockBackend(LockBackend, Protocol):
    async def try_acquire_many(self, keys: Sequence[str], *, ttl: float) -> list[Lease | None]:
        """Try each key once, in as few round trips as the server allows (one per Redis
        Cluster hash slot; one statement on PostgreSQL): a Lease (fencing token included)
        for each key taken, None for a key held by someone else. Same order as keys."""
        ...

    async def release_many(self, leases: Sequence[Lease]) -> list[bool]:
        """Release each lease; True where it was still ours."""
        ...

    async def extend_many(self, leases: Sequence[Lease], ttl: float) -> list[Lease | None]:
        """Renew each; None where it was lost."""
        ...


class FenceEpochs(Protocol):
    """Durable fencing epochs per lock key, kept outside the lock server.

    `PostgresStore.fence_epochs` and `RunOnce.fence_epochs` provide them. They let a
    backend that can lose its counters (Redis) restart them above every token it issued.
    """

    def advance(
        self, namespace: str, key: str, *, at_least: int, bound: float
    ) -> AbstractAsyncContextManager[int]:
        """Bump the epoch of `key` in `namespace` durably, and yield it.

        The epoch becomes at least `at_least`. No other `advance` of the key gets an epoch
        until the block is left, so counters start in epoch order. Waits at most `bound`
        seconds, then raises LockUnavailable.
        """
        ...


@runtime_checkable
class BorrowsFenceEpochs(Protocol):
    """A lock backend that can use fencing epochs it was not configured with.

    [`RunOnce`][flowlock.jobs.RunOnce] lends it its own while open. RedisLocks is one.
    """

    def borrow_fence_epochs(self, epochs: FenceEpochs) -> Callable[[], None]:
        """Use `epochs` while the backend has none of its own.

        Returns the call that gives them back; that call is idempotent.
        """
        ...


class _Renewer(Protocol):
    """What a Held lease needs of its backend."""

    async def release(self, lease: Lease) -> None: ...

    async def extend(self, lease: Lease, ttl: float | None = None) -> Lease: ...


class _Acquirer(_Renewer, Protocol):
    """What a LeaseContext needs of its backend."""

    async def _acquire(self, key: str, ttl: float, wait: float) -> Lease: ...


class LeaseContext:
    """What `backend.acquire(...)` returns.

    Await it for a Lease. Or use it as an async context manager for a
    [`Held`][flowlock.locks.base.Held]: a watchdog renews it every `ttl / 3` and it is released on
    exit.
    """

    def __init__(
        self,
        backend: _Acquirer,
        key: str,
        *,
        ttl: float,
        wait: float,
        renew: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        check_lock_args(key, ttl, wait)
        self._backend = backend
        self._key = key
        self._ttl = ttl
        self._wait = wait
        self._renew = renew
        self._clock = clock
        self._held: Held | None = None

    def __await__(self) -> Generator[object, None, Lease]:
        return self._backend._acquire(self._key, self._ttl, self._wait).__await__()

    async def __aenter__(self) -> Held:
        lease = await self._backend._acquire(self._key, self._ttl, self._wait)
        self._held = Held(self._backend, lease, renew=self._renew, clock=self._clock)
        return self._held

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        held, self._held = self._held, None
        if held is not None:
            await held.close(raise_errors=exc is None)


class Held:
    """A lease being held: renewed in the background, checked before commit, released once.

    A failed renewal is never swallowed: [`check`][flowlock.locks.base.Held.check] raises LockLost
    from then on, and the loss is logged once. An unreachable backend is retried until the lease's
    local deadline. Any exception from `extend` counts as a failed renewal. The watchdog always ends
    by releasing the lease or marking it lost.
    """

    def __init__(
        self,
        backend: _Renewer,
        lease: Lease,
        *,
        renew: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._backend = backend
        self._lease = lease
        self._clock = clock
        self._lost: str | None = None
        self._released = False
        self._watchdog: asyncio.Task[None] | None = None
        if renew:
            self._watchdog = asyncio.create_task(
                self._renew_forever(), name=f"flowlock-renew:{lease.key}"
            )

    @property
    def lease(self) -> Lease:
        """The current lease (its deadline moves with each renewal)."""
        return self._lease

    @property
    def lost(self) -> str | None:
        """Why the lease was lost, or None while it is held."""
        if self._lost is None and self._lease.remaining(self._clock()) <= 0:
            return "its ttl ran out on the local clock before a renewal succeeded"
        return self._lost

    def check(self) -> None:
        """Raise LockLost if the lease is lost or past its local deadline. Call before commit."""
        reason = self.lost
        if reason is not None:
            raise LockLost(self._lease.key, reason)

    async def _renew_forever(self) -> None:
        lease = self._lease
        # Stopped by cancellation, and also by _released. Some drivers swallow a cancellation
        # (Python 3.11's asyncio.wait_for, when it lands as the call completes). This loop must not
        # renew a released lease forever.
        while not self._released:
            await asyncio.sleep(lease.ttl / 3)
            if self._released:
                return
            try:
                lease = self._lease = await self._backend.extend(lease)
            except LockNotOwned:
                self._mark_lost("a renewal found another owner (the lease had expired)")
                return
            except Exception as exc:
                # Why every Exception, not only flowlock's: an untranslated backend error must not
                # end the renewals silently. That would leave a lease nobody renews and nobody
                # marked lost. CancelledError, how close() stops this loop, is not an Exception.
                reason = _describe(exc)
                if lease.remaining(self._clock()) <= 0:
                    self._mark_lost(f"renewals failed until the ttl ran out: {reason}")
                    return
                log.warning(
                    "flowlock: renewing the lease on %r failed, retrying: %s",
                    lease.key,
                    reason,
                    exc_info=not isinstance(exc, FlowlockError),
                )
                await asyncio.sleep(min(lease.ttl / 10, max(lease.remaining(self._clock()), 0)))

    def _mark_lost(self, reason: str) -> None:
        if self._lost is None:
            self._lost = reason
            log.warning("flowlock: lost the lease on %r: %s", self._lease.key, reason)

    async def close(self, *, raise_errors: bool = True) -> None:
        """Stop renewing and release the lease, once.

        Safe under cancellation: the release completes in its own task. It releases only this
        lease's token, never another owner's.
        """
        if self._released:
            return
        self._released = True
        # Stopping the watchdog and releasing run as one task, shielded from the caller. A
        # cancellation while the watchdog winds down must not skip the release. Otherwise the key
        # stays held until its ttl ends.
        release = _keep(asyncio.ensure_future(self._stop_and_release()))
        try:
            await asyncio.shield(release)
        except asyncio.CancelledError:
            # The caller was cancelled mid-release. Let the release finish on its own, bounded by
            # the backend's timeouts, rather than leave the key held until its ttl ends.
            release.add_done_callback(_log_release_failure)
            raise
        except LockNotOwned:
            if self._lost is None:
                self._mark_lost("the lease expired before release")
            if raise_errors:
                raise
        except FlowlockError as exc:
            log.warning("flowlock: releasing the lease on %r failed: %s", self._lease.key, exc)
            if raise_errors:
                raise

    async def _stop_and_release(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)
        await self._backend.release(self._lease)


def _describe(exc: BaseException) -> str:
    """A flowlock error's message; anything else with its type, which says more."""
    return str(exc) if isinstance(exc, FlowlockError) else f"{type(exc).__name__}: {exc}"


# The loop keeps only weak references to tasks. A release left to finish after its caller was
# cancelled must be held here, or it could be collected half-way.
_running: set[asyncio.Future[None]] = set()


def _keep(task: asyncio.Future[None]) -> asyncio.Future[None]:
    _running.add(task)
    task.add_done_callback(_running.discard)
    return task


def _log_release_failure(task: asyncio.Future[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning(
            "flowlock: a release finished after its caller was cancelled and failed: %s",
            task.exception(),
        )
