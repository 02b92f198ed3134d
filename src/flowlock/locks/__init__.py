"""Lease locks: the port (`flowlock.locks.base`) and its backends.

`MemoryLocks` is in-process. `RedisLocks` (extra `redis`) and `AdvisoryLocks` (extra
`postgres`) load on first use, so importing this package loads no driver.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from flowlock.locks.base import BulkLockBackend, Held, Lease, LeaseContext, LockBackend
from flowlock.locks.memory import MemoryLocks

if TYPE_CHECKING:
    from flowlock.locks.advisory import AdvisoryLocks
    from flowlock.locks.redis import RedisLocks

__all__ = [
    "AdvisoryLocks",
    "BulkLockBackend",
    "Held",
    "Lease",
    "LeaseContext",
    "LockBackend",
    "MemoryLocks",
    "RedisLocks",
]

_WHERE = {"AdvisoryLocks": "flowlock.locks.advisory", "RedisLocks": "flowlock.locks.redis"}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'flowlock.locks' has no attribute {name!r}")
    return getattr(importlib.import_module(where), name)
