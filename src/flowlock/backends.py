"""The composition of backends: URLs and options in, a store and lock backend out.

The only module that builds concrete stores and lock backends. It imports each one when
it is asked for, so a SQLite user never imports asyncpg or redis.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

from flowlock.core.errors import InvalidInput
from flowlock.core.extras import require
from flowlock.core.settings import (
    DEFAULT_ACQUIRE_TIMEOUT,
    DEFAULT_APPLICATION_NAME,
    DEFAULT_COMMAND_TIMEOUT,
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_LOCK_TIMEOUT,
    DEFAULT_MAX_SIZE,
    DEFAULT_MIN_SIZE,
    POSTGRES_SCHEMES,
    PoolingChoice,
    check_application_name,
    check_flag,
    check_pooling,
    check_seconds,
    check_size,
)
from flowlock.locks.base import FenceEpochs, LockBackend
from flowlock.options import ConnectOptions, EngineOptions, LockKind, check_keywords
from flowlock.stores.base import Store
from flowlock.strategies.table import with_bounds

if TYPE_CHECKING:  # imported when built, so a SQLite-only user never imports asyncpg
    import asyncpg

    from flowlock.stores.postgres import PostgresStore

__all__ = ["build_locks", "build_postgres_store", "build_store", "compose"]

_POSTGRES = POSTGRES_SCHEMES


def _scheme(url: str) -> str:
    return url.partition("://")[0].lower()


def compose(database_url: str | None, options: ConnectOptions) -> tuple[Store, EngineOptions]:
    """The store `options` describe, and the engine's own keywords.

    Every keyword is checked here, once, before anything is opened.
    """
    check_keywords(options, ConnectOptions, "connect()")
    lease_wait = options.get("lease_wait")
    if lease_wait is not None:
        check_seconds("lease_wait", lease_wait, zero=True)
    batching = options.get("batching", True)
    check_flag("batching", batching)
    schema = options.get("schema")
    pooling = options.get("pooling")
    store = build_store(
        database_url,
        pool=options.get("pool"),
        auto_migrate=options.get("auto_migrate", True),
        schema=schema,
        max_size=options.get("max_size"),
        min_size=options.get("min_size"),
        acquire_timeout=options.get("acquire_timeout"),
        connect_timeout=options.get("connect_timeout"),
        command_timeout=options.get("command_timeout"),
        lock_timeout=options.get("lock_timeout"),
        application_name=options.get("application_name"),
        pipeline=batching,
        pooling=pooling,
    )
    redis_url = options.get("redis_url")
    kind = options.get("locks") or ("redis" if redis_url is not None else None)
    engine = _engine_options(options)
    engine["strategies"] = with_bounds(
        options.get("strategies"),
        options.get("lock_timeout"),
        lease_wait,
        has_backend=kind is not None,
    )
    epochs = getattr(store, "fence_epochs", None)
    if kind == "advisory" or (kind == "redis" and epochs is not None):
        _needs_session(store, kind)
    if kind is not None:
        name = options.get("application_name")
        engine["locks"] = build_locks(
            kind,
            database_url=database_url,
            redis_url=redis_url,
            namespace=options.get("namespace", "default"),
            schema=schema,
            fence_floor=store.fencing_floor,
            fence_epochs=epochs,
            application_name=_ADVISORY_NAME if name is None else f"{name}-advisory"[:63],
            io_timeout=options.get("command_timeout"),
            pooling=pooling or "auto",
        )
    return store, engine


def _needs_session(store: Store, kind: LockKind) -> None:
    """The advisory locks, or the PostgreSQL store's fencing epochs lent to the Redis lock
    backend, need a session: the store, which opens first, refuses a transaction pooler, before
    anything is written."""
    from flowlock._pg.fence import EPOCHS
    from flowlock.locks.advisory.backend import NEEDS_SESSION
    from flowlock.stores.postgres import PostgresStore

    if isinstance(store, PostgresStore):
        store.needs_session(NEEDS_SESSION if kind == "advisory" else EPOCHS)


def _engine_options(options: ConnectOptions) -> EngineOptions:
    """The keywords of `options` that the engine itself takes (its lock backend apart)."""
    shared = EngineOptions.__optional_keys__ - {"locks"}
    return cast(EngineOptions, {k: v for k, v in options.items() if k in shared})


def build_store(
    database_url: str | None = None,
    *,
    pool: asyncpg.Pool | None = None,
    auto_migrate: bool = True,
    schema: str | None = None,
    max_size: int | None = None,
    min_size: int | None = None,
    acquire_timeout: float | None = None,
    connect_timeout: float | None = None,
    command_timeout: float | None = None,
    lock_timeout: float | None = None,
    application_name: str | None = None,
    pipeline: bool = True,
    pooling: PoolingChoice | None = None,
) -> Store:
    """The store for `database_url`, not opened yet.

    `postgresql://` or `postgres://` (asyncpg), `sqlite:///path`, or `memory://` for
    tests. Or the PostgreSQL store on an application's asyncpg `pool`. The keywords are
    [`connect`][flowlock.connect]'s, None meaning the store's default. A keyword that does not apply
    to this store is refused. `pipeline` is the PostgreSQL store's; `batching=False` turns
    it off. So is `pooling` (None: "auto").
    """
    bounds = _Bounds.checked(
        max_size, min_size, acquire_timeout, connect_timeout, command_timeout, lock_timeout,
        application_name,
    )  # fmt: skip
    choice = "auto" if pooling is None else check_pooling(pooling)
    if pool is not None:
        return _on_pool(
            pool, database_url, bounds, schema=schema, auto_migrate=auto_migrate, pooling=choice
        )
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
            pooling=choice,
        )
    if pooling is not None:
        raise InvalidInput("pooling means nothing to SQLite or the memory store; leave it out")
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
    """The store keywords of [`connect`][flowlock.connect], checked; None where not given."""

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
        max_size: int | None,
        min_size: int | None,
        acquire_timeout: float | None,
        connect_timeout: float | None,
        command_timeout: float | None,
        lock_timeout: float | None,
        application_name: str | None,
    ) -> _Bounds:
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
        """InvalidInput when any of `names` was given: it means nothing to `what`."""
        given = self.given(names)
        if given:
            raise InvalidInput(
                f"{', '.join(given)} {'means' if len(given) == 1 else 'mean'} nothing to {what}; "
                "leave it out"
            )

    def sqlite(self) -> dict[str, Any]:
        """The keywords of `SqliteStore.from_url` that were given."""
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
    pooling: PoolingChoice,
) -> PostgresStore:
    """The PostgreSQL store on the application's own `pool`."""
    require("asyncpg", "postgres", "a PostgreSQL pool")
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
        pooling=pooling,
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
    pooling: PoolingChoice = "auto",
) -> PostgresStore:
    """The PostgreSQL store, typed as such for callers that use its pool.

    The benchmark's raw floor and read-backs need that. `min_size` connections open up
    front; `application_name` shows in `pg_stat_activity`. The bounds are
    [`connect`][flowlock.connect]'s. Nothing is opened yet.
    """
    require("asyncpg", "postgres", "a postgresql:// database URL")
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
        pooling=pooling,
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
    pooling: PoolingChoice = "auto",
) -> LockBackend:
    """The lock backend `kind` names, not opened yet.

    - `"redis"`: [`RedisLocks`][flowlock.locks.redis.RedisLocks] on `redis_url`.
      `fence_epochs` keeps tokens increasing across Redis data losses. `fence_floor`
      keeps them above the tokens the store recorded. `rng` jitters wake-ups; seed it to
      reproduce a run.
    - `"advisory"`: [`AdvisoryLocks`][flowlock.locks.advisory.AdvisoryLocks] on PostgreSQL
      `database_url`. Tables in `schema`, a pool of `pool_size` named
      `application_name`, migrated on open unless `auto_migrate=False`. `io_timeout`
      bounds each round trip; None is the backend's default. `pooling`: see
      `AdvisoryLocks` (refused behind a transaction pooler).
    - `"memory"`: [`MemoryLocks`][flowlock.locks.memory.MemoryLocks], for one process and tests.

    `namespace` separates the lock keys of deployments sharing one server.
    """
    if kind == "redis":
        if redis_url is None:
            raise InvalidInput('locks="redis" needs redis_url="redis://host:6379/0"')
        require("redis", "redis", "redis_url=")
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
        require("asyncpg", "postgres", 'locks="advisory"')
        from flowlock.locks.advisory import DEFAULT_IO_TIMEOUT, AdvisoryLocks

        return AdvisoryLocks(
            database_url,
            namespace=namespace,
            schema=schema,
            pool_size=pool_size,
            auto_migrate=auto_migrate,
            application_name=application_name,
            io_timeout=DEFAULT_IO_TIMEOUT if io_timeout is None else io_timeout,
            pooling=pooling,
        )
    if kind == "memory":
        from flowlock.locks.memory import MemoryLocks

        return MemoryLocks()
    raise InvalidInput(f'locks must be "redis", "advisory" or "memory", not {kind!r}')
