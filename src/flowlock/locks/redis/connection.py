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
import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeAlias, TypeVar

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import BlockingConnectionPool
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import MasterNotFoundError, Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from flowlock.core.errors import LockUnavailable
from flowlock.locks.redis import urls

__all__ = [
    "BACKEND",
    "DRIVER_ERRORS",
    "Client",
    "Servers",
    "bounded",
    "close",
    "connect",
    "servers",
    "text",
    "translate",
]

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


Client: TypeAlias = "aioredis.Redis | RedisCluster"
"""A redis-py client the backend runs its commands on: one server's (also a Sentinel primary's)
or a Redis Cluster's."""


class Servers:
    """The client a backend sends its commands on, where its pub/sub listener subscribes
    (:meth:`pubsub`, a fresh subscription each time), and what :meth:`aclose` closes.

    One server and Sentinel: the pub/sub connection is the client's own (with Sentinel it asks
    the sentinels for the primary each time it connects, so the listener follows a failover).
    Cluster: a release is announced with a classic PUBLISH, which the cluster broadcasts to every
    node (primaries and replicas), so one subscription on any one node hears every release;
    each new subscription goes to the next node the cluster client knows, so a node that died
    is passed over at the listener's next reconnect."""

    def __init__(
        self, client: Client, *, closing: Sequence[Callable[[], Awaitable[None]]] = ()
    ) -> None:
        self.client = client
        self._closing = tuple(closing)
        self._turn = 0

    @property
    def cluster(self) -> bool:
        """Whether the client is a Redis Cluster's."""
        return isinstance(self.client, RedisCluster)

    def pubsub(self) -> PubSub:
        """A new, unsubscribed pub/sub that hears every release of the backend's namespace."""
        client = self.client
        if not isinstance(client, RedisCluster):
            return client.pubsub()
        # Before the cluster client's first command it knows its startup nodes only.
        nodes = client.get_nodes() or list(client.nodes_manager.startup_nodes.values())
        node = nodes[self._turn % len(nodes)]
        self._turn += 1
        kwargs = _accepted(node.connection_class, node.connection_kwargs)
        pool = aioredis.ConnectionPool(
            connection_class=node.connection_class, max_connections=1, **kwargs
        )
        return PubSub(pool)

    async def aclose(self) -> None:
        """Close the client and what was opened with it (the sentinels' clients)."""
        try:
            await self.client.aclose()
        finally:
            for close in self._closing:
                await close()


