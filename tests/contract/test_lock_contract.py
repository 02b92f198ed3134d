"""One contract for every lease-lock backend: memory, Redis and PostgreSQL advisory locks.

Each test runs once per backend against a real server (Redis keys under a per-test namespace,
advisory locks in a per-test schema and namespace). A few checks need to reach behind a
backend's back (read the server's TTL, delete a key under its holder); backends that offer no
such door skip just those checks. The Redis-only behaviours (key layout, fence floor protocol,
jitter, lifecycle) follow the contract.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import asyncpg
import pytest
from redis.crc import key_slot

from flowlock.errors import (
    EngineClosed,
    InvalidInput,
    LockBusy,
    LockLost,
    LockNotOwned,
    LockTimeout,
)
from flowlock.locks.base import Lease, LockBackend
from flowlock.locks.memory import MemoryLocks
from flowlock.locks.redis import RedisLocks


@dataclass
class Harness:
    """A backend under test, with the doors behind its back that the backend offers."""

    locks: LockBackend
    kind: str
    # The server's remaining ttl of ``key`` in seconds (None: not held).
    server_ttl: Callable[[str], Awaitable[float | None]] | None = None
    # Take ``key`` away from its holder without telling it.
    steal: Callable[[str], Awaitable[None]] | None = None


@pytest.fixture(
    params=[
        pytest.param("memory"),
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("advisory", marks=pytest.mark.postgres),
    ]
)
def backend_setup(request: pytest.FixtureRequest) -> tuple[str, dict[str, str]]:
    """Which backend, and the servers (and per-test isolation) it needs."""
    kind: str = request.param
    if kind == "redis":
        return kind, {
            "url": request.getfixturevalue("redis_url"),
            "namespace": request.getfixturevalue("redis_namespace"),
        }
    if kind == "advisory":
        pytest.importorskip("flowlock.locks.advisory")
        return kind, {
            "dsn": request.getfixturevalue("pg_url"),
            "schema": request.getfixturevalue("pg_schema"),
        }
    return kind, {}


@pytest.fixture
async def harness(backend_setup: tuple[str, dict[str, str]]) -> AsyncIterator[Harness]:
    """An open backend of each kind, isolated from every other test."""
    kind, where = backend_setup
    if kind == "memory":
        memory = MemoryLocks()

        async def memory_ttl(key: str) -> float | None:
            entry = memory._held.get(key)
            return None if entry is None else entry.deadline - time.monotonic()

        async def memory_steal(key: str) -> None:
            memory._held.pop(key, None)

        yield Harness(memory, kind, memory_ttl, memory_steal)
    elif kind == "redis":
        async with RedisLocks(where["url"], namespace=where["namespace"]) as redis_locks:
            client = redis_locks.client

            async def redis_ttl(key: str) -> float | None:
                pttl = int(await client.pttl(redis_locks.redis_key(key)))
                return None if pttl == -2 else (math.inf if pttl == -1 else pttl / 1000)

            async def redis_steal(key: str) -> None:
                await client.delete(redis_locks.redis_key(key))

            yield Harness(redis_locks, kind, redis_ttl, redis_steal)
    else:
        from flowlock.locks.advisory import AdvisoryLocks

        locks = AdvisoryLocks(
            where["dsn"], namespace=f"t_{uuid.uuid4().hex[:8]}", schema=where["schema"]
        )
        await locks.open()

        async def advisory_steal(key: str) -> None:
            # The server ends the holder's session, which drops its transaction-level lock.
            lock_id = locks.lock_id(key)
            conn = await asyncpg.connect(where["dsn"])
            try:
                await conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory'"
                    " AND classid = $1::bigint::oid AND objid = $2::bigint::oid AND objsubid = 1",
                    (lock_id >> 32) & 0xFFFFFFFF,
                    lock_id & 0xFFFFFFFF,
                )
            finally:
                await conn.close()

        try:
            yield Harness(locks, kind, None, advisory_steal)
        finally:
            await locks.aclose()


async def take(locks: LockBackend, key: str, *, ttl: float, wait: float = 0.0) -> Lease:
    """``await locks.acquire(...)`` as a coroutine, for create_task."""
    return await locks.acquire(key, ttl=ttl, wait=wait)


async def eventually(check: Callable[[], Awaitable[bool]], within: float = 2.0) -> bool:
    """Whether ``check()`` becomes true within ``within`` seconds (for effects that land in a
    background task, such as a release that outlives its cancelled caller)."""
    deadline = time.monotonic() + within
    while True:
        if await check():
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.01)


# --- acquiring and waiting --------------------------------------------------------------------


async def test_nonblocking_acquire_fails_busy_when_held(harness: Harness) -> None:
    """wait=0 on a held key raises LockBusy at once and takes nothing."""
    locks = harness.locks
    lease = await locks.acquire("k", ttl=5)
    started = time.monotonic()
    with pytest.raises(LockBusy):
        await locks.acquire("k", ttl=5, wait=0)
    assert time.monotonic() - started < 0.5
    assert await locks.owned(lease)
    await locks.release(lease)


async def test_blocking_acquire_times_out_at_its_bound(harness: Harness) -> None:
    """A waiter on a key that stays held gives up with LockTimeout at about its wait bound."""
    locks = harness.locks
    lease = await locks.acquire("k", ttl=10)
    wait = 0.4
    started = time.monotonic()
    with pytest.raises(LockTimeout) as caught:
        await locks.acquire("k", ttl=5, wait=wait)
    elapsed = time.monotonic() - started
    assert 0.9 * wait <= elapsed < 3 * wait
    assert caught.value.key == "k"
    assert await locks.owned(lease)
    await locks.release(lease)


async def test_waiter_is_woken_promptly_by_a_release(harness: Harness) -> None:
    """A waiter gets the lock right after the holder releases, long before its bound or the
    holder's ttl: it is woken, not polling."""
    locks = harness.locks
    lease = await locks.acquire("k", ttl=30)
    waiter = asyncio.create_task(take(locks, "k", ttl=5, wait=10))
    await asyncio.sleep(0.2)
    assert not waiter.done()
    released = time.monotonic()
    await locks.release(lease)
    second = await asyncio.wait_for(waiter, 5)
    woke_after = time.monotonic() - released
    assert woke_after < 0.25, f"the waiter took {woke_after:.3f} s to notice the release"
    assert second.fencing > lease.fencing
    await locks.release(second)


