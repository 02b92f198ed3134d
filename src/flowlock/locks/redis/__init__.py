"""Lease locks in Redis, with fencing tokens that survive a Redis data loss.


    locks = RedisLocks("redis://127.0.0.1:6379/0", namespace="billing")
    await locks.open()
    async with locks.acquire("invoice-42", ttl=10, wait=2) as held:
        ...
        held.check()
    await locks.aclose()

One concern per module:

- `keys`: where a lock and its counter live (one cluster slot).
- `scripts`: the Lua scripts, with their KEYS and ARGV.
- `wakeups`: local waiter queues and the pub/sub listener.
- `fence`: restarting a fencing counter Redis lost.
- `connection`: bounded connections and driver errors.
- `bulk`: many locks per round trip, and the lanes that coalesce single-key calls onto it.
- `many`: the many-lock calls of `RedisLocks` (`try_acquire_many`, ...).
- `backend`: [`RedisLocks`][flowlock.locks.redis.RedisLocks], which composes them.
"""

from __future__ import annotations

from flowlock.core.extras import require

require("redis", "redis", "Redis leases (flowlock.locks.redis)")

from flowlock.locks.redis.backend import RedisLocks

__all__ = ["RedisLocks"]
