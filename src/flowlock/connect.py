"""The composition root: the one place that builds concrete stores and lock backends.

:func:`connect` turns URLs into an :class:`~flowlock.engine.Engine` (``Engine.connect`` is the
same function). :func:`build_store` and :func:`build_locks` are its two halves, for callers that
compose differently (the CLI, the benchmark): :func:`build_locks` is the only lock-backend factory.
Concrete backends are imported lazily, so a SQLite-only user never imports asyncpg or redis.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from flowlock.core.errors import InvalidInput
from flowlock.core.settings import (
    DEFAULT_ACQUIRE_TIMEOUT,
    DEFAULT_APPLICATION_NAME,
    DEFAULT_COMMAND_TIMEOUT,
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_LOCK_TIMEOUT,
    DEFAULT_MAX_SIZE,
    DEFAULT_MIN_SIZE,
    POSTGRES_SCHEMES,
    check_application_name,
    check_seconds,
    check_size,
)
from flowlock.engine import (
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_PAYLOAD,
    DEFAULT_SYNC,
    Engine,
    LockKind,
    StrategyConfig,
    _given,
)
from flowlock.locks.base import FenceEpochs, LockBackend
from flowlock.metrics import Metrics
from flowlock.stores.base import Store
from flowlock.strategies.distributed import Distributed
from flowlock.strategies.monitor import ConflictMonitor
from flowlock.strategies.pessimistic import Pessimistic

if TYPE_CHECKING:  # imported when built, so a SQLite-only user never imports asyncpg
    import asyncpg

    from flowlock.stores.postgres import PostgresStore

__all__ = ["build_locks", "build_postgres_store", "build_store", "connect"]

_POSTGRES = POSTGRES_SCHEMES


def _scheme(url: str) -> str:
    return url.partition("://")[0].lower()


def connect(
    database_url: str | None = None,
    *,
    pool: asyncpg.Pool | None = None,
    redis_url: str | None = None,
    locks: LockKind | None = None,
    auto_migrate: bool = True,
    pool_size: int | None = None,
    max_size: int | None = None,
    min_size: int | None = None,
    acquire_timeout: float | None = None,
    connect_timeout: float | None = None,
    command_timeout: float | None = None,
    lock_timeout: float | None = None,
    lease_wait: float | None = None,
    application_name: str | None = None,
    schema: str | None = None,
    namespace: str = "default",
    strategy: str = "optimistic",
    strategies: StrategyConfig | None = None,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD,
    monitor: ConflictMonitor | None = None,
    metrics: Metrics | None = None,
    escalation_sync: float = DEFAULT_SYNC,
    batching: bool = True,
    max_batch: int = DEFAULT_MAX_BATCH,
) -> Engine:
    """An engine over the database at ``database_url``: ``postgresql://...`` (an asyncpg pool,
    tables in ``schema`` if given), ``sqlite:///path`` or ``memory://``; or over an application's
    own asyncpg ``pool``. Open it with ``async with``. Migrations run on open unless
    ``auto_migrate=False``. Every argument is checked before anything is opened (InvalidInput).

    The bounds (None: the default named):

    - ``max_size``: connections the pool opens at most (20; SQLite 4). ``pool_size`` is the same
      keyword under its older name: give either (both, only when they agree).
    - ``min_size``: connections opened up front (1; PostgreSQL only).
    - ``acquire_timeout``: seconds a call waits for a free pool connection, then StoreBusy
      (PostgreSQL 10 s, SQLite 30 s).
    - ``connect_timeout``: seconds opening one connection may take (10 s; PostgreSQL only).
    - ``command_timeout``: seconds one round trip to PostgreSQL may take, on the client's clock,
      beyond the lock wait the server bounds itself (30 s; PostgreSQL only). A statement that
      may wait for a lock gets that wait plus this: ``lock_timeout + command_timeout`` for
      every statement of the store, the pessimistic strategy's ``lock_timeout`` plus this for
      its FOR UPDATE, 60 s plus this for a migration's. Past it (a server paused or cut off by
      the network) the connection is terminated and the call raises ConnectionLost, or
      OutcomeUnknown once a write may have been sent. With ``locks="advisory"`` it is also
      the backend's ``io_timeout`` (10 s when not given).
    - ``lock_timeout``: seconds a write waits for a row lock, then LockTimeout (5 s): the
      preset ``Pessimistic(lock_timeout=...)``'s bound and the store's bound on an optimistic
      compare-and-swap waiting for a row lock's holder (SQLite: its busy timeout).
    - ``lease_wait``: seconds the distributed strategy waits for a lease, then LockTimeout (5 s):
      the preset ``Distributed(wait=...)``'s bound; needs a lock backend.
    - ``application_name``: how the connections show in ``pg_stat_activity`` ("flowlock";
      PostgreSQL only; the advisory-lock backend's pool shows it with "-advisory" after it).

    ``lock_timeout`` and ``lease_wait`` set the presets: a ``Pessimistic`` or ``Distributed``
    given in ``strategies`` carries its own bound, and one that differs from the keyword is
    refused (one wait, one bound).

    ``pool``: an :class:`asyncpg.Pool` the application built. flowlock uses its connections as
    they are (statements with no codec of flowlock's, ``lock_timeout`` and ``schema`` set LOCAL to
    a transaction of its own where a call needs them) and does not close it at ``aclose``. The
    keywords that build a pool (``max_size``/``pool_size``, ``min_size``, ``connect_timeout``,
    ``application_name``) are refused with it; ``database_url`` is then needed only for
    ``locks="advisory"``, whose leases hold connections of their own.

    The "distributed" strategy leases from Redis when ``redis_url`` (``redis://`` or
    ``unix://``) is given, or from PostgreSQL advisory locks with ``locks="advisory"`` (no
    Redis needed); without either it is not available. ``namespace`` separates lock keys of
    unrelated deployments sharing one Redis or database.

    ``strategy``, ``strategies``, ``max_payload_bytes``, ``monitor``, ``metrics``,
    ``escalation_sync``, ``batching`` and ``max_batch`` are the
    :class:`~flowlock.engine.Engine`'s; a ``Distributed()`` given without ``locks=`` leases from
    the backend built here.
    """
    if lease_wait is not None:
        check_seconds("lease_wait", lease_wait, zero=True)
    if not isinstance(batching, bool):
        raise InvalidInput(f"batching must be True or False, not {batching!r}")
    store = build_store(
        database_url,
        pool=pool,
        auto_migrate=auto_migrate,
        schema=schema,
        pool_size=pool_size,
        max_size=max_size,
        min_size=min_size,
        acquire_timeout=acquire_timeout,
        connect_timeout=connect_timeout,
        command_timeout=command_timeout,
        lock_timeout=lock_timeout,
        application_name=application_name,
        pipeline=batching,
    )
    kind = locks if locks is not None else ("redis" if redis_url is not None else None)
    table = _with_bounds(strategies, lock_timeout, lease_wait, has_backend=kind is not None)
    backend = None
    if kind is not None:
        backend = build_locks(
            kind,
            database_url=database_url,
            redis_url=redis_url,
            namespace=namespace,
            schema=schema,
            fence_floor=store.fencing_floor,
            fence_epochs=getattr(store, "fence_epochs", None),
            application_name=(
                _ADVISORY_NAME if application_name is None else f"{application_name}-advisory"[:63]
            ),
            io_timeout=command_timeout,
        )
    return Engine(
        store,
        strategy=strategy,
        strategies=table,
        locks=backend,
        monitor=monitor,
        max_payload_bytes=max_payload_bytes,
        metrics=metrics,
        escalation_sync=escalation_sync,
        batching=batching,
        max_batch=max_batch,
    )


def _with_bounds(
    strategies: StrategyConfig | None,
    lock_timeout: float | None,
    lease_wait: float | None,
    *,
    has_backend: bool,
) -> StrategyConfig | None:
    """``strategies`` with the presets ``lock_timeout`` and ``lease_wait`` configure: a
    ``Pessimistic(lock_timeout=...)`` / ``Distributed(wait=...)`` for a name not given; a given
    one that says otherwise is refused."""
    if lock_timeout is None and lease_wait is None:
        return strategies
    table = dict(_given(strategies))
    if lock_timeout is not None:
        given = table.setdefault("pessimistic", Pessimistic(lock_timeout=lock_timeout))
        if _pessimistic_bound(given, lock_timeout) != lock_timeout:
            raise InvalidInput(
                f"lock_timeout={lock_timeout:g} and Pessimistic(lock_timeout="
                f"{_pessimistic_bound(given, lock_timeout):g}) in strategies= are two bounds for "
                "one wait; give one"
            )
    if lease_wait is not None:
        if "distributed" not in table and not has_backend:
            raise InvalidInput(
                "lease_wait bounds the distributed strategy's wait for a lease, and this engine "
                'has no lock backend: give redis_url=... or locks="advisory" too'
            )
        given = table.setdefault("distributed", Distributed(wait=lease_wait))
        if isinstance(given, Distributed) and given.wait != lease_wait:
            raise InvalidInput(
                f"lease_wait={lease_wait:g} and Distributed(wait={given.wait:g}) in strategies= "
                "are two bounds for one wait; give one"
            )
    return table


def _pessimistic_bound(strategy: object, otherwise: float) -> float:
    """A waiting Pessimistic's lock_timeout; ``otherwise`` for anything else (NOWAIT waits
    for nothing, and a strategy of another kind has no such bound)."""
    if isinstance(strategy, Pessimistic) and not strategy.nowait:
        return strategy.lock_timeout
    return otherwise


def build_store(
    database_url: str | None = None,
    *,
    pool: asyncpg.Pool | None = None,
    auto_migrate: bool = True,
    schema: str | None = None,
    pool_size: int | None = None,
    max_size: int | None = None,
    min_size: int | None = None,
    acquire_timeout: float | None = None,
    connect_timeout: float | None = None,
    command_timeout: float | None = None,
    lock_timeout: float | None = None,
    application_name: str | None = None,
    pipeline: bool = True,
) -> Store:
    """The store for ``database_url``: ``postgresql://`` / ``postgres://`` (asyncpg),
    ``sqlite:///path``, or ``memory://`` (in-process, for tests); or the PostgreSQL store on an
    application's asyncpg ``pool``. The keywords are :func:`connect`'s (None: the store's
    default); one that does not apply to the store asked for is refused. ``pipeline``: the
    PostgreSQL store's (off with ``connect(batching=False)``). Nothing is opened yet."""
    bounds = _Bounds.checked(
        pool_size, max_size, min_size, acquire_timeout, connect_timeout, command_timeout,
        lock_timeout, application_name,
    )  # fmt: skip
    if pool is not None:
        return _on_pool(pool, database_url, bounds, schema=schema, auto_migrate=auto_migrate)
    if database_url is None:
        raise InvalidInput(
            "give a database_url (postgresql://..., sqlite:///path or memory://) or an asyncpg "
            "pool as pool=..."
        )
    if not isinstance(database_url, str):
        raise InvalidInput(
            f"database_url must be a string, not {type(database_url).__name__} (an asyncpg pool "
            "of your own goes in pool=...)"
        )
    scheme = _scheme(database_url)
    if scheme in _POSTGRES:
        return build_postgres_store(
            database_url,
            pool_size=_or(bounds.max_size, DEFAULT_MAX_SIZE),
            min_size=_or(bounds.min_size, DEFAULT_MIN_SIZE),
            schema=schema,
            auto_migrate=auto_migrate,
            application_name=_or(bounds.application_name, DEFAULT_APPLICATION_NAME),
            acquire_timeout=_or(bounds.acquire_timeout, DEFAULT_ACQUIRE_TIMEOUT),
            connect_timeout=_or(bounds.connect_timeout, DEFAULT_CONNECT_TIMEOUT),
            command_timeout=_or(bounds.command_timeout, DEFAULT_COMMAND_TIMEOUT),
            lock_timeout=_or(bounds.lock_timeout, DEFAULT_LOCK_TIMEOUT),
            pipeline=pipeline,
        )
    if scheme == "sqlite":
        from flowlock.stores.sqlite import SqliteStore

        bounds.refuse(
            ("min_size", "connect_timeout", "command_timeout", "application_name"),
            "SQLite (PostgreSQL only)",
        )
        return SqliteStore.from_url(database_url, auto_migrate=auto_migrate, **bounds.sqlite())
    if scheme == "memory":
        from flowlock.stores.memory import MemoryStore

        bounds.refuse(
            (*_POOL_KEYWORDS, "acquire_timeout", "command_timeout"),
            "the memory store (it has no pool)",
        )
        return MemoryStore(lock_timeout=_or(bounds.lock_timeout, DEFAULT_LOCK_TIMEOUT))
    raise InvalidInput(
        f"unsupported database url {database_url.split('@')[-1]!r}: use "
        "postgresql://user@host/db, sqlite:///path/to/file.db or memory://"
    )


