"""The Redis lock backend's parts on their own, without a Redis: key naming, the FIFO wake-ups
and watchers of one key, and the single-flight fence floor."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import asyncpg
import pytest

from flowlock._pg.fence import PostgresFenceEpochs
from flowlock.core.errors import InvalidInput, LockUnavailable
from flowlock.locks.redis.fence import EPOCH_BITS, FenceFloors
from flowlock.locks.redis.keys import Keyspace
from flowlock.locks.redis.wakeups import Wakeups


def test_keys_are_escaped_and_share_a_hash_tag() -> None:
    """Separators and glob characters are percent-encoded; lock and fence share one {tag}."""
    keys = Keyspace("ns:1")
    assert keys.lock("a:b") == "flowlock:ns%3A1:{a%3Ab}"
    assert keys.fence("a:b") == "flowlock:ns%3A1:{a%3Ab}:fence"
    assert keys.lock("{x}*") == "flowlock:ns%3A1:{%7Bx%7D%2A}"
    assert keys.pattern() == "flowlock:ns%3A1:*"


async def test_a_release_wakes_the_oldest_waiter_and_every_watcher() -> None:
    """One release: the oldest waiter of the key and all its watchers wake, nobody else."""
    wakeups = Wakeups(random.Random(0))
    first, second = wakeups.join("k"), wakeups.join("k")
    other = wakeups.join("other")
    with wakeups.watch("k") as watch_a, wakeups.watch("k") as watch_b:
        wakeups.released("k")
        assert first.woken
        assert not second.woken
        assert not other.woken
        assert watch_a.released
        assert watch_b.released
    for place in (first, second, other):
        place.leave(with_lease=False)


async def test_a_woken_waiter_leaving_without_the_lease_passes_the_wake_on() -> None:
    """The woken head leaves without the lease: the next waiter is woken. Leaving with the
    lease keeps the wake (the next release is the next waiter's)."""
    wakeups = Wakeups(random.Random(0))
    first, second, third = wakeups.join("k"), wakeups.join("k"), wakeups.join("k")
    wakeups.released("k")
    first.leave(with_lease=False)
    assert second.woken
    assert not third.woken
    second.attempting()
    second.leave(with_lease=True)
    assert not third.woken
    third.leave(with_lease=False)


async def test_a_head_that_lost_its_retry_keeps_its_place() -> None:
    """A woken waiter whose retry lost to another holder waits again at the head: the next
    release wakes it, not the one behind it."""
    wakeups = Wakeups(random.Random(0))
    head, behind = wakeups.join("k"), wakeups.join("k")
    wakeups.released("k")
    head.attempting()
    waiting = asyncio.create_task(head.wait(30))
    await asyncio.sleep(0)  # one step: the task is now asleep in head.wait
    assert not head.woken
    wakeups.released("k")
    await asyncio.wait_for(waiting, 10)
    assert head.woken
    assert not behind.woken
    head.leave(with_lease=True)
    behind.leave(with_lease=False)


async def test_the_holders_expiry_wakes_the_oldest_waiter() -> None:
    """A failed attempt that saw the holder's PTTL arms a timer that wakes the oldest waiter
    after it, not before (no release needed, and long before the waiter's own 30 s bound);
    -1 (no expiry) arms nothing."""
    wakeups = Wakeups(random.Random(0))
    place = wakeups.join("k")
    place.attempting()
    loop = asyncio.get_running_loop()
    place.held(-1)
    assert not place.woken
    armed = loop.time()
    place.held(200)
    await asyncio.wait_for(place.wait(30), 10)
    assert place.woken
    assert loop.time() - armed >= 0.2
    place.leave(with_lease=True)


async def test_a_new_subscription_and_a_close_wake_everyone_who_must_look_again() -> None:
    """missed(): the oldest waiter per key retries and every watcher looks again (not a
    release); wake_all(): every waiter and watcher finds out the backend closed."""
    wakeups = Wakeups(random.Random(0))
    first, second = wakeups.join("k"), wakeups.join("k")
    with wakeups.watch("k") as watch:
        wakeups.missed()
        assert first.woken
        assert not second.woken
        assert await watch.wait(0)
        assert not watch.released
        wakeups.wake_all()
        assert second.woken
    first.leave(with_lease=True)
    second.leave(with_lease=True)


def _spawn(work: Coroutine[Any, Any, int]) -> asyncio.Task[int]:
    return asyncio.create_task(work)


class _Started:
    """What a FenceFloors asked its backend to start: (key, floor) per call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    async def __call__(self, key: str, floor: int, bound: float) -> None:
        self.calls.append((key, floor))


def _floors(fetch: Callable[[str], Awaitable[int]] | None, gap: int) -> FenceFloors:
    return FenceFloors(fetch, gap=gap, spawn=_spawn, start=_Started(), namespace="ns")


async def test_concurrent_floors_for_one_key_share_one_call() -> None:
    """Ten acquirers of one key at once: one fence_floor call, one start of the counter at
    floor + gap, each gets that floor, and no call is left in flight."""
    asked: list[str] = []
    answer = asyncio.Event()

    async def fence_floor(key: str) -> int:
        asked.append(key)
        await answer.wait()
        return 7

    started = _Started()
    floors = FenceFloors(fence_floor, gap=100, spawn=_spawn, start=started, namespace="ns")
    assert floors.unknown == ""
    assert floors.span == ""  # no epochs: no epoch boundary to report
    sharers = [asyncio.create_task(floors.floor("k", 30)) for _ in range(10)]
    await asyncio.sleep(0)  # one step: each of the ten has asked (none awaits before asking)
    assert list(floors.in_flight) == ["k"]
    answer.set()
    assert await asyncio.gather(*sharers) == [107] * 10
    assert asked == ["k"]
    assert started.calls == [("k", 107)]
    assert floors.in_flight == {}


async def test_a_bad_or_slow_floor_is_an_error_for_every_sharer() -> None:
    """A negative floor is InvalidInput; a floor that does not come within the bound is
    LockUnavailable; without fence_floor the script is told to restart at 1."""

    async def negative(key: str) -> int:
        return -1

    async def never(key: str) -> int:
        await asyncio.sleep(10)
        return 0

    with pytest.raises(InvalidInput):
        await _floors(negative, 1).floor("k", 1)
    slow = _floors(never, 1)
    results = await asyncio.gather(
        slow.floor("k", 0.05), slow.floor("k", 0.05), return_exceptions=True
    )
    assert all(isinstance(r, LockUnavailable) for r in results)
    assert _floors(None, 1).unknown == "0"


async def test_lent_epochs_are_used_while_lent_and_own_ones_win() -> None:
    """Lent epochs turn on the missing-counter report and the epoch boundary, until given back;
    a second lender's are used once the first gave theirs back; epochs of the backend's own are
    never replaced by lent ones."""
    floors = _floors(None, 1)
    first, second = (
        PostgresFenceEpochs(_no_pool, acquire_timeout=1, size=1),
        PostgresFenceEpochs(_no_pool, acquire_timeout=1, size=1),
    )
    give_first = floors.lend(first)
    give_second = floors.lend(second)
    assert floors.epochs is first
    assert (floors.unknown, floors.span) == ("", str(1 << EPOCH_BITS))
    give_first()
    give_first()  # idempotent
    assert floors.epochs is second
    give_second()
    assert floors.epochs is None
    assert (floors.unknown, floors.span) == ("0", "")
    own = PostgresFenceEpochs(_no_pool, acquire_timeout=1, size=1)
    mine = FenceFloors(None, gap=1, spawn=_spawn, start=_Started(), namespace="ns", epochs=own)
    mine.lend(first)
    assert mine.epochs is own


def _no_pool() -> asyncpg.Pool:
    raise AssertionError("no pool: this test does no I/O")
