"""The keywords of `Engine()` and `connect()`, each defined once.

`Engine`, `flowlock.sync.Engine` and every `connect` take them with `Unpack`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal, TypeAlias, TypedDict

if TYPE_CHECKING:  # types only: this module imports nothing at run time
    from datetime import timedelta

    import asyncpg

    from flowlock.core.settings import PoolingChoice
    from flowlock.locks.base import LockBackend
    from flowlock.metrics import Metrics
    from flowlock.strategies.monitor import ConflictMonitor
    from flowlock.strategies.table import StrategyConfig

__all__ = [
    "DEFAULT_MAX_BATCH",
    "DEFAULT_SYNC",
    "MAX_BATCH",
    "ConnectOptions",
    "EngineOptions",
    "LockKind",
    "check_keywords",
]

DEFAULT_SYNC = 0.5
"""Seconds between two escalation-sync rounds, unless `escalation_sync`."""

DEFAULT_MAX_BATCH = 256
"""The most calls on one instance decided and written together, unless `max_batch`."""

MAX_BATCH = 10_000

LockKind: TypeAlias = Literal["redis", "advisory", "memory"]
"""`connect(locks=...)`: the lock backend the "distributed" strategy leases from."""


class _Tuning(TypedDict, total=False):
    """How an engine runs calls: the keywords `Engine()` and `connect()` share."""

    strategy: str
    """The default strategy's name ("optimistic")."""
    strategies: StrategyConfig | None
    """Strategy objects, e.g. `[Optimistic(max_attempts=5)]`; presets fill the other names."""
    monitor: ConflictMonitor | None
    """The adaptive strategy's monitor: threshold, window, what it escalates to."""
    max_payload_bytes: int
    """The largest payload or data, as compact JSON (64 KiB)."""
    metrics: Metrics | None
    """Prometheus metrics to record on; nothing is recorded without it."""
    escalation_sync: float
    """Seconds between sharing escalations with other engines (0.5)."""
    batching: bool
    """Apply concurrent calls on one instance together (True)."""
    max_batch: int
    """The most calls in one batch (256)."""
    timers: bool
    """Run the timer service, which fires timed transitions when due (True). False: this engine
    only takes calls; timers still arm, and other engines fire them."""
    timer_lease: float
    """Seconds a claimed timer is this engine's before another may fire it (30)."""
    timer_batch: int
    """The most timer firings this engine has in flight at once (64)."""
    outbox: bool
    """Run the outbox dispatcher once a handler is registered (`on_emit`) (True). False: this
    engine never delivers; messages are still written, and other engines deliver them."""
    outbox_lease: float
    """Seconds a claimed message is this engine's before another may deliver it again (60);
    more than any handler's timeout."""
    outbox_retention: timedelta | None
    """How long done messages are kept before the dispatcher deletes them (7 days); None
    keeps them."""
    outbox_backoff: tuple[float, float]
    """Seconds before the first retry of a failed delivery, and the cap the doubling wait
    stops at ((1.0, 300.0)); each wait is a random part of that (full jitter)."""


class EngineOptions(_Tuning, total=False):
    """The keywords of `Engine(store, ...)` and `flowlock.sync.Engine(store, ...)`."""

    locks: LockBackend | None
    """The lock backend of the "distributed" strategy."""


class ConnectOptions(_Tuning, total=False):
    """The keywords of `connect(database_url, ...)`, `Engine.connect` and the sync one's.

    `None` means the default named. Every keyword is checked before anything opens.
    """

    pool: asyncpg.Pool | None
    """An application's asyncpg pool, used as it is and never closed by flowlock."""
    redis_url: str | None
    """Lease from Redis: `redis://`, `unix://`, `redis+sentinel://`, `redis+cluster://`."""
    locks: LockKind | None
    """Which lock backend the "distributed" strategy leases from ("redis" with redis_url)."""
    auto_migrate: bool
    """Create or upgrade flowlock's tables on open (True)."""
    max_size: int | None
    """Connections the pool opens at most (20; SQLite 4)."""
    min_size: int | None
    """Connections opened up front (1; PostgreSQL only)."""
    acquire_timeout: float | None
    """Seconds a call waits for a free connection, then StoreBusy (10; SQLite 30)."""
    connect_timeout: float | None
    """Seconds opening one connection may take (10; PostgreSQL only)."""
    command_timeout: float | None
    """Seconds one round trip may take beyond a lock wait (30; PostgreSQL only)."""
    lock_timeout: float | None
    """Seconds a write waits for a row lock, then LockTimeout (5)."""
    lease_wait: float | None
    """Seconds the distributed strategy waits for a lease, then LockTimeout (5)."""
    application_name: str | None
    """The name in `pg_stat_activity` ("flowlock")."""
    schema: str | None
    """The PostgreSQL schema of flowlock's tables (the search path's first)."""
    namespace: str
    """Separates lock keys of deployments that share one server ("default")."""
    pooling: PoolingChoice | None
    """What sits between flowlock and PostgreSQL: "auto" (found out on open), "session" (direct
    or session pooling) or "transaction" (PgBouncer pool_mode=transaction). PostgreSQL only."""


def check_keywords(given: Mapping[str, object], allowed: type, where: str) -> None:
    """TypeError for a keyword `allowed` (a TypedDict) does not name, as Python would."""
    keys: frozenset[str] = getattr(allowed, "__optional_keys__", frozenset())
    for name in given:
        if name not in keys:
            raise TypeError(
                f"{where} got an unexpected keyword argument {name!r}; "
                f"it takes {', '.join(sorted(keys))}"
            )
