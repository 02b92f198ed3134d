"""One (scenario, strategy) pair of a run: its session, its rounds and its result.

Callers are parked on a gate, then released together. Timing starts at that release.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from flowlock.bench.config import ADMIN_POOL, BenchConfig, Target
from flowlock.bench.host import loop_name
from flowlock.bench.measure import Armed, Sampler, cpu_seconds, sampled
from flowlock.bench.procs import Arm, ArmedReply, Close, Closed, Done, Go, Open, Opened, WorkerPool
from flowlock.bench.progress import Progress
from flowlock.bench.registry import STRATEGIES, StrategySpec
from flowlock.bench.results import (
    HTTP,
    IN_PROCESS,
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
from flowlock.bench.scenarios import Scenario
from flowlock.bench.servers import clear_escalation_board
from flowlock.bench.session import BenchSession, open_session
from flowlock.checker import Verdict

if TYPE_CHECKING:
    from flowlock.bench.extend import HostsRun, ServiceRun

__all__ = ["Pair", "Run", "run_pair", "seeded"]


@dataclass(slots=True)
class Run:
    """What every pair of one run shares."""

    config: BenchConfig
    target: Target
    seed: int
    progress: Progress
    workers: WorkerPool
    hosts: HostsRun | None = None
    service: ServiceRun | None = None
    """The service the `--http` pairs call (None without `--http`)."""


def seeded(seed: int, *parts: object) -> random.Random:
    # One random stream per pair (and round), derived from the run's seed: reruns with --seed
    # replay the same jitter, and adding a scenario does not shift the others' streams.
    return random.Random("/".join(map(str, (seed, *parts))))


# -- one round ---------------------------------------------------------------------------------

_RoundOutcome = tuple[list[CallResult], float, float, float]
"""Every call's result, the seconds from release to the last answer, the lease wait, and the
CPU seconds the calling processes spent meanwhile."""


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
        spent = cpu_seconds(sampler)
        results, wall = await armed.go()
        spent = cpu_seconds(sampler) - spent
    return results, wall, session.lease_wait - leased, spent


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
    # The workers' CPU: they make the calls. This process only waits for their replies.
    return results, wall, lease, sum(reply.cpu for reply in replies)


# -- one pair ----------------------------------------------------------------------------------


@dataclass(slots=True)
class Pair:
    """One (scenario, strategy) pair being run: its session and what its timed rounds recorded."""

    run: Run
    scenario: Scenario
    spec: StrategySpec
    params: Params
    session: BenchSession
    transport: Transport = IN_PROCESS
    callers: WorkerPool | None = None
    """The processes that fire instead of this one or the run's workers (`--http`: the
    load generator)."""
    timed: Timed = field(default_factory=Timed)
    quiet: Timed = field(default_factory=Timed)
    """An emitting scenario's rounds without its messages (`Params.quiet`)."""

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
        self, key: str, n: int, sampler: Sampler | None, *, timed: bool = True, quiet: bool = False
    ) -> None:
        """Set up and fire one round; when `timed`, read it back and record it.

        `sampler` watches the connections while the calls run; None means unwatched. `quiet`:
        an emitting scenario's round without its messages, recorded apart.
        """
        # The same stream for both transports: an --http pair fires the same choices. And for
        # a quiet round and the round with messages after it: the same calls, to compare.
        rng = seeded(self.run.seed, self.scenario.name, self.spec.name, n)
        # The warm-up only fills the pools and the statement caches: one call each.
        shape = self.params if timed else self.params.evolve(ops=1, warmup=True)
        shape = shape.evolve(quiet=quiet)
        plan = await self.scenario.setup(self.session.engine, key, shape, rng)
        if self.callers is not None:
            # Over HTTP the engine's CPU is the service's: the row reports none (cpu_us null).
            results, wall, lease, cpu = await _round_in_processes(self.callers, plan, sampler)
        elif self.run.config.in_processes(self.scenario):
            results, wall, lease, cpu = await _round_in_processes(self.run.workers, plan, sampler)
        else:
            results, wall, lease, cpu = await _round_in_process(
                self.scenario, self.session, plan, sampler
            )
        if not timed:
            return
        finals, histories, extra = await self.scenario.readback(self.session, plan)
        into = self.quiet if quiet else self.timed
        into.records.append(RoundRecord(plan, tuple(results), finals, histories, extra))
        into.wall += wall
        into.lease_wait += lease
        into.cpu += cpu

    async def rounds(self, rounds: int) -> ConnectionStats:
        """Run the warm-up round, then the timed rounds under the sampler.

        The warm-up is skipped when the config says so. Service calls are not sampled:
        the service's connections are not the run's. Returns what the sampler saw.
        """
        run = self.run
        quiet = self.scenario.emits
        if run.config.warms_up():
            # Untimed: fills the pools and every connection's prepared-statement cache (over
            # HTTP also the client's connections and the service's pool); the statements of
            # both kinds of round of an emitting scenario.
            if quiet:
                await self.one_round(f"{self.prefix}-warmup-q", 0, None, timed=False, quiet=True)
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
                if quiet:
                    # Unwatched: the connections figures are the rounds with messages'.
                    await self.one_round(f"{self.prefix}-q{n}", n, None, quiet=True)
                await self.one_round(f"{self.prefix}-r{n}", n, sampler)
                run.progress.advance()
        return sampler.stats()


async def run_pair(run: Run, scenario: Scenario, spec: StrategySpec) -> ScenarioResult:
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
        seeded(run.seed, scenario.name, spec.name),
        pool_size=ADMIN_POOL if multi else None,
        batching=config.batching,
        # The worker processes' engines fire the timers; this one only sets up and reads back.
        timers=not multi,
    ) as session:
        pair = Pair(run, scenario, spec, params, session)
        await clear_escalation_board(session.pool)
        if multi:
            await pair.open_workers()
        # On an error or Ctrl-C no polite close (a worker may be mid-round): the run's exit
        # closes their stdin, and they cancel their calls and close their sessions.
        stats = await pair.rounds(rounds)
        fired: tuple[int, ...] = ()
        if multi:
            closed = await run.workers.ask([Close()] * run.workers.count, Closed)
            counts = (sum(c.escalated for c in closed), sum(c.adopted for c in closed))
            fired = tuple(c.fired for c in closed)
        else:
            monitor = session.engine.monitor
            counts = (monitor.escalations, monitor.adopted)
    run.progress.end()
    result = summarise(
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
    race = scenario.race(pair.timed.records, params, fired)
    result = replace(
        result,
        race=race,
        delivery=scenario.delivery(pair.timed.records),
        capacity=scenario.capacity(pair.timed.records),
    )
    if not pair.quiet.records:
        return result
    without = summarise(
        scenario,
        spec.name,
        params,
        pair.quiet,
        ConnectionStats(),
        loop=loop_name(),
        escalations=None,
    )
    # One verdict for the pair: its rounds without messages are judged too.
    both = Verdict.of([*result.verdict.violations, *without.verdict.violations])
    return replace(result, without=without, verdict=both)
