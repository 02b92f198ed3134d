"""Measuring a round: the start gate, per-call timing and the connection sampler.

docs/benchmarks.md says what the sampler counts and how.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Sequence

import asyncpg

from flowlock.bench.results import CallResult, CallSpec, ConnectionStats
from flowlock.bench.scenarios import Scenario, Session
from flowlock.bench.servers import DRIVER_ERRORS, connect, store_error
from flowlock.core.errors import TransitionRefused

__all__ = [
    "SAMPLE_INTERVAL",
    "Armed",
    "Gate",
    "RemoteFailure",
    "Sampler",
    "cpu_seconds",
    "peak_overlap",
    "sampled",
    "timed_call",
    "until",
]

SAMPLE_INTERVAL = 0.004
"""Seconds between two pg_stat_activity samples while calls run (peak connections, lock wait):
a storm round lasts a few tens of milliseconds."""
_IDLE_INTERVAL = 0.002  # between rounds: how soon a round's first sample is taken


# -- process CPU ---------------------------------------------------------------------------------


def cpu_seconds(sampler: Sampler | None = None) -> float:
    """This process's CPU seconds so far (user + system, every thread), less the sampler's.

    The sampler's thread is the benchmark's, not the engine's: its CPU is left out.
    """
    spent = time.process_time()
    return spent - sampler.cpu() if sampler is not None else spent


# -- the connection sampler ----------------------------------------------------------------------


def peak_overlap(intervals: Sequence[tuple[float, float]]) -> int:
    """The most of these (start, end) intervals that overlap at one instant.

    An interval that ends exactly when another starts does not overlap it.
    """
    edges = sorted(
        [(started, 1) for started, _ in intervals] + [(ended, -1) for _, ended in intervals],
        key=lambda edge: (edge[0], edge[1]),
    )
    peak = level = 0
    for _, step in edges:
        level += step
        peak = max(peak, level)
    return peak


class Sampler:
    """Samples the run's connections between `start` and `stop`.

    It records peak connections (in use, active, open) and lock wait (count x interval).
    It runs on its own thread, loop and connection. The callers' loop is busiest during a burst,
    so a sampler there would only run once the burst is over.
    """

    _QUERY = """
        SELECT count(*)::int AS open,
               count(*) FILTER (WHERE state <> 'idle')::int AS in_use,
               count(*) FILTER (WHERE state = 'active')::int AS active,
               count(*) FILTER (WHERE wait_event_type = 'Lock' AND application_name = $2)::int
                   AS waiting
          FROM pg_stat_activity
         WHERE datname = current_database()
           AND (application_name LIKE $1 OR application_name = 'flowlock-runner')
    """
    _INTERVALS = """
        SELECT extract(epoch FROM query_start)::float8 AS started,
               extract(epoch FROM state_change)::float8 AS ended
          FROM pg_stat_activity
         WHERE datname = current_database() AND application_name LIKE $1 AND state = 'idle'
           AND query_start >= to_timestamp($2)
    """

    def __init__(self, url: str, tag: str, application_name: str) -> None:
        self._url = url
        self._like = f"flowlock%-{tag}"
        self._app = application_name
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.recording = False
        self._since = 0.0
        self._since_epoch = 0.0
        self._offset = 0.0  # the server's clock minus ours (seconds)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._conn: asyncpg.Connection | None = None
        self._busy: asyncio.Lock | None = None  # the connection runs one query at a time
        self.peak = 0
        self.peak_active = 0
        self.peak_open = 0
        self.lock_wait = 0.0

    def cpu(self) -> float:
        """The CPU seconds its thread has used so far (0 before it starts, or where the
        platform has no per-thread clock)."""
        thread = self._thread
        if thread is None or thread.ident is None or not hasattr(time, "pthread_getcpuclockid"):
            return 0.0
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except (OSError, ValueError):
            return 0.0  # the thread has ended, so no round is being measured

    def stats(self) -> ConnectionStats:
        """What it has seen so far."""
        return ConnectionStats(self.peak, self.peak_active, self.peak_open, self.lock_wait)

    async def __aenter__(self) -> Sampler:
        self._thread = threading.Thread(target=self._main, name="flowlock-bench-sampler")
        self._thread.start()
        try:
            await asyncio.to_thread(self._ready.wait, 15)
        except BaseException:
            # Cancelled (Ctrl-C) while the thread starts: no __aexit__ will stop it, and a
            # thread left running keeps the interpreter from exiting.
            self._stop.set()
            raise
        if self._error is not None:
            await self._join()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._join()

    async def _join(self) -> None:
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 15)
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def start(self) -> None:
        """Record from now on."""
        self._since = time.perf_counter()
        self._since_epoch = time.time()
        self.recording = True

    def stop(self) -> None:
        self.recording = False

    async def settle(self) -> None:
        """After a round, add what the samples were too coarse to see.

        Each connection's last statement stays in pg_stat_activity with its start and end.
        Their largest overlap is a lower bound of the peak.
        It is exact for one statement per caller, as in the storm.
        """
        if self._loop is None:
            return
        future = asyncio.run_coroutine_threadsafe(self._overlap(), self._loop)
        self.peak = max(self.peak, await asyncio.wrap_future(future))

    async def _overlap(self) -> int:
        assert self._conn is not None
        assert self._busy is not None
        since = self._since_epoch + self._offset - 0.005
        async with self._busy:
            rows = await self._conn.fetch(self._INTERVALS, self._like, since)
        return peak_overlap([(r["started"], r["ended"]) for r in rows])

    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except BaseException as exc:  # reported by __aexit__ on the caller's loop
            self._error = exc
        finally:
            self._ready.set()

    async def _run(self) -> None:
        conn = self._conn = await connect(self._url)
        before = time.time()
        server = await conn.fetchval("SELECT extract(epoch FROM clock_timestamp())::float8")
        self._offset = float(server) - (before + time.time()) / 2
        self._loop = asyncio.get_running_loop()
        self._busy = asyncio.Lock()
        self._ready.set()
        try:
            await self._sample(conn, self._busy)
        except DRIVER_ERRORS as exc:
            raise store_error(exc, self._url, "the connection sampler failed") from exc
        finally:
            self._loop = None
            with contextlib.suppress(*DRIVER_ERRORS):
                await conn.close(timeout=2)

    async def _sample(self, conn: asyncpg.Connection, busy: asyncio.Lock) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            recording = self.recording
            if recording:
                async with busy:
                    row = await conn.fetchrow(self._QUERY, self._like, self._app)
                now = time.perf_counter()
                if row is not None and self.recording:
                    self.peak = max(self.peak, row["in_use"])
                    self.peak_active = max(self.peak_active, row["active"])
                    self.peak_open = max(self.peak_open, row["open"])
                    self.lock_wait += row["waiting"] * (now - max(last, self._since))
                last = now
            else:
                last = time.perf_counter()
            await asyncio.sleep(SAMPLE_INTERVAL if recording else _IDLE_INTERVAL)


@contextlib.asynccontextmanager
async def sampled(sampler: Sampler | None) -> AsyncIterator[None]:
    """Sample while the block runs the round's calls, then add what samples missed.

    Without a sampler (the warm-up round) it does nothing.
    """
    if sampler is None:
        yield
        return
    sampler.start()
    try:
        yield
    finally:
        sampler.stop()
    await sampler.settle()


# -- the start gate and the timed calls ----------------------------------------------------------


class Gate:
    """Parks every caller until all have arrived, then releases them at one instant."""

    def __init__(self, parties: int) -> None:
        self._parties = parties
        self._arrived = 0
        self._all_here = asyncio.Event()
        self._open = asyncio.Event()
        self.released_at = 0.0
        if parties == 0:
            self._all_here.set()

    async def wait(self) -> None:
        self._arrived += 1
        if self._arrived == self._parties:
            self._all_here.set()
        await self._open.wait()

    async def ready(self) -> None:
        await self._all_here.wait()

    def release(self) -> float:
        self.released_at = time.perf_counter()
        self._open.set()
        return self.released_at


class RemoteFailure(Exception):
    """A failure that another process reported, such as the service's problem document.

    It holds the error's name, whether the workflow refused the call, and the attempts.
    It is recorded like the same error raised in this process.
    """

    def __init__(self, error: str, message: str, *, refused: bool = False, attempts: int = 1):
        super().__init__(message)
        self.error = error
        self.refused = refused
        self.attempts = max(1, attempts)


async def timed_call(
    scenario: Scenario, session: Session, spec: CallSpec, started: float
) -> CallResult:
    """Make one call and say what it came to, timed from `started` (perf_counter seconds).
    Never raises for the call's own failure: that is a measurement."""
    try:
        fired = await scenario.fire(session, spec)
    except TransitionRefused as exc:
        return CallResult(
            spec, "refused", time.perf_counter() - started, 1, type(exc).__name__, str(exc)
        )
    except RemoteFailure as exc:
        return CallResult(
            spec,
            "refused" if exc.refused else "failed",
            time.perf_counter() - started,
            exc.attempts,
            exc.error,
            str(exc)[:500],
        )
    except Exception as exc:
        # Any failure is a measurement, not a crash of the benchmark: FlowlockErrors are the
        # expected ones (conflicts, lock timeouts); anything else would be an engine bug, and the
        # report shows it by its type.
        attempts = getattr(exc, "attempts", 1)
        return CallResult(
            spec,
            "failed",
            time.perf_counter() - started,
            attempts if isinstance(attempts, int) and attempts > 0 else 1,
            type(exc).__name__,
            str(exc)[:500],
        )
    return CallResult(
        spec,
        fired.kind,
        time.perf_counter() - started,
        fired.attempts,
        batch_size=fired.batch_size,
    )


