"""The Redis lock backend's wake-ups on a real Redis: FIFO hand-off to one local waiter per
release, the wake passed on by a waiter that leaves without the lease, watchers
(``wait_released``), and one shared ``fence_floor`` call per key.

Nothing here depends on how fast the machine is: a waiter is known to be queued when it is
asleep in the backend's wake-up queue (:class:`~lock_probes.Sleepers`), holders and bounds that
must not end during a test last 30 s, a holder meant to run out lasts 2 s, and what a waiter
did is counted in acquire-script calls (:class:`~lock_probes.Attempts`), not guessed from how
soon it answered.
"""

from __future__ import annotations

import asyncio
import random
import socket
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio
from redis.exceptions import ConnectionError as RedisConnectionError

from flowlock.core.errors import EngineClosed, InvalidInput, LockUnavailable
from flowlock.locks.base import Lease
from flowlock.locks.redis import RedisLocks, scripts
from flowlock.locks.redis.wakeups import WAKE_JITTER
from lock_probes import Attempts, Sleepers, wait_until

pytestmark = [pytest.mark.redis]

HELD = 30.0  # holders, waits and bounds that must not end during a test
EXPIRING = 2.0  # a holder meant to run out: a stall of a second cannot end it early
BOUND = 1.0  # a wait meant to end at its bound
LATE = 5.0  # how far past a cause an answer may come on a loaded machine
MS = 0.01  # Redis counts ttls in whole milliseconds on its own clock


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


@pytest.fixture
def sleepers(monkeypatch: pytest.MonkeyPatch) -> Sleepers:
    """The backend's waiters and watchers asleep, counted."""
    return Sleepers(monkeypatch)


async def _take(locks: RedisLocks, key: str = "k", *, wait: float = HELD) -> Lease:
    return await locks.acquire(key, ttl=HELD, wait=wait)


async def test_a_crowd_on_one_key_costs_about_two_attempts_per_lease(locks: RedisLocks) -> None:
    """100 tasks on one key, 1 ms each: all get it in turn, never two at once, with at most
    3 acquire attempts per lease (each release wakes one waiter, not all of them)."""
    attempts = Attempts(locks)
    inside = 0
    overlaps = 0
    fences: list[int] = []

    async def once() -> None:
        nonlocal inside, overlaps
        lease = await _take(locks, "hot")
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


async def test_a_release_costs_a_queued_waiter_one_attempt(
    locks: RedisLocks, sleepers: Sleepers
) -> None:
    """A waiter tries once, finds the key held and sleeps; the release (pub/sub) wakes it and
    it takes the key with exactly one more attempt: no polling in between, and neither its
    bound nor the holder's ttl (30 s) could have woken it."""
    attempts = Attempts(locks)
    lease = await _take(locks)
    waiter = asyncio.create_task(_take(locks))
    await sleepers.settled(1, waiter)
    assert attempts.calls == 2
    assert attempts.replies[1][0] == scripts.HELD
    await locks.release(lease)
    got = await asyncio.wait_for(waiter, LATE)
    assert attempts.calls == 3
    assert attempts.replies[2] == (scripts.ACQUIRED, got.fencing)
    assert sleepers.total == 1
    await locks.release(got)


@pytest.mark.parametrize("other_holder", ["releases", "expires"])
@pytest.mark.slow
async def test_a_waiter_whose_retry_loses_to_another_process_keeps_its_place(
    locks: RedisLocks, other: redis.asyncio.Redis, sleepers: Sleepers, other_holder: str
) -> None:
    """The oldest waiter's retry loses to another process's SET: it stays at the head (the
    waiter behind it does not move) and takes the key when that holder releases, or when its
    lease runs out (not before), long before its own bound."""
    lock_key = locks.redis_key("k")
    attempts = Attempts(locks)
    px = int(HELD * 1000) if other_holder == "releases" else int(EXPIRING * 1000)
    took_over = 0.0

    async def other_process_takes_it() -> None:
        nonlocal took_over
        took_over = time.monotonic()
        await other.set(lock_key, "someone-else", px=px)

    lease = await _take(locks)  # attempt 1
    first = asyncio.create_task(_take(locks))  # attempt 2
    await sleepers.settled(1, first)
    second = asyncio.create_task(_take(locks))  # attempt 3
    await sleepers.settled(2, first, second)
    attempts.before[4] = other_process_takes_it  # the head's retry after the release
    await locks.release(lease)
    # The head retried (attempt 4), lost, and is asleep again; the one behind never woke.
    await wait_until(lambda: attempts.calls == 4 and sleepers.now == 2, what="the lost retry")
    assert attempts.replies[3][0] == scripts.HELD
    assert await other.get(lock_key) == "someone-else"
    assert not first.done()
    released = time.monotonic()
    if other_holder == "releases":
        await other.delete(lock_key)
        await other.publish(lock_key, "")  # what the release script does
    got = await asyncio.wait_for(first, EXPIRING + LATE)
    if other_holder == "releases":
        assert time.monotonic() - released < LATE
    else:
        took = time.monotonic() - took_over
        assert EXPIRING - MS <= took < EXPIRING + LATE, took
    assert attempts.calls == 5
    assert not second.done()
    await locks.release(got)
    await locks.release(await asyncio.wait_for(second, LATE))


