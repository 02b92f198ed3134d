"""Stores: where instances and their history live. See :mod:`flowlock.stores.base`.

`flowlock.backends.build_store` builds one from a URL.
"""

from __future__ import annotations

from flowlock.stores.base import EscalationBoard, LockedResult, Plan, RowLock, Store
from flowlock.stores.memory import MemoryBoard, MemoryStore

__all__ = [
    "EscalationBoard",
    "LockedResult",
    "MemoryBoard",
    "MemoryStore",
    "Plan",
    "RowLock",
    "Store",
]
