"""Lease locks on PostgreSQL advisory locks: no Redis needed.

docs/deployment.md says how a lease, its fencing token and its connections work.
"""

from __future__ import annotations

from flowlock.core.extras import require

require("asyncpg", "postgres", "Advisory-lock leases (flowlock.locks.advisory)")

from flowlock.locks.advisory.backend import DEFAULT_IO_TIMEOUT, AdvisoryLocks
from flowlock.locks.advisory.sql import advisory_lock_id

__all__ = ["DEFAULT_IO_TIMEOUT", "AdvisoryLocks", "advisory_lock_id"]
