"""What a run under `--hosts` or `--http` takes from the lab (`flowlock_lab`).

flowlock's bench knows the lab only by these shapes: it never imports it. The lab
passes an object of this shape to `flowlock.bench.runner.run_bench`.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Protocol

from flowlock.core.install import lab_install

if TYPE_CHECKING:
    from flowlock.bench.config import BenchConfig, Target
    from flowlock.bench.pairs import Run
    from flowlock.bench.procs import WorkerPool
    from flowlock.bench.progress import Progress
    from flowlock.bench.registry import StrategySpec
    from flowlock.bench.results import ScenarioResult
    from flowlock.bench.scenarios import Scenario
    from flowlock.bench.servers import DatabaseServer, RedisServer

__all__ = ["LAB_MISSING", "HostsRun", "Lab", "ServiceRun"]

LAB_MISSING = (
    f"--hosts, --http and --soak run in flowlock's lab, which is not installed: {lab_install()}"
)
"""The one line a run that needs the lab says when it is not installed."""


class HostsRun(Protocol):
    """The namespaced hosts of a `--hosts` run, while they exist."""

    @property
    def count(self) -> int: ...

    @property
    def server_address(self) -> str:
        """Where the servers listen: the bridge's address, reachable from every host."""
        ...

    @property
    def trusted(self) -> tuple[str, ...]:
        """The networks PostgreSQL lets in without a password."""
        ...

    def worker_pool(self, count: int) -> WorkerPool:
        """`count` worker processes, round robin over the hosts."""
        ...

    async def close(
        self, workers: WorkerPool, server: DatabaseServer, redis: RedisServer | None
    ) -> None:
        """Close the workers, then count what they left on the hosts."""
        ...

    def args(self) -> dict[str, Any]:
        """The report's `hosts` argument."""
        ...

    def notes(self) -> list[str]: ...


class ServiceRun(Protocol):
    """The `flowlock serve` of an `--http` run, while it runs."""

    def args(self) -> dict[str, Any]:
        """What the report states about the service and its HTTP clients."""
        ...

    def note(self) -> str: ...

    async def run_pair(self, run: Run, scenario: Scenario, spec: StrategySpec) -> ScenarioResult:
        """The pair again, every call an HTTP request to the service."""
        ...


class Lab(Protocol):
    """What the lab adds to a run: hosts for the workers, and a service to call."""

    def check(self, config: BenchConfig) -> None:
        """Refuse what this machine cannot run, before any server starts."""
        ...

    def hosts(
        self, config: BenchConfig, progress: Progress
    ) -> AbstractAsyncContextManager[HostsRun]: ...

    def service(
        self, config: BenchConfig, target: Target, pool_size: int, progress: Progress
    ) -> AbstractAsyncContextManager[ServiceRun]: ...
