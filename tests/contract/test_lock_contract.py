"""One contract for every lease-lock backend: memory, Redis and PostgreSQL advisory locks.

Each test runs once per backend against a real server (Redis keys under a per-test namespace,
advisory locks in a per-test schema and namespace). A few checks need to reach behind a
backend's back (read the server's TTL, delete a key under its holder, see who is queued for a
key); each backend's harness says how it does that. The Redis-only behaviours (key layout, fence
floor protocol, jitter, lifecycle) follow the contract.

No test here depends on how fast the machine is. Leases that must stay held have a ttl of
:data:`HELD` seconds; leases meant to run out have :data:`EXPIRING` seconds, so that a stall of a
second cannot end one before the test has used it. A test waits for a cause (a waiter queued, a
key freed) by polling it with a generous deadline, never by sleeping a guessed time; where a
bound is the promise (a wait gives up at ``wait``) it is asserted tightly from below and
generously from above. The memory backend runs on its injected clock, so its leases run out when
the test says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import asyncpg
import pytest
from redis.crc import key_slot

import flowlock.locks.base
import pg_budget
from flowlock.core.errors import (
    EngineClosed,
    InvalidInput,
    LockBusy,
    LockLost,
    LockNotOwned,
    LockTimeout,
)
from flowlock.locks.advisory import AdvisoryLocks
from flowlock.locks.base import Lease, LeaseContext, LockBackend
from flowlock.locks.memory import MemoryLocks
from flowlock.locks.redis import RedisLocks
from lock_probes import Attempts, Sleepers, advisory_sessions, wait_until

# A lease that must stay held for the whole test: nothing the test does takes this long.
HELD = 30.0
# A lease meant to run out (a crashed or stalled holder): a one-second stall of the test or the
# machine cannot end it before the test has used it.
EXPIRING = 2.0
# A wait meant to end at its bound.
BOUND = 1.0
# How far past a bound an answer may come on a loaded machine: generous, since the bound itself
# is asserted from below.
LATE = 5.0
# Redis and PostgreSQL count ttls in whole milliseconds on their own clocks.
MS = 0.01


class Harness:
    """A backend under test, with the doors behind its back that the test needs."""

    kind: str
    reads_ttl = True  # whether server_ttl can read the server's remaining ttl

    def __init__(self, locks: LockBackend) -> None:
        self.locks = locks

    def clock(self) -> float:
        """The backend's clock: leases' ``expires_at`` are readings of it."""
        return time.monotonic()

    async def pass_time(self, seconds: float) -> None:
        """Let ``seconds`` pass on the backend's clock (a server's clock runs on its own)."""
        await asyncio.sleep(seconds)

    async def expire(self, key: str, ttl: float) -> None:
        """Until the lease on ``key`` (of ``ttl`` seconds, never renewed) has run out and the
        backend has dropped it by itself."""

        async def dropped() -> bool:
            return not await self.locks.locked(key)

        await wait_until(dropped, within=ttl + LATE, what=f"the expiry of {key!r}")

    async def queued(self, key: str) -> int:
        """How many callers are waiting for ``key`` right now (acquires and watchers)."""
        raise NotImplementedError

    async def tries(self, key: str) -> object:
        """A reading that stays the same while the callers waiting for ``key`` just wait, and
        changes whenever one of them tries the key again."""
        raise NotImplementedError

    async def renewal_mark(self, key: str) -> float | None:
        """A reading taken on the server side that moves forward each time the lease on ``key``
        is pushed back (None: not held)."""
        raise NotImplementedError

    async def server_ttl(self, key: str) -> float | None:
        """The server's remaining ttl of ``key`` in seconds (None: not held)."""
        raise NotImplementedError

    async def steal(self, key: str) -> None:
        """Take ``key`` away from its holder without telling it."""
        raise NotImplementedError


class CountingCondition(asyncio.Condition):
    """The memory backend's condition (every waiter and watcher sleeps on it), counted:
    ``sleeping`` now, ``entered`` sleeps begun."""

    def __init__(self) -> None:
        super().__init__()
        self.sleeping = 0
        self.entered = 0

    async def wait(self) -> Literal[True]:
        self.sleeping += 1
        self.entered += 1
        try:
            return await super().wait()
        finally:
            self.sleeping -= 1


class MemoryHarness(Harness):
    """Memory locks on an injected clock (the real one plus whatever the test skipped)."""

    kind = "memory"

    def __init__(self) -> None:
        self.skipped = 0.0
        self.memory = MemoryLocks(clock=self.clock)
        self.condition = CountingCondition()
        self.memory._changed = self.condition
        super().__init__(self.memory)

    def clock(self) -> float:
        return time.monotonic() + self.skipped

    async def pass_time(self, seconds: float) -> None:
        # Waiters are not woken by this: no test skips time under a waiter.
        self.skipped += seconds

    async def expire(self, key: str, ttl: float) -> None:
        await self.pass_time(ttl)
        assert not await self.memory.locked(key)

    async def queued(self, key: str) -> int:
        return self.condition.sleeping  # one key per test: all sleepers wait for it

    async def tries(self, key: str) -> object:
        return self.condition.entered

    async def renewal_mark(self, key: str) -> float | None:
        entry = self.memory._held.get(key)
        return None if entry is None else entry.deadline

    async def server_ttl(self, key: str) -> float | None:
        entry = self.memory._held.get(key)
        return None if entry is None else entry.deadline - self.clock()

    async def steal(self, key: str) -> None:
        self.memory._held.pop(key, None)


