"""RunOnce: every (job, tick) runs to completion exactly once, however many runners fire it, in
one process (memory locks, advisory locks) and across OS processes (advisory locks, Redis),
including when a runner is killed or stalled mid-job.

Run as a script (``python test_jobs.py CONFIG_JSON``) this file is the worker process of the
multi-process tests: it fires ticks and prints one JSON line per event. Workers that must run at
once start through the shared gate of ``proc_worker`` and record their contended phase, which
the test holds to have overlapped. Nothing here waits a fixed time for something to happen: the
tests wait for the event itself (a line from the worker, a lease no longer held, a file).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from proc_worker import Gate, ready_and_wait, record_phase

import flowlock
import pg_budget
from flowlock.jobs import JobContext, RunOnce, RunResult
from flowlock.locks import LockBackend, MemoryLocks
from flowlock.locks.base import LeaseContext

pytestmark = pytest.mark.postgres

THIS = Path(__file__)
# Runners (in one process, or one per OS process): with the advisory locks each holds about 4
# connections, so 6 of them stay well inside a busy server's (tests/pg_budget.py).
PROCESSES = 6
TICKS = 20

_SIDE = """
CREATE TABLE IF NOT EXISTS job_side (
    job text NOT NULL, tick text NOT NULL, fencing bigint NOT NULL, pid int NOT NULL,
    phase text NOT NULL
)
"""
# An "end" row is written only while this run still owns the tick: a fenced side effect.
_END = """
INSERT INTO job_side (job, tick, fencing, pid, phase)
SELECT $1, $2, $3, $4, 'end'
 WHERE EXISTS (SELECT 1 FROM flowlock_job_runs
                WHERE job = $1 AND tick = $2 AND fencing = $3 AND state = 'running')
"""


async def wait_for_file(path: str | Path, within: float = 60.0) -> None:
    """Return once ``path`` exists; TimeoutError after ``within`` seconds."""
    deadline = time.monotonic() + within
    while not Path(path).exists():  # noqa: ASYNC240 (a stat of a local file, not I/O to wait on)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {within} s")
        await asyncio.sleep(0.01)


async def wait_until(
    condition: Callable[[], Awaitable[bool]], within: float = 30.0, what: str = "the condition"
) -> float:
    """Poll ``condition`` until it is true; the seconds that took. AssertionError after
    ``within`` seconds."""
    started = time.monotonic()
    while not await condition():
        if time.monotonic() - started > within:
            raise AssertionError(f"{what} did not hold within {within} s")
        await asyncio.sleep(0.05)
    return time.monotonic() - started


def job_fn(
    conn: asyncpg.Connection | asyncpg.Pool,
    seconds: float,
    *,
    announce: bool = False,
    hold: str | None = None,
) -> Callable[[JobContext], Awaitable[int]]:
    """The job: log its start (unfenced), optionally announce it on stdout, work (``seconds``,
    or until the file ``hold`` exists), log its end (fenced)."""

    async def fn(ctx: JobContext) -> int:
        await conn.execute(
            "INSERT INTO job_side VALUES ($1, $2, $3, $4, 'start')",
            ctx.job,
            ctx.tick,
            ctx.fencing,
            os.getpid(),
        )
        if announce:
            print(json.dumps({"event": "start", "tick": ctx.tick, "fencing": ctx.fencing}))
            sys.stdout.flush()
        if hold is None:
            await asyncio.sleep(seconds)
        else:
            await wait_for_file(hold)
        await conn.execute(_END, ctx.job, ctx.tick, ctx.fencing, os.getpid())
        return ctx.fencing

    return fn


async def open_locks(kind: str, where: dict[str, str]) -> LockBackend:
    """An open lock backend of ``kind`` on the test's servers and namespace."""
    backend: LockBackend
    if kind == "advisory":
        from flowlock.locks.advisory import AdvisoryLocks

        backend = AdvisoryLocks(
            where["pg_url"], schema=where["schema"], namespace=where["namespace"], pool_size=2
        )
    elif kind == "redis":
        from flowlock.locks.redis import RedisLocks

        backend = RedisLocks(where["redis_url"], namespace=where["namespace"])
    else:
        backend = MemoryLocks()
    await backend.open()
    return backend


# -- the worker process ----------------------------------------------------------------------


