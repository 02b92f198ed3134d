"""A soak's worker processes: started, streamed from, replaced when killed, and faulted.

Also the run's shared state and the load's constants.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import time
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from flowlock.bench.config import Target
from flowlock.bench.servers import DRIVER_ERRORS, connect, store_error
from flowlock.checker import CallRecord
from flowlock.core.errors import FlowlockError
from flowlock_lab.soak_config import SoakConfig
from flowlock_lab.soak_results import OutcomeKind
from flowlock_lab.soak_worker import WorkerSpec

__all__ = [
    "CALL_BOUND",
    "HOT_SLOT",
    "LEASE_TTL",
    "LEASE_WAIT",
    "READY_BOUND",
    "SPREAD",
    "STORM_SLOT",
    "Fleet",
    "Soak",
]

LEASE_TTL = 2.0
"""The distributed strategies' lease in a soak: short, so a worker paused for a few seconds
loses its leases to others and fencing has to refuse its late writes."""
LEASE_WAIT = 2.0
STORM_SLOT = 1.0
"""Seconds each storm instance is the target: every caller that picks the storm in that second
fires at it."""
HOT_SLOT = 5.0
"""Seconds each hot counter is the target of every hot call (then the next one is)."""
SPREAD = 64
"""Spread counters, created before the load."""
CALL_BOUND = 60.0
"""The soak's own bound on one call; flowlock's bounds end every call long before (a call that
reaches it is counted `hung` and fails the verdict)."""
READY_BOUND = 60.0
"""Seconds a worker process may take to start and open its engine."""
_EXIT_BOUND = CALL_BOUND + 30.0  # a stopped worker finishing its calls and closing
_LINE_LIMIT = 16 * 1024 * 1024


# -- the worker processes ------------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class _Worker:
    """One worker process and what it has streamed back."""

    name: str
    slot: int
    proc: asyncio.subprocess.Process
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    pending: dict[str, tuple[float, str, str, str | None]] = field(default_factory=dict)
    killed: bool = False
    paused: bool = False
    stderr: deque[str] = field(default_factory=lambda: deque(maxlen=20))
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None and not self.killed


@dataclass(slots=True)
class _Tally:
    """Every call of every worker: its record, kind and error class, in arrival order."""

    records: list[CallRecord] = field(default_factory=list)
    kinds: list[OutcomeKind] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    samples: dict[str, str] = field(default_factory=dict)
    escaped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, record: CallRecord, kind: OutcomeKind, error: str | None) -> None:
        self.records.append(record)
        self.kinds.append(kind)
        if error:
            self.errors[error] += 1
            if error not in self.samples and record.error:
                self.samples[error] = record.error


class Fleet:
    """The worker processes, and their replacement when one is killed.

    It is also the faults' `flowlock_lab.faults.Targets`: workers and servers.
    """

    def __init__(self, run: Soak) -> None:
        self.run = run
        self.workers: list[_Worker] = []
        self.tally = _Tally()
        self.crashes: list[str] = []
        self.stopping = False
        self._started = 0

    @property
    def started(self) -> int:
        return self._started

    def live(self) -> list[_Worker]:
        return [w for w in self.workers if w.alive]

    async def start(self, slot: int) -> _Worker:
        run = self.run
        name = (
            f"w{slot}" if self._started < run.config.process_count() else f"w{slot}r{self._started}"
        )
        self._started += 1
        spec = run.spec(name, slot)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "flowlock_lab.soak_worker",
            spec.to_json(),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            # Its own session: a Ctrl-C in the terminal reaches only the soak, which stops it.
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            limit=_LINE_LIMIT,
        )
        worker = _Worker(name, slot, proc)
        self.workers.append(worker)
        worker.tasks = [
            asyncio.create_task(self._read(worker)),
            asyncio.create_task(self._drain(worker)),
        ]
        return worker

    async def _drain(self, worker: _Worker) -> None:
        assert worker.proc.stderr is not None
        while line := await worker.proc.stderr.readline():
            worker.stderr.append(line.decode(errors="replace").rstrip())

    async def _read(self, worker: _Worker) -> None:
        assert worker.proc.stdout is not None
        while line := await worker.proc.stdout.readline():
            try:
                doc = json.loads(line)
            except ValueError:
                continue  # the torn last line of a worker killed mid-write
            self._take(worker, doc)
        code = await worker.proc.wait()
        self._orphans(worker)
        if worker.killed:
            await self._replace(worker)
        elif code != 0 or (not self.stopping and time.monotonic() < self.run.stop_at):
            # A worker also ends by itself, status 0, once the spec's stop time has come: on a
            # busy machine that can be before the soak marks itself stopping.
            tail = " | ".join(list(worker.stderr)[-5:])
            self.crashes.append(f"{worker.name} exited with status {code}: {tail}")

    def _take(self, worker: _Worker, doc: Mapping[str, Any]) -> None:
        event = doc.get("e")
        if event == "inv":
            worker.pending[doc["n"]] = (float(doc["t"]), doc["i"], doc["op"], doc["ev"])
        elif event == "end":
            worker.pending.pop(doc["n"], None)
            self.tally.add(CallRecord.from_dict(doc["r"]), doc["k"], doc["x"])
        elif event == "ready":
            worker.ready.set()
        elif event == "escaped":
            self.tally.escaped.append(f"{worker.name}: {doc['x']}")
        elif event == "note":
            self.tally.notes.append(f"{worker.name}: {doc['m']}")

    def _orphans(self, worker: _Worker) -> None:
        """The calls a dead worker had in flight, from their invoke on, with no completion.

        They may have taken effect, so they count as unknown.
        """
        for invoked, iid, op, event in worker.pending.values():
            self.tally.add(CallRecord(iid, op, event, invoked, None, "unknown"), "killed", None)
        worker.pending.clear()

    async def _replace(self, worker: _Worker) -> None:
        if self.stopping or time.monotonic() + 2.0 >= self.run.stop_at:
            return
        try:
            fresh = await self.start(worker.slot)
        except OSError as exc:
            self.crashes.append(f"could not start a replacement for {worker.name}: {exc}")
            return
        if self.stopping and fresh.proc.stdin is not None:
            # stop() began while it was starting: it ends at once (stop() waits for it).
            fresh.proc.stdin.close()

    async def stop(self) -> None:
        """Close every worker's stdin; each finishes its calls, closes and exits.

        A worker still running after a bound is killed; its calls in flight count as killed.
        Nothing is left stopped.
        """
        self.stopping = True
        done = 0
        # A replacement being started when stop() began is appended while this waits: take
        # workers in rounds until no new one came.
        while done < len(self.workers):
            batch, done = self.workers[done:], len(self.workers)
            for worker in batch:
                if worker.proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        worker.proc.send_signal(signal.SIGCONT)
                    if worker.proc.stdin is not None and not worker.proc.stdin.is_closing():
                        worker.proc.stdin.close()
            for worker in batch:
                try:
                    await asyncio.wait_for(asyncio.shield(worker.proc.wait()), _EXIT_BOUND)
                except TimeoutError:
                    self.crashes.append(f"{worker.name} did not exit within {_EXIT_BOUND:.0f} s")
                    with contextlib.suppress(ProcessLookupError):
                        worker.proc.kill()
            for worker in batch:
                await asyncio.gather(*worker.tasks, return_exceptions=True)

    async def kill_all(self) -> None:
        """On an error or Ctrl-C: SIGKILL whatever still runs and reap it."""
        self.stopping = True
        for worker in self.workers:
            if worker.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.proc.kill()
        for worker in self.workers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(worker.proc.wait(), 10)
            for task in worker.tasks:
                task.cancel()
            await asyncio.gather(*worker.tasks, return_exceptions=True)

    # -- the faults (flowlock_lab.faults.Targets) ----------------------------------------------

    def _victim(self, rng: random.Random, *, unpaused: bool = False) -> _Worker:
        choices = [w for w in self.live() if w.ready.is_set() and not (unpaused and w.paused)]
        if not choices:
            raise _NoTarget("no worker process is running and ready")
        return rng.choice(sorted(choices, key=lambda w: w.name))

    async def kill_worker(self, rng: random.Random) -> str:
        worker = self._victim(rng)
        worker.killed = True
        worker.proc.kill()
        return worker.name

    async def pause_worker(self, rng: random.Random, seconds: float) -> str:
        worker = self._victim(rng, unpaused=True)
        worker.paused = True
        try:
            worker.proc.send_signal(signal.SIGSTOP)
            await asyncio.sleep(seconds)
        finally:
            worker.paused = False
            if worker.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.proc.send_signal(signal.SIGCONT)
        return f"{worker.name} for {seconds:.1f} s"

    async def terminate_backends(self, rng: random.Random) -> str:
        url = self.run.target.url
        conn = await connect(url)
        try:
            pids = await conn.fetch(
                "SELECT pid FROM pg_stat_activity WHERE application_name LIKE $1 "
                "AND pid <> pg_backend_pid() ORDER BY pid",
                f"%-{self.run.target.tag}",
            )
            chosen = rng.sample([r["pid"] for r in pids], min(len(pids), rng.randint(1, 3)))
            ended = 0
            for pid in chosen:
                ended += bool(await conn.fetchval("SELECT pg_terminate_backend($1)", pid))
        except DRIVER_ERRORS as exc:
            raise store_error(exc, url, "cannot end the workers' sessions") from exc
        finally:
            with contextlib.suppress(*DRIVER_ERRORS):
                await conn.close()
        return f"{ended} of {len(pids)} session(s)"

    async def restart_postgres(self) -> str:
        await asyncio.to_thread(self.run.postgres.restart)
        return "PostgreSQL"

    async def restart_redis(self) -> str:
        if self.run.redis is None:
            raise _NoTarget("no Redis")
        await asyncio.to_thread(self.run.redis.restart)
        return "Redis (empty)"


class _NoTarget(FlowlockError):
    """A fault found nothing to act on (every worker busy being replaced, say)."""


# -- the run -----------------------------------------------------------------------------------


@dataclass(slots=True)
class Soak:
    config: SoakConfig
    seed: int
    target: Target
    strategies: tuple[str, ...]
    postgres: Any  # EmbeddedPostgres; typed loosely so this module imports it lazily
    redis: Any | None
    started: float = 0.0
    stop_at: float = 0.0
    peak_connections: int = 0

    def spec(self, name: str, slot: int) -> WorkerSpec:
        callers, processes = self.config.caller_count(), self.config.process_count()
        tasks = callers // processes + (1 if slot < callers % processes else 0)
        # One connection per caller and one spare (the fencing floor a Redis lease reads).
        target = Target(
            self.target.url,
            self.target.schema,
            self.target.namespace,
            self.target.tag,
            tasks + 1,
            self.target.redis_url,
        )
        return WorkerSpec(
            name=name,
            target=target.to_json(),
            strategies=self.strategies,
            tasks=tasks,
            seed=f"{self.seed}/{name}",
            started=self.started,
            stop_at=self.stop_at,
            storm_slot=STORM_SLOT,
            hot_slot=HOT_SLOT,
            spread=SPREAD,
            lease_ttl=LEASE_TTL,
            lease_wait=LEASE_WAIT,
            call_bound=CALL_BOUND,
            batching=self.config.batching,
        )
