"""The BulkLockBackend calls of AdvisoryLocks: many keys per call, one statement per holder."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import asyncpg

from flowlock.core.errors import InvalidInput, LockBusy, LockNotOwned
from flowlock.locks.advisory.bulk import Bulk
from flowlock.locks.base import Lease, check_lock_args, check_ttl

__all__ = ["BulkCalls"]


class BulkCalls:
    """Mixed into AdvisoryLocks. Without the bulk path (`bulk=False`, an old server) each key
    goes its own way, concurrently."""

    _bulk: Bulk | None

    def _pools(self) -> tuple[asyncpg.Pool, asyncpg.Pool]:
        raise NotImplementedError

    def lock_id(self, key: str) -> int:
        raise NotImplementedError

    async def _acquire(self, key: str, ttl: float, wait: float) -> Lease:
        raise NotImplementedError

    async def release(self, lease: Lease) -> None:
        raise NotImplementedError

    async def extend(self, lease: Lease, ttl: float | None = None) -> Lease:
        raise NotImplementedError

    async def try_acquire_many(self, keys: Sequence[str], *, ttl: float) -> list[Lease | None]:
        """Try each key once, in one statement per holder: a Lease for each key taken, None
        for a key held by someone else (or twice in `keys`). Same order as keys."""
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
            # A string is a sequence too: "abc" would try the keys "a", "b" and "c".
            raise InvalidInput(f"keys must be a list, not {type(keys).__name__}")
        ttl = check_ttl(ttl)
        for key in keys:
            check_lock_args(key, ttl, 0)
        self._pools()
        if not keys:
            return []  # no holder opened, no round trip
        if self._bulk is None:
            return list(await asyncio.gather(*(self._try_alone(k, ttl) for k in keys)))
        return await self._bulk.try_acquire_many(keys, ttl, [self.lock_id(k) for k in keys])

    async def _try_alone(self, key: str, ttl: float) -> Lease | None:
        try:
            return await self._acquire(key, ttl, 0.0)
        except LockBusy:
            return None

    async def release_many(self, leases: Sequence[Lease]) -> list[bool]:
        """Release each lease; True where it was still ours."""
        self._pools()
        bulk = self._bulk
        if bulk is not None and all(bulk.kept(lease.token) for lease in leases):
            return await bulk.release_many(leases)
        return list(await asyncio.gather(*(self._release_quietly(lease) for lease in leases)))

    async def _release_quietly(self, lease: Lease) -> bool:
        try:
            await self.release(lease)
        except LockNotOwned:
            return False
        return True

    async def extend_many(self, leases: Sequence[Lease], ttl: float) -> list[Lease | None]:
        """Renew each lease for `ttl` seconds from now; None where it was lost."""
        ttl = check_ttl(ttl)
        self._pools()
        bulk = self._bulk
        if bulk is not None and all(bulk.kept(lease.token) for lease in leases):
            return await bulk.extend_many(leases, ttl)
        return list(await asyncio.gather(*(self._extend_quietly(lease, ttl) for lease in leases)))

    async def _extend_quietly(self, lease: Lease, ttl: float) -> Lease | None:
        try:
            return await self.extend(lease, ttl)
        except LockNotOwned:
            return None