class RedisHarness(Harness):
    """Redis locks; the acquire scripts (one-lock and many-lock) and the waiters' sleeps are
    counted."""

    kind = "redis"

    def __init__(self, locks: RedisLocks, sleepers: Sleepers) -> None:
        super().__init__(locks)
        self.redis = locks
        self.sleepers = sleepers
        self.attempts = Attempts(locks)

    async def queued(self, key: str) -> int:
        return self.sleepers.now

    async def tries(self, key: str) -> object:
        return self.attempts.calls

    async def _pttl(self, key: str) -> int:
        return int(await self.redis.client.pttl(self.redis.redis_key(key)))

    async def renewal_mark(self, key: str) -> float | None:
        # The server's expiry on the local clock: steady between renewals (to a millisecond or
        # two), later by about ttl/3 after each one.
        pttl = await self._pttl(key)
        return None if pttl < 0 else time.monotonic() + pttl / 1000

    async def server_ttl(self, key: str) -> float | None:
        pttl = await self._pttl(key)
        return None if pttl == -2 else (math.inf if pttl == -1 else pttl / 1000)

    async def steal(self, key: str) -> None:
        await self.redis.client.delete(self.redis.redis_key(key))


class AdvisoryHarness(Harness):
    """Advisory locks, seen in pg_locks / pg_stat_activity on a connection of the test's own."""

    kind = "advisory"
    reads_ttl = False  # the ttl is the session's idle timer: PostgreSQL does not show it

    def __init__(self, locks: AdvisoryLocks, probe: asyncpg.Connection) -> None:
        super().__init__(locks)
        self.advisory = locks
        self.probe = probe

    async def queued(self, key: str) -> int:
        sessions = await advisory_sessions(self.probe, self.advisory.lock_id(key))
        return sum(not s.granted for s in sessions)

    async def tries(self, key: str) -> object:
        # A waiter in PostgreSQL's lock queue is one statement, started once: a retry would be
        # a new statement (a new query_start), or a new session.
        sessions = await advisory_sessions(self.probe, self.advisory.lock_id(key))
        return sorted((s.pid, s.query_start) for s in sessions if not s.granted)

    async def renewal_mark(self, key: str) -> float | None:
        # Each renewal is a statement on the lease's own session, which restarts its idle timer:
        # the session's query_start is when the server's ttl last started over.
        sessions = await advisory_sessions(self.probe, self.advisory.lock_id(key))
        held = [s for s in sessions if s.granted]
        return held[0].query_start.timestamp() if held else None

    async def server_ttl(self, key: str) -> float | None:
        raise AssertionError("PostgreSQL does not show a session's idle timer")

    async def steal(self, key: str) -> None:
        # The server ends the holder's session, which drops its transaction-level lock.
        for session in await advisory_sessions(self.probe, self.advisory.lock_id(key)):
            if session.granted:
                await self.probe.execute("SELECT pg_terminate_backend($1)", session.pid)


@pytest.fixture(
    params=[
        pytest.param("memory"),
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("redis-one-by-one", marks=pytest.mark.redis),
        pytest.param("redis-cluster", marks=[pytest.mark.redis, pytest.mark.slow]),
        pytest.param("advisory", marks=pytest.mark.postgres),
        # The same backend with every lease on a session of its own (no shared holders).
        pytest.param("advisory-solo", marks=pytest.mark.postgres),
    ]
)
def backend_setup(request: pytest.FixtureRequest) -> tuple[str, dict[str, str]]:
    """Which backend, and the servers (and per-test isolation) it needs."""
    kind: str = request.param
    if kind == "redis-cluster":
        url = request.getfixturevalue("redis_cluster_url")
        return kind, {"url": url, "namespace": f"t_{uuid.uuid4().hex[:12]}"}
    if kind.startswith("redis"):
        return kind, {
            "url": request.getfixturevalue("redis_url"),
            "namespace": request.getfixturevalue("redis_namespace"),
        }
    if kind.startswith("advisory"):
        return kind, {
            "dsn": request.getfixturevalue("pg_url"),
            "schema": request.getfixturevalue("pg_schema"),
        }
    return kind, {}


