"""The Redis lock backend's wake-ups on a real Redis: FIFO hand-off to one local waiter per
release, the wake passed on by a waiter that leaves without the lease, watchers
(``wait_released``), and one shared ``fence_floor`` call per key."""

from __future__ import annotations

import asyncio
import random
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, cast

import pytest
import redis.asyncio
from redis.commands.core import AsyncScript

from flowlock.errors import EngineClosed, InvalidInput, LockUnavailable
from flowlock.locks.base import Lease
from flowlock.locks.redis import RedisLocks

pytestmark = [pytest.mark.redis]


class Attempts:
    """Wraps a backend's acquire script: counts the calls, and lets a test act before one."""

    def __init__(self, locks: RedisLocks) -> None:
        assert locks._scripts is not None
        self._script = locks._scripts[0]
        self.calls = 0
        self.before: dict[int, Callable[[], Awaitable[None]]] = {}
        # The wrapper stands in for the acquire script: it is called the same way.
        locks._scripts = (cast(AsyncScript, self), *locks._scripts[1:])

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        hook = self.before.get(self.calls)
        if hook is not None:
            await hook()
        return await self._script(*args, **kwargs)


@pytest.fixture
async def locks(redis_url: str, redis_namespace: str) -> AsyncIterator[RedisLocks]:
    """An open backend on this test's namespace."""
    async with RedisLocks(redis_url, namespace=redis_namespace) as backend:
        yield backend


@pytest.fixture
async def other(redis_url: str) -> AsyncIterator[redis.asyncio.Redis]:
    """A plain client standing in for another process."""
    client = redis.asyncio.from_url(redis_url, decode_responses=True)
    yield client
    await client.aclose()


async def _take(locks: RedisLocks, key: str = "k", *, wait: float = 10.0) -> Lease:
    return await locks.acquire(key, ttl=10, wait=wait)


async def _queued(*tasks: asyncio.Task[Any]) -> None:
    """Let tasks make their first attempt and start waiting."""
    await asyncio.sleep(0.1)
    assert not any(task.done() for task in tasks)


async def test_a_crowd_on_one_key_costs_about_two_attempts_per_lease(locks: RedisLocks) -> None:
    """100 tasks on one key, 1 ms each: all get it in turn, never two at once, with at most
    3 acquire attempts per lease (each release wakes one waiter, not all of them)."""
    attempts = Attempts(locks)
    inside = 0
    overlaps = 0
    fences: list[int] = []

    async def once() -> None:
        nonlocal inside, overlaps
        lease = await _take(locks, "hot", wait=20)
        overlaps += inside
        inside += 1
        await asyncio.sleep(0.001)
        inside -= 1
        fences.append(lease.fencing)
        await locks.release(lease)

    await asyncio.gather(*(once() for _ in range(100)))
    assert overlaps == 0
    assert fences == list(range(1, 101))
    assert attempts.calls <= 3 * 100, attempts.calls


@pytest.mark.parametrize("other_holder", ["releases", "expires"])
async def test_a_waiter_whose_retry_loses_to_another_process_keeps_its_place(
    locks: RedisLocks, other: redis.asyncio.Redis, other_holder: str
) -> None:
    """The oldest waiter's retry loses to another process's SET: it stays at the head and takes
    the key when that holder releases (or its lease runs out), long before its own bound."""
    lock_key = locks.redis_key("k")
    attempts = Attempts(locks)

    async def other_process_takes_it() -> None:
        await other.set(lock_key, "someone-else", px=300)

    lease = await _take(locks)  # attempt 1
    first = asyncio.create_task(_take(locks))  # attempt 2
    await _queued(first)
    second = asyncio.create_task(_take(locks))  # attempt 3
    await _queued(first, second)
    attempts.before[4] = other_process_takes_it  # the head's retry after the release
    await locks.release(lease)
    await asyncio.sleep(0.1)
    assert await other.get(lock_key) == "someone-else"
    assert not first.done()
    released = time.monotonic()
    if other_holder == "releases":
        await other.delete(lock_key)
        await other.publish(lock_key, "")  # what the release script does
    got = await asyncio.wait_for(first, 2.0)
    took = time.monotonic() - released
    assert took < (0.3 if other_holder == "releases" else 0.8), took
    assert not second.done()
    await locks.release(got)
    await locks.release(await asyncio.wait_for(second, 2.0))


