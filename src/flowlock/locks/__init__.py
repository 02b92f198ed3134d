"""Lease locks: the port (:mod:`flowlock.locks.base`) and its backends."""

from __future__ import annotations

from flowlock.locks.base import Held, Lease, LeaseContext, LockBackend
from flowlock.locks.memory import MemoryLocks

__all__ = ["Held", "Lease", "LeaseContext", "LockBackend", "MemoryLocks"]
