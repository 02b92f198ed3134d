"""The benchmark matrix on namespaced hosts (`--hosts`) and through HTTP (`--http`).

flowlock's runner takes `LAB` and calls back into it; `run` passes it.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from flowlock.bench import runner
from flowlock.bench.config import ADMIN_POOL, BenchConfig, Target, service_pool
from flowlock.bench.host import cores, loop_name
from flowlock.bench.pairs import Pair, Run, seeded
from flowlock.bench.procs import WORKER_ARGV, Close, Closed, Open, Opened, WorkerPool
from flowlock.bench.progress import Progress
from flowlock.bench.registry import STRATEGIES, StrategySpec
from flowlock.bench.results import HTTP, BenchReport, ScenarioResult, summarise
from flowlock.bench.scenarios import Scenario
from flowlock.bench.servers import (
    DatabaseServer,
    RedisServer,
    clear_escalation_board,
    count_connections_from,
    count_redis_clients_from,
)
from flowlock.bench.session import open_session
from flowlock_lab.hosts import NamespacedHosts
from flowlock_lab.http import Service, check_http_support, running_service

__all__ = ["LAB", "LabParts", "OnHosts", "ThroughService", "run", "run_bench"]

_SETTLE = 5.0  # seconds for the servers to see the closed workers' sockets go


class OnHosts:
    """A run's namespaced hosts: where its workers run, and what they left behind."""

    def __init__(self, hosts: NamespacedHosts, progress: Progress) -> None:
        self.hosts = hosts
        self.progress = progress
        self.left: dict[str, int] | None = None

    @property
    def count(self) -> int:
        return self.hosts.count

    @property
    def server_address(self) -> str:
        return self.hosts.server_address

    @property
    def trusted(self) -> tuple[str, ...]:
        return (str(self.hosts.plan.subnet),)

    def worker_pool(self, count: int) -> WorkerPool:
        on = [self.hosts.plan.host_for(p) for p in range(count)]
        return WorkerPool(
            count,
            commands=[h.command(WORKER_ARGV) for h in on],
            labels=[f"host h{h.index}, {h.ip}, namespace {h.netns}" for h in on],
        )

    async def close(
        self, workers: WorkerPool, server: DatabaseServer, redis: RedisServer | None
    ) -> None:
        self.progress.status("closing the workers and counting what they left on the hosts")
        await workers.aclose()
        self.left = await self._left(server, redis)

    async def _left(self, server: DatabaseServer, redis: RedisServer | None) -> dict[str, int]:
        """Processes in the namespaces, and connections and Redis clients from the hosts.

        All are 0 when clean. While any is left it looks again for a few seconds.
        A server notices a closed socket a moment after its process exits.
        """
        addresses = [h.ip for h in self.hosts.hosts]
        deadline = time.monotonic() + _SETTLE
        while True:
            pids = await asyncio.to_thread(self.hosts.pids)
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

    def args(self) -> dict[str, Any]:
        return {**self.hosts.describe(), "left": self.left}

    def notes(self) -> list[str]:
        notes = list(self.hosts.notes)
        if self.left and any(self.left.values()):
            shown = ", ".join(f"{n} {what.replace('_', ' ')}" for what, n in self.left.items() if n)
            notes.append(f"left behind by the hosts' closed workers: {shown}")
        return notes


class ThroughService:
    """A run's `flowlock serve`, and how a pair runs through it."""

    def __init__(self, config: BenchConfig, service: Service, load: WorkerPool) -> None:
        self.config = config
        self.service = service
        self.load = load
        """The load generator: one process of its own (`flowlock_lab.http_load`)."""

    def args(self) -> dict[str, Any]:
        return {
            "http_service": self.service.to_json(),
            "http_client": {
                "library": "flowlock_lab.http_load (HTTP/1.1 on plain asyncio streams)",
                "clients": "one keep-alive connection per caller",
                "callers": self.config.workers,
                "connections": self.config.workers,
                "process": "a load generator of its own, on the same cores as the service and "
                "PostgreSQL",
            },
        }

    def note(self) -> str:
        return (
            f"--http: {self.config.workers} callers in a load generator process of their own "
            f"and the service's {self.service.workers} worker process(es) share this machine's "
            f"{cores()} cores with PostgreSQL; the generator costs little per request, but on a "
            "shared machine every figure is noisy"
        )

    async def run_pair(self, run: Run, scenario: Scenario, spec: StrategySpec) -> ScenarioResult:
        """The same rounds, each call an HTTP request by one of `workers` callers.

        Each caller has its own client. Setup and readback use a small admin session here.
        """
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
                seeded(run.seed, scenario.name, spec.name),
                pool_size=ADMIN_POOL,
                batching=config.batching,
            ) as admin,
        ):
            # An empty escalation board, as for every pair: the service's adaptive engine would
            # otherwise adopt what its in-process twin escalated a moment before.
            await clear_escalation_board(admin.pool)
            name = f"{run.seed}/{scenario.name}/{spec.name}/http"
            opened = Open(run.target, 1, scenario.name, spec.name, params, name)
            await self.load.ask([opened], Opened)
            pair = Pair(run, scenario, spec, params, admin, transport=HTTP, callers=self.load)
            stats = await pair.rounds(rounds)
            await self.load.ask([Close()], Closed)
        run.progress.end()
        return summarise(
            scenario, spec.name, params, pair.timed, stats, loop=loop_name(), transport=HTTP
        )


class LabParts:
    """What the lab gives flowlock's runner (the shape of `flowlock.bench.extend.Lab`)."""

    def check(self, config: BenchConfig) -> None:
        if config.http:
            check_http_support()

    @asynccontextmanager
    async def hosts(self, config: BenchConfig, progress: Progress) -> AsyncIterator[OnHosts]:
        assert config.hosts is not None
        progress.status(f"creating {config.hosts} namespaced hosts")
        async with NamespacedHosts(config.hosts, delay_ms=config.netem_delay_ms) as hosts:
            yield OnHosts(hosts, progress)

    @asynccontextmanager
    async def service(
        self, config: BenchConfig, target: Target, pool_size: int, progress: Progress
    ) -> AsyncIterator[ThroughService]:
        async with running_service(
            target,
            workers=config.http_workers,
            pool_size=service_pool(pool_size, config.http_workers),
            progress=progress,
        ) as service:
            load = WorkerPool(
                1,
                commands=[[sys.executable, "-m", "flowlock_lab.http_load", service.base_url]],
                labels=["the HTTP load generator"],
            )
            progress.status("starting the HTTP load generator")
            await load.start()
            try:
                yield ThroughService(config, service, load)
            finally:
                await load.aclose()


LAB = LabParts()


async def run_bench(config: BenchConfig, progress: Progress | None = None) -> BenchReport:
    """`flowlock.bench.run_bench` with the lab: `hosts` and `http` work."""
    return await runner.run_bench(config, progress, lab=LAB)


def run(config: BenchConfig, progress: Progress | None = None) -> BenchReport:
    """`flowlock.bench.run` with the lab: `hosts` and `http` work."""
    return runner.run(config, progress, lab=LAB)
