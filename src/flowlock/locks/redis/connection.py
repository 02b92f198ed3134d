"""The redis-py client a backend opens, and the one place driver errors are translated.

Every call is bounded by `socket_timeout`, and while acquiring by what is left of
`wait`. Any failure raises LockUnavailable; at release the key simply expires. redis-py's
retries are off: a retried compare-and-delete that had landed would report LockNotOwned.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
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
    "log_late_failure",
    "millis",
    "servers",
    "text",
    "translate",
]

T = TypeVar("T")

log = logging.getLogger("flowlock")

BACKEND = "redis"  # the backend's name, in leases and in LockUnavailable


def _redis_errors() -> tuple[type[BaseException], ...]:
    """Every exception class redis-py defines, found from their roots.

    Not all derive from RedisError: the cluster client's errors and ChildDeadlockedError
    stand alone. Read from the module, so classes a later redis-py adds are caught too.
    """
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
    """The client for commands, a fresh pub/sub per `pubsub`, and what `aclose` closes.

    One server and Sentinel use the client's own pub/sub connection. With Sentinel it asks
    for the primary on each connect, so the listener follows a failover. A cluster
    broadcasts a classic PUBLISH to every node, so one subscription on any node hears every
    release. Each new subscription tries the next known node, passing over dead ones.
    """

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
    """The keywords of `kwargs` that connection class `cls` takes.

    A cluster node's kwargs carry the cluster client's own too, which a plain connection refuses.
    """
    names: set[str] = set()
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is not None:
            names.update(inspect.signature(init).parameters)
    return {name: value for name, value in kwargs.items() if name in names and name != "self"}


class _Sentinel(Sentinel):
    """redis-py's Sentinel, safe to ask from many tasks at once.

    redis-py reorders its sentinel list by index across an await. Concurrent discoveries then
    overwrite each other: a sentinel drops out for good and its client is never closed. Here
    the list is reordered by identity, between awaits, and closing closes every client.
    """

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
    """A Sentinel primary's pool that queues a burst of callers.

    It waits for a connection, as the one-server pool does, instead of failing at
    `max_connections`.
    """


def _kwargs_for(cls: type, options: Mapping[str, Any]) -> dict[str, Any]:
    """`options` without those a redis-py of this version does not take."""
    parameters = inspect.signature(cls).parameters
    return {name: value for name, value in options.items() if name in parameters}


def _options(connect_timeout: float) -> dict[str, Any]:
    # No socket_timeout in redis-py. With one, it bounds each write with asyncio.wait_for, which on
    # Python 3.11 can swallow a cancellation. A lease watchdog would then renew forever. bounded()
    # bounds every call instead; the connect keeps its own bound. No retries: a retried compare-and-
    # delete that had landed would report LockNotOwned.
    return {
        "socket_timeout": None,
        "socket_connect_timeout": connect_timeout,
        "retry": Retry(NoBackoff(), 0),
        "decode_responses": True,
        **_no_maintenance_probe(),
    }


def connect(url: str, *, max_connections: int, connect_timeout: float) -> aioredis.Redis:
    """One server's client (`redis://`, `rediss://`, `unix://`) on a blocking pool.

    Callers beyond `max_connections` queue, within each call's bound, instead of failing.
    Nothing is sent until the first command.
    """
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=None, **_options(connect_timeout)
    )
    return aioredis.Redis.from_pool(pool)


def servers(address: urls.RedisAddress, *, max_connections: int, connect_timeout: float) -> Servers:
    """The servers `address` names: one server, a Sentinel primary or a Redis Cluster.

    See `urls` for the URLs. Nothing is sent until the first command.
    """
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
    """The flowlock error for driver error `exc`, raised while doing `what`.

    `seconds` is the call's bound. That call acquired, extended or released nothing.
    """
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
    """Await one Redis call for at most `seconds`.

    Every driver failure becomes LockUnavailable saying `what` was being done.
    """
    try:
        async with asyncio.timeout(seconds):
            return await call
    except DRIVER_ERRORS as exc:
        raise translate(what, exc, seconds) from exc


async def close(servers: Servers, seconds: float) -> None:
    """Close `servers` and their connections.

    A failed goodbye on a broken connection is logged, not raised: the caller cannot act on it.
    """
    try:
        await bounded("close", servers.aclose(), seconds)
    except LockUnavailable as exc:
        log.debug("flowlock: closing the Redis client: %s", exc)


def millis(seconds: float) -> int:
    """`seconds` as a Redis ttl in milliseconds, rounded up: the server may keep the key a
    hair longer than the local deadline, never less."""
    return max(1, math.ceil(seconds * 1000))


def log_late_failure(task: asyncio.Future[Any]) -> None:
    """A done callback for a release left to finish after its caller was cancelled."""
    if not task.cancelled() and task.exception() is not None:
        log.warning(
            "flowlock: a release finished after its caller was cancelled and failed: %s",
            task.exception(),
        )


def text(value: object) -> str | None:
    """A reply as a string (a client from `from_client` may not decode its replies)."""
    if isinstance(value, bytes):
        return value.decode()
    return None if value is None else str(value)