@pytest.fixture
async def harness(
    backend_setup: tuple[str, dict[str, str]], monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Harness]:
    """An open backend of each kind, isolated from every other test."""
    kind, where = backend_setup
    if kind == "memory":
        yield MemoryHarness()
    elif kind.startswith("redis"):
        # "redis" coalesces concurrent calls onto the many-lock scripts; "redis-one-by-one"
        # sends each call alone.
        sleepers = Sleepers(monkeypatch)
        bulk = kind == "redis"
        async with RedisLocks(where["url"], namespace=where["namespace"], bulk=bulk) as redis_locks:
            yield RedisHarness(redis_locks, sleepers)
    else:
        # Room for the twenty watchers of the watcher test, each queued on a connection.
        locks = AdvisoryLocks(
            where["dsn"],
            namespace=f"t_{uuid.uuid4().hex[:8]}",
            schema=where["schema"],
            pool_size=24,
            bulk=kind == "advisory",
        )
        await locks.open()
        probe = await pg_budget.connect(where["dsn"])
        try:
            yield AdvisoryHarness(locks, probe)
        finally:
            await probe.close()
            await locks.aclose()


async def take(locks: LockBackend, key: str, *, ttl: float, wait: float = 0.0) -> Lease:
    """``await locks.acquire(...)`` as a coroutine, for create_task."""
    return await locks.acquire(key, ttl=ttl, wait=wait)


async def freed(locks: LockBackend, key: str, what: str) -> None:
    """Until ``key`` is free (a release that may land in a background task): well within a
    ttl of HELD, so only a release, never the ttl, can explain it."""

    async def free() -> bool:
        return not await locks.locked(key)

    await wait_until(free, what=what)


class WatchdogTicks:
    """Stands in for the ``asyncio`` module inside ``flowlock.locks.base``: a Held's watchdog
    sleeps between renewals until the test calls :meth:`tick` instead of for ttl/3, so the test
    puts a renewal exactly where it wants one, with a ttl (HELD) that cannot run out meanwhile.
    Everything else is asyncio's own."""

    def __init__(self) -> None:
        self._tick = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(asyncio, name)

    async def sleep(self, delay: float) -> None:
        await self._tick.wait()
        self._tick.clear()

    def tick(self) -> None:
        """Let the watchdog renew now."""
        self._tick.set()


@pytest.fixture
def ticks(monkeypatch: pytest.MonkeyPatch) -> WatchdogTicks:
    """The watchdog of every Held in this test renews when the test says so."""
    stand_in = WatchdogTicks()
    monkeypatch.setattr(flowlock.locks.base, "asyncio", stand_in)
    return stand_in


class Renewals:
    """Counts (and times) the calls to a backend's ``extend``, in place of it on the instance."""

    def __init__(self, locks: LockBackend, monkeypatch: pytest.MonkeyPatch) -> None:
        self.at: list[float] = []
        self.started = asyncio.Event()
        real = locks.extend

        async def extend(lease: Lease, ttl: float | None = None) -> Lease:
            self.at.append(time.monotonic())
            self.started.set()
            return await real(lease, ttl)

        monkeypatch.setattr(locks, "extend", extend)


# --- acquiring and waiting --------------------------------------------------------------------


async def test_nonblocking_acquire_fails_busy_when_held(harness: Harness) -> None:
    """wait=0 on a held key raises LockBusy at once (it does not wait for a holder whose lease
    has 30 s to run) and takes nothing."""
    locks = harness.locks
    lease = await locks.acquire("k", ttl=HELD)
    started = time.monotonic()
    with pytest.raises(LockBusy):
        await locks.acquire("k", ttl=HELD, wait=0)
    assert time.monotonic() - started < LATE
    assert await locks.owned(lease)
    await locks.release(lease)
    assert not await locks.locked("k")


async def test_blocking_acquire_times_out_at_its_bound(harness: Harness) -> None:
    """A waiter on a key that stays held gives up with LockTimeout at its wait bound (not
    before), saying how long it waited; the holder keeps the key."""
    locks = harness.locks
    lease = await locks.acquire("k", ttl=HELD)
    started = time.monotonic()
    with pytest.raises(LockTimeout) as caught:
        await locks.acquire("k", ttl=HELD, wait=BOUND)
    took = time.monotonic() - started
    assert BOUND <= took < BOUND + LATE, took
    assert BOUND <= caught.value.waited <= took
    assert caught.value.key == "k"
    assert await locks.owned(lease)
    await locks.release(lease)


@pytest.mark.slow
async def test_waiter_is_woken_by_the_release_not_by_polling(harness: Harness) -> None:
    """A waiter queued behind a holder does not try the key again while the holder keeps it
    (2 s: a poller would have tried many times), and gets it as soon as the holder releases,
    with a larger fencing token; neither its own bound nor the holder's ttl (30 s each) could
    have let it in, so the release woke it (Redis pub/sub, PostgreSQL's lock queue, the memory
    backend's condition)."""
    locks = harness.locks
    lease = await locks.acquire("k", ttl=HELD)
    waiter = asyncio.create_task(take(locks, "k", ttl=HELD, wait=HELD))

    async def queued() -> bool:
        return await harness.queued("k") == 1

    await wait_until(queued, what="the waiter queueing")
    before = await harness.tries("k")
    await asyncio.sleep(2.0)  # not for ordering: the window in which a poller would try again
    assert await harness.tries("k") == before, "the waiter tried the key again while it was held"
    assert await harness.queued("k") == 1
    assert not waiter.done()
    released = time.monotonic()
    await locks.release(lease)
    second = await asyncio.wait_for(waiter, LATE)
    assert time.monotonic() - released < LATE
    assert second.fencing > lease.fencing
    assert await locks.owned(second)
    await locks.release(second)


