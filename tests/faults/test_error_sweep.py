"""The public API swept while its connections are killed at random points: only flowlock errors
ever escape, no connection is left behind, and every history stays exactly once.

For about 25 seconds (``FLOWLOCK_SWEEP_SECONDS``) many tasks and two threads call a random mix of
the public API: ``Engine`` create / get / fire / history / list / count under every strategy
(optimistic, pessimistic, adaptive, distributed on Redis and on advisory locks),
``flowlock.sync.Engine``, ``AdvisoryLocks`` and ``RedisLocks`` used on their own (acquire,
extend, owned, locked, wait_released, release, ``async with``), and ``RunOnce.run``. Meanwhile a
chaos task, at random moments, ends some or all of this test's PostgreSQL sessions
(``pg_terminate_backend``, the FATAL message a restart or a failover sends; only sessions whose
``application_name`` this test set), kills Redis connections (``CLIENT KILL``) and restarts the
test's own Redis, with or without its data. It injects each kind of fault once early on, so
every kind is sure to happen; the test fails unless each kind hit something (a session filter
that stopped matching would end nothing, and the sweep would be a plain load test) and unless
the calls saw the typed errors those faults cause (``ConnectionLost`` or ``OutcomeUnknown`` from
the store, ``SessionGone`` from the advisory locks, ``LockUnavailable`` from ``RedisLocks``).

Every exception a call raises is collected; one that is not a FlowlockError fails the test,
printed with its traceback, and so does a flowlock warning logged with an untyped exception
(the lease watchdog and the escalation sync keep going after one, so it would not escape). Once
the chaos stops, every call that failed is retried with its request id until it answers (a
retry of a call that was in fact applied answers ``idempotent=True``), then the checker runs
over every instance's history with the number of calls that were applied, the history's request
ids are compared with those calls, each job tick is reported run at most once, every pool is
back to idle, and after ``aclose`` no session of this test is left on the server.

The randomness is seeded (``FLOWLOCK_SWEEP_SEED``, else a fresh seed); the seed is printed.

A second test restarts a PostgreSQL of its own (``EmbeddedPostgres.restart()``) under the same kind
of load.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import random
import time
import traceback
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import pytest
import redis.asyncio as aioredis
from redis.exceptions import RedisError

import flowlock
import flowlock.sync
import pg_budget
from flowlock import examples
from flowlock.checker import check
from flowlock.embedded import EmbeddedPostgres, EmbeddedRedis
from flowlock.jobs import RunOnce
from flowlock.locks.advisory import AdvisoryLocks
from flowlock.locks.base import LockBackend
from flowlock.locks.redis import RedisLocks
from lock_probes import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

SECONDS = float(os.environ.get("FLOWLOCK_SWEEP_SECONDS", "25"))
WORKERS = 16
THREADS = 2
DOCS = 8  # countersign documents every worker signs (hot keys: contention on purpose)
QUORUM = 10**6  # never reached: every signature is one applied transition
STRATEGIES = ("optimistic", "pessimistic", "adaptive", "distributed")
SETTLE = 60.0  # bound on the quiet phase: calls retried until they answer


@dataclass
class Call:
    """One logical fire: its instance, event and request id, and what its tries answered:
    ``applied`` (a try answered ``applied=True``), ``idempotent`` (a try answered
    ``idempotent=True``: an earlier try of it was applied, or, for an approval, another call
    already made the same decision), ``refused`` (the event did not apply: nothing written),
    ``failures`` (tries that raised something else)."""

    instance_id: str
    event: str
    request_id: str
    applied: bool = False
    idempotent: bool = False
    refused: bool = False
    failures: int = 0

    @property
    def answered(self) -> bool:
        return self.applied or self.idempotent or self.refused


@dataclass
class Sweep:
    """What the sweep saw: every exception by type, the untyped ones with their traceback, the
    fires, the job ticks answered as run."""

    rng: random.Random
    deadline: float
    errors: Counter[str] = field(default_factory=Counter)
    untyped: list[str] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    tickets: set[str] = field(default_factory=set)
    runs: Counter[str] = field(default_factory=Counter)
    ops: Counter[str] = field(default_factory=Counter)
    seen: Counter[tuple[str, str]] = field(default_factory=Counter)  # (call, error) -> times
    injected: Counter[str] = field(default_factory=Counter)  # fault -> times injected
    chaos: Counter[str] = field(default_factory=Counter)  # fault -> sessions, clients... it hit

    def running(self) -> bool:
        return time.monotonic() < self.deadline

    def record(self, what: str, exc: BaseException) -> None:
        """A call raised ``exc``: counted if it is a flowlock error, kept with its traceback if
        not."""
        if isinstance(exc, flowlock.FlowlockError) and type(exc).__module__.startswith("flowlock."):
            self.errors[type(exc).__name__] += 1
            self.seen[what, type(exc).__name__] += 1
        else:
            trace = "".join(traceback.format_exception(exc))
            self.untyped.append(f"{what}: {type(exc).__module__}.{type(exc).__name__}\n{trace}")


@contextlib.contextmanager
def caught(sweep: Sweep, what: str) -> Iterator[None]:
    """Run the block as one public call: what it raises is recorded, never propagated (but a
    cancellation is)."""
    sweep.ops[what] += 1
    try:
        yield
    except asyncio.CancelledError:
        raise
    except BaseException as exc:
        sweep.record(what, exc)


class UntypedLogs(logging.Handler):
    """flowlock's log records that carry an exception that is not a flowlock error: a failure
    a background task (lease watchdog, escalation sync, Redis listener) swallowed untranslated."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.found: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            if not isinstance(exc, flowlock.FlowlockError):
                trace = "".join(traceback.format_exception(exc))
                self.found.append(f"logged: {record.getMessage()}\n{trace}")


