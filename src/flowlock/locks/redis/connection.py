"""The redis-py client a backend opens, and the one place driver errors are translated.

Failures
    Every call to Redis is bounded: by ``socket_timeout``, and while acquiring also by what is
    left of ``wait``. A Redis that refuses, times out or answers an error raises LockUnavailable
    (nothing acquired; at release the key simply expires at its ttl). redis-py's automatic
    retries are off: a retried compare-and-delete whose first try had landed would report
    LockNotOwned for a lease that was in fact released.

    :func:`translate` is the one place a driver error becomes a flowlock error, and
    :data:`DRIVER_ERRORS` what it takes: every exception class redis-py defines (``ConnectionError``
    of a connection killed with ``CLIENT KILL`` or reset, ``TimeoutError``, ``ResponseError``,
    ``BusyLoadingError`` from a Redis still loading its data after a restart, ``ReadOnlyError``
    from a replica, and those that do not derive from ``RedisError``, such as the cluster
    client's) and the OS's (a reset socket; the call's own bound). Every call to
    Redis goes through :func:`bounded`, which uses it; closing the client goes through
    :func:`close`. redis-py disconnects a connection that failed before it goes back to the
    pool, so the next call opens a fresh one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from flowlock.errors import LockUnavailable

__all__ = ["BACKEND", "DRIVER_ERRORS", "bounded", "close", "connect", "text", "translate"]

T = TypeVar("T")

log = logging.getLogger("flowlock")

BACKEND = "redis"  # the backend's name, in leases and in LockUnavailable


def _redis_errors() -> tuple[type[BaseException], ...]:
    """Every exception class redis-py defines, by their roots. Most derive from RedisError, but
    not all: the cluster client's RedisClusterException (and CrossSlotTransactionError,
    SlotNotCoveredError...), ChildDeadlockedError (a pool used after a fork) and others stand
    alone, and would escape a catch of RedisError alone. Read from the module, so a class a later
    redis-py adds is caught too."""
    found = [
        cls
        for cls in vars(redis.exceptions).values()
        if isinstance(cls, type) and issubclass(cls, Exception)
    ]
    roots = {cls for cls in found if not any(o is not cls and issubclass(cls, o) for o in found)}
    return (RedisError, *sorted(roots - {RedisError}, key=lambda cls: cls.__name__))


# What the edge catches: redis-py's errors and the OS's (TimeoutError, the bound of bounded(),
# and ConnectionError are OSErrors).
DRIVER_ERRORS: tuple[type[BaseException], ...] = (*_redis_errors(), OSError)


def _no_maintenance_probe() -> dict[str, Any]:
    # redis-py >= 7 probes every new connection for maintenance notifications ("auto"): one
    # more round trip per connect, answered with an error by servers that lack them.
    try:
        from redis.maint_notifications import MaintNotificationsConfig
    except ImportError:  # redis-py < 7
        return {}
    return {"maint_notifications_config": MaintNotificationsConfig(enabled=False)}


def connect(url: str, *, max_connections: int, connect_timeout: float) -> aioredis.Redis:
    """A client on a bounded, blocking pool: a burst of callers beyond ``max_connections``
    queues for a connection (within each call's bound) instead of failing at once. Nothing is
    sent until the first command."""
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=None,
        # No socket_timeout in redis-py: with one, it bounds each write with asyncio.wait_for,
        # which on Python 3.11 swallows a cancellation that lands as the write completes (the
        # caller's task then runs on as if never cancelled; a lease watchdog would renew
        # forever). Every call is bounded by bounded() instead, with asyncio.timeout; the
        # connect keeps its own bound.
        socket_timeout=None,
        socket_connect_timeout=connect_timeout,
        retry=Retry(NoBackoff(), 0),
        decode_responses=True,
        **_no_maintenance_probe(),
    )
    return aioredis.Redis.from_pool(pool)


def translate(what: str, exc: BaseException, seconds: float) -> LockUnavailable:
    """The flowlock error for driver error ``exc`` raised while doing ``what`` (bounded by
    ``seconds``): nothing was acquired, extended or released by that call."""
    if isinstance(exc, TimeoutError):
        return LockUnavailable(BACKEND, f"{what}: no answer within {seconds:.2f} s")
    return LockUnavailable(BACKEND, f"{what}: {type(exc).__name__}: {exc}")


async def bounded(what: str, call: Awaitable[T], seconds: float) -> T:
    """Await one Redis call for at most ``seconds``; every driver failure becomes
    LockUnavailable saying ``what`` was being done (:func:`translate`)."""
    try:
        async with asyncio.timeout(seconds):
            return await call
    except DRIVER_ERRORS as exc:
        raise translate(what, exc, seconds) from exc


async def close(client: aioredis.Redis, seconds: float) -> None:
    """Close ``client`` and its connections; a failure to say goodbye on a connection that is
    already broken is nothing the caller can act on, so it is logged, not raised."""
    try:
        await bounded("close", client.aclose(), seconds)
    except LockUnavailable as exc:
        log.debug("flowlock: closing the Redis client: %s", exc)


def text(value: object) -> str | None:
    """A reply as a string (a client from ``from_client`` may not decode its replies)."""
    if isinstance(value, bytes):
        return value.decode()
    return None if value is None else str(value)