_POOL_KEYWORDS = ("max_size", "min_size", "connect_timeout", "application_name")
_ADVISORY_NAME = "flowlock-advisory"
_T = TypeVar("_T")


def _or(value: _T | None, default: _T) -> _T:
    return default if value is None else value


@dataclass(frozen=True, slots=True)
class _Bounds:
    """The store keywords of :func:`connect`, checked; None where not given."""

    max_size: int | None
    min_size: int | None
    acquire_timeout: float | None
    connect_timeout: float | None
    command_timeout: float | None
    lock_timeout: float | None
    application_name: str | None

    @classmethod
    def checked(
        cls,
        pool_size: int | None,
        max_size: int | None,
        min_size: int | None,
        acquire_timeout: float | None,
        connect_timeout: float | None,
        command_timeout: float | None,
        lock_timeout: float | None,
        application_name: str | None,
    ) -> _Bounds:
        if pool_size is not None:
            check_size("pool_size", pool_size)
            if max_size is not None and max_size != pool_size:
                raise InvalidInput(
                    f"pool_size={pool_size} and max_size={max_size}: pool_size is max_size's "
                    "older name, give one of them"
                )
            max_size = pool_size
        if max_size is not None:
            check_size("max_size", max_size)
        if min_size is not None:
            check_size("min_size", min_size, least=0)
            top = _or(max_size, DEFAULT_MAX_SIZE)
            if min_size > top:
                raise InvalidInput(f"min_size={min_size} is above max_size={top}")
        seconds = {
            "acquire_timeout": acquire_timeout,
            "connect_timeout": connect_timeout,
            "command_timeout": command_timeout,
            "lock_timeout": lock_timeout,
        }
        for name, value in seconds.items():
            if value is not None:
                check_seconds(name, value)
        if application_name is not None:
            check_application_name(application_name)
        return cls(max_size, min_size, acquire_timeout, connect_timeout, command_timeout,
                   lock_timeout, application_name)  # fmt: skip

    def given(self, names: tuple[str, ...]) -> list[str]:
        return [name for name in names if getattr(self, name) is not None]

    def refuse(self, names: tuple[str, ...], what: str) -> None:
        """InvalidInput when any of ``names`` was given: it means nothing to ``what``."""
        given = self.given(names)
        if given:
            raise InvalidInput(
                f"{', '.join(given)} {'means' if len(given) == 1 else 'mean'} nothing to {what}; "
                "leave it out"
            )

    def sqlite(self) -> dict[str, Any]:
        """The keywords of :meth:`SqliteStore.from_url` that were given."""
        named = {
            "pool_size": self.max_size,
            "acquire_timeout": self.acquire_timeout,
            "busy_timeout": self.lock_timeout,
        }
        return {name: value for name, value in named.items() if value is not None}