@pytest.fixture
def untyped_logs() -> Iterator[UntypedLogs]:
    handler = UntypedLogs()
    logger = logging.getLogger("flowlock")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


@pytest.fixture
def seed() -> int:
    """The sweep's seed: FLOWLOCK_SWEEP_SEED, else a fresh one (printed, to replay a failure)."""
    value = int(os.environ.get("FLOWLOCK_SWEEP_SEED") or random.SystemRandom().randrange(2**32))
    print(f"\nerror sweep seed: {value} (replay with FLOWLOCK_SWEEP_SEED={value})")
    return value


@pytest.fixture
def app() -> str:
    """The application_name prefix of every PostgreSQL session this test opens."""
    return f"flowlock-sweep-{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def own_redis() -> AsyncIterator[EmbeddedRedis]:
    """A Redis of this test's own, to restart and kill connections of at will."""
    server = EmbeddedRedis()
    await server.open()
    try:
        yield server
    finally:
        await server.aclose()


# -- the system under test ------------------------------------------------------------------


@dataclass
class System:
    """Everything the sweep calls, built on one database schema and one Redis."""

    engines: dict[str, flowlock.Engine]  # "redis" (distributed on Redis), "advisory"
    sync: flowlock.sync.Engine
    advisory: AdvisoryLocks
    redis: RedisLocks
    runner: RunOnce

    @property
    def backends(self) -> dict[str, LockBackend]:
        return {"advisory": self.advisory, "redis": self.redis}