async def worker(cfg: dict[str, Any]) -> None:
    """Fire each tick of ``cfg["ticks"]``; print one JSON line per result. With a ``gate``:
    say ready, wait for the go signal, fire tick i at ``go + i * interval`` (plus jitter) on the
    machine's monotonic clock, and record the phase from the first tick to the last."""
    locks = await open_locks(cfg["kind"], cfg["where"])
    try:
        runner = RunOnce(
            locks,
            cfg["where"]["pg_url"],
            schema=cfg["where"]["schema"],
            ttl=cfg["ttl"],
            wait=cfg["wait"],
            pool_size=2,
            owner=f"proc-{cfg['proc']}",
        )
        async with runner:
            side = await pg_budget.connect(
                cfg["where"]["pg_url"], server_settings={"search_path": cfg["where"]["schema"]}
            )
            fn = job_fn(
                side,
                cfg["job_seconds"],
                announce=cfg.get("announce", False),
                hold=cfg.get("hold"),
            )
            gate = cfg.get("gate")
            origin = time.monotonic()
            if gate is not None:
                origin = await ready_and_wait(gate, cfg["proc"])
            start = time.monotonic()
            try:
                for i, tick in enumerate(cfg["ticks"]):
                    at = origin + i * cfg["interval"] + random.uniform(0, cfg["jitter"])
                    await asyncio.sleep(max(0.0, at - time.monotonic()))
                    line: dict[str, Any] = {"proc": cfg["proc"], "tick": str(tick)}
                    try:
                        result = await runner.run(cfg["job"], tick, fn)
                    except flowlock.FlowlockError as exc:
                        line["error"] = type(exc).__name__
                    else:
                        line |= {
                            "status": result.status,
                            "fencing": result.fencing,
                            "previous": result.previous_fencing,
                        }
                    print(json.dumps(line))
                    sys.stdout.flush()
                if gate is not None:
                    record_phase(gate, cfg["proc"], start, time.monotonic())
            finally:
                await side.close()
    finally:
        await locks.aclose()


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture
async def side(pg_url: str, pg_schema: str) -> AsyncIterator[asyncpg.Pool]:
    """A pool on the test's schema, with the job's side-effect table created."""
    conn = await pg_budget.connect(pg_url)
    try:
        await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{pg_schema}"')
    finally:
        await conn.close()
    pool = await pg_budget.create_pool(
        pg_url, min_size=1, max_size=4, server_settings={"search_path": pg_schema}
    )
    await pool.execute(_SIDE)
    yield pool
    await pool.close()


@pytest.fixture(
    params=[
        pytest.param("advisory"),
        pytest.param("redis", marks=pytest.mark.redis),
    ]
)
def shared(
    request: pytest.FixtureRequest, pg_url: str, pg_schema: str
) -> tuple[str, dict[str, str]]:
    """A lock backend that several processes can share, and where its servers are."""
    kind: str = request.param
    where = {"pg_url": pg_url, "schema": pg_schema, "namespace": f"t_{uuid.uuid4().hex[:8]}"}
    if kind == "redis":
        pytest.importorskip("flowlock.locks.redis")
        where["redis_url"] = request.getfixturevalue("redis_url")
        where["namespace"] = request.getfixturevalue("redis_namespace")
    return kind, where


@pytest.fixture(params=["memory", "advisory"])
def local(
    request: pytest.FixtureRequest, pg_url: str, pg_schema: str
) -> tuple[str, dict[str, str]]:
    """A lock backend for runners inside this process."""
    return request.param, {
        "pg_url": pg_url,
        "schema": pg_schema,
        "namespace": f"t_{uuid.uuid4().hex[:8]}",
    }


async def side_rows(pool: asyncpg.Pool) -> list[asyncpg.Record]:
    return await pool.fetch("SELECT job, tick, fencing, pid, phase FROM job_side")


async def run_rows(pool: asyncpg.Pool) -> dict[str, asyncpg.Record]:
    rows = await pool.fetch("SELECT * FROM flowlock_job_runs")
    return {r["tick"]: r for r in rows}


def spawn(cfg: dict[str, Any]) -> Awaitable[asyncio.subprocess.Process]:
    """This module as a worker process; it imports the helpers of tests/ as the suite does."""
    path = os.pathsep.join(filter(None, [str(THIS.parents[1]), os.environ.get("PYTHONPATH")]))
    return asyncio.create_subprocess_exec(
        sys.executable,
        str(THIS),
        json.dumps(cfg),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": path},
    )