async def test_a_crashed_holders_key_is_taken_when_its_ttl_ends(harness: Harness) -> None:
    """A holder that never releases loses the key at its ttl, and a waiter gets it then."""
    locks = harness.locks
    started = time.monotonic()
    await locks.acquire("k", ttl=0.3)  # never released
    second = await locks.acquire("k", ttl=5, wait=3)
    assert 0.25 <= time.monotonic() - started < 2.0
    await locks.release(second)


# --- releasing, extending, inspecting ---------------------------------------------------------


async def test_release_frees_only_its_own_key(harness: Harness) -> None:
    """Releasing one lease leaves other keys held; a second release of it is LockNotOwned."""
    locks = harness.locks
    first = await locks.acquire("k1", ttl=5)
    other = await locks.acquire("k2", ttl=5)
    await locks.release(first)
    assert not await locks.locked("k1")
    assert await locks.locked("k2")
    with pytest.raises(LockNotOwned):
        await locks.release(first)
    assert await locks.owned(other)
    await locks.release(other)


async def test_release_after_expiry_spares_the_new_holder(harness: Harness) -> None:
    """A lease released after its ttl ran out raises LockNotOwned and leaves the key that a new
    holder took alone."""
    locks = harness.locks
    stale = await locks.acquire("k", ttl=0.2)
    await asyncio.sleep(0.35)
    fresh = await locks.acquire("k", ttl=5, wait=2)
    with pytest.raises(LockNotOwned):
        await locks.release(stale)
    assert await locks.owned(fresh)
    assert await locks.locked("k")
    await locks.release(fresh)


async def test_extend_adds_time_and_refuses_when_not_owned(harness: Harness) -> None:
    """extend pushes the deadline (the key outlives its first ttl); once the lease is gone,
    extend raises LockNotOwned."""
    locks = harness.locks
    lease = await locks.acquire("k", ttl=0.3)
    longer = await locks.extend(lease, 2.0)
    assert longer.expires_at > lease.expires_at
    assert longer.ttl == 2.0
    assert longer.token == lease.token
    assert longer.fencing == lease.fencing
    await asyncio.sleep(0.45)
    assert await locks.owned(longer)
    if harness.server_ttl is not None:
        left = await harness.server_ttl("k")
        assert left is not None
        assert 1.0 < left <= 2.0
    await locks.release(longer)
    with pytest.raises(LockNotOwned):
        await locks.extend(longer)


async def test_extend_after_expiry_is_not_owned(harness: Harness) -> None:
    """A lease that expired cannot be extended back to life."""
    locks = harness.locks
    lease = await locks.acquire("k", ttl=0.2)
    await asyncio.sleep(0.35)
    with pytest.raises(LockNotOwned):
        await locks.extend(lease)


async def test_locked_and_owned_report_truthfully(harness: Harness) -> None:
    """locked and owned follow the key through acquire, another owner and release."""
    locks = harness.locks
    assert not await locks.locked("k")
    first = await locks.acquire("k", ttl=5)
    assert await locks.locked("k")
    assert await locks.owned(first)
    assert not await locks.locked("other")
    await locks.release(first)
    assert not await locks.locked("k")
    assert not await locks.owned(first)
    second = await locks.acquire("k", ttl=5)
    assert not await locks.owned(first)
    assert await locks.owned(second)
    await locks.release(second)