@contextlib.asynccontextmanager
async def build(
    pg_url: str, schema: str, redis_url: str, app: str, namespace: str
) -> AsyncIterator[System]:
    """Every engine, backend and runner of the sweep, open; closed on the way out (also when
    building fails half-way)."""
    # Short bounds everywhere: a call against a dead server must fail soon, typed.
    bounds: dict[str, Any] = {
        "schema": schema,
        "namespace": namespace,
        "max_size": 8,
        "acquire_timeout": 5.0,
        "connect_timeout": 5.0,
        "lock_timeout": 2.0,
        "lease_wait": 2.0,
        "escalation_sync": 0.2,
    }
    async with contextlib.AsyncExitStack() as stack:
        engines: dict[str, flowlock.Engine] = {}
        backends: tuple[tuple[str, dict[str, Any]], ...] = (
            ("redis", {"redis_url": redis_url}),
            ("advisory", {"locks": "advisory"}),
        )
        for name, backend in backends:
            engine = flowlock.Engine.connect(
                pg_url, application_name=f"{app}-{name[0]}", **backend, **bounds
            )
            engines[name] = await stack.enter_async_context(engine)
            for wf in (examples.countersign(QUORUM), examples.approval()):
                await engine.register(wf)
        sync = flowlock.sync.Engine.connect(
            pg_url, locks="advisory", application_name=f"{app}-s", **{**bounds, "max_size": 4}
        )
        stack.push_async_callback(asyncio.to_thread, sync.close)
        await asyncio.to_thread(sync.open)
        await asyncio.to_thread(sync.register, examples.countersign(QUORUM))
        advisory = AdvisoryLocks(
            pg_url,
            schema=schema,
            namespace=f"{namespace}-own",
            pool_size=8,
            io_timeout=3.0,
            connect_timeout=5.0,
            application_name=f"{app}-l",
        )
        await stack.enter_async_context(advisory)
        redis_locks = RedisLocks(redis_url, namespace=f"{namespace}-own", socket_timeout=1.0)
        await stack.enter_async_context(redis_locks)
        runner = RunOnce(
            redis_locks,
            pg_url,
            schema=schema,
            ttl=2.0,
            acquire_timeout=5.0,
            application_name=f"{app}-j",
        )
        await stack.enter_async_context(runner)
        yield System(engines, sync, advisory, redis_locks, runner)


# -- the calls --------------------------------------------------------------------------------


async def fire(system: System, sweep: Sweep, rng: random.Random, n: int) -> None:
    """Sign a hot document (or close / reopen an approval) under a random strategy on a random
    engine, once; a failed call is left for the quiet phase to retry."""
    engine = system.engines[rng.choice(list(system.engines))]
    strategy = rng.choice(STRATEGIES)
    if sweep.tickets and rng.random() < 0.2:
        call = Call(rng.choice(sorted(sweep.tickets)), rng.choice(["approve", "reject"]), f"t{n}")
    else:
        call = Call(f"doc-{rng.randrange(DOCS)}", "sign", f"s{n}")
    sweep.calls.append(call)
    with caught(sweep, f"fire/{strategy}"):
        await _try(engine, call, strategy)


async def _try(engine: flowlock.Engine, call: Call, strategy: str | None = None) -> None:
    try:
        outcome = await engine.fire(
            call.instance_id,
            call.event,
            actor=call.request_id,
            request_id=call.request_id,
            strategy=strategy,
        )
    except flowlock.TransitionRefused:
        call.refused = True
        raise
    except BaseException:
        call.failures += 1
        raise
    call.applied |= outcome.applied
    call.idempotent |= outcome.idempotent


async def read(system: System, sweep: Sweep, rng: random.Random) -> None:
    """One of the reads, on a random engine."""
    engine = system.engines[rng.choice(list(system.engines))]
    kind = rng.choice(["get", "history", "list", "count", "create"])
    with caught(sweep, kind):
        if kind == "get":
            await engine.get(f"doc-{rng.randrange(DOCS)}")
        elif kind == "history":
            await engine.history(f"doc-{rng.randrange(DOCS)}")
        elif kind == "list":
            page = await engine.list("countersign", state="pending", limit=5)
            if page.next_cursor is not None:
                await engine.list("countersign", state="pending", after=page.next_cursor)
        elif kind == "count":
            await engine.count("countersign")
        else:
            iid = f"ticket-{uuid.uuid4().hex[:8]}"
            await _create(engine, iid, sweep)


async def _create(engine: flowlock.Engine, iid: str, sweep: Sweep) -> None:
    await engine.create("approval", instance_id=iid)
    sweep.tickets.add(iid)  # only once created: a create whose answer was lost has no history