@pytest.mark.slow  # waits out a ttl
async def test_a_crashed_holders_key_is_taken_when_its_ttl_ends(harness: Harness) -> None:
    """A holder that never releases loses the key at its ttl, not before, and a waiter gets it
    then."""
    locks = harness.locks
    started = time.monotonic()
    crashed = await locks.acquire("k", ttl=EXPIRING)  # never released
    second = await locks.acquire("k", ttl=HELD, wait=HELD)
    took = time.monotonic() - started
    assert EXPIRING - MS <= took < EXPIRING + LATE, took
    assert second.fencing > crashed.fencing
    await locks.release(second)


# --- releasing, extending, inspecting ---------------------------------------------------------


async def test_release_frees_only_its_own_key(harness: Harness) -> None:
    """Releasing one lease leaves other keys held; a second release of it is LockNotOwned."""
    locks = harness.locks
    first = await locks.acquire("k1", ttl=HELD)
    other = await locks.acquire("k2", ttl=HELD)
    await locks.release(first)
    assert not await locks.locked("k1")
    assert await locks.locked("k2")
    with pytest.raises(LockNotOwned):
        await locks.release(first)
    assert await locks.owned(other)
    await locks.release(other)


@pytest.mark.slow  # waits out a ttl
async def test_an_expired_lease_can_be_neither_extended_nor_released(harness: Harness) -> None:
    """A lease whose ttl ran out cannot be extended back to life, and releasing it raises
    LockNotOwned and leaves alone the key that a new holder took."""
    locks = harness.locks
    stale = await locks.acquire("k", ttl=EXPIRING)
    await harness.expire("k", EXPIRING)
    with pytest.raises(LockNotOwned):
        await locks.extend(stale)
    assert not await locks.locked("k")
    fresh = await locks.acquire("k", ttl=HELD, wait=LATE)
    with pytest.raises(LockNotOwned):
        await locks.extend(stale)
    with pytest.raises(LockNotOwned):
        await locks.release(stale)
    assert await locks.owned(fresh)
    assert await locks.locked("k")
    await locks.release(fresh)


@pytest.mark.slow  # waits out a ttl
async def test_extend_adds_time_and_refuses_when_not_owned(harness: Harness) -> None:
    """extend pushes the deadline (the key outlives its first ttl, and the server's ttl is the
    new one); once the lease is gone, extend raises LockNotOwned."""
    locks = harness.locks
    lease = await locks.acquire("k", ttl=EXPIRING)
    longer = await locks.extend(lease, HELD)
    assert longer.expires_at > lease.expires_at
    assert longer.ttl == HELD
    assert longer.token == lease.token
    assert longer.fencing == lease.fencing
    # Not for ordering: the first ttl must have run out on the backend's clock.
    await harness.pass_time(EXPIRING + 0.5)
    assert await locks.owned(longer)
    if harness.reads_ttl:
        left = await harness.server_ttl("k")
        assert left is not None
        assert EXPIRING < left <= HELD
    await locks.release(longer)
    with pytest.raises(LockNotOwned):
        await locks.extend(longer)


async def test_locked_and_owned_report_truthfully(harness: Harness) -> None:
    """locked and owned follow the key through acquire, another owner and release."""
    locks = harness.locks
    assert not await locks.locked("k")
    first = await locks.acquire("k", ttl=HELD)
    assert await locks.locked("k")
    assert await locks.owned(first)
    assert not await locks.locked("other")
    await locks.release(first)
    assert not await locks.locked("k")
    assert not await locks.owned(first)
    second = await locks.acquire("k", ttl=HELD)
    assert not await locks.owned(first)
    assert await locks.owned(second)
    await locks.release(second)


async def test_every_lease_has_a_ttl(harness: Harness) -> None:
    """The server holds a key no longer than its ttl, and the local deadline is no later."""
    locks = harness.locks
    before = harness.clock()
    lease = await locks.acquire("k", ttl=HELD)
    after = harness.clock()
    assert before + HELD <= lease.expires_at + 1e-6
    assert lease.expires_at <= after + HELD
    assert 0 < lease.remaining(harness.clock()) <= HELD
    if harness.reads_ttl:
        left = await harness.server_ttl("k")
        assert left is not None
        assert 0 < left <= HELD
    await locks.release(lease)