@pytest.mark.parametrize("leaves", ["cancelled", "timed out", "gave up"])
async def test_a_woken_waiter_that_leaves_passes_the_wake_on(
    locks: RedisLocks, sleepers: Sleepers, leaves: str
) -> None:
    """The oldest waiter, woken by a release, leaves before its retry lands (cancelled, its
    caller's timeout, its call failing): the next waiter is woken and gets the key at once, not
    at its bound or the holder's expiry (30 s each)."""
    attempts = Attempts(locks)
    in_flight = asyncio.Event()
    caller_timeout = asyncio.timeout(None)

    async def stuck() -> None:
        in_flight.set()
        if leaves == "gave up":
            raise RedisConnectionError("the retry's connection broke")
        await asyncio.Event().wait()  # never reaches Redis

    async def first_waiter() -> Lease:
        async with caller_timeout:
            return await _take(locks)

    expected: dict[str, type[BaseException]] = {
        "cancelled": asyncio.CancelledError,
        "timed out": TimeoutError,
        "gave up": LockUnavailable,
    }
    lease = await _take(locks)  # attempt 1
    first = asyncio.create_task(first_waiter())  # attempt 2
    await sleepers.settled(1, first)
    second = asyncio.create_task(_take(locks))  # attempt 3
    await sleepers.settled(2, first, second)
    attempts.before[4] = stuck  # the head's retry
    await locks.release(lease)
    released = time.monotonic()
    await asyncio.wait_for(in_flight.wait(), LATE)
    if leaves == "cancelled":
        first.cancel()
    elif leaves == "timed out":
        caller_timeout.reschedule(asyncio.get_running_loop().time())
    with pytest.raises(expected[leaves]):
        await first
    got = await asyncio.wait_for(second, LATE)
    assert time.monotonic() - released < LATE
    assert attempts.calls == 5  # the second waiter's retry: it was woken, once
    await locks.release(got)


@pytest.mark.slow
async def test_the_holders_expiry_wake_is_jittered_by_the_injected_rng(
    redis_url: str, redis_namespace: str, other: redis.asyncio.Redis
) -> None:
    """A holder that never releases: the waiter wakes at its expiry plus a delay drawn from the
    injected random source (up to WAKE_JITTER), not before (a woken waiter retries at once;
    only the expiry timer is jittered)."""
    drawn: list[tuple[float, float]] = []

    class Late(random.Random):
        def uniform(self, a: float, b: float) -> float:
            drawn.append((a, b))
            return 0.5

    async with RedisLocks(redis_url, namespace=redis_namespace, rng=Late(1)) as locks:
        attempts = Attempts(locks)
        saw: float | None = None

        async def note_the_time() -> None:
            nonlocal saw
            saw = time.monotonic()

        attempts.before[1] = note_the_time
        await other.set(locks.redis_key("k"), "crashed", px=int(EXPIRING * 1000))
        lease = await _take(locks)
        woke = time.monotonic()
        assert saw is not None
        status, pttl = attempts.replies[0]
        assert status == scripts.HELD
        # The first attempt saw the holder's pttl: the retry comes pttl + 0.5 s after it.
        took = woke - saw
        assert pttl / 1000 + 0.5 - MS <= took < pttl / 1000 + 0.5 + LATE, (took, pttl)
        assert attempts.calls == 2
        assert drawn == [(0.0, WAKE_JITTER)]
        await locks.release(lease)


# --- watchers --------------------------------------------------------------------------------


async def test_every_watcher_is_woken_by_a_release_and_the_waiter_still_gets_the_key(
    locks: RedisLocks, sleepers: Sleepers
) -> None:
    """50 watchers and one waiter on a held key: one release wakes all 50 (True), and the
    waiter, whose wake they do not take, gets the key as well (bounds and the holder's ttl are
    30 s away)."""
    lease = await _take(locks)
    watchers = [asyncio.create_task(locks.wait_released("k", HELD)) for _ in range(50)]
    waiter = asyncio.create_task(_take(locks))
    await sleepers.settled(51, waiter, *watchers)
    released = time.monotonic()
    await locks.release(lease)
    assert await asyncio.wait_for(asyncio.gather(*watchers), LATE) == [True] * 50
    got = await asyncio.wait_for(waiter, LATE)
    assert time.monotonic() - released < LATE
    await locks.release(got)


async def test_wait_released_on_a_free_key_is_true_at_once(
    locks: RedisLocks, sleepers: Sleepers
) -> None:
    """A free key: True without ever waiting, and nothing is taken."""
    started = time.monotonic()
    assert await locks.wait_released("k", HELD) is True
    assert sleepers.total == 0
    assert time.monotonic() - started < LATE
    assert not await locks.locked("k")