async def lock(system: System, sweep: Sweep, rng: random.Random) -> None:
    """One use of a lock backend on its own, as an application would: held with ``async
    with``, or acquired, extended and released by hand (released in ``finally``)."""
    name = rng.choice(list(system.backends))
    locks = system.backends[name]
    key = f"key-{rng.randrange(6)}"
    ttl, wait = rng.choice([0.6, 1.0, 2.0]), rng.choice([0.0, 0.2, 1.0])
    kind = rng.choice(["with", "by-hand", "look"])
    with caught(sweep, f"lock/{name}/{kind}"):
        if kind == "with":
            async with locks.acquire(key, ttl=ttl, wait=wait) as held:
                await asyncio.sleep(rng.uniform(0, ttl))
                await locks.owned(held.lease)
                held.check()
        elif kind == "by-hand":
            lease = await locks.acquire(key, ttl=ttl, wait=wait)
            try:
                await asyncio.sleep(rng.uniform(0, ttl / 2))
                if rng.random() < 0.7:
                    lease = await locks.extend(lease, ttl)
                await asyncio.sleep(rng.uniform(0, ttl / 2))
            finally:
                await locks.release(lease)
        else:
            await locks.locked(key)
            await locks.wait_released(key, rng.uniform(0, 0.3))


async def job(system: System, sweep: Sweep, rng: random.Random) -> None:
    """One RunOnce.run of a random tick; a tick answered "ran" or "took_over" is counted."""
    tick = str(rng.randrange(30))

    async def work(ctx: flowlock.jobs.JobContext) -> str:
        await asyncio.sleep(rng.uniform(0, 0.2))
        return tick

    with caught(sweep, "job"):
        result = await system.runner.run("sweep", tick, work)
        if result.status in ("ran", "took_over"):
            sweep.runs[tick] += 1


async def worker(system: System, sweep: Sweep, rng: random.Random, first: int) -> None:
    n = first
    while sweep.running():
        n += 1
        roll = rng.random()
        if roll < 0.45:
            await fire(system, sweep, rng, n)
        elif roll < 0.7:
            await read(system, sweep, rng)
        elif roll < 0.92:
            await lock(system, sweep, rng)
        else:
            await job(system, sweep, rng)


def sync_worker(system: System, sweep: Sweep, rng: random.Random, first: int) -> None:
    """The blocking engine, in a thread of its own: signatures, reads and counts."""
    n = first
    while sweep.running():
        n += 1
        kind = rng.choice(["fire", "get", "count", "history"])
        with caught(sweep, f"sync/{kind}"):
            if kind == "fire":
                call = Call(f"doc-{rng.randrange(DOCS)}", "sign", f"y{n}")
                sweep.calls.append(call)
                try:
                    outcome = system.sync.fire(
                        call.instance_id, "sign", actor=call.request_id, request_id=call.request_id
                    )
                except BaseException:
                    call.failures += 1
                    raise
                call.applied |= outcome.applied
                call.idempotent |= outcome.idempotent
            elif kind == "get":
                system.sync.get(f"doc-{rng.randrange(DOCS)}")
            elif kind == "count":
                system.sync.count("countersign")
            else:
                system.sync.history(f"doc-{rng.randrange(DOCS)}")


# -- the chaos ----------------------------------------------------------------------------------


async def end_sessions(admin: asyncpg.Connection, app: str, rng: random.Random, every: bool) -> int:
    """End some (or all) of this test's sessions; how many."""
    pids = await _sessions(admin, app)
    if not every:
        pids = rng.sample(pids, k=min(len(pids), rng.randint(1, 4)))
    for pid in pids:
        await admin.fetchval("SELECT pg_terminate_backend($1)", pid)
    return len(pids)


async def _sessions(admin: asyncpg.Connection, app: str) -> list[int]:
    rows = await admin.fetch(
        "SELECT pid FROM pg_stat_activity WHERE application_name LIKE $1 || '%' "
        "AND pid <> pg_backend_pid()",
        app,
    )
    return [r["pid"] for r in rows]