@pytest.mark.slow
async def test_fencing_tokens_strictly_increase_per_key(harness: Harness) -> None:
    """Each acquisition of a key gets a larger fencing token than every earlier one of it,
    whether the previous lease was released or expired, and whatever other keys do."""
    locks = harness.locks
    tokens: list[int] = []
    for round_ in range(4):
        ttl = EXPIRING if round_ == 2 else HELD
        lease = await locks.acquire("k", ttl=ttl, wait=LATE)
        tokens.append(lease.fencing)
        other = await locks.acquire(f"other-{round_}", ttl=HELD)
        await locks.release(other)
        if round_ == 2:
            await harness.expire("k", ttl)  # expires instead of being released
        else:
            await locks.release(lease)
    assert tokens == sorted(set(tokens)), tokens


async def test_keys_with_separators_do_not_collide(harness: Harness) -> None:
    """Keys that a naive 'prefix:key' layout would confuse are all distinct locks."""
    locks = harness.locks
    keys = ["a:b", "a", ":b", "a:", "b", "a:b:fence", "{a:b}", "a%3Ab", "a:b}:fence", "*", "a b"]
    leases = [await locks.acquire(key, ttl=HELD) for key in keys]
    for key in keys:
        assert await locks.locked(key)
    for lease in leases:
        await locks.release(lease)
    for key in keys:
        assert not await locks.locked(key)


# --- the context manager and its watchdog -----------------------------------------------------