def _accepted(cls: type, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The keywords of ``kwargs`` that connection class ``cls`` takes (a cluster node's carry
    the cluster client's own too, which a plain connection refuses)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is not None:
            names.update(inspect.signature(init).parameters)
    return {name: value for name, value in kwargs.items() if name in names and name != "self"}


class _Sentinel(Sentinel):
    """redis-py's Sentinel, asked safely by many tasks at once.

    redis-py moves the sentinel that answered to the front of its list by index, across an
    await: discoveries running at the same time (every connection opened while the primary is
    down asks) then overwrite one another's entries, a sentinel drops out of the list for good
    and its client is never closed. Here the list is only ever reordered between awaits, by
    identity, and closing closes every sentinel's client."""

    def __init__(self, sentinels: Sequence[tuple[str, int]], **kwargs: Any) -> None:
        super().__init__(sentinels, **kwargs)  # type: ignore[no-untyped-call, unused-ignore]
        self._every = list(self.sentinels)

    async def discover_master(self, service_name: str) -> tuple[str, int]:
        errors = []
        for sentinel in list(self.sentinels):
            try:
                masters = await sentinel.sentinel_masters()
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
                errors.append(f"{sentinel}: {exc!r}")
                continue
            if isinstance(masters, list):  # RESP3's shape
                masters = {str(m.get("name")): m for m in masters}
            state = masters.get(service_name)
            if state and self.check_master_state(state, service_name):
                # The one that answered is asked first next time.
                self.sentinels[:] = [sentinel, *(s for s in self._every if s is not sentinel)]
                return state["ip"], state["port"]
        raise MasterNotFoundError(f"No master found for {service_name!r}: {'; '.join(errors)}")

    async def aclose(self) -> None:
        await asyncio.gather(*(s.aclose() for s in self._every), return_exceptions=True)


class _BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):
    """A Sentinel primary's pool that queues a burst of callers for a connection, as the one
    server's pool does, instead of failing them at ``max_connections``."""


def _kwargs_for(cls: type, options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` without those a redis-py of this version does not take."""
    parameters = inspect.signature(cls).parameters
    return {name: value for name, value in options.items() if name in parameters}


def _options(connect_timeout: float) -> dict[str, Any]:
    # No socket_timeout in redis-py: with one, it bounds each write with asyncio.wait_for,
    # which on Python 3.11 swallows a cancellation that lands as the write completes (the
    # caller's task then runs on as if never cancelled; a lease watchdog would renew forever).
    # Every call is bounded by bounded() instead, with asyncio.timeout; the connect keeps its
    # own bound. No retries: a retried compare-and-delete whose first try had landed would
    # report LockNotOwned for a lease that was in fact released.
    return {
        "socket_timeout": None,
        "socket_connect_timeout": connect_timeout,
        "retry": Retry(NoBackoff(), 0),
        "decode_responses": True,
        **_no_maintenance_probe(),
    }


def connect(url: str, *, max_connections: int, connect_timeout: float) -> aioredis.Redis:
    """One server's client (``redis://``, ``rediss://``, ``unix://``) on a bounded, blocking
    pool: a burst of callers beyond ``max_connections`` queues for a connection (within each
    call's bound) instead of failing at once. Nothing is sent until the first command."""
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=None, **_options(connect_timeout)
    )
    return aioredis.Redis.from_pool(pool)


def servers(address: urls.RedisAddress, *, max_connections: int, connect_timeout: float) -> Servers:
    """The servers ``address`` names (see :mod:`~flowlock.locks.redis.urls`): one server (as
    :func:`connect`), a Sentinel-managed primary or a Redis Cluster. Nothing is sent until the
    first command."""
    if address.kind == "single":
        return Servers(
            connect(address.url, max_connections=max_connections, connect_timeout=connect_timeout)
        )
    options = {
        **_options(connect_timeout),
        "username": address.username,
        "password": address.password,
        "client_name": address.client_name,
    }
    if address.kind == "cluster":
        return Servers(_cluster(address, max_connections, options))
    return _sentinel(address, max_connections, connect_timeout, options)


def _cluster(address: urls.RedisAddress, max_connections: int, options: dict[str, Any]) -> Client:
    # max_connections is per node in a cluster; redis-py's cluster pools do not queue: a burst
    # beyond it fails (MaxConnectionsError, LockUnavailable to the caller).
    return RedisCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in address.hosts],
        max_connections=max_connections,
        **_kwargs_for(RedisCluster, options),
    )


def _sentinel(
    address: urls.RedisAddress,
    max_connections: int,
    connect_timeout: float,
    options: dict[str, Any],
) -> Servers:
    # The sentinels are asked one after another until one names the primary: each question
    # is bounded, so a sentinel that hangs costs one bound and the next one is asked.
    sentinel = _Sentinel(
        address.hosts,
        sentinel_kwargs={
            "socket_timeout": connect_timeout,
            "socket_connect_timeout": connect_timeout,
            "retry": Retry(NoBackoff(), 0),
            "username": address.sentinel_username,
            "password": address.sentinel_password,
            "client_name": address.client_name,
        },
    )
    assert address.service_name is not None
    client = sentinel.master_for(
        address.service_name,
        connection_pool_class=_BlockingSentinelPool,
        max_connections=max_connections,
        timeout=None,
        db=address.db,
        **options,
    )
    return Servers(client, closing=[sentinel.aclose])


def translate(what: str, exc: BaseException, seconds: float) -> LockUnavailable:
    """The flowlock error for driver error ``exc`` raised while doing ``what`` (bounded by
    ``seconds``): nothing was acquired, extended or released by that call."""
    if isinstance(exc, TimeoutError):
        return LockUnavailable(BACKEND, f"{what}: no answer within {seconds:.2f} s")
    advice = ""
    if "no permissions" in str(exc).lower() or "can't run this command" in str(exc).lower():
        # An ACL that denies @dangerous denies INFO, which the acquire script runs to stamp the
        # fencing counter with the server's replication id.
        advice = (
            "; the Redis user needs EVALSHA, SET, GET, INCR, PEXPIRE, PUBLISH, INFO (the acquire "
            "script reads the replication id) and SUBSCRIBE: grant them (e.g. +@scripting +info)"
        )
    return LockUnavailable(BACKEND, f"{what}: {type(exc).__name__}: {exc}{advice}")


async def bounded(what: str, call: Awaitable[T], seconds: float) -> T:
    """Await one Redis call for at most ``seconds``; every driver failure becomes
    LockUnavailable saying ``what`` was being done (:func:`translate`)."""
    try:
        async with asyncio.timeout(seconds):
            return await call
    except DRIVER_ERRORS as exc:
        raise translate(what, exc, seconds) from exc


async def close(servers: Servers, seconds: float) -> None:
    """Close ``servers`` and their connections; a failure to say goodbye on a connection that is
    already broken is nothing the caller can act on, so it is logged, not raised."""
    try:
        await bounded("close", servers.aclose(), seconds)
    except LockUnavailable as exc:
        log.debug("flowlock: closing the Redis client: %s", exc)


def text(value: object) -> str | None:
    """A reply as a string (a client from ``from_client`` may not decode its replies)."""
    if isinstance(value, bytes):
        return value.decode()
    return None if value is None else str(value)