def worker_cfg(kind: str, where: dict[str, str], **cfg: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "kind": kind,
        "where": where,
        "job": "report",
        "proc": 0,
        "ttl": 10.0,
        "wait": 0.0,
        "interval": 0.0,
        "jitter": 0.0,
        "job_seconds": 0.01,
    }
    return base | cfg


async def read_until_start(proc: asyncio.subprocess.Process) -> dict[str, Any]:
    assert proc.stdout is not None
    while True:
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=30)
        if not line:
            assert proc.stderr is not None
            err = await proc.stderr.read()
            code = await asyncio.wait_for(proc.wait(), timeout=30)
            raise AssertionError(
                f"the worker ended (exit code {code}) before starting the job: {err.decode()}"
            )
        event: dict[str, Any] = json.loads(line)
        if event.get("event") == "start":
            return event


# -- in one process ---------------------------------------------------------------------------


async def test_each_tick_runs_once_in_process(
    local: tuple[str, dict[str, str]], side: asyncpg.Pool
) -> None:
    """6 runners x 20 ticks fired at once in one process: 20 runs, one per tick, none twice."""
    kind, where = local
    shared_memory = MemoryLocks() if kind == "memory" else None
    backends = [shared_memory or await open_locks(kind, where) for _ in range(PROCESSES)]
    runners = [
        RunOnce(b, where["pg_url"], schema=where["schema"], pool_size=2, owner=f"r{i}")
        for i, b in enumerate(backends)
    ]
    try:
        for r in runners:
            await r.open()
        fn = job_fn(side, 0.01)

        async def fire(runner: RunOnce, tick: int) -> RunResult[int]:
            await asyncio.sleep(random.uniform(0, 0.01))
            return await runner.run("report", tick, fn)

        results = []
        for tick in range(TICKS):
            results += await asyncio.gather(*[fire(r, tick) for r in runners])
    finally:
        for r in runners:
            await r.aclose()
        for b in set(backends):
            await b.aclose()
    assert sum(r.ran for r in results) == TICKS
    for name in map(str, range(TICKS)):
        assert [r.status for r in results if r.tick == name].count("ran") == 1, name
    rows = await side_rows(side)
    assert sorted(r["tick"] for r in rows if r["phase"] == "start") == sorted(
        map(str, range(TICKS))
    )
    assert len([r for r in rows if r["phase"] == "end"]) == TICKS
    runs = await run_rows(side)
    assert {r["state"] for r in runs.values()} == {"done"} and len(runs) == TICKS


async def test_done_tick_never_runs_again(pg_url: str, pg_schema: str) -> None:
    """A tick recorded done is skipped by every later run, with who finished it."""
    calls = 0

    async def fn(ctx: JobContext) -> str:
        nonlocal calls
        calls += 1
        return f"{ctx.job}@{ctx.tick}"

    locks = MemoryLocks()
    async with RunOnce(locks, pg_url, schema=pg_schema, owner="me") as runner:
        first = await runner.run("j", 7, fn)
        second = await runner.run("j", "7", fn)
    assert (first.status, first.value, first.fencing, first.attempt) == ("ran", "j@7", 1, 1)
    assert first.ran and not first.skipped
    assert second.status == "done_elsewhere" and second.skipped
    assert (second.previous_fencing, second.previous_owner) == (1, "me")
    assert calls == 1