def end_sessions_unnoticed(url: str, app: str, seed: int, every: bool) -> int:
    """End some (or all) of this test's sessions and wait until the server has ended them,
    blocking the calling thread (the event loop of the sweep) all along, on a connection and a
    loop of its own: the sweep's connections have not read the server's FATAL message when
    their next call starts, as when calls come right after a restart (the case in which asyncpg
    raised InternalClientError, "cannot switch to state 15", to callers)."""

    async def run() -> int:
        admin = await pg_budget.connect(url)
        try:
            pids = await _sessions(admin, app)
            if not every:
                pids = random.Random(seed).sample(pids, k=min(len(pids), 4))
            for pid in pids:
                await admin.fetchval("SELECT pg_terminate_backend($1)", pid)
            alive = "SELECT count(*) FROM pg_stat_activity WHERE pid = any($1::int[])"
            deadline = time.monotonic() + 30
            while await admin.fetchval(alive, pids):
                assert time.monotonic() < deadline, "the terminated sessions did not end"
                await asyncio.sleep(0.01)
            return len(pids)
        finally:
            await admin.close()

    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        return thread.submit(asyncio.run, run()).result()


async def kill_clients(admin: aioredis.Redis, rng: random.Random, every: bool) -> int:
    """Kill some (or all) Redis connections but the admin's own; how many."""
    try:
        me = await admin.client_id()
        clients = [c for c in await admin.client_list() if int(c["id"]) != me]
    except RedisError:  # the admin's own connection went with a restart: it reconnects next time
        return 0
    if not every:
        clients = rng.sample(clients, k=min(len(clients), rng.randint(1, 3)))
    killed = 0
    for client in clients:
        with contextlib.suppress(RedisError):  # gone by itself meanwhile
            await admin.client_kill_filter(_id=client["id"])
            killed += 1
    return killed


# The faults and each one's share of the chaos task's picks (after it has injected each once).
FAULTS = {
    "pg sessions ended": 0.3,
    "pg every session ended": 0.1,
    "pg sessions ended unnoticed": 0.15,
    "redis clients killed": 0.3,
    "redis restarted": 0.105,
    "redis restarted empty": 0.045,
}


@dataclass
class Faults:
    """What the chaos task can do; each answers how many sessions or clients it hit."""

    pg: Callable[[bool], Awaitable[int]]  # end some (False) or all (True) of the test's sessions
    unnoticed: Callable[[bool], int]  # the same, blocking the sweep's loop meanwhile
    redis_kill: Callable[[bool], Awaitable[int]]
    redis_restart: Callable[[bool], Awaitable[None]]  # True: with its data flushed
    pg_restart: Callable[[], Awaitable[None]] | None = None

    @property
    def shares(self) -> dict[str, float]:
        return FAULTS if self.pg_restart is None else {**FAULTS, "pg restarted": 0.06}

    async def inject(self, fault: str, rng: random.Random) -> int:
        """Inject ``fault``: how many sessions or clients it ended (a restart counts 1)."""
        if fault == "pg sessions ended":
            return await self.pg(False)
        if fault == "pg every session ended":
            return await self.pg(True)
        if fault == "pg sessions ended unnoticed":
            # Blocks this loop meanwhile (see end_sessions_unnoticed), on purpose.
            return self.unnoticed(rng.random() < 0.3)
        if fault == "redis clients killed":
            return await self.redis_kill(rng.random() < 0.2)
        if fault == "pg restarted":
            assert self.pg_restart is not None
            await self.pg_restart()
            return 1
        await self.redis_restart(fault == "redis restarted empty")
        return 1


async def chaos(sweep: Sweep, rng: random.Random, faults: Faults) -> None:
    """Every kind of fault once, early, in a seeded order; then faults picked at random."""
    shares = faults.shares
    first = sorted(shares)
    rng.shuffle(first)
    while sweep.running():
        await asyncio.sleep(rng.uniform(0.05, 0.5))
        fault = first.pop() if first else rng.choices(list(shares), list(shares.values()))[0]
        sweep.injected[fault] += 1
        sweep.chaos[fault] += await faults.inject(fault, rng)