async def test_every_lease_has_a_ttl(harness: Harness) -> None:
    """The server holds a key no longer than its ttl, and the local deadline is no later."""
    locks = harness.locks
    before = time.monotonic()
    lease = await locks.acquire("k", ttl=3)
    after = time.monotonic()
    assert before + 3 <= lease.expires_at + 1e-6
    assert lease.expires_at <= after + 3
    assert 0 < lease.remaining() <= 3
    if harness.server_ttl is not None:
        left = await harness.server_ttl("k")
        assert left is not None
        assert 0 < left <= 3
    await locks.release(lease)


async def test_fencing_tokens_strictly_increase_per_key(harness: Harness) -> None:
    """Each acquisition of a key gets a larger fencing token than every earlier one of it,
    whether the previous lease was released or expired, and whatever other keys do."""
    locks = harness.locks
    tokens: list[int] = []
    for round_ in range(4):
        lease = await locks.acquire("k", ttl=0.2 if round_ == 2 else 5)
        tokens.append(lease.fencing)
        other = await locks.acquire(f"other-{round_}", ttl=5)
        await locks.release(other)
        if round_ == 2:
            await asyncio.sleep(0.3)  # expires instead of being released
        else:
            await locks.release(lease)
    assert tokens == sorted(set(tokens)), tokens


async def test_keys_with_separators_do_not_collide(harness: Harness) -> None:
    """Keys that a naive 'prefix:key' layout would confuse are all distinct locks."""
    locks = harness.locks
    keys = ["a:b", "a", ":b", "a:", "b", "a:b:fence", "{a:b}", "a%3Ab", "a:b}:fence", "*", "a b"]
    leases = [await locks.acquire(key, ttl=5) for key in keys]
    for key in keys:
        assert await locks.locked(key)
    for lease in leases:
        await locks.release(lease)
    for key in keys:
        assert not await locks.locked(key)


# --- the context manager and its watchdog -----------------------------------------------------


async def test_context_manager_renews_through_a_long_step_and_releases(harness: Harness) -> None:
    """async with keeps the lease through a step over three times its ttl and releases at exit."""
    locks = harness.locks
    ttl = 0.3
    async with locks.acquire("k", ttl=ttl, wait=1) as held:
        await asyncio.sleep(3.3 * ttl)
        held.check()
        assert held.lost is None
        assert await locks.owned(held.lease)
        with pytest.raises(LockBusy):
            await locks.acquire("k", ttl=5)
        if harness.server_ttl is not None:
            left = await harness.server_ttl("k")
            assert left is not None
            assert 0 < left <= ttl
    assert not await locks.locked("k")


async def test_failed_renewal_surfaces_as_lock_lost(harness: Harness) -> None:
    """When the key is taken from under a held lease, the next renewal fails, check() raises
    LockLost, and the exit leaves the new owner's key alone."""
    if harness.steal is None:
        pytest.skip(f"no way to take a {harness.kind} lock from under its holder")
    locks = harness.locks
    ttl = 0.3
    context = locks.acquire("k", ttl=ttl)
    held = await context.__aenter__()
    await harness.steal("k")
    thief = await locks.acquire("k", ttl=5)
    await asyncio.sleep(ttl / 3 + 0.15)  # one renewal attempt
    assert held.lost is not None
    with pytest.raises(LockLost):
        held.check()
    with pytest.raises(LockNotOwned):
        await context.__aexit__(None, None, None)
    assert await locks.owned(thief)
    await locks.release(thief)


# --- cancellation -----------------------------------------------------------------------------


