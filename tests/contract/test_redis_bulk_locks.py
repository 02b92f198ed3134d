"""The Redis lock backend's bulk path: many keys per round trip, every lock property per key.

`try_acquire_many`, `release_many` and `extend_many` (BulkLockBackend), and the coalescing of
concurrent single-key calls onto them (`bulk=True`, the default). The round trips are counted
in-process: every script call the backend sends goes through a counted wrapper. The contract
suite (test_lock_contract.py) runs over both paths too. Exclusivity and fencing under real
concurrency are checked over the history of many tasks in two processes (`_check_history`).
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import random
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from typing import Any, cast

import pytest
from redis.commands.core import AsyncScript

from flowlock.core.errors import EngineClosed, InvalidInput, LockNotOwned, LockUnavailable
from flowlock.locks.base import BulkLockBackend, Lease
from flowlock.locks.redis import RedisLocks, bulk
from lock_probes import Attempts, wait_until

pytestmark = pytest.mark.redis

HELD = 30.0  # a lease that must stay held for the whole test


class Counted:
    """Wraps one script and counts its calls."""

    def __init__(self, script: AsyncScript) -> None:
        self.script = script
        self.calls = 0

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return await self.script(*args, **kwargs)


class RoundTrips:
    """Every acquire, release and extend script call a backend sends, counted."""

    def __init__(self, locks: RedisLocks) -> None:
        assert locks._scripts is not None and locks._runner is not None
        self.runner = locks._runner
        self.single = [Counted(s) for s in locks._scripts[:3]]
        acquire, release, extend = (cast(AsyncScript, c) for c in self.single)
        locks._scripts = (acquire, release, extend, locks._scripts[3])
        self._start = self.runner.round_trips

    @property
    def total(self) -> int:
        return sum(c.calls for c in self.single) + self.runner.round_trips - self._start


@pytest.fixture(
    params=[
        pytest.param("redis"),
        pytest.param("redis-cluster", marks=pytest.mark.slow),
    ]
)
def where(request: pytest.FixtureRequest) -> tuple[str, str]:
    """One Redis server (the test's namespace is cleaned after it), or a Redis Cluster of the
    session's own (a fresh namespace; the cluster goes at the end)."""
    if request.param == "redis-cluster":
        return request.getfixturevalue("redis_cluster_url"), f"t_{uuid.uuid4().hex[:12]}"
    return request.getfixturevalue("redis_url"), request.getfixturevalue("redis_namespace")


@pytest.fixture
async def locks(where: tuple[str, str]) -> AsyncIterator[RedisLocks]:
    async with RedisLocks(where[0], namespace=where[1]) as opened:
        yield opened


async def test_redis_locks_is_a_bulk_lock_backend(locks: RedisLocks) -> None:
    assert isinstance(locks, BulkLockBackend)


@pytest.mark.parametrize("bulk_on", [True, False], ids=["bulk", "one-by-one"])
async def test_concurrent_calls_on_different_keys_share_round_trips(
    where: tuple[str, str], bulk_on: bool
) -> None:
    """200 tasks take, extend and release 200 different keys at once: with bulk on they go in a
    handful of round trips (at most `DEPTH` alone, the rest together), each task still gets
    its own lease, and every key is free at the end. With bulk off, one round trip per call."""
    n = 200
    async with RedisLocks(where[0], namespace=where[1], bulk=bulk_on) as locks:
        trips = RoundTrips(locks)
        keys = [f"k{i}" for i in range(n)]
        leases = await asyncio.gather(*(locks.acquire(k, ttl=HELD) for k in keys))
        acquires = trips.total
        leases = await asyncio.gather(*(locks.extend(le, ttl=HELD) for le in leases))
        extends = trips.total - acquires
        await asyncio.gather(*(locks.release(le) for le in leases))
        releases = trips.total - acquires - extends
        assert [le.key for le in leases] == keys
        assert len({le.token for le in leases}) == n
        assert not any(await asyncio.gather(*(locks.locked(k) for k in keys)))
    if bulk_on:
        # A free slot sends what is queued at once: at most DEPTH alone, then one batch per
        # slot that frees (MAX_BATCH is above n). On a cluster a batch is one pipeline: a
        # round trip per node (three).
        most = 2 * bulk.DEPTH * (3 if "cluster" in where[0] else 1)
        for trips_of_kind in (acquires, extends, releases):
            assert trips_of_kind <= most, (acquires, extends, releases)
    else:
        assert (acquires, extends, releases) == (n, n, n)


async def test_try_acquire_many_takes_free_keys_and_leaves_busy_ones_alone(
    locks: RedisLocks, where: tuple[str, str]
) -> None:
    """Busy keys answer None and keep their holder, token and ttl; free keys get a lease with a
    fencing token above every earlier one of that key, and the server's ttl; a key named twice
    is taken once."""
    async with RedisLocks(where[0], namespace=where[1]) as other:
        busy = await other.acquire("b", ttl=HELD)
        pttl_before = await locks.client.pttl(locks.redis_key("b"))
        first = await locks.try_acquire_many(["a", "b", "c", "a"], ttl=5)
        assert [le is not None for le in first] == [True, False, True, False]
        assert await locks.client.get(locks.redis_key("b")) == busy.token
        assert 0 < await locks.client.pttl(locks.redis_key("b")) <= pttl_before
        a, c = cast(Lease, first[0]), cast(Lease, first[2])
        assert (a.key, c.key) == ("a", "c")
        for lease in (a, c):
            assert await locks.owned(lease)
            assert 0 < await locks.client.pttl(locks.redis_key(lease.key)) <= 5000
            assert lease.ttl == 5 and lease.backend == "redis"
        # Released only by its owner: the lease's token, whichever backend object sends it.
        forged = replace(busy, token="someone-else")
        assert await locks.release_many([a, c, forged]) == [True, True, False]
        assert await other.owned(busy)
        again = await locks.try_acquire_many(["c", "a"], ttl=5)
        assert [cast(Lease, le).fencing for le in again] == [c.fencing + 1, a.fencing + 1]
        await other.release(busy)
        assert await locks.release_many([le for le in again if le]) == [True, True]
        assert await locks.try_acquire_many([], ttl=5) == []


async def test_one_call_per_hash_slot_and_one_round_trip_per_node(locks: RedisLocks) -> None:
    """Forty keys: one script call on one server; on a cluster one per hash slot, pipelined in
    one round trip per node. Every key is answered in its own place either way."""
    keys = [f"slot-{i}" for i in range(40)]
    # Warm: a cluster node loads a script on its first NOSCRIPT (one more round trip).
    warm = await locks.try_acquire_many([f"warm-{i}" for i in range(40)], ttl=HELD)
    await locks.release_many([le for le in warm if le])
    trips = RoundTrips(locks)
    got = await locks.try_acquire_many(keys, ttl=HELD)
    assert [cast(Lease, le).key for le in got] == keys
    cluster = "cluster" in str(type(locks.client)).lower()
    assert trips.total == (3 if cluster else 1)
    assert len({le.fencing for le in got if le}) == 1  # every counter new: each starts at 1
    assert await locks.release_many([le for le in got if le]) == [True] * 40
    assert not any(await asyncio.gather(*(locks.locked(k) for k in keys)))


async def test_release_and_extend_many_act_only_for_the_owner(locks: RedisLocks) -> None:
    """A lease whose key expired and was taken by another token is neither released nor
    extended; the owner's are, with the new ttl on the server and on the lease."""
    mine = [cast(Lease, le) for le in await locks.try_acquire_many(["x", "y"], ttl=5)]
    # y's lease runs out and someone else takes the key.
    await locks.client.delete(locks.redis_key("y"))
    thief = await locks.acquire("y", ttl=HELD)
    extended = await locks.extend_many(mine, ttl=20)
    assert extended[1] is None
    x = cast(Lease, extended[0])
    assert x.ttl == 20 and x.expires_at > mine[0].expires_at
    assert 5000 < await locks.client.pttl(locks.redis_key("x")) <= 20000
    assert await locks.client.get(locks.redis_key("y")) == thief.token
    forged = replace(thief, token="not-the-owner")
    assert await locks.release_many([x, mine[1], forged]) == [True, False, False]
    assert await locks.owned(thief)
    with pytest.raises(LockNotOwned):
        await locks.release(x)
    await locks.release(thief)


async def test_bulk_calls_refuse_bad_input_and_a_closed_backend(
    redis_url: str, redis_namespace: str
) -> None:
    locks = RedisLocks(redis_url, namespace=redis_namespace)
    with pytest.raises(EngineClosed):
        await locks.try_acquire_many(["a"], ttl=5)
    await locks.open()
    try:
        for keys, ttl in ((["a", ""], 5), (["a"], 0), ("ab", 5), (["a", 3], 5)):
            with pytest.raises(InvalidInput):
                await locks.try_acquire_many(keys, ttl=ttl)  # type: ignore[arg-type]
        assert not await locks.locked("a")  # nothing changed
        with pytest.raises(InvalidInput):
            await locks.release_many(["a"])  # type: ignore[list-item]
        with pytest.raises(InvalidInput):
            await locks.extend_many([], ttl=-1)
    finally:
        await locks.aclose()


async def test_missing_fencing_counters_are_started_from_the_floor(
    where: tuple[str, str],
) -> None:
    """With a fence floor, a bulk try over keys whose counters Redis lost starts each one
    above its floor, as the one-key path does."""

    async def floor(key: str) -> int:
        return {"p": 500, "q": 900}[key]

    async with RedisLocks(where[0], namespace=where[1], fence_floor=floor, fence_gap=10) as locks:
        got = await locks.try_acquire_many(["p", "q"], ttl=5)
        assert [cast(Lease, le).fencing for le in got] == [511, 911]
        assert await locks.release_many([le for le in got if le]) == [True, True]


async def test_a_caller_cancelled_while_its_batch_is_in_flight_leaves_no_key_behind(
    redis_url: str, redis_namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bulk, "DEPTH", 1)
    async with RedisLocks(redis_url, namespace=redis_namespace) as locks:
        alone, sent, answer = asyncio.Event(), asyncio.Event(), asyncio.Event()
        attempts = Attempts(locks)

        async def hold_the_slot() -> None:  # the first call holds the only slot
            await alone.wait()

        attempts.before[1] = hold_the_slot
        assert locks._runner is not None
        real = locks._runner.acquire

        async def held_back(*args: Any, **kwargs: Any) -> Any:
            replies = await real(*args, **kwargs)  # the keys are taken on the server...
            sent.set()
            await answer.wait()  # ...and the answers wait here
            return replies

        locks._runner.acquire = held_back  # type: ignore[method-assign]
        first = asyncio.create_task(locks._acquire("k0", HELD, 0))
        await wait_until(lambda: attempts.calls == 1, what="the first call sent")
        queued = [asyncio.create_task(locks._acquire(k, HELD, 0)) for k in ("k1", "k2")]
        await asyncio.sleep(0.05)
        alone.set()
        await sent.wait()
        assert await locks.locked("k1") and await locks.locked("k2")
        for task in queued:
            task.cancel()
        await asyncio.gather(*queued, return_exceptions=True)
        answer.set()
        await locks.release(await first)

        async def freed() -> bool:
            return not await locks.locked("k1") and not await locks.locked("k2")

        await wait_until(freed, what="the abandoned keys freed")


async def test_a_queued_attempt_is_bounded_by_its_own_bound(
    redis_url: str, redis_namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An acquire queued behind a slow call gives up at its own bound (LockUnavailable), not
    when the slot frees; nothing stays held for it."""
    monkeypatch.setattr(bulk, "DEPTH", 1)
    async with RedisLocks(redis_url, namespace=redis_namespace, socket_timeout=5.0) as locks:
        alone = asyncio.Event()
        attempts = Attempts(locks)

        async def hold_the_slot() -> None:  # the first call holds the only slot
            await alone.wait()

        attempts.before[1] = hold_the_slot
        first = asyncio.create_task(locks._acquire("k0", HELD, 10.0))
        await wait_until(lambda: attempts.calls == 1, what="the first call sent")
        try:
            # wait=0.1: the attempt's bound is 0.1 s; the slot stays busy until `alone` is set.
            with pytest.raises(LockUnavailable):
                await asyncio.wait_for(locks._acquire("q", HELD, 0.1), timeout=3.0)
        finally:
            alone.set()
        await locks.release(await first)
        assert not await locks.locked("q")


async def test_cancelled_try_acquire_many_gives_back_what_its_first_round_took(
    redis_url: str, redis_namespace: str
) -> None:
    """A caller cancelled while try_acquire_many starts a missing fencing counter gives back
    the keys the first round took (not left held until their ttl)."""
    asked = asyncio.Event()
    stall = asyncio.Event()

    async def floor(key: str) -> int:
        if key == "fresh":
            asked.set()
            await stall.wait()
        return 0

    async with RedisLocks(redis_url, namespace=redis_namespace, fence_floor=floor) as locks:
        await locks.release(await locks._acquire("known", HELD, 0))  # its counter exists
        task = asyncio.create_task(locks.try_acquire_many(["known", "fresh"], ttl=HELD))
        await asyncio.wait_for(asked.wait(), timeout=5.0)
        assert await locks.locked("known")  # taken by the first round
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stall.set()

        async def freed() -> bool:
            return not await locks.locked("known") and not await locks.locked("fresh")

        await wait_until(freed, what="the keys of the cancelled call freed")


# --- many tasks in two processes, then the history checked --------------------------------

Record = tuple[str, int, int, int]  # key, fencing token, held from, held until (monotonic ns)


async def _hammer(
    url: str, namespace: str, tasks: int, rounds: int, keys: int, peer: str | None = None
) -> list[Record]:
    """`tasks` tasks each take a random key `rounds` times (waiting for it), hold it a moment
    and release it; one record per lease: held from just after the acquire returned to just
    before the release was sent. With `peer`, first wait until that Redis key exists (the
    other process is ready), else set it (this one is)."""
    records: list[Record] = []
    rng = random.Random()
    async with RedisLocks(url, namespace=namespace, max_connections=20) as locks:
        ready = f"flowlock:{namespace}:ready"
        if peer is None:
            await locks.client.set(ready, "1", ex=60)
        else:

            async def peer_ready() -> bool:
                return bool(await locks.client.exists(ready))

            await wait_until(peer_ready, within=60, what="the other process ready")

        async def one() -> None:
            for _ in range(rounds):
                key = f"hot-{rng.randrange(keys)}"
                lease = await locks.acquire(key, ttl=HELD, wait=HELD)
                start = time.monotonic_ns()
                await asyncio.sleep(rng.choice((0, 0, 0.001)))
                end = time.monotonic_ns()
                await locks.release(lease)
                records.append((key, lease.fencing, start, end))

        await asyncio.gather(*(one() for _ in range(tasks)))
    return records


def _hammer_in_process(url: str, namespace: str, tasks: int, rounds: int, keys: int) -> Any:
    return asyncio.run(_hammer(url, namespace, tasks, rounds, keys))


def _check_history(records: list[Record]) -> None:
    """Per key: fencing tokens unique, and in token order each holder's time ends before the
    next one's begins (no two holders at once, tokens increasing with time)."""
    by_key: dict[str, list[Record]] = defaultdict(list)
    for record in records:
        by_key[record[0]].append(record)
    for key, held in by_key.items():
        held.sort(key=lambda r: r[1])
        tokens = [r[1] for r in held]
        assert len(set(tokens)) == len(tokens), f"{key}: a fencing token handed out twice"
        for before, after in itertools.pairwise(held):
            assert before[3] <= after[2], f"{key}: tokens {before[1]} and {after[1]} overlap"


async def test_many_tasks_in_two_processes_keep_every_key_exclusive_and_fenced(
    redis_url: str, redis_namespace: str
) -> None:
    """40 tasks here and 40 in another process take 12 keys over and over through the
    coalesced path (batches of acquires, releases on different keys): the history shows one
    holder per key at a time and fencing tokens increasing with time."""
    args = (redis_url, redis_namespace, 40, 6, 12)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=context) as pool:
        other = asyncio.get_running_loop().run_in_executor(pool, _hammer_in_process, *args)
        here = await _hammer(*args, peer="ready")
        there = await other
    assert len(here) == len(there) == 240
    _check_history(here + there)
