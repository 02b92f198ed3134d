"""What driver errors mean in the advisory lock backend (translated by flowlock._pg.errors)."""

from __future__ import annotations

from flowlock._pg.errors import Context
from flowlock.core.errors import LockError

NAME = "advisory"


class Busy(LockError):
    """SQLSTATE 55P03 (lock_timeout, or the try-lock found the lock taken) or 57014."""


# A session that is gone or did not answer is a SessionGone of this backend: the server ended it
# (idle-in-transaction timeout, terminated, restarted), the network failed, or a round trip
# outlived ``io_timeout``.
ERRORS = Context(
    what="PostgreSQL error in the advisory lock backend",
    tables="flowlock_fences is",
    opener="the advisory lock backend",
    busy=lambda exc: Busy(str(exc)),
    cancel_is_busy=True,
    lock_backend=NAME,
)