async def test_cancelled_exit_leaves_no_key_behind(harness: Harness) -> None:
    """A task cancelled at any point of an async-with exit (watchdog stop, release in flight)
    still releases its key: nothing is left for the ttl to clean up."""
    locks = harness.locks
    for ticks in range(8):
        for ttl, body in ((30.0, 0.0), (0.3, 0.1 + 0.002 * ticks)):
            key = f"k-{ticks}-{ttl}"
            entered = asyncio.Event()

            async def holder(key: str, ttl: float, body: float, entered: asyncio.Event) -> None:
                async with locks.acquire(key, ttl=ttl):
                    entered.set()
                    await asyncio.sleep(body)

            task = asyncio.create_task(holder(key, ttl, body, entered))
            await entered.wait()
            if body:
                await asyncio.sleep(body)
            for _ in range(ticks):
                await asyncio.sleep(0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

            async def released(key: str = key) -> bool:
                return not await locks.locked(key)

            assert await eventually(released), f"{key} left behind (cancelled after {ticks})"


async def test_cancelled_release_still_releases(harness: Harness) -> None:
    """A release() whose caller is cancelled mid-flight still frees the key (redis-py #3847),
    and the key can be taken again at once."""
    locks = harness.locks
    for ticks in range(4):
        lease = await locks.acquire("k", ttl=30)
        task = asyncio.create_task(locks.release(lease))
        for _ in range(ticks + 1):
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

        async def released() -> bool:
            return not await locks.locked("k")

        assert await eventually(released), f"key left behind (cancelled after {ticks})"
        again = await locks.acquire("k", ttl=5)
        await locks.release(again)


async def test_cancelled_waiter_takes_nothing(harness: Harness) -> None:
    """A waiter cancelled while waiting neither takes the key later nor blocks others."""
    locks = harness.locks
    lease = await locks.acquire("k", ttl=30)
    waiter = asyncio.create_task(take(locks, "k", ttl=30, wait=10))
    await asyncio.sleep(0.1)
    waiter.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await waiter
    await locks.release(lease)
    await asyncio.sleep(0.1)
    assert not await locks.locked("k")


# --- the shared watchdog (locks/base.py) ------------------------------------------------------


class SwallowsCancel:
    """Memory locks whose extend finishes even when cancelled mid-flight, as a driver built on
    Python 3.11's asyncio.wait_for does when the cancel lands as the call completes."""

    name = "memory"

    def __init__(self) -> None:
        self.inner = MemoryLocks()
        self.extending = asyncio.Event()

    async def _acquire(self, key: str, ttl: float, wait: float) -> Lease:
        return await self.inner._acquire(key, ttl, wait)

    async def release(self, lease: Lease) -> None:
        await self.inner.release(lease)

    async def extend(self, lease: Lease, ttl: float | None = None) -> Lease:
        self.extending.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(0.05)
        return await self.inner.extend(lease, ttl)


async def test_watchdog_stops_even_if_a_renewal_swallows_its_cancellation() -> None:
    """Closing a Held whose renewal is in flight and ignores cancellation still stops the
    watchdog and releases the key, instead of renewing a released lease forever."""
    from flowlock.locks.base import LeaseContext

    backend = SwallowsCancel()
    context = LeaseContext(backend, "k", ttl=0.15, wait=0)
    async with asyncio.timeout(2):
        async with context:
            await backend.extending.wait()
    assert not await backend.inner.locked("k")
    await asyncio.sleep(0.2)  # no renewal after release would bring it back either
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
    redis_url: str, redis_namespace: str
) -> None:
    """A backend on a caller's client works and does not close that client."""
    import redis.asyncio

    client = redis.asyncio.from_url(redis_url, decode_responses=True)
    try:
        async with RedisLocks.from_client(client, namespace=redis_namespace) as locks:
            lease = await locks.acquire("k", ttl=5)
            waiter = asyncio.create_task(take(locks, "k", ttl=5, wait=5))
            await asyncio.sleep(0.1)
            await locks.release(lease)
            await locks.release(await waiter)
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
            lease = await locks.acquire(key, ttl=5, wait=10)
            await locks.release(lease)
            return lease.fencing

        spread = await asyncio.gather(*(once(f"k{i}") for i in range(200)))
        assert spread == [1] * 200
        crowd = await asyncio.gather(*(once("hot") for _ in range(100)))
        assert sorted(crowd) == list(range(1, 101))


# --- watching without taking -----------------------------------------------------------------


async def test_wait_released_on_a_free_key_returns_at_once(harness: Harness) -> None:
    """wait_released on a free key is True at once and takes nothing."""
    locks = harness.locks
    started = time.monotonic()
    assert await locks.wait_released("k", 2.0) is True
    assert time.monotonic() - started < 1.0
    assert not await locks.locked("k")


async def test_wait_released_wakes_every_watcher_on_release(harness: Harness) -> None:
    """Twenty watchers of a held key all return True soon after the release, none holds it."""
    locks = harness.locks
    lease = await locks.acquire("k", ttl=10)
    watchers = [asyncio.create_task(locks.wait_released("k", 5.0)) for _ in range(20)]
    await asyncio.sleep(0.2)
    assert not any(w.done() for w in watchers)
    released = time.monotonic()
    await locks.release(lease)
    assert await asyncio.gather(*watchers) == [True] * 20
    assert time.monotonic() - released < 2.0
    assert not await locks.locked("k")


async def test_wait_released_times_out_while_held(harness: Harness) -> None:
    """While the holder keeps the key, wait_released is False after about its bound."""
    locks = harness.locks
    lease = await locks.acquire("k", ttl=10)
    started = time.monotonic()
    assert await locks.wait_released("k", 0.3) is False
    assert 0.25 <= time.monotonic() - started < 2.0
    assert await locks.owned(lease)
    await locks.release(lease)