class WaitSeen(MemoryLocks):
    """Memory locks that set ``waiting`` when a caller asks to wait for a lease (it is then
    queued behind the holder by the time anyone else runs: asking and queueing happen in one
    step of its task)."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = asyncio.Event()

    def acquire(self, key: str, *, ttl: float, wait: float = 0.0) -> LeaseContext:
        if wait > 0:
            self.waiting.set()
        return super().acquire(key, ttl=ttl, wait=wait)


async def test_waiting_runner_finds_the_tick_done(pg_url: str, pg_schema: str) -> None:
    """While one runner runs the job, a runner that does not wait skips it; a runner that waits
    for the lease meanwhile gets it after the job finished and reports done, without running."""
    locks = WaitSeen()
    started, finish = asyncio.Event(), asyncio.Event()
    calls = 0

    async def slow(ctx: JobContext) -> int:
        nonlocal calls
        calls += 1
        started.set()
        await finish.wait()
        return ctx.fencing

    async with (
        RunOnce(locks, pg_url, schema=pg_schema) as a,
        RunOnce(locks, pg_url, schema=pg_schema, wait=30) as b,
        RunOnce(locks, pg_url, schema=pg_schema, wait=0) as c,
    ):
        first = asyncio.ensure_future(a.run("j", 1, slow))
        await started.wait()
        busy = await c.run("j", 1, slow)
        waiting = asyncio.ensure_future(b.run("j", 1, slow))
        await asyncio.wait_for(locks.waiting.wait(), 30)
        assert not waiting.done()
        finish.set()
        ran, waited = await first, await waiting
    assert ran.status == "ran" and calls == 1
    assert busy.status == "running_elsewhere" and busy.fencing is None
    assert waited.status == "done_elsewhere"
    # It held the lease (a token after the runner's) and found the tick done by that runner.
    assert ran.fencing is not None and waited.fencing is not None
    assert waited.fencing > ran.fencing
    assert waited.previous_fencing == ran.fencing


async def test_failed_tick_runs_again(pg_url: str, pg_schema: str, side: asyncpg.Pool) -> None:
    """fn raising leaves the tick 'failed' with its error; the next run runs it again."""
    locks = MemoryLocks()

    async def boom(ctx: JobContext) -> None:
        raise RuntimeError("disk full")

    async def ok(ctx: JobContext) -> int:
        return ctx.attempt

    async with RunOnce(locks, pg_url, schema=pg_schema) as runner:
        with pytest.raises(RuntimeError, match="disk full"):
            await runner.run("j", 1, boom)
        row = (await run_rows(side))["1"]
        assert (row["state"], row["error"]) == ("failed", "RuntimeError: disk full")
        again = await runner.run("j", 1, ok)
    assert (again.status, again.value, again.previous_fencing) == ("ran", 2, 1)
    assert (await run_rows(side))["1"]["state"] == "done"


async def test_stale_runner_cannot_record_after_a_takeover(pg_url: str, pg_schema: str) -> None:
    """A runner whose lease expired and was taken over gets LockLost, not a false success."""
    now = [1000.0]
    locks = MemoryLocks(clock=lambda: now[0])
    release_a = asyncio.Event()

    a_started = asyncio.Event()

    async def a_fn(ctx: JobContext) -> str:
        a_started.set()
        await release_a.wait()
        return "a"

    async def b_fn(ctx: JobContext) -> str:
        return "b"

    async with (
        RunOnce(locks, pg_url, schema=pg_schema, ttl=30, owner="a") as a,
        RunOnce(locks, pg_url, schema=pg_schema, ttl=30, owner="b") as b,
    ):
        stale = asyncio.ensure_future(a.run("j", 1, a_fn))
        await asyncio.wait_for(a_started.wait(), 30)
        now[0] += 31  # a's lease runs out (a is "paused")
        took = await b.run("j", 1, b_fn)
        release_a.set()
        with pytest.raises(flowlock.LockLost, match="taken over by b"):
            await stale
    assert (took.status, took.value, took.previous_owner) == ("took_over", "b", "a")
    assert took.fencing is not None and took.previous_fencing is not None
    assert took.fencing > took.previous_fencing


@pytest.mark.slow
async def test_long_job_keeps_its_lease(
    local: tuple[str, dict[str, str]], side: asyncpg.Pool
) -> None:
    """A job running 3x the ttl keeps its lease (renewed); others skip it all along."""
    kind, where = local
    ttl = 2.0
    locks = await open_locks(kind, where)
    try:
        async with (
            RunOnce(locks, where["pg_url"], schema=where["schema"], ttl=ttl) as a,
            RunOnce(locks, where["pg_url"], schema=where["schema"], ttl=ttl) as b,
        ):
            started = asyncio.Event()
            deadlines: set[float] = set()

            async def long(ctx: JobContext) -> float:
                started.set()
                begun = time.monotonic()
                while time.monotonic() - begun < 3 * ttl:
                    await asyncio.sleep(0.1)
                    ctx.check()
                    deadlines.add(ctx.lease.expires_at)
                return time.monotonic() - begun

            job = asyncio.ensure_future(a.run("j", 1, long))
            await started.wait()
            others = []
            while not job.done():
                others.append(await b.run("j", 1, long))
                await asyncio.sleep(0.1)
            result = await job
    finally:
        await locks.aclose()
    assert result.status == "ran"
    assert result.value is not None and result.value >= 3 * ttl
    # Renewed: the lease's deadline moved at least twice (every ttl / 3 while the job ran).
    assert len(deadlines) >= 3, deadlines
    assert others and all(o.status == "running_elsewhere" for o in others[:-1])
    # The probe in flight when the job finished finds it still running or already done: the
    # loop stops at the job's end, which may fall on either side of that last probe.
    assert others[-1].status in ("running_elsewhere", "done_elsewhere")
    assert (await run_rows(side))["1"]["fencing"] == result.fencing


def test_bad_arguments_are_refused(pg_url: str) -> None:
    """ttl and wait are checked up front, like any lease's."""
    with pytest.raises(flowlock.InvalidInput):
        RunOnce(MemoryLocks(), pg_url, ttl=0)
    with pytest.raises(flowlock.InvalidInput):
        RunOnce(MemoryLocks(), pg_url, wait=-1)


