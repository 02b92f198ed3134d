"""Fencing epochs in PostgreSQL, for the Redis lock backend's counters.

The bump is committed before the caller sees it, under a session lock held across the Redis
call. The PostgreSQL guide says why. The lock needs a session of its own: a direct connection
or session pooling. Behind a transaction pooler (PgBouncer `pool_mode=transaction`) the epochs
are refused with InvalidInput (`flowlock._pg.pooling.session_needed`), when the engine opens
or, wired by hand, at the first bump.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import asyncpg

from flowlock._pg.errors import DRIVER_ERRORS, Context
from flowlock._pg.pool import check_schema, connection, terminate
from flowlock._pg.pooling import session_needed
from flowlock.core.errors import LockUnavailable

__all__ = ["EPOCHS", "EPOCH_LOCK_CLASS", "PostgresFenceEpochs"]

EPOCHS = "fencing epochs (the Redis lock backend's fence_epochs, kept in PostgreSQL)"
"""What the refusal behind a transaction pooler names."""

# The first half of the two-int advisory lock key (the second is hashtext(namespace:key)). The
# two-int form never meets the one-bigint locks of AdvisoryLocks and the migrations.
EPOCH_LOCK_CLASS = 0x666C6F77  # "flow"

_LOCK_KEY = "hashtext($1 || ':' || $2)"

# $1 namespace, $2 key, $3 the least epoch wanted. The lock comes first: the INSERT has no row to
# insert before the CTE has taken it.
_BUMP = """
WITH lock AS (SELECT pg_advisory_lock({cls}, {key}))
INSERT INTO {table} AS e (namespace, key, epoch)
SELECT $1, $2, greatest($3::bigint, 1) FROM lock
ON CONFLICT (namespace, key) DO UPDATE SET epoch = greatest(e.epoch + 1, $3::bigint)
RETURNING epoch
"""
_UNLOCK = "SELECT pg_advisory_unlock({cls}, {key})"

_REDIS = "redis"
_UNLOCK_FAILURES: tuple[type[BaseException], ...] = (TimeoutError, *DRIVER_ERRORS)

log = logging.getLogger("flowlock")


def _busy(exc: BaseException) -> LockUnavailable:
    return LockUnavailable(
        _REDIS,
        f"the fencing epoch's lock in PostgreSQL was not free within lock_timeout ({exc}); "
        "another process is starting the same key's counter: retry",
    )


_ERRORS = Context(
    what="PostgreSQL error while bumping a fencing epoch",
    tables="flowlock_fence_epochs is",
    opener="the engine (or RunOnce)",
    busy=_busy,
    cancel_is_busy=True,
    lock_backend=_REDIS,
)


class PostgresFenceEpochs:
    """The fencing epochs of Redis lock keys, in `flowlock_fence_epochs` of `schema` (the
    connection's `search_path` without one), on connections of the pool `pool()` returns.

    `acquire_timeout` bounds the wait for a connection (StoreBusy past it); `size` is the
    pool's, for that message. Every other wait is bounded by the caller's `bound`. `pooled`
    says whether that pool goes through a transaction pooler: `advance` then refuses (the
    lock it holds across the Redis call needs a session).
    """

    __slots__ = ("_acquire_timeout", "_bump", "_pool", "_pooled", "_size", "_unlock")

    def __init__(
        self,
        pool: Callable[[], asyncpg.Pool],
        *,
        schema: str | None = None,
        acquire_timeout: float,
        size: int,
        pooled: Callable[[], bool] = lambda: False,
    ) -> None:
        check_schema(schema)
        table = "flowlock_fence_epochs" if schema is None else f'"{schema}".flowlock_fence_epochs'
        self._pool = pool
        self._pooled = pooled
        self._acquire_timeout = acquire_timeout
        self._size = size
        self._bump = _BUMP.format(cls=EPOCH_LOCK_CLASS, key=_LOCK_KEY, table=table)
        self._unlock = _UNLOCK.format(cls=EPOCH_LOCK_CLASS, key=_LOCK_KEY)

    @asynccontextmanager
    async def advance(
        self, namespace: str, key: str, *, at_least: int, bound: float
    ) -> AsyncIterator[int]:
        """Bump the epoch of `key` in `namespace` to at least `at_least` (and at least one
        above the last), commit it, and yield it while holding the key's lock: no other
        `advance` of the key gets its epoch until this one's `async with` is left. Waits at
        most `bound` seconds for the lock and the bump (LockUnavailable past it). InvalidInput
        behind a transaction pooler, before anything is sent."""
        pool = self._pool()
        if self._pooled():
            raise session_needed(EPOCHS)
        async with connection(
            pool,
            acquire_timeout=min(self._acquire_timeout, bound),
            size=self._size,
            context=_ERRORS,
        ) as conn:
            locked = False
            try:
                try:
                    async with asyncio.timeout(bound):
                        # A lock granted just as the wait ran out may be held: let go below.
                        locked = True
                        epoch = int(await conn.fetchval(self._bump, namespace, key, at_least))
                except TimeoutError as exc:
                    raise LockUnavailable(
                        _REDIS,
                        f"bumping the fencing epoch of {key!r} took over {bound:.1f} s",
                    ) from exc
                yield epoch
                try:
                    async with asyncio.timeout(bound):
                        released = await conn.fetchval(self._unlock, namespace, key)
                    if released:
                        locked = False
                    else:
                        log.warning(
                            "flowlock: the fencing epoch lock of %r was not held by the session "
                            "letting go of it: is a transaction-pooling proxy (PgBouncer "
                            "pool_mode=transaction) between flowlock and PostgreSQL that the "
                            "probe on open did not see (a busy pooler)? Fencing epochs need a "
                            "direct connection or session pooling; pass pooling='transaction' "
                            "to have them refused at open",
                            key,
                        )
                except _UNLOCK_FAILURES as exc:
                    # The counter is started: the caller's work is done, and the lock goes with
                    # the session terminated below.
                    log.debug("flowlock: letting go of the fencing epoch lock failed: %s", exc)
            finally:
                if locked:
                    # Whatever went wrong, the lock must not go back to the pool with the
                    # connection: end the session, and the lock with it.
                    terminate(conn)