# Slow: it holds a real lease for 2.25 times a ttl of seconds, on each backend.
@pytest.mark.slow
async def test_context_manager_renews_every_third_of_its_ttl(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """async with keeps the lease through a step of 2.25 times its ttl: the watchdog renews it
    every ttl/3 (never sooner; 4 to 7 times where 6 are due), the renewals push the server's
    expiry back, nobody else can take the key meanwhile, and the exit releases it."""
    locks = harness.locks
    ttl = 2.0  # a stall of up to 2/3 of it between two renewals loses nothing
    renewals = Renewals(locks, monkeypatch)
    marks: list[float] = []
    async with locks.acquire("k", ttl=ttl, wait=LATE) as held:
        entered = time.monotonic()
        until = entered + 2.25 * ttl
        while time.monotonic() < until:
            mark = await harness.renewal_mark("k")
            assert mark is not None, "the key was dropped while held"
            marks.append(mark)
            await asyncio.sleep(0.1)
        held.check()
        assert held.lost is None
        assert await locks.owned(held.lease)
        with pytest.raises(LockBusy):
            await locks.acquire("k", ttl=HELD)
        if harness.reads_ttl:
            left = await harness.server_ttl("k")
            assert left is not None
            assert 0 < left <= ttl
    assert not await locks.locked("k")
    # Each renewal comes ttl/3 plus a round trip after the last one: never two closer than
    # ttl/3 (the clock's resolution aside), so at most 7 in a window of 2.25 ttl, where 6 are
    # due; at least 4 even if the machine stalled for a second or so meanwhile.
    renewed = sum(entered <= at < until for at in renewals.at)
    assert 4 <= renewed <= 7, (renewed, renewals.at)
    gaps = [b - a for a, b in itertools.pairwise(renewals.at)]
    assert min(gaps) >= ttl / 3 - 0.001, gaps
    # On the server: the expiry moved forward by about ttl/3 at each renewal (two renewals
    # between two readings count once).
    pushes = sum(b - a > ttl / 6 for a, b in itertools.pairwise(marks))
    assert pushes >= 3, marks


async def test_failed_renewal_surfaces_as_lock_lost(harness: Harness, ticks: WatchdogTicks) -> None:
    """When the key is taken from under a held lease, the next renewal fails, check() raises
    LockLost, and the exit leaves the new owner's key alone."""
    locks = harness.locks
    context = locks.acquire("k", ttl=HELD)
    held = await context.__aenter__()
    await harness.steal("k")
    thief = await locks.acquire("k", ttl=HELD, wait=LATE)
    assert held.lost is None  # nothing has told the holder yet
    ticks.tick()  # the next renewal

    async def lost() -> bool:
        return held.lost is not None

    await wait_until(lost, what="the failed renewal")
    with pytest.raises(LockLost):
        held.check()
    with pytest.raises(LockNotOwned):
        await context.__aexit__(None, None, None)
    assert await locks.owned(thief)
    await locks.release(thief)


# --- cancellation -----------------------------------------------------------------------------


async def test_cancelled_exit_leaves_no_key_behind(
    harness: Harness, ticks: WatchdogTicks, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A task cancelled at any point of an async-with exit (watchdog stop, a renewal in flight,
    release in flight) still releases its key: the key is free long before its 30 s ttl could
    have freed it."""
    locks = harness.locks
    renewals = Renewals(locks, monkeypatch)
    for depth in range(8):
        for renewing in (False, True):
            key = f"k-{depth}-{renewing}"
            entered, leave = asyncio.Event(), asyncio.Event()

            async def holder(key: str, entered: asyncio.Event, leave: asyncio.Event) -> None:
                async with locks.acquire(key, ttl=HELD):
                    entered.set()
                    await leave.wait()

            task = asyncio.create_task(holder(key, entered, leave))
            await entered.wait()
            if renewing:
                renewals.started.clear()
                ticks.tick()
                await renewals.started.wait()  # the watchdog's extend is in flight
            leave.set()
            for _ in range(depth):  # the cancel lands this many steps into the exit
                await asyncio.sleep(0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await freed(locks, key, f"the release of {key} (cancelled {depth} steps in)")


async def test_cancelled_release_still_releases(harness: Harness) -> None:
    """A release() whose caller is cancelled mid-flight still frees the key (redis-py #3847),
    and the key can be taken again at once."""
    locks = harness.locks
    for depth in range(4):
        lease = await locks.acquire("k", ttl=HELD)
        task = asyncio.create_task(locks.release(lease))
        for _ in range(depth + 1):
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await freed(locks, "k", f"the release cancelled {depth + 1} steps in")
        again = await locks.acquire("k", ttl=HELD)
        await locks.release(again)


async def test_cancelled_waiter_takes_nothing(harness: Harness) -> None:
    """A waiter cancelled while waiting does not keep the key after the holder releases it
    (long before its own 30 s bound), nor stop another caller from taking it."""
    locks = harness.locks
    lease = await locks.acquire("k", ttl=HELD)
    waiter = asyncio.create_task(take(locks, "k", ttl=HELD, wait=HELD))

    async def queued() -> bool:
        return await harness.queued("k") == 1

    await wait_until(queued, what="the waiter queueing")
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await locks.release(lease)
    # (An advisory waiter's session is ended when it is cancelled; PostgreSQL may still grant
    # it the lock for the instant before it notices, which is why this waits.)
    await freed(locks, "k", "the key's release")
    other = await locks.acquire("k", ttl=HELD, wait=LATE)
    assert await locks.owned(other)
    await locks.release(other)


# --- the shared watchdog (locks/base.py) ------------------------------------------------------


class SwallowsCancel:
    """Memory locks whose extend finishes even when cancelled mid-flight, as a driver built on
    Python 3.11's asyncio.wait_for does when the cancel lands as the call completes. Its clock
    stands still: no lease of it runs out, however slow the machine."""

    name = "memory"

    def __init__(self) -> None:
        self.inner = MemoryLocks(clock=self.clock)
        self.extending = asyncio.Event()

    @staticmethod
    def clock() -> float:
        return 0.0

    async def _acquire(self, key: str, ttl: float, wait: float) -> Lease:
        return await self.inner._acquire(key, ttl, wait)

    async def release(self, lease: Lease) -> None:
        await self.inner.release(lease)

    async def extend(self, lease: Lease, ttl: float | None = None) -> Lease:
        self.extending.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(0.05)  # a call in flight, finishing despite a cancel
        return await self.inner.extend(lease, ttl)


async def test_watchdog_stops_even_if_a_renewal_swallows_its_cancellation() -> None:
    """Closing a Held whose renewal is in flight and ignores cancellation still stops the
    watchdog and releases the key, instead of renewing a released lease forever."""
    backend = SwallowsCancel()
    context = LeaseContext(backend, "k", ttl=0.15, wait=0, clock=backend.clock)
    async with asyncio.timeout(LATE):
        async with context as held:
            await backend.extending.wait()  # the first renewal is in flight
    assert held._watchdog is not None
    assert held._watchdog.done()  # no renewal after release could bring the key back
    assert not await backend.inner.locked("k")


# --- bad arguments ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "ttl", "wait"),
    [
        ("", 5, 0),
        (None, 5, 0),
        (42, 5, 0),
        ("k" * 513, 5, 0),
        ("k", 0, 0),
        ("k", -1, 0),
        ("k", math.nan, 0),
        ("k", math.inf, 0),
        ("k", 3601, 0),
        ("k", "5", 0),
        ("k", True, 0),
        ("k", 5, -1),
        ("k", 5, math.nan),
        ("k", 5, 3601),
        ("k", 5, "1"),
    ],
)
async def test_bad_arguments_raise_invalid_input(
    harness: Harness, key: Any, ttl: Any, wait: Any
) -> None:
    """Nonsense keys, ttls and waits are refused with InvalidInput before any I/O."""
    with pytest.raises(InvalidInput):
        harness.locks.acquire(key, ttl=ttl, wait=wait)


# --- Redis specifics --------------------------------------------------------------------------

pytest_redis = pytest.mark.redis


@pytest.fixture
async def redis_locks(redis_url: str, redis_namespace: str) -> AsyncIterator[RedisLocks]:
    """An open RedisLocks on this test's namespace."""
    async with RedisLocks(redis_url, namespace=redis_namespace) as locks:
        yield locks


@pytest_redis
async def test_redis_key_layout_escapes_and_shares_a_slot(redis_locks: RedisLocks) -> None:
    """User parts are percent-encoded inside one hash tag shared by the lock and fence keys."""
    ns = redis_locks.namespace
    assert redis_locks.redis_key("a:b") == f"flowlock:{ns}:{{a%3Ab}}"
    assert redis_locks.fence_key("a:b") == f"flowlock:{ns}:{{a%3Ab}}:fence"
    assert redis_locks.redis_key("{x}*") == f"flowlock:{ns}:{{%7Bx%7D%2A}}"
    lease = await redis_locks.acquire("a:b", ttl=5)
    client = redis_locks.client
    assert await client.get(redis_locks.redis_key("a:b")) == lease.token
    fence = await client.get(redis_locks.fence_key("a:b"))
    assert fence is not None and int(fence) == lease.fencing
    assert key_slot(redis_locks.redis_key("a:b").encode()) == key_slot(
        redis_locks.fence_key("a:b").encode()
    )
    await redis_locks.release(lease)


@pytest_redis
async def test_redis_namespaces_with_separators_do_not_collide(
    redis_url: str, redis_namespace: str
) -> None:
    """(namespace "n:a", key "b") and (namespace "n", key "a:b") are different locks."""
    async with (
        RedisLocks(redis_url, namespace=f"{redis_namespace}:a") as left,
        RedisLocks(redis_url, namespace=redis_namespace) as right,
    ):
        try:
            one = await left.acquire("b", ttl=5)
            two = await right.acquire("a:b", ttl=5)
            assert left.redis_key("b") != right.redis_key("a:b")
            assert one.fencing == two.fencing == 1
            await left.release(one)
            await right.release(two)
        finally:
            await left.client.delete(left.redis_key("b"), left.fence_key("b"))


@pytest_redis
async def test_redis_tokens_are_random_128_bit_or_injected(
    redis_url: str, redis_namespace: str
) -> None:
    """Default tokens are 32 hex digits, fresh per lease; an injected factory is used."""
    async with RedisLocks(redis_url, namespace=redis_namespace) as locks:
        first = await locks.acquire("k", ttl=5)
        await locks.release(first)
        second = await locks.acquire("k", ttl=5)
        await locks.release(second)
    assert len(first.token) == 32
    int(first.token, 16)
    assert first.token != second.token
    names = iter(["tok-1", "tok-2"])
    async with RedisLocks(redis_url, namespace=redis_namespace, token=lambda: next(names)) as locks:
        lease = await locks.acquire("k", ttl=5)
        assert lease.token == "tok-1"
        assert await locks.client.get(locks.redis_key("k")) == "tok-1"
        await locks.release(lease)


@pytest_redis
async def test_redis_fence_floor_protocol(redis_url: str, redis_namespace: str) -> None:
    """A missing fencing counter is floored from fence_floor plus fence_gap, once; after a
    (simulated) data loss tokens continue above every token issued, recorded or not."""
    asked: list[str] = []
    recorded = 0

    async def floor(key: str) -> int:
        asked.append(key)
        return recorded

    async with RedisLocks(
        redis_url, namespace=redis_namespace, fence_floor=floor, fence_gap=100
    ) as locks:
        issued = []
        for _ in range(3):
            lease = await locks.acquire("k:1", ttl=5)
            issued.append(lease.fencing)
            await locks.release(lease)
        assert issued == [101, 102, 103]
        assert asked == ["k:1"]
        recorded = 102  # 103 was issued but never written anywhere
        await locks.client.delete(locks.fence_key("k:1"))  # Redis lost its data
        lease = await locks.acquire("k:1", ttl=5)
        assert lease.fencing == 102 + 100 + 1
        assert lease.fencing > max(issued)
        assert asked == ["k:1", "k:1"]
        await locks.release(lease)


@pytest_redis
async def test_redis_fence_floor_is_not_asked_while_the_key_is_held(
    redis_url: str, redis_namespace: str
) -> None:
    """A busy key never costs a floor lookup; a bad floor value is InvalidInput."""
    asked: list[str] = []

    async def floor(key: str) -> Any:
        asked.append(key)
        return "nope"

    async with RedisLocks(redis_url, namespace=redis_namespace, fence_floor=floor) as locks:
        await locks.client.set(locks.redis_key("k"), "someone", px=5000)
        with pytest.raises(LockBusy):
            await locks.acquire("k", ttl=5)
        assert asked == []
        await locks.client.delete(locks.redis_key("k"))
        with pytest.raises(InvalidInput):
            await locks.acquire("k", ttl=5)
        assert not await locks.locked("k")


@pytest_redis
async def test_redis_lease_deadline_counts_from_before_the_request(
    redis_url: str, redis_namespace: str
) -> None:
    """expires_at is the injected clock's reading before the SET was sent, plus the ttl."""
    readings = iter(range(1000, 2000))
    async with RedisLocks(
        redis_url, namespace=redis_namespace, clock=lambda: float(next(readings))
    ) as locks:
        lease = await locks.acquire("k", ttl=5)
        # The first reading starts the wait; the second is taken just before sending.
        assert lease.expires_at == 1001 + 5
        longer = await locks.extend(lease)
        assert longer.expires_at == 1002 + 5
        await locks.release(longer)


@pytest_redis
async def test_redis_lifecycle_and_misuse(redis_url: str, redis_namespace: str) -> None:
    """open/aclose are idempotent; a closed backend says so; bad configuration and foreign
    leases are InvalidInput."""
    locks = RedisLocks(redis_url, namespace=redis_namespace)
    with pytest.raises(EngineClosed):
        await locks.acquire("k", ttl=5)
    await locks.open()
    await locks.open()
    assert locks.listening
    lease = await locks.acquire("k", ttl=5)
    with pytest.raises(InvalidInput):
        await locks.release(Lease("k", lease.token, 1, 5, 0, "memory"))
    with pytest.raises(InvalidInput):
        await locks.extend(lease, -1)
    await locks.release(lease)
    await locks.aclose()
    await locks.aclose()
    with pytest.raises(EngineClosed):
        await locks.locked("k")
    await locks.open()  # reopens
    assert not await locks.locked("k")
    await locks.aclose()
    bads: tuple[Callable[[], object], ...] = (
        lambda: RedisLocks("http://localhost:6379"),
        lambda: RedisLocks(redis_url, namespace=""),
        lambda: RedisLocks(redis_url, fence_gap=-1),
        lambda: RedisLocks(redis_url, socket_timeout=0),
    )
    for bad in bads:
        with pytest.raises(InvalidInput):
            bad()


@pytest_redis
async def test_redis_from_client_leaves_the_client_open(
    redis_url: str, redis_namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backend on a caller's client works (a waiter is woken by a release through it) and
    does not close that client."""
    import redis.asyncio

    sleepers = Sleepers(monkeypatch)
    client = redis.asyncio.from_url(redis_url, decode_responses=True)
    try:
        async with RedisLocks.from_client(client, namespace=redis_namespace) as locks:
            lease = await locks.acquire("k", ttl=HELD)
            waiter = asyncio.create_task(take(locks, "k", ttl=HELD, wait=HELD))
            await sleepers.settled(1, waiter)
            await locks.release(lease)
            # Woken through the caller's client (pub/sub), long before its bound or the ttl.
            await locks.release(await asyncio.wait_for(waiter, LATE))
        assert await client.ping()
    finally:
        await client.aclose()


@pytest_redis
async def test_redis_a_burst_beyond_max_connections_queues(
    redis_url: str, redis_namespace: str
) -> None:
    """More concurrent callers than connections queue for one instead of failing, and a crowd of
    waiters on one key each gets it in turn."""
    async with RedisLocks(redis_url, namespace=redis_namespace, max_connections=4) as locks:

        async def once(key: str) -> int:
            lease = await locks.acquire(key, ttl=HELD, wait=HELD)
            await locks.release(lease)
            return lease.fencing

        spread = await asyncio.gather(*(once(f"k{i}") for i in range(200)))
        assert spread == [1] * 200
        crowd = await asyncio.gather(*(once("hot") for _ in range(100)))
        assert sorted(crowd) == list(range(1, 101))


# --- watching without taking -----------------------------------------------------------------


async def test_wait_released_on_a_free_key_returns_at_once(harness: Harness) -> None:
    """wait_released on a free key is True at once (long before its 30 s bound) and takes
    nothing."""
    locks = harness.locks
    started = time.monotonic()
    assert await locks.wait_released("k", HELD) is True
    assert time.monotonic() - started < LATE
    assert not await locks.locked("k")


async def test_wait_released_wakes_every_watcher_on_release(harness: Harness) -> None:
    """Twenty watchers queued on a held key all return True right after the release (long
    before their 30 s bound and the holder's 30 s ttl), and none of them holds it."""
    locks = harness.locks
    lease = await locks.acquire("k", ttl=HELD)
    watchers = [asyncio.create_task(locks.wait_released("k", HELD)) for _ in range(20)]

    async def all_queued() -> bool:
        return await harness.queued("k") == 20

    await wait_until(all_queued, what="twenty watchers queueing")
    assert not any(w.done() for w in watchers)
    released = time.monotonic()
    await locks.release(lease)
    assert await asyncio.wait_for(asyncio.gather(*watchers), LATE) == [True] * 20
    assert time.monotonic() - released < LATE
    assert not await locks.locked("k")


async def test_wait_released_times_out_while_held(harness: Harness) -> None:
    """While the holder keeps the key, wait_released is False at its bound (not before); the
    holder keeps the key."""
    locks = harness.locks
    lease = await locks.acquire("k", ttl=HELD)
    started = time.monotonic()
    assert await locks.wait_released("k", BOUND) is False
    took = time.monotonic() - started
    assert BOUND <= took < BOUND + LATE, took
    assert await locks.owned(lease)
    await locks.release(lease)