async def test_bad_job_or_tick_is_refused(pg_url: str, pg_schema: str) -> None:
    """An empty job or tick, or a bool tick, is InvalidInput before any I/O."""

    async def fn(ctx: JobContext) -> None:
        return None

    async with RunOnce(MemoryLocks(), pg_url, schema=pg_schema) as runner:
        for job, tick in (("", 1), ("j", ""), ("j", True)):
            with pytest.raises(flowlock.InvalidInput):
                await runner.run(job, tick, fn)


# -- across processes -------------------------------------------------------------------------


async def communicate_all(
    procs: list[asyncio.subprocess.Process], within: float = 90
) -> list[dict[str, Any]]:
    """Every worker's JSON lines, once each has exited 0 (their stderr otherwise)."""
    lines: list[dict[str, Any]] = []
    for proc in procs:
        out, err = await asyncio.wait_for(proc.communicate(), timeout=within)
        assert proc.returncode == 0, err.decode()[-3000:]
        lines += [json.loads(line) for line in out.decode().splitlines()]
    return lines


async def kill_all(procs: list[asyncio.subprocess.Process]) -> None:
    for proc in procs:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.slow
async def test_each_tick_runs_once_across_processes(
    shared: tuple[str, dict[str, str]], side: asyncpg.Pool, tmp_path: Path
) -> None:
    """6 OS processes x 20 ticks at once, some waiting for the lease: 20 runs in all, none
    twice; the runners that do not wait skip a tick running elsewhere, the waiters never give
    up."""
    kind, where = shared
    gate = Gate(tmp_path / "gate", PROCESSES)
    waits = [0.0 if p % 2 == 0 else 30.0 for p in range(PROCESSES)]
    procs = []
    try:
        for p in range(PROCESSES):
            procs.append(
                await spawn(
                    worker_cfg(
                        kind, where, proc=p, ticks=list(range(TICKS)), gate=str(gate),
                        interval=0.1, jitter=0.02, wait=waits[p],
                    )
                )
            )  # fmt: skip
        await gate.open_when_ready(procs)
        lines = await communicate_all(procs)
    finally:
        await kill_all(procs)
    gate.assert_overlapped()
    assert len(lines) == PROCESSES * TICKS
    assert [x for x in lines if "error" in x] == []
    statuses = Counter(x["status"] for x in lines)
    # No take-over: no runner lost its lease (the ttl, 10 s, is far above a 10 ms job).
    assert statuses["took_over"] == 0, statuses
    # 20 runs in all, one per tick: none twice, none missing.
    ran = [x for x in lines if x["status"] == "ran"]
    assert sorted(int(x["tick"]) for x in ran) == list(range(TICKS))
    # The ticks were contended: runners that do not wait found a tick's lease held ...
    assert any(x["status"] == "running_elsewhere" for x in lines if waits[x["proc"]] == 0)
    # ... and the waiters waited it out instead: they ran the tick or found it done.
    assert {x["status"] for x in lines if waits[x["proc"]] > 0} <= {"ran", "done_elsewhere"}
    rows = await side_rows(side)
    assert sorted(int(r["tick"]) for r in rows if r["phase"] == "start") == list(range(TICKS))
    assert sorted(int(r["tick"]) for r in rows if r["phase"] == "end") == list(range(TICKS))
    runs = await run_rows(side)
    assert len(runs) == TICKS and {r["state"] for r in runs.values()} == {"done"}
    assert {r["fencing"] for r in runs.values()} == {x["fencing"] for x in ran}