async def test_wait_released_is_false_at_its_bound_while_held(locks: RedisLocks) -> None:
    """Nobody releases: False at the bound, not before; the holder keeps the key."""
    lease = await _take(locks)
    started = time.monotonic()
    assert await locks.wait_released("k", BOUND) is False
    took = time.monotonic() - started
    assert BOUND <= took < BOUND + LATE, took
    assert await locks.owned(lease)
    await locks.release(lease)


@pytest.mark.slow
async def test_wait_released_wakes_at_the_holders_expiry(
    locks: RedisLocks, other: redis.asyncio.Redis
) -> None:
    """A holder that never releases (crashed): True when its lease runs out, not before (and
    long before the watcher's 30 s bound)."""
    started = time.monotonic()
    await other.set(locks.redis_key("k"), "crashed", px=int(EXPIRING * 1000))
    assert await locks.wait_released("k", HELD) is True
    took = time.monotonic() - started
    assert EXPIRING - MS <= took < EXPIRING + LATE, took


@pytest.mark.slow
async def test_wait_released_sees_an_extension_and_waits_on(
    locks: RedisLocks, other: redis.asyncio.Redis, sleepers: Sleepers
) -> None:
    """A holder that extends before its expiry is not taken for released at the old expiry:
    the watcher looks again then, and waits on until the holder releases."""
    lock_key = locks.redis_key("k")
    await other.set(lock_key, "alive", px=int(EXPIRING * 1000))
    watcher = asyncio.create_task(locks.wait_released("k", HELD))
    await sleepers.settled(1, watcher)  # asleep until the old expiry
    assert await other.pexpire(lock_key, int(HELD * 1000))
    # At the old expiry it wakes, sees the extension, and sleeps again.
    await wait_until(lambda: sleepers.total == 2 and sleepers.now == 1, within=EXPIRING + LATE)
    assert not watcher.done()
    await other.delete(lock_key)
    await other.publish(lock_key, "")  # what the release script does
    assert await asyncio.wait_for(watcher, LATE) is True


async def test_wait_released_errors(
    redis_url: str, redis_namespace: str, sleepers: Sleepers
) -> None:
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
        watcher = asyncio.create_task(locks.wait_released("k", HELD))
        await sleepers.settled(1, watcher)
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


def _count_missing_counters(locks: RedisLocks, crowd: int) -> asyncio.Event:
    """An event set when the ``crowd``-th acquire attempt is told the fencing counter is
    missing. A floor call waiting on it answers only after every one of them has joined it:
    each joins as soon as it is told, before the call's task can run again."""
    attempts = Attempts(locks)
    everyone = asyncio.Event()

    def told(reply: tuple[int, int]) -> None:
        if sum(status == scripts.NO_COUNTER for status, _ in attempts.replies) == crowd:
            everyone.set()

    attempts.after = told
    return everyone


async def test_first_acquirers_of_a_new_key_share_one_fence_floor_call(
    redis_url: str, redis_namespace: str
) -> None:
    """50 concurrent first acquirers of a key with no fencing counter: one fence_floor call,
    answered only once all 50 are waiting for it, and every token above its floor plus the gap,
    in order."""
    asked: list[str] = []
    everyone: asyncio.Event | None = None

    async def fence_floor(key: str) -> int:
        asked.append(key)
        assert everyone is not None
        await everyone.wait()
        return 7

    async with RedisLocks(
        redis_url, namespace=redis_namespace, fence_floor=fence_floor, fence_gap=100
    ) as locks:
        everyone = _count_missing_counters(locks, 50)

        async def once() -> int:
            lease = await _take(locks, "new")
            await locks.release(lease)
            return lease.fencing

        fences = await asyncio.gather(*(once() for _ in range(50)))
        assert everyone.is_set()
        assert asked == ["new"]
        assert sorted(fences) == list(range(108, 158))
        assert locks._floors == {}


async def test_a_failed_fence_floor_call_fails_every_sharer(
    redis_url: str, redis_namespace: str
) -> None:
    """A shared fence_floor call that fails once all 20 acquirers share it: each of them gets
    the error, nothing is taken, and the next acquirer asks again."""
    asked = 0
    everyone: asyncio.Event | None = None

    async def fence_floor(key: str) -> int:
        nonlocal asked
        asked += 1
        if asked == 1:
            assert everyone is not None
            await everyone.wait()
            raise LockUnavailable("postgres", "down")
        return 0

    async with RedisLocks(redis_url, namespace=redis_namespace, fence_floor=fence_floor) as locks:
        everyone = _count_missing_counters(locks, 20)
        results = await asyncio.gather(
            *(_take(locks, "new") for _ in range(20)), return_exceptions=True
        )
        assert all(isinstance(r, LockUnavailable) for r in results), results
        assert asked == 1
        assert not await locks.locked("new")
        lease = await _take(locks, "new")
        assert asked == 2
        await locks.release(lease)
