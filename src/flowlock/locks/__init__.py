"""Lease locks: the port (:mod:`flowlock.locks.base`) and its backends.

- :class:`MemoryLocks`: in-process, for tests and single-process use;
- :class:`flowlock.locks.redis.RedisLocks`: Redis (``SET NX PX``, Lua release and extend,
  pub/sub wake-ups, fencing epochs in PostgreSQL);
- :class:`flowlock.locks.advisory.AdvisoryLocks`: PostgreSQL transaction-level advisory locks
  (no Redis needed).
"""

from __future__ import annotations

from flowlock.locks.advisory import AdvisoryLocks
from flowlock.locks.base import Held, Lease, LeaseContext, LockBackend
from flowlock.locks.memory import MemoryLocks
from flowlock.locks.redis import RedisLocks

__all__ = [
    "AdvisoryLocks",
    "Held",
    "Lease",
    "LeaseContext",
    "LockBackend",
    "MemoryLocks",
    "RedisLocks",
]
