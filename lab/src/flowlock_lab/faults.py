"""The soak's fault injector: what to break, when, and the bounded loop that does it.

One seeded random source makes every choice, so `--seed` replays the schedule.
docs/benchmarks.md lists the fault kinds.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Sequence
from typing import Protocol

from flowlock.core.errors import FlowlockError
from flowlock_lab.soak_results import FAULT_KINDS, Fault, FaultKind

__all__ = ["FaultInjector", "Schedule", "Targets"]

_ACTION_BOUND = 90.0
"""The longest one fault may take (a PostgreSQL restart on a loaded machine: seconds)."""


class Targets(Protocol):
    """What the faults act on: the soak's worker processes and its own servers.

    Each method returns what it hit (a worker's name, a count).
    It raises FlowlockError when it could not.
    """

    async def kill_worker(self, rng: random.Random) -> str: ...

    async def pause_worker(self, rng: random.Random, seconds: float) -> str: ...

    async def terminate_backends(self, rng: random.Random) -> str: ...

    async def restart_postgres(self) -> str: ...

    async def restart_redis(self) -> str: ...


class Schedule:
    """The order and timing of the faults.

    Kinds come in a shuffled cycle, each once per cycle. Gaps are `interval` jittered by half.
    A pause lasts from a tenth of the lease ttl to twice it.
    So about half the pauses outlive the worker's leases.
    """

    def __init__(
        self,
        rng: random.Random,
        kinds: Sequence[FaultKind] = FAULT_KINDS,
        *,
        interval: float,
        lease_ttl: float,
    ) -> None:
        self.rng = rng
        self.kinds = tuple(kinds)
        self.interval = interval
        self.lease_ttl = lease_ttl
        self._cycle: list[FaultKind] = []

    def next_kind(self) -> FaultKind:
        if not self._cycle:
            self._cycle = list(self.kinds)
            self.rng.shuffle(self._cycle)
        return self._cycle.pop()

    def gap(self) -> float:
        return self.interval * self.rng.uniform(0.5, 1.5)

    def pause(self) -> float:
        return self.rng.uniform(0.1 * self.lease_ttl, 2.0 * self.lease_ttl)


class FaultInjector:
    """Injects faults from `schedule` into `targets` until `stop_at` or `max_faults`.

    `stop_at` is on the monotonic clock. Each fault is recorded.
    A failed fault is recorded with `ok=False` and the reason, and the loop goes on.
    """

    def __init__(
        self, targets: Targets, schedule: Schedule, *, started: float, max_faults: int
    ) -> None:
        self.targets = targets
        self.schedule = schedule
        self.started = started
        self.max_faults = max_faults
        self.faults: list[Fault] = []
        self._pauses: set[asyncio.Task[None]] = set()

    async def run(self, stop_at: float) -> None:
        """Inject until `stop_at`; no new fault starts within a second of it.

        Pauses run in the background, each bounded. They are awaited before returning.
        Each pause always ends with SIGCONT, also when the soak stops early.
        """
        try:
            while len(self.faults) + len(self._pauses) < self.max_faults:
                gap = self.schedule.gap()
                if time.monotonic() + gap + 1.0 >= stop_at:
                    break
                await asyncio.sleep(gap)
                await self._one(self.schedule.next_kind())
        finally:
            if self._pauses:
                await asyncio.gather(*self._pauses, return_exceptions=True)

    async def _one(self, kind: FaultKind) -> None:
        rng = self.schedule.rng
        if kind == "pause-worker":
            seconds = self.schedule.pause()
            task = asyncio.create_task(self._do(kind, self.targets.pause_worker(rng, seconds)))
            self._pauses.add(task)
            task.add_done_callback(self._pauses.discard)
            return
        action: Awaitable[str]
        if kind == "kill-worker":
            action = self.targets.kill_worker(rng)
        elif kind == "terminate-backend":
            action = self.targets.terminate_backends(rng)
        elif kind == "restart-postgres":
            action = self.targets.restart_postgres()
        else:
            action = self.targets.restart_redis()
        await self._do(kind, action)

    async def _do(self, kind: FaultKind, action: Awaitable[str]) -> None:
        at = time.monotonic() - self.started
        try:
            async with asyncio.timeout(_ACTION_BOUND):
                target = await action
        except (FlowlockError, TimeoutError) as exc:
            self.faults.append(Fault(kind, at, "", ok=False, detail=f"{type(exc).__name__}: {exc}"))
        else:
            self.faults.append(Fault(kind, at, str(target)))

    async def cancel(self) -> None:
        """Stop the pauses in flight (each resumes its worker on the way out)."""
        for task in list(self._pauses):
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._pauses, return_exceptions=True)
