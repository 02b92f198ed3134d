"""The servers a run uses, the pool size they can take, and cleanup after a run.

Errors on the runner's own connections are translated here into one line, never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from flowlock._pg.errors import DRIVER_ERRORS as PG_DRIVER_ERRORS
from flowlock.bench.config import ADMIN_POOL, ADVISORY_POOL, BenchConfig, redact, service_pool
from flowlock.bench.progress import Progress
from flowlock.bench.registry import STRATEGIES
from flowlock.bench.scenarios import SCENARIOS
from flowlock.core.errors import InvalidInput, StoreError

__all__ = [
    "DRIVER_ERRORS",
    "OWN_APPLICATION_NAME",
    "DatabaseServer",
    "RedisServer",
    "clear_escalation_board",
    "connect",
    "connections_needed",
    "count_connections_from",
    "count_redis_clients_from",
    "count_redis_lock_keys",
    "delete_redis_keys",
    "demand",
    "drop_schema",
    "fit_pool",
    "postgres_server",
    "probe",
    "redis_server",
    "store_error",
    "with_service",
]

_EMBEDDED_MAX_CONNECTIONS = 500
_CONNECTION_HEADROOM = 6  # the sampler, one-off connections, backends still exiting
OWN_APPLICATION_NAME = "flowlock-bench"
"""The application name of the runner's own connections (`connect`): never counted."""

DRIVER_ERRORS = PG_DRIVER_ERRORS
"""What the runner's own plain connections may raise: the PostgreSQL layer's one list."""


def _where(url: str) -> str:
    return redact(url).split("@")[-1]


def store_error(exc: BaseException, url: str, what: str) -> StoreError:
    """A driver error on one of the runner's own connections, as one line naming the server."""
    return StoreError(f"{what} on PostgreSQL at {_where(url)!r}: {exc}")


async def connect(url: str) -> asyncpg.Connection:
    """A plain connection of the runner's own (not counted among the run's connections)."""
    try:
        return await asyncpg.connect(
            url, timeout=10, server_settings={"application_name": OWN_APPLICATION_NAME}
        )
    except DRIVER_ERRORS as exc:
        raise store_error(exc, url, "cannot connect") from exc


# -- the database ------------------------------------------------------------------------------


@dataclass(slots=True)
class DatabaseServer:
    """The database of a run: its URL and kind (`"embedded"` or `"external"`).

    Once probed it also has the version, each session's pool size, and notes for the report.
    """

    url: str
    kind: str
    version: str = ""
    pool_size: int = 0
    notes: list[str] = field(default_factory=list)


@contextlib.asynccontextmanager
async def postgres_server(
    config: BenchConfig,
    progress: Progress,
    *,
    host: str | None = None,
    trusted: Sequence[str] = (),
) -> AsyncIterator[DatabaseServer]:
    """The database to run against: the caller's, or an embedded one.

    An embedded server is stopped on the way out. It listens on `host` (default 127.0.0.1).
    It lets in clients of the `trusted` networks, such as the namespaced hosts' subnet.
    """
    if config.database_url is not None:
        progress.status(f"connecting to {_where(config.database_url)}")
        yield DatabaseServer(config.database_url, "external")
        return
    from flowlock.embedded import EmbeddedPostgres

    progress.status("starting an embedded PostgreSQL")
    wanted = 3 * (config.pool_size or config.workers) + 50
    where: dict[str, Any] = {} if host is None else {"host": host, "trusted_networks": trusted}
    pg = EmbeddedPostgres(max_connections=max(_EMBEDDED_MAX_CONNECTIONS, wanted), **where)
    # Why try/finally around async with: __aexit__ stops the server on errors and on the
    # cancellation Ctrl-C causes; the extra stop() covers a cancel that lands in __aenter__
    # after the server came up (stop() is idempotent).
    try:
        async with pg:
            yield DatabaseServer(pg.url, "embedded")
            progress.status("stopping the embedded PostgreSQL")
    finally:
        await asyncio.to_thread(pg.stop)


