"""The composition root: the one place that builds concrete stores and lock backends.

:func:`connect` turns URLs into an :class:`~flowlock.engine.Engine` (``Engine.connect`` is the
same function). :func:`build_store` and :func:`build_locks` are its two halves, for callers that
compose differently (the CLI, the benchmark): :func:`build_locks` is the only lock-backend factory.
Concrete backends are imported lazily, so a SQLite-only user never imports asyncpg or redis.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from flowlock.engine import (
    DEFAULT_MAX_PAYLOAD,
    DEFAULT_SYNC,
    Engine,
    LockKind,
    StrategyConfig,
)
from flowlock.errors import InvalidInput
from flowlock.locks.base import LockBackend
from flowlock.metrics import Metrics
from flowlock.stores.base import Store
from flowlock.strategies.monitor import ConflictMonitor

if TYPE_CHECKING:  # imported when built, so a SQLite-only user never imports asyncpg
    from flowlock.stores.postgres import PostgresStore

__all__ = ["build_locks", "build_postgres_store", "build_store", "connect"]

_POSTGRES = ("postgresql", "postgres")


def _scheme(url: str) -> str:
    return url.partition("://")[0].lower()


def connect(
    database_url: str,
    *,
    redis_url: str | None = None,
    locks: LockKind | None = None,
    auto_migrate: bool = True,
    pool_size: int = 20,
    schema: str | None = None,
    namespace: str = "default",
    strategy: str = "optimistic",
    strategies: StrategyConfig | None = None,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD,
    monitor: ConflictMonitor | None = None,
    metrics: Metrics | None = None,
    escalation_sync: float = DEFAULT_SYNC,
) -> Engine:
    """An engine over the database at ``database_url``: ``postgresql://...`` (asyncpg pool of
    ``pool_size``, tables in ``schema`` if given) or ``sqlite:///path``. Open it with
    ``async with``. Migrations run on open unless ``auto_migrate=False``.

    The "distributed" strategy leases from Redis when ``redis_url`` (``redis://`` or
    ``unix://``) is given, or from PostgreSQL advisory locks with ``locks="advisory"`` (no
    Redis needed); without either it is not available. ``namespace`` separates lock keys of
    unrelated deployments sharing one Redis or database.

    ``strategy``, ``strategies``, ``max_payload_bytes``, ``monitor``, ``metrics`` and
    ``escalation_sync`` are the :class:`~flowlock.engine.Engine`'s; a ``Distributed()`` given
    without ``locks=`` leases from the backend built here.
    """
    store = build_store(database_url, auto_migrate=auto_migrate, pool_size=pool_size, schema=schema)
    kind = locks if locks is not None else ("redis" if redis_url is not None else None)
    backend = None
    if kind is not None:
        backend = build_locks(
            kind,
            database_url=database_url,
            redis_url=redis_url,
            namespace=namespace,
            schema=schema,
            fence_floor=store.fencing_floor,
        )
    return Engine(
        store,
        strategy=strategy,
        strategies=strategies,
        locks=backend,
        monitor=monitor,
        max_payload_bytes=max_payload_bytes,
        metrics=metrics,
        escalation_sync=escalation_sync,
    )


def build_store(
    database_url: str, *, auto_migrate: bool = True, pool_size: int = 20, schema: str | None = None
) -> Store:
    """The store for ``database_url``: ``postgresql://`` / ``postgres://`` (asyncpg),
    ``sqlite:///path``, or ``memory://`` (in-process, for tests). Nothing is opened yet."""
    if not isinstance(database_url, str):
        raise InvalidInput(f"database_url must be a string, not {type(database_url).__name__}")
    scheme = _scheme(database_url)
    if scheme in _POSTGRES:
        return build_postgres_store(
            database_url, pool_size=pool_size, schema=schema, auto_migrate=auto_migrate
        )
    if scheme == "sqlite":
        from flowlock.stores.sqlite import SqliteStore

        return SqliteStore.from_url(database_url, auto_migrate=auto_migrate)
    if scheme == "memory":
        from flowlock.stores.memory import MemoryStore

        return MemoryStore()
    raise InvalidInput(
        f"unsupported database url {database_url.split('@')[-1]!r}: use "
        "postgresql://user@host/db, sqlite:///path/to/file.db or memory://"
    )


def build_postgres_store(
    database_url: str,
    *,
    pool_size: int = 20,
    min_size: int = 1,
    schema: str | None = None,
    auto_migrate: bool = True,
    application_name: str = "flowlock",
) -> PostgresStore:
    """The PostgreSQL store, typed as such for callers that also use its pool (the benchmark's
    raw floor and read-backs): ``min_size`` connections opened up front, ``application_name``
    shown in ``pg_stat_activity``. Nothing is opened yet."""
    from flowlock.stores.postgres import PostgresStore

    return PostgresStore(
        database_url,
        pool_size=pool_size,
        min_size=min_size,
        schema=schema,
        auto_migrate=auto_migrate,
        application_name=application_name,
    )


def build_locks(
    kind: LockKind,
    *,
    database_url: str | None = None,
    redis_url: str | None = None,
    namespace: str = "default",
    schema: str | None = None,
    fence_floor: Callable[[str], Awaitable[int]] | None = None,
    pool_size: int = 20,
    auto_migrate: bool = True,
    application_name: str = "flowlock-advisory",
    rng: random.Random | None = None,
) -> LockBackend:
    """The lock backend ``kind`` names, not opened yet.

    - ``"redis"``: :class:`~flowlock.locks.redis.RedisLocks` on ``redis_url``; ``fence_floor``
      (the store's ``fencing_floor``) floors its fencing tokens after Redis lost its data;
      ``rng`` jitters its wake-ups (seed it for a reproducible run).
    - ``"advisory"``: :class:`~flowlock.locks.advisory.AdvisoryLocks` on ``database_url``
      (PostgreSQL), tables in ``schema``, a pool of ``pool_size`` connections named
      ``application_name``, migrating on open unless ``auto_migrate=False``.
    - ``"memory"``: :class:`~flowlock.locks.memory.MemoryLocks` (one process, tests).

    ``namespace`` separates the lock keys of unrelated deployments sharing one server.
    """
    if kind == "redis":
        if redis_url is None:
            raise InvalidInput('locks="redis" needs redis_url="redis://host:6379/0"')
        from flowlock.locks.redis import RedisLocks

        return RedisLocks(redis_url, namespace=namespace, fence_floor=fence_floor, rng=rng)
    if kind == "advisory":
        if database_url is None or _scheme(database_url) not in _POSTGRES:
            raise InvalidInput('locks="advisory" needs a postgresql:// database_url')
        from flowlock.locks.advisory import AdvisoryLocks

        return AdvisoryLocks(
            database_url,
            namespace=namespace,
            schema=schema,
            pool_size=pool_size,
            auto_migrate=auto_migrate,
            application_name=application_name,
        )
    if kind == "memory":
        from flowlock.locks.memory import MemoryLocks

        return MemoryLocks()
    raise InvalidInput(f'locks must be "redis", "advisory" or "memory", not {kind!r}')