def _on_pool(
    pool: asyncpg.Pool,
    database_url: str | None,
    bounds: _Bounds,
    *,
    schema: str | None,
    auto_migrate: bool,
) -> PostgresStore:
    """The PostgreSQL store on the application's own ``pool``."""
    bounds.refuse(_POOL_KEYWORDS, "pool= (flowlock does not build your pool)")
    if database_url is not None and (
        not isinstance(database_url, str) or _scheme(database_url) not in _POSTGRES
    ):
        raise InvalidInput(
            "with pool=..., database_url may only be the same database's postgresql:// URL "
            '(for locks="advisory"), not a URL of another kind'
        )
    from flowlock.stores.postgres import PostgresStore

    return PostgresStore(
        pool=pool,
        schema=schema,
        auto_migrate=auto_migrate,
        acquire_timeout=_or(bounds.acquire_timeout, DEFAULT_ACQUIRE_TIMEOUT),
        lock_timeout=_or(bounds.lock_timeout, DEFAULT_LOCK_TIMEOUT),
        command_timeout=_or(bounds.command_timeout, DEFAULT_COMMAND_TIMEOUT),
    )


def build_postgres_store(
    database_url: str,
    *,
    pool_size: int = DEFAULT_MAX_SIZE,
    min_size: int = DEFAULT_MIN_SIZE,
    schema: str | None = None,
    auto_migrate: bool = True,
    application_name: str = DEFAULT_APPLICATION_NAME,
    acquire_timeout: float = DEFAULT_ACQUIRE_TIMEOUT,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    command_timeout: float = DEFAULT_COMMAND_TIMEOUT,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
    pipeline: bool = True,
) -> PostgresStore:
    """The PostgreSQL store, typed as such for callers that also use its pool (the benchmark's
    raw floor and read-backs): ``min_size`` connections opened up front, ``application_name``
    shown in ``pg_stat_activity``; the bounds are :func:`connect`'s. Nothing is opened yet."""
    from flowlock.stores.postgres import PostgresStore

    return PostgresStore(
        database_url,
        pool_size=pool_size,
        min_size=min_size,
        schema=schema,
        auto_migrate=auto_migrate,
        application_name=application_name,
        acquire_timeout=acquire_timeout,
        connect_timeout=connect_timeout,
        command_timeout=command_timeout,
        lock_timeout=lock_timeout,
        pipeline=pipeline,
    )


