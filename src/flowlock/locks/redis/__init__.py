"""Lease locks in Redis: one key per lock, compare-and-delete / compare-and-extend in Lua,
waiters woken by pub/sub, and fencing tokens that stay increasing across a Redis data loss.

::

    locks = RedisLocks("redis://127.0.0.1:6379/0", namespace="billing")
    await locks.open()
    async with locks.acquire("invoice-42", ttl=10, wait=2) as held:
        ...
        held.check()
    await locks.aclose()

The protocol, one concern per module (each module's docstring tells its part):

- :mod:`~flowlock.locks.redis.keys`: where a lock and its fencing counter live (one cluster slot);
- :mod:`~flowlock.locks.redis.scripts`: the three Lua scripts (acquire, release, extend), their
  KEYS and ARGV;
- :mod:`~flowlock.locks.redis.wakeups`: the FIFO queue of local waiters per key (a release wakes
  the oldest one only, which passes the wake on if it leaves without the lease), the watchers of
  ``wait_released``, the holder's-expiry timer, and the reconnecting pub/sub listener;
- :mod:`~flowlock.locks.redis.fence`: starting a fencing counter Redis does not have (a new key,
  or Redis lost its data) above every earlier token, from the key's epoch in PostgreSQL (or a
  ``fence_floor``), once per key for all its concurrent acquirers;
- :mod:`~flowlock.locks.redis.connection`: the bounded connection pool (no redis-py
  ``socket_timeout``; every call bounded with ``asyncio.timeout`` instead) and the one place
  driver errors become LockUnavailable;
- :mod:`~flowlock.locks.redis.backend`: :class:`RedisLocks`, which composes them.
"""

from __future__ import annotations

from flowlock.core.extras import require

require("redis", "redis", "Redis leases (flowlock.locks.redis)")

from flowlock.locks.redis.backend import RedisLocks

__all__ = ["RedisLocks"]