@pytest.mark.slow
async def test_killed_runner_is_taken_over(
    shared: tuple[str, dict[str, str]], side: asyncpg.Pool
) -> None:
    """SIGKILL a runner mid-job: another takes the tick over with a higher fencing token and
    runs it to completion once."""
    kind, where = shared
    victim = await spawn(
        worker_cfg(kind, where, ticks=["t"], ttl=3.0, job_seconds=600, announce=True)
    )
    try:
        started = await read_until_start(victim)
    finally:
        victim.kill()
        await victim.wait()
    locks = await open_locks(kind, where)
    try:
        async with RunOnce(
            locks, where["pg_url"], schema=where["schema"], ttl=10, wait=60, owner="heir"
        ) as runner:
            result = await runner.run("report", "t", job_fn(side, 0.01))
    finally:
        await locks.aclose()
    assert result.status == "took_over"
    assert result.previous_fencing == started["fencing"]
    assert result.fencing is not None and result.fencing > started["fencing"]
    row = (await run_rows(side))["t"]
    assert (row["state"], row["fencing"], row["owner"]) == ("done", result.fencing, "heir")
    rows = await side_rows(side)
    assert sorted(r["fencing"] for r in rows if r["phase"] == "start") == [
        started["fencing"],
        result.fencing,
    ]
    assert [r["fencing"] for r in rows if r["phase"] == "end"] == [result.fencing]


@pytest.mark.slow
async def test_stalled_runner_is_taken_over_and_cannot_finish(
    shared: tuple[str, dict[str, str]], side: asyncpg.Pool, tmp_path: Path
) -> None:
    """SIGSTOP a runner mid-job: while its lease lives, another runner skips the tick; once the
    lease has run out, another takes over and finishes; the stalled one, resumed, gets LockLost
    and its fenced side effect is refused."""
    kind, where = shared
    hold = tmp_path / "let-the-victim-finish"
    # The victim's job runs until `hold` exists, so it is mid-job whenever it is stopped.
    victim = await spawn(
        worker_cfg(kind, where, ticks=["t"], ttl=4.0, hold=str(hold), announce=True)
    )
    locks = await open_locks(kind, where)
    try:
        started = await read_until_start(victim)
        victim.send_signal(signal.SIGSTOP)
        try:
            # The lease lives on for up to its ttl (renewed every ttl / 3 until the stop).
            async with RunOnce(
                locks, where["pg_url"], schema=where["schema"], ttl=10, wait=0, owner="probe"
            ) as prober:
                probe = await prober.run("report", "t", job_fn(side, 0.01))
            key = "flowlock-job:report:t"  # RunOnce's lease key for (job, tick)
            await wait_until(
                lambda: _not(locks.locked(key)), what="the stalled runner's lease running out"
            )
            async with RunOnce(
                locks, where["pg_url"], schema=where["schema"], ttl=10, wait=10, owner="heir"
            ) as runner:
                result = await runner.run("report", "t", job_fn(side, 0.01))
        finally:
            hold.touch()
            victim.send_signal(signal.SIGCONT)
        lines = await communicate_all([victim], within=60)
    finally:
        await locks.aclose()
        await kill_all([victim])
    assert lines[-1] == {"proc": 0, "tick": "t", "error": "LockLost"}
    assert probe.status == "running_elsewhere"  # not taken over while the lease lived
    assert result.status == "took_over"
    assert result.previous_fencing == started["fencing"]
    assert result.fencing is not None and result.fencing > started["fencing"]
    row = (await run_rows(side))["t"]
    assert (row["state"], row["fencing"], row["owner"]) == ("done", result.fencing, "heir")
    side_effects = await side_rows(side)
    starts = sorted(r["fencing"] for r in side_effects if r["phase"] == "start")
    assert starts == [started["fencing"], result.fencing]
    assert [r["fencing"] for r in side_effects if r["phase"] == "end"] == [result.fencing]


async def _not(check: Awaitable[bool]) -> bool:
    return not await check


if __name__ == "__main__":
    asyncio.run(worker(json.loads(sys.argv[1])))