@pytest.mark.parametrize("leaves", ["cancelled", "timed out", "gave up"])
async def test_a_woken_waiter_that_leaves_passes_the_wake_on(
    redis_url: str, redis_namespace: str, leaves: str
) -> None:
    """The oldest waiter, woken by a release, leaves before its retry lands (cancelled, its
    caller's timeout, its own bound): the next waiter gets the key at once, not at its bound
    (the holder's ttl is 10 s, the next waiter's wait 5 s)."""
    async with RedisLocks(redis_url, namespace=redis_namespace, socket_timeout=0.3) as locks:
        attempts = Attempts(locks)

        async def stuck() -> None:
            await asyncio.sleep(30)

        async def first_waiter() -> Lease:
            if leaves == "timed out":
                async with asyncio.timeout(0.5):
                    return await _take(locks, wait=5)
            return await _take(locks, wait=5)

        lease = await _take(locks)  # attempt 1
        first = asyncio.create_task(first_waiter())  # attempt 2
        await _queued(first)
        second = asyncio.create_task(_take(locks, wait=5))  # attempt 3
        await _queued(first, second)
        attempts.before[4] = stuck  # the head's retry never reaches Redis
        await locks.release(lease)
        released = time.monotonic()
        await asyncio.sleep(0.05)
        if leaves == "cancelled":
            first.cancel()
        with pytest.raises((asyncio.CancelledError, TimeoutError, LockUnavailable)):
            await first
        got = await asyncio.wait_for(second, 2.0)
        assert time.monotonic() - released < 1.0
        await locks.release(got)


async def test_the_holders_expiry_wake_is_jittered_by_the_injected_rng(
    redis_url: str, redis_namespace: str, other: redis.asyncio.Redis
) -> None:
    """A holder that never releases: the waiter wakes at its expiry plus a delay drawn from the
    injected random source (a woken waiter retries at once; only the timer is jittered)."""

    class Late(random.Random):
        def uniform(self, a: float, b: float) -> float:
            return 0.3

    async with RedisLocks(redis_url, namespace=redis_namespace, rng=Late(1)) as locks:
        await other.set(locks.redis_key("k"), "crashed", px=200)
        started = time.monotonic()
        lease = await _take(locks, wait=5)
        assert 0.45 <= time.monotonic() - started < 1.5
        await locks.release(lease)


# --- watchers --------------------------------------------------------------------------------


async def test_every_watcher_is_woken_by_a_release_and_the_waiter_still_gets_the_key(
    locks: RedisLocks,
) -> None:
    """50 watchers and one waiter on a held key: one release wakes all 50 (True), and the
    waiter, whose wake they do not take, gets the key just as promptly."""
    lease = await _take(locks)
    watchers = [asyncio.create_task(locks.wait_released("k", 5.0)) for _ in range(50)]
    waiter = asyncio.create_task(_take(locks, wait=5))
    await _queued(waiter, *watchers)
    released = time.monotonic()
    await locks.release(lease)
    assert await asyncio.gather(*watchers) == [True] * 50
    got = await waiter
    assert time.monotonic() - released < 0.5
    await locks.release(got)


async def test_wait_released_on_a_free_key_is_true_at_once(locks: RedisLocks) -> None:
    """A free key: True at once, and nothing is taken."""
    started = time.monotonic()
    assert await locks.wait_released("k", 5.0) is True
    assert time.monotonic() - started < 0.2
    assert not await locks.locked("k")


async def test_wait_released_is_false_at_its_bound_while_held(locks: RedisLocks) -> None:
    """Nobody releases: False after about the bound; the holder keeps the key."""
    lease = await _take(locks)
    started = time.monotonic()
    assert await locks.wait_released("k", 0.3) is False
    assert 0.28 <= time.monotonic() - started < 0.6
    assert await locks.owned(lease)
    await locks.release(lease)