def assert_faults_hit(sweep: Sweep, faults: Faults) -> None:
    """Every kind of fault was injected and hit something (a session filter that stopped
    matching would end nothing), and the calls saw the typed errors those faults cause."""
    for fault in faults.shares:
        assert sweep.injected[fault] >= 1, f"{fault!r} never injected: a sweep too short?"
        assert sweep.chaos[fault] >= 1, (
            f"{fault!r} injected {sweep.injected[fault]} times and hit nothing: does its filter "
            "still match this test's sessions or clients?"
        )

    def seen(error: str, where: str = "") -> int:
        return sum(n for (what, name), n in sweep.seen.items() if name == error and where in what)

    # A PostgreSQL session ended under a call of the store, and under an advisory lock.
    assert seen("ConnectionLost") + seen("OutcomeUnknown") >= 1, sweep.errors
    assert seen("SessionGone") >= 1, sweep.errors
    # Redis went away under a call of RedisLocks used on its own.
    assert seen("LockUnavailable", "lock/redis") >= 1, sorted(sweep.seen.items())


# -- after the chaos ------------------------------------------------------------------------------


async def settle(system: System, sweep: Sweep) -> None:
    """Retry every call that did not answer, with its request id, until it does: each ends
    applied (now, or idempotent because an earlier try was applied) or refused."""
    engine = system.engines["redis"]
    deadline = time.monotonic() + SETTLE
    for call in sweep.calls:
        while not call.answered:
            try:
                await _try(engine, call, "pessimistic")
            except flowlock.TransitionRefused:
                pass
            except (flowlock.StoreError, flowlock.ConcurrencyError):
                assert time.monotonic() < deadline, f"{call} still fails after the chaos"
                await asyncio.sleep(0.05)


async def assert_exactly_once(system: System, sweep: Sweep) -> None:
    """Every instance's history is exactly once, and holds exactly the calls that were applied:
    each call answered ``applied=True``, and each answered ``idempotent=True`` for its own
    request id after a try of it failed (that try was applied, its answer lost)."""
    engine = system.engines["redis"]
    calls: dict[str, dict[str, Call]] = defaultdict(dict)
    for call in sweep.calls:
        calls[call.instance_id][call.request_id] = call
    instances = {f"doc-{i}" for i in range(DOCS)} | sweep.tickets
    for iid in sorted(instances):
        inst = await engine.get(iid)
        history = await engine.history(iid)
        recorded = {e.request_id for e in history if e.request_id is not None}
        assert len(recorded) == len(history), f"{iid}: a row without a request id"
        mine = calls[iid]
        assert recorded <= set(mine), f"{iid}: rows of no call: {recorded - set(mine)}"
        for rid in recorded:
            call = mine[rid]
            assert call.applied or call.idempotent, f"{iid}: a row for a refused call {call}"
            if not call.applied:
                assert call.failures, f"{iid}: idempotent with no earlier try: {call}"
        expected = [c for c in mine.values() if c.applied or c.request_id in recorded]
        verdict = check(inst, history, expected_applied=len(expected))
        assert verdict.ok, verdict.violations
        lost = {c.request_id for c in mine.values() if c.applied} - recorded
        assert not lost, f"{iid}: applied calls missing from the history: {lost}"
    twice = {tick: n for tick, n in sweep.runs.items() if n > 1}
    assert not twice, f"job ticks answered as run more than once: {twice}"