def demand(pool: int, advisory: bool) -> int:
    """Connections one process's session may open with a pool of `pool`."""
    if not advisory:
        return pool
    lease = min(ADVISORY_POOL, pool)
    return pool + lease + max(2, min(8, lease // 4))


def connections_needed(pool: int, *, advisory: bool, multi: bool, processes: int) -> int:
    """Connections a run with session pools of `pool` needs at its busiest.

    That is one session here, or `processes` workers sharing the pool plus a small admin pool.
    RunOnce adds a few per process.
    """
    alone = demand(pool, advisory)
    if not multi:
        return alone
    spread = processes * (demand(math.ceil(pool / processes), advisory) + 4) + ADMIN_POOL
    return max(alone, spread)


def with_service(alone: int, pool: int, workers: int) -> int:
    """Connections a `--http` run needs, when the same run without the service needs `alone`.

    The service's pools stay open all run, beside every in-process or admin session.
    """
    service = workers * service_pool(pool, workers)
    return service + max(alone, ADMIN_POOL)


def fit_pool(wanted: int, free: int, needed: Callable[[int], int]) -> int:
    """The largest pool up to `wanted` whose `needed` connections fit in `free`.

    It returns 1 when none fits; the caller then checks `needed(1)` itself.
    """
    pool = wanted
    while pool > 1 and needed(pool) > free:
        pool -= 1
    return pool


_LIMITS = """
SELECT current_setting('max_connections')::int AS max_conn,
       current_setting('superuser_reserved_connections')::int AS su_reserved,
       coalesce(current_setting('reserved_connections', true), '0')::int AS reserved,
       (SELECT count(*) FROM pg_stat_activity
         WHERE backend_type = 'client backend')::int AS used,
       (SELECT rolsuper FROM pg_roles WHERE rolname = current_user) AS superuser
"""


async def _inspect(server: DatabaseServer) -> asyncpg.Record:
    """Read the server version into `server`; return its connection limits."""
    conn = await connect(server.url)
    try:
        # server_version, e.g. "15.20 (Debian 15.20-0+deb12u1)": asyncpg's parsed
        # ServerVersion reads "15.20" as 15.0.20, so take the server's own first word.
        shown = await conn.fetchval("SELECT current_setting('server_version')")
        server.version = str(shown).split()[0]
        row = await conn.fetchrow(_LIMITS)
    except DRIVER_ERRORS as exc:
        raise store_error(exc, server.url, "cannot inspect the server") from exc
    finally:
        await conn.close()
    assert row is not None
    return row


async def probe(server: DatabaseServer, config: BenchConfig) -> None:
    """Read the server version and size the pool to what the server can still accept."""
    row = await _inspect(server)
    reserved = 0 if row["superuser"] else row["su_reserved"] + row["reserved"]
    free = row["max_conn"] - reserved - row["used"] - _CONNECTION_HEADROOM
    advisory = any(STRATEGIES[n].locks == "advisory" for n in config.strategy_names())
    multi = any(config.in_processes(SCENARIOS[n]) for n in config.scenario_names())
    procs = config.process_count()

    def needed(pool: int) -> int:
        alone = connections_needed(pool, advisory=advisory, multi=multi, processes=procs)
        return with_service(alone, pool, config.http_workers) if config.http else alone

    wanted = config.pool_size or config.workers
    pool = fit_pool(wanted, free, needed)
    limits = f"max_connections={row['max_conn']}, {row['used']} in use"
    if needed(pool) > free:
        raise InvalidInput(
            f"the server accepts about {max(free, 0)} more connections "
            f"({limits}); the benchmark needs more; raise max_connections"
        )
    server.pool_size = pool
    if pool < wanted:
        if config.pool_size is not None:
            raise InvalidInput(
                f"the server accepts about {max(free, 0)} more connections "
                f"({limits}), not a pool of "
                f"{wanted} and what goes with it; lower --pool-size or raise max_connections"
            )
        shared = " (the service's as many again, under --http)" if config.http else ""
        server.notes.append(
            f"pool lowered from {wanted} to {pool} connections{shared}: the server allows "
            f"max_connections={row['max_conn']} and {row['used']} are in use; "
            f"{config.workers - pool} callers wait for a pooled connection"
        )


async def drop_schema(url: str, schema: str) -> None:
    """Drop the run's scratch schema and everything in it."""
    conn = await connect(url)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    except DRIVER_ERRORS as exc:
        raise store_error(exc, url, f"cannot drop the scratch schema {schema!r}") from exc
    finally:
        await conn.close()


async def clear_escalation_board(pool: asyncpg.Pool) -> None:
    """Empty the adaptive strategy's escalation board in the run's schema.

    Each pair starts without the previous pair's escalations, as with its fresh pools.
    An escalation outlives its round by its cool-down, and every engine adopts every active one.
    """
    try:
        await pool.execute("DELETE FROM flowlock_escalations")
    except DRIVER_ERRORS as exc:
        raise StoreError(f"cannot empty the escalation board: {exc}") from exc


async def count_connections_from(url: str, addresses: Sequence[str]) -> int:
    """The server's client connections from any of `addresses` (the namespaced hosts')."""
    conn = await connect(url)
    try:
        found = await conn.fetchval(
            "SELECT count(*)::int FROM pg_stat_activity WHERE host(client_addr) = ANY($1::text[])",
            list(addresses),
        )
    except DRIVER_ERRORS as exc:
        raise store_error(exc, url, "cannot count the hosts' connections") from exc
    finally:
        await conn.close()
    return int(found or 0)


# -- Redis -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RedisServer:
    """The Redis of a run: its URL, `"embedded"` or `"external"`, and its version."""

    url: str
    kind: str
    version: str


@contextlib.asynccontextmanager
async def redis_server(
    config: BenchConfig, progress: Progress, needed: bool, *, host: str | None = None
) -> AsyncIterator[RedisServer | None]:
    """Redis for distributed-redis: the caller's, an embedded one, or None.

    An embedded server listens on `host` (default 127.0.0.1) and is removed on the way out.
    None means no strategy needs Redis or none could be started.
    """
    if not needed:
        yield None
        return
    if config.redis_url is not None:
        progress.status(f"connecting to Redis at {_where(config.redis_url)}")
        yield RedisServer(config.redis_url, "external", await _redis_version(config.redis_url))
        return
    from flowlock.embedded import EmbeddedRedis

    if EmbeddedRedis.find_executable() is None:
        yield None
        return
    progress.status("starting an embedded Redis")
    server = EmbeddedRedis() if host is None else EmbeddedRedis(host=host)
    try:
        async with server:
            yield RedisServer(server.url, "embedded", server.version)
            progress.status("stopping the embedded Redis")
    finally:
        await asyncio.to_thread(server.stop)


async def _redis_version(url: str) -> str:
    import redis.asyncio as aioredis
    from redis.exceptions import RedisError

    client = aioredis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
    try:
        info = await client.info("server")
    except (RedisError, OSError) as exc:
        raise StoreError(f"cannot reach Redis at {_where(url)!r}: {exc}") from exc
    finally:
        await client.aclose()
    return str(info.get("redis_version", "?"))


async def delete_redis_keys(url: str, namespace: str) -> None:
    """Delete the run's lock and fencing keys from the caller's Redis."""
    import redis.asyncio as aioredis
    from redis.exceptions import RedisError

    from flowlock.locks.redis import RedisLocks

    pattern = RedisLocks(url, namespace=namespace).key_pattern()
    client = aioredis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
    try:
        batch: list[Any] = []
        async for key in client.scan_iter(match=pattern, count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                await client.delete(*batch)
                batch.clear()
        if batch:
            await client.delete(*batch)
    except (RedisError, OSError) as exc:
        raise StoreError(f"cannot delete the run's Redis keys ({pattern}): {exc}") from exc
    finally:
        await client.aclose()


async def count_redis_lock_keys(url: str, namespace: str) -> int:
    """The lock keys under the run's Redis namespace, not fencing counters or stamps.

    A lock key ends with its hash tag's `}`; the user's key is escaped inside it.
    """
    import redis.asyncio as aioredis
    from redis.exceptions import RedisError

    from flowlock.locks.redis import RedisLocks

    pattern = RedisLocks(url, namespace=namespace).key_pattern()
    client = aioredis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
    try:
        found = 0
        async for key in client.scan_iter(match=pattern, count=1000):
            found += bytes(key).endswith(b"}")
        return found
    except (RedisError, OSError) as exc:
        raise StoreError(f"cannot count the run's Redis lock keys ({pattern}): {exc}") from exc
    finally:
        await client.aclose()


async def count_redis_clients_from(url: str, addresses: Sequence[str]) -> int:
    """Redis's client connections from any of `addresses` (the namespaced hosts')."""
    import redis.asyncio as aioredis
    from redis.exceptions import RedisError

    wanted = set(addresses)
    client = aioredis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
    try:
        clients = await client.client_list()
    except (RedisError, OSError) as exc:
        raise StoreError(f"cannot list Redis's clients at {_where(url)!r}: {exc}") from exc
    finally:
        await client.aclose()
    return sum(1 for c in clients if str(c.get("addr", "")).rpartition(":")[0] in wanted)
