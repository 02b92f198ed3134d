"""An in-process lock backend for unit tests and single-process use. Same contract as Redis.

A release wakes waiters through an asyncio.Condition; an expiry wakes them at its
deadline. No polling.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from flowlock.core.errors import LockBusy, LockNotOwned, LockTimeout
from flowlock.locks.base import Lease, LeaseContext, check_lock_key, check_ttl, check_wait

__all__ = ["MemoryLocks"]


@dataclass(slots=True)
class _Entry:
    token: str
    deadline: float


class MemoryLocks:
    """Lease locks in a dict. ``clock`` and ``token`` are injectable for tests."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        token: Callable[[], str] = lambda: secrets.token_hex(16),
    ) -> None:
        self._clock = clock
        self._token = token
        self._held: dict[str, _Entry] = {}
        self._fences: dict[str, int] = {}
        self._changed = asyncio.Condition()

    @property
    def name(self) -> str:
        return "memory"

    def acquire(self, key: str, *, ttl: float, wait: float = 0.0) -> LeaseContext:
        return LeaseContext(self, key, ttl=ttl, wait=wait, clock=self._clock)

    def _live(self, key: str) -> _Entry | None:
        entry = self._held.get(key)
        if entry is not None and entry.deadline <= self._clock():
            del self._held[key]
            return None
        return entry

    async def _acquire(self, key: str, ttl: float, wait: float) -> Lease:
        started = self._clock()
        async with self._changed:
            while True:
                holder = self._live(key)
                now = self._clock()
                if holder is None:
                    token = self._token()
                    self._held[key] = _Entry(token, now + ttl)
                    fence = self._fences[key] = self._fences.get(key, 0) + 1
                    return Lease(key, token, fence, ttl, started + ttl, self.name)
                left = started + wait - now
                if wait <= 0:
                    raise LockBusy(key)
                if left <= 0:
                    raise LockTimeout(key, now - started)
                # Woken by a release, or at the holder's expiry, or at our own deadline.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), min(left, holder.deadline - now))

    async def release(self, lease: Lease) -> None:
        async with self._changed:
            holder = self._live(lease.key)
            if holder is None or holder.token != lease.token:
                raise LockNotOwned(lease.key, "release")
            del self._held[lease.key]
            self._changed.notify_all()

    async def extend(self, lease: Lease, ttl: float | None = None) -> Lease:
        ttl = lease.ttl if ttl is None else check_ttl(ttl)
        sent = self._clock()
        holder = self._live(lease.key)
        if holder is None or holder.token != lease.token:
            raise LockNotOwned(lease.key, "extend")
        holder.deadline = sent + ttl
        return lease.renewed(sent + ttl, ttl)

    async def wait_released(self, key: str, wait: float) -> bool:
        check_lock_key(key)
        check_wait(wait)
        started = self._clock()
        async with self._changed:
            while True:
                holder = self._live(key)
                if holder is None:
                    return True
                now = self._clock()
                left = started + wait - now
                if left <= 0:
                    return False
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), min(left, holder.deadline - now))

    async def owned(self, lease: Lease) -> bool:
        holder = self._live(lease.key)
        return holder is not None and holder.token == lease.token

    async def locked(self, key: str) -> bool:
        check_lock_key(key)
        return self._live(key) is not None

    async def open(self) -> None:
        return None

    async def aclose(self) -> None:
        return None