def assert_idle(system: System) -> None:
    """Every pool is back to idle: no connection is still checked out, no lease still held."""
    for name, engine in system.engines.items():
        pool = engine.store.pool  # type: ignore[attr-defined]
        assert pool.get_idle_size() == pool.get_size() <= pool.get_max_size(), name
    for locks in (system.advisory, system.engines["advisory"].locks):
        assert isinstance(locks, AdvisoryLocks)
        bulk = locks._bulk
        assert not locks._slots and not locks._pending and not len(bulk or ()), locks
        # The bulk path's holder sessions stay checked out for the backend's life (holding no
        # key now); any other connection out would be a leak.
        holders = 0 if bulk is None else len(bulk._holders)
        pools = locks._pools()
        assert all(pool.get_size() <= pool.get_max_size() for pool in pools), locks
        out = [(pool.get_size(), pool.get_idle_size()) for pool in pools]
        assert sum(size - idle for size, idle in out) == holders, (locks, out, holders)


async def sessions_left(pg_url: str, app: str) -> int:
    conn = await pg_budget.connect(pg_url)
    try:
        found = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE $1 || '%'", app
        )
        return int(found)
    finally:
        await conn.close()


async def run_sweep(system: System, seed: int, faults: Faults) -> Sweep:
    """The load and the chaos for SECONDS; then the quiet phase's retries."""
    master = random.Random(seed)
    sweep = Sweep(master, time.monotonic() + SECONDS)
    loop_errors: list[str] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, context: loop_errors.append(repr(context)))
    rngs = [random.Random(master.randrange(2**32)) for _ in range(WORKERS + THREADS + 1)]
    tasks = [
        asyncio.create_task(worker(system, sweep, rngs[i], i * 1_000_000)) for i in range(WORKERS)
    ]
    tasks += [
        asyncio.create_task(
            asyncio.to_thread(sync_worker, system, sweep, rngs[WORKERS + i], (100 + i) * 10**6)
        )
        for i in range(THREADS)
    ]
    tasks.append(asyncio.create_task(chaos(sweep, rngs[-1], faults)))
    # Every call is bounded (acquire_timeout, lock_timeout, lease waits, io timeouts): the
    # workers end soon after the deadline.
    async with asyncio.timeout(SECONDS + 120):
        await asyncio.gather(*tasks)
    await settle(system, sweep)
    loop.set_exception_handler(None)
    assert not loop_errors, loop_errors
    return sweep


def report(sweep: Sweep, untyped_logs: UntypedLogs, faults: Faults) -> None:
    """Prints what the sweep did; fails on an untyped error, or on a fault that hit nothing."""
    print(f"calls: {sum(sweep.ops.values())} {dict(sorted(sweep.ops.items()))}")
    print(f"typed errors: {dict(sorted(sweep.errors.items()))}")
    print(f"faults injected: {dict(sorted(sweep.injected.items()))}")
    print(f"faults hit (sessions, clients, restarts): {dict(sorted(sweep.chaos.items()))}")
    print(f"fires: {len(sweep.calls)}, applied {sum(c.applied for c in sweep.calls)}")
    faulted = ("ConnectionLost", "OutcomeUnknown", "SessionGone", "LockUnavailable")
    where = {
        f"{what}: {name}": n for (what, name), n in sorted(sweep.seen.items()) if name in faulted
    }
    print(f"where the faults' errors were seen: {where}")
    untyped = sweep.untyped + untyped_logs.found
    for text in untyped:
        print(text)
    assert not untyped, f"{len(untyped)} untyped errors escaped (printed above)"
    assert_faults_hit(sweep, faults)