async def test_wait_released_wakes_at_the_holders_expiry(
    locks: RedisLocks, other: redis.asyncio.Redis
) -> None:
    """A holder that never releases (crashed): True when its lease runs out."""
    await other.set(locks.redis_key("k"), "crashed", px=400)
    started = time.monotonic()
    assert await locks.wait_released("k", 5.0) is True
    assert 0.35 <= time.monotonic() - started < 1.0


async def test_wait_released_sees_an_extension_and_waits_on(
    locks: RedisLocks, other: redis.asyncio.Redis
) -> None:
    """A holder that extends before its expiry is not taken for released at the old expiry."""
    await other.set(locks.redis_key("k"), "alive", px=300)
    watcher = asyncio.create_task(locks.wait_released("k", 5.0))
    await asyncio.sleep(0.15)
    await other.pexpire(locks.redis_key("k"), 600)
    await asyncio.sleep(0.4)
    assert not watcher.done()
    assert await watcher is True


async def test_wait_released_errors(redis_url: str, redis_namespace: str) -> None:
    """Bad arguments are InvalidInput, a closed backend EngineClosed (also for a watcher waiting
    when it closes), an unreachable Redis LockUnavailable."""
    locks = RedisLocks(redis_url, namespace=redis_namespace)
    with pytest.raises(EngineClosed):
        await locks.wait_released("k", 1.0)
    async with locks:
        for key, wait in (("", 1.0), ("k", -1.0), ("k", "1"), (None, 1.0)):
            with pytest.raises(InvalidInput):
                await locks.wait_released(key, wait)  # type: ignore[arg-type]
        lease = await _take(locks)
        watcher = asyncio.create_task(locks.wait_released("k", 5.0))
        await _queued(watcher)
    with pytest.raises(EngineClosed):
        await watcher
    await locks.open()
    await locks.client.delete(locks.redis_key("k"))
    await locks.aclose()
    assert lease.key == "k"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with RedisLocks(f"redis://127.0.0.1:{port}/0", socket_timeout=0.5) as down:
        with pytest.raises(LockUnavailable):
            await down.wait_released("k", 1.0)


# --- fencing floor ---------------------------------------------------------------------------


async def test_first_acquirers_of_a_new_key_share_one_fence_floor_call(
    redis_url: str, redis_namespace: str
) -> None:
    """50 concurrent first acquirers of a key with no fencing counter: one fence_floor call,
    and every token above its floor plus the gap, in order."""
    asked: list[str] = []

    async def fence_floor(key: str) -> int:
        asked.append(key)
        await asyncio.sleep(0.05)
        return 7

    async with RedisLocks(
        redis_url, namespace=redis_namespace, fence_floor=fence_floor, fence_gap=100
    ) as locks:

        async def once() -> int:
            lease = await _take(locks, "new", wait=10)
            await locks.release(lease)
            return lease.fencing

        fences = await asyncio.gather(*(once() for _ in range(50)))
        assert asked == ["new"]
        assert sorted(fences) == list(range(108, 158))
        assert locks._floors == {}


async def test_a_failed_fence_floor_call_fails_every_sharer(
    redis_url: str, redis_namespace: str
) -> None:
    """A shared fence_floor call that fails: each of its sharers gets the error, nothing is
    taken, and the next acquirer asks again."""
    asked = 0

    async def fence_floor(key: str) -> int:
        nonlocal asked
        asked += 1
        await asyncio.sleep(0.05)
        if asked == 1:
            raise LockUnavailable("postgres", "down")
        return 0

    async with RedisLocks(redis_url, namespace=redis_namespace, fence_floor=fence_floor) as locks:
        results = await asyncio.gather(
            *(_take(locks, "new", wait=2) for _ in range(20)), return_exceptions=True
        )
        assert all(isinstance(r, LockUnavailable) for r in results), results
        assert asked == 1
        assert not await locks.locked("new")
        lease = await _take(locks, "new")
        assert asked == 2
        await locks.release(lease)
