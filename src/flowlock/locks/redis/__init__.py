"""Lease locks in Redis, with fencing tokens that survive a Redis data loss.

::

    locks = RedisLocks("redis://127.0.0.1:6379/0", namespace="billing")
    await locks.open()
    async with locks.acquire("invoice-42", ttl=10, wait=2) as held:
        ...
        held.check()
    await locks.aclose()

One concern per module:

- :mod:`~flowlock.locks.redis.keys`: where a lock and its counter live (one cluster slot).
- :mod:`~flowlock.locks.redis.scripts`: the Lua scripts, with their KEYS and ARGV.
- :mod:`~flowlock.locks.redis.wakeups`: local waiter queues and the pub/sub listener.
- :mod:`~flowlock.locks.redis.fence`: restarting a fencing counter Redis lost.
- :mod:`~flowlock.locks.redis.connection`: bounded connections and driver errors.
- :mod:`~flowlock.locks.redis.backend`: :class:`RedisLocks`, which composes them.
"""

from __future__ import annotations

from flowlock.core.extras import require

require("redis", "redis", "Redis leases (flowlock.locks.redis)")

from flowlock.locks.redis.backend import RedisLocks

__all__ = ["RedisLocks"]