async def test_only_flowlock_errors_escape_while_connections_are_killed(
    pg_url: str,
    pg_schema: str,
    own_redis: EmbeddedRedis,
    app: str,
    seed: int,
    untyped_logs: UntypedLogs,
) -> None:
    """Every public call, under random ends of this test's PostgreSQL sessions, Redis
    connection kills and Redis restarts, raises only FlowlockError subclasses; afterwards
    every call answers on retry, every history is exactly once, no pool holds a connection and
    no session is left on the server."""
    async with contextlib.AsyncExitStack() as stack:
        system = await stack.enter_async_context(
            build(pg_url, pg_schema, own_redis.url, app, pg_schema)
        )
        admin = await pg_budget.connect(pg_url)
        stack.push_async_callback(admin.close)
        redis_admin = aioredis.Redis.from_url(own_redis.url, decode_responses=True)
        stack.push_async_callback(redis_admin.aclose)
        for i in range(DOCS):
            await system.engines["redis"].create("countersign", instance_id=f"doc-{i}")

        async def pg(every: bool) -> int:
            return await end_sessions(admin, app, sweep_rng, every)

        async def redis_kill(every: bool) -> int:
            return await kill_clients(redis_admin, sweep_rng, every)

        async def redis_restart(flush: bool) -> None:
            await asyncio.to_thread(own_redis.restart, keep_data=not flush)

        def unnoticed(every: bool) -> int:
            return end_sessions_unnoticed(pg_url, app, sweep_rng.randrange(2**32), every)

        sweep_rng = random.Random(seed ^ 0x5EED)
        faults = Faults(pg, unnoticed, redis_kill, redis_restart)
        sweep = await run_sweep(system, seed, faults)
        report(sweep, untyped_logs, faults)
        await assert_exactly_once(system, sweep)
        await wait_until(lambda: _idle(system), within=30, what="every pool back to idle")
    await wait_until(
        lambda: _none_left(pg_url, app), within=30, what="every session of the test ended"
    )


def _idle(system: System) -> bool:
    assert_idle(system)  # wait_until counts its AssertionError as "not yet" and reports the last
    return True


async def _none_left(pg_url: str, app: str) -> bool:
    return await sessions_left(pg_url, app) == 0


# -- a PostgreSQL restart ----------------------------------------------------------------------


async def _close_quietly(conn: asyncpg.Connection) -> None:
    with contextlib.suppress(asyncpg.InterfaceError, OSError):
        await conn.close()


async def test_only_flowlock_errors_escape_while_postgresql_restarts(
    own_redis: EmbeddedRedis, app: str, seed: int, untyped_logs: UntypedLogs
) -> None:
    """The same sweep on a PostgreSQL of the test's own that is restarted at random moments
    (and its sessions ended between restarts): only FlowlockError subclasses escape, every
    call answers afterwards, every history is exactly once, nothing is left behind."""
    async with EmbeddedPostgres(max_connections=200) as server:
        url = server.url
        schema = "sweep"
        rng = random.Random(seed ^ 0xFA11)
        restarts: list[float] = []
        async with contextlib.AsyncExitStack() as stack:
            system = await stack.enter_async_context(build(url, schema, own_redis.url, app, schema))
            admin_box: list[asyncpg.Connection] = [await pg_budget.connect(url)]
            stack.push_async_callback(lambda: _close_quietly(admin_box[0]))
            redis_admin = aioredis.Redis.from_url(own_redis.url, decode_responses=True)
            stack.push_async_callback(redis_admin.aclose)
            for i in range(DOCS):
                await system.engines["redis"].create("countersign", instance_id=f"doc-{i}")

            async def pg(every: bool) -> int:
                return await end_sessions(admin_box[0], app, rng, every)

            async def pg_restart() -> None:
                await asyncio.to_thread(server.restart)
                restarts.append(time.monotonic())
                admin_box[0] = await pg_budget.connect(url)

            async def redis_kill(every: bool) -> int:
                return await kill_clients(redis_admin, rng, every)

            async def redis_restart(flush: bool) -> None:
                await asyncio.to_thread(own_redis.restart, keep_data=not flush)

            def unnoticed(every: bool) -> int:
                return end_sessions_unnoticed(url, app, rng.randrange(2**32), every)

            faults = Faults(pg, unnoticed, redis_kill, redis_restart, pg_restart)
            sweep = await run_sweep(system, seed, faults)
            print(f"PostgreSQL restarts: {len(restarts)}")
            report(sweep, untyped_logs, faults)
            assert restarts
            await assert_exactly_once(system, sweep)
            await wait_until(lambda: _idle(system), within=30, what="every pool back to idle")
        await wait_until(lambda: _none_left(url, app), within=30, what="every session ended")