def build_locks(
    kind: LockKind,
    *,
    database_url: str | None = None,
    redis_url: str | None = None,
    namespace: str = "default",
    schema: str | None = None,
    fence_floor: Callable[[str], Awaitable[int]] | None = None,
    fence_epochs: FenceEpochs | None = None,
    pool_size: int = 20,
    auto_migrate: bool = True,
    application_name: str = "flowlock-advisory",
    rng: random.Random | None = None,
    io_timeout: float | None = None,
) -> LockBackend:
    """The lock backend ``kind`` names, not opened yet.

    - ``"redis"``: :class:`~flowlock.locks.redis.RedisLocks` on ``redis_url``;
      ``fence_epochs`` (a PostgreSQL store's) keeps its fencing tokens strictly increasing
      across Redis data losses, ``fence_floor`` (the store's ``fencing_floor``) keeps them above
      the tokens the store recorded (see :mod:`flowlock.locks.redis.fence`);
      ``rng`` jitters its wake-ups (seed it for a reproducible run).
    - ``"advisory"``: :class:`~flowlock.locks.advisory.AdvisoryLocks` on ``database_url``
      (PostgreSQL), tables in ``schema``, a pool of ``pool_size`` connections named
      ``application_name``, migrating on open unless ``auto_migrate=False``, each round trip
      bounded by ``io_timeout`` (None: the backend's default).
    - ``"memory"``: :class:`~flowlock.locks.memory.MemoryLocks` (one process, tests).

    ``namespace`` separates the lock keys of unrelated deployments sharing one server.
    """
    if kind == "redis":
        if redis_url is None:
            raise InvalidInput('locks="redis" needs redis_url="redis://host:6379/0"')
        from flowlock.locks.redis import RedisLocks

        return RedisLocks(
            redis_url,
            namespace=namespace,
            fence_floor=fence_floor,
            fence_epochs=fence_epochs,
            rng=rng,
        )
    if kind == "advisory":
        if database_url is None or _scheme(database_url) not in _POSTGRES:
            raise InvalidInput('locks="advisory" needs a postgresql:// database_url')
        from flowlock.locks.advisory import DEFAULT_IO_TIMEOUT, AdvisoryLocks

        return AdvisoryLocks(
            database_url,
            namespace=namespace,
            schema=schema,
            pool_size=pool_size,
            auto_migrate=auto_migrate,
            application_name=application_name,
            io_timeout=DEFAULT_IO_TIMEOUT if io_timeout is None else io_timeout,
        )
    if kind == "memory":
        from flowlock.locks.memory import MemoryLocks

        return MemoryLocks()
    raise InvalidInput(f'locks must be "redis", "advisory" or "memory", not {kind!r}')