async def until(at: float) -> float:
    """Sleep until `at` (seconds since the epoch); the perf_counter time `at` corresponds to.

    A call whose time has passed starts at once, and its latency still counts from `at`.
    """
    wait = at - time.time()
    if wait > 0:
        await asyncio.sleep(wait)
        return time.perf_counter()
    return time.perf_counter() + wait


class Armed:
    """A round's callers, created and parked on the gate: `go` releases them."""

    def __init__(
        self, scenario: Scenario, session: Session, lanes: Sequence[Sequence[CallSpec]]
    ) -> None:
        self._gate = Gate(len(lanes))
        self._tasks = [asyncio.create_task(self._lane(scenario, session, lane)) for lane in lanes]

    async def _lane(
        self, scenario: Scenario, session: Session, lane: Sequence[CallSpec]
    ) -> tuple[list[CallResult], float, float]:
        """The lane's results, when its first call could start, and when its last one ended."""
        await self._gate.wait()
        started = self._gate.released_at
        first: float | None = None
        results: list[CallResult] = []
        for spec in lane:
            if spec.at is not None:
                started = await until(spec.at)
            if first is None:
                first = started
            results.append(await timed_call(scenario, session, spec, started))
            started = time.perf_counter()
        return results, self._gate.released_at if first is None else first, started

    async def ready(self) -> None:
        """Every caller waits at the gate."""
        await self._gate.ready()

    async def go(self) -> tuple[list[CallResult], float]:
        """Release every caller; every result, and the seconds from release to the last end."""
        released = self._gate.release()
        try:
            done = await asyncio.gather(*self._tasks)
        except BaseException:
            await self.cancel()
            raise
        results = [r for lane, _, _ in done for r in lane]
        # From the first call's start: the release, or the earliest `at` when calls wait for one.
        began = min((first for _, first, _ in done), default=released)
        wall = max((end for _, _, end in done), default=began) - began
        return results, wall

    async def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
