"""Fencing tokens that never repeat across Redis data losses (issue 10, item 2): a key's tokens
strictly increase however many times Redis comes back empty, whether or not a holder ever wrote
anything through the engine, because each time the counter is found missing the key's epoch in
PostgreSQL is bumped (committed) and the counter is started above it. Redis restarts use servers
of the tests' own; PostgreSQL gets a fresh schema per test."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import sys
import textwrap
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

import flowlock
from flowlock import examples
from flowlock._pg.fence import EPOCH_LOCK_CLASS
from flowlock.checker import check
from flowlock.core.errors import LockUnavailable
from flowlock.embedded import EmbeddedRedis
from flowlock.jobs import JobContext, RunOnce
from flowlock.locks.base import FenceEpochs, LockBackend
from flowlock.locks.redis import RedisLocks
from flowlock.locks.redis.fence import EPOCH_BITS
from flowlock.stores.postgres import PostgresStore
from lock_probes import wait_until

pytestmark = [pytest.mark.postgres]

SPAN = 1 << EPOCH_BITS


@pytest.fixture
def server() -> Iterator[EmbeddedRedis]:
    """A Redis of this test's own, to restart empty."""
    with EmbeddedRedis() as embedded:
        yield embedded


@pytest.fixture
async def store(pg_url: str, pg_schema: str) -> AsyncIterator[PostgresStore]:
    """A migrated PostgreSQL store in the test's schema (its fence_epochs are the source)."""
    opened = PostgresStore(pg_url, schema=pg_schema, pool_size=10)
    await opened.open()
    yield opened
    await opened.aclose()


async def _token(locks: LockBackend, key: str) -> int:
    lease = await locks.acquire(key, ttl=5, wait=5)
    await locks.release(lease)
    return lease.fencing


async def _empty_restart(server: EmbeddedRedis) -> None:
    await asyncio.to_thread(server.restart)


def _increasing(tokens: list[int]) -> None:
    assert all(a < b for a, b in itertools.pairwise(tokens)), tokens


@pytest.mark.slow
async def test_restart_redis_empty_twice_with_no_write_between(
    server: EmbeddedRedis, pg_url: str, pg_schema: str
) -> None:
    """An engine's Redis locks, a key nobody ever wrote through the engine: Redis restarted
    empty twice, one acquire before, between and after: each token is above every earlier one
    (before the fix the second and third repeated the first: floor 0 plus the gap each time)."""
    async with flowlock.Engine.connect(pg_url, schema=pg_schema, redis_url=server.url) as engine:
        locks = engine.locks
        assert locks is not None
        tokens = [await _token(locks, "never-written")]
        for _ in range(2):
            await _empty_restart(server)
            tokens.append(await _token(locks, "never-written"))
        _increasing(tokens)
        assert [t >> EPOCH_BITS for t in tokens] == [1, 2, 3]


@pytest.mark.slow
async def test_standalone_redis_locks_with_the_stores_epochs(
    server: EmbeddedRedis, store: PostgresStore
) -> None:
    """RedisLocks(fence_epochs=store.fence_epochs) on its own: three empty restarts, several
    acquires in each life of Redis, every token above every earlier one; the epoch row counts
    the starts of the counter."""
    tokens: list[int] = []
    async with RedisLocks(server.url, fence_epochs=store.fence_epochs) as locks:
        assert locks.fence_epochs is store.fence_epochs
        for life in range(4):
            if life:
                await _empty_restart(server)
            tokens += [await _token(locks, "k") for _ in range(3)]
    _increasing(tokens)
    epoch = await store.pool.fetchval(
        "SELECT epoch FROM flowlock_fence_epochs WHERE namespace = 'default' AND key = 'k'"
    )
    assert epoch == 4


@pytest.mark.slow
async def test_run_once_ticks_fail_across_two_empty_restarts_and_still_take_over(
    server: EmbeddedRedis, pg_url: str, pg_schema: str
) -> None:
    """RunOnce with a plain RedisLocks(url) (no floor, no epochs of its own): a tick whose fn
    fails, Redis restarted empty, run again (fails), restarted empty, run again: each run gets a
    higher token than the last, so each one takes the tick over and the last one completes it.
    Before the fix the token repeated (1), the claim needed a higher one, and the tick stayed
    failed ("running_elsewhere") for good."""
    seen: list[int] = []

    async def job(ctx: JobContext) -> str:
        seen.append(ctx.fencing)
        if len(seen) < 3:
            raise RuntimeError("flaky")
        return "done"

    async with (
        RedisLocks(server.url) as locks,
        RunOnce(locks, pg_url, schema=pg_schema, owner="me") as runner,
    ):
        assert locks.fence_epochs is runner.fence_epochs
        for _ in range(2):
            with pytest.raises(RuntimeError):
                await runner.run("report", "2024-05-01", job)
            await _empty_restart(server)
        result = await runner.run("report", "2024-05-01", job)
    assert result.status == "ran"
    assert result.value == "done"
    _increasing(seen)
    assert locks.fence_epochs is None  # given back at the runner's close


@pytest.mark.slow
@pytest.mark.parametrize("gap", [1_000_000, 5_000_000_000])
async def test_an_upgraded_store_keeps_old_tokens_below_new_ones(
    server: EmbeddedRedis, pg_url: str, pg_schema: str, gap: int
) -> None:
    """Tokens handed out under the floor scheme (floor + gap; the default gap, and one of 5e9,
    above the first epoch's range), then epochs (Engine.connect; with a custom gap, RedisLocks
    given the same gap): the first token of each key with epochs is above the old counter
    (unstamped, so an epoch is taken), and after an empty restart every new token is above every
    old one, recorded or not, also for a key nobody wrote; the history stays increasing and
    checks out."""
    old_store = PostgresStore(pg_url, schema=pg_schema, pool_size=5)
    old_locks = RedisLocks(server.url, fence_floor=old_store.fencing_floor, fence_gap=gap)
    async with flowlock.Engine(old_store, locks=old_locks) as old:
        await old.register(examples.inventory())
        await old.create("inventory", instance_id="sku", data={"stock": 100})
        await old.fire("sku", "reserve", strategy="distributed")
        await _empty_restart(server)
        await old.fire("sku", "reserve", strategy="distributed")  # floor 1 + the gap
        unrecorded = await _token(old_locks, "sku")  # issued, never written
        never_written = await _token(old_locks, "job-key")  # no floor: 0 + the gap
    assert never_written == gap + 1

    store = PostgresStore(pg_url, schema=pg_schema, pool_size=5)
    if gap == 1_000_000:
        new = flowlock.Engine.connect(pg_url, schema=pg_schema, redis_url=server.url)
    else:
        locks = RedisLocks(
            server.url, fence_floor=store.fencing_floor, fence_gap=gap,
            fence_epochs=store.fence_epochs,
        )  # fmt: skip
        new = flowlock.Engine(store, locks=locks)
    async with new:
        await new.register(examples.inventory())
        assert new.locks is not None
        # Redis still has the old counters, but not stamped with the server's replication id
        # (see flowlock.locks.redis.fence): the first acquire takes an epoch, above them.
        upgraded = await _token(new.locks, "job-key")
        assert upgraded > never_written
        assert await _token(new.locks, "job-key") == upgraded + 1  # then the counter goes on
        await new.fire("sku", "reserve", strategy="distributed")
        await _empty_restart(server)
        await new.fire("sku", "reserve", strategy="distributed")
        assert await _token(new.locks, "job-key") > upgraded + 1
        history = await new.history("sku")
        tokens = [e.fencing_token for e in history]
        assert None not in tokens
        _increasing([t for t in tokens if t is not None])
        assert history[-1].fencing_token > unrecorded  # type: ignore[operator]
        verdict = check(await new.get("sku"), history, expected_applied=4)
        assert verdict.ok, verdict.violations


async def test_a_full_epoch_takes_the_next_one(redis_url: str, redis_namespace: str,
                                               store: PostgresStore) -> None:  # fmt: skip
    """A counter one token short of its epoch's end hands that token out, then the next
    acquire starts the next epoch (the counter never crosses into a range a later epoch would
    hand out again)."""
    async with RedisLocks(
        redis_url, namespace=redis_namespace, fence_epochs=store.fence_epochs
    ) as locks:
        first = await _token(locks, "hot")
        assert first == SPAN + 1
        await locks.client.set(locks.fence_key("hot"), 2 * SPAN - 2)
        assert await _token(locks, "hot") == 2 * SPAN - 1
        assert await _token(locks, "hot") == 2 * SPAN + 1
        assert await _token(locks, "hot") == 2 * SPAN + 2


async def test_a_floor_past_the_last_epoch_is_refused_before_any_bump(
    redis_url: str, redis_namespace: str, store: PostgresStore
) -> None:
    """A fence floor whose next epoch would pass 2^53 is LockUnavailable before the epoch is
    bumped: nothing is committed, so the key is not left unlockable, and another key is fine."""

    async def huge(key: str) -> int:
        return 1 << 60

    async with RedisLocks(
        redis_url, namespace=redis_namespace, fence_floor=huge, fence_epochs=store.fence_epochs
    ) as locks:
        with pytest.raises(LockUnavailable, match="used up"):
            await _token(locks, "far")
    rows = await store.pool.fetchval("SELECT count(*) FROM flowlock_fence_epochs WHERE key = 'far'")
    assert rows == 0
    async with RedisLocks(
        redis_url, namespace=redis_namespace, fence_epochs=store.fence_epochs
    ) as locks:
        assert await _token(locks, "far") == SPAN + 1


async def test_an_advance_holds_the_key_until_its_counter_is_started(
    store: PostgresStore, pg_schema: str
) -> None:
    """While one advance of a key is inside its ``async with`` (the counter not started yet),
    another advance of that key waits (seen in PostgreSQL's lock queue), and gets a higher
    epoch after; one whose bound runs out first is LockUnavailable within it. Another key does
    not wait. An advance that fails inside leaves no lock behind (its connection is ended, not
    given back)."""
    epochs, ns = store.fence_epochs, pg_schema  # a namespace of this test's own

    async def queued() -> bool:
        return await _epoch_lock_waiters(store, ns, "k") >= 1

    async with epochs.advance(ns, "k", at_least=0, bound=5) as first:
        assert first == 1
        second = asyncio.create_task(_advance_once(epochs, "k", bound=10, namespace=ns))
        await wait_until(queued, what="the second advance queueing for the key's lock")
        other = await _advance_once(epochs, "other", bound=5, namespace=ns)
        assert other == 1
        began = time.monotonic()
        with pytest.raises(LockUnavailable):
            await _advance_once(epochs, "k", bound=0.3, namespace=ns)
        assert time.monotonic() - began < 5
        assert not second.done()
    # The timed-out advance may have been cancelled before or after its bump.
    assert await second in (2, 3)
    with pytest.raises(RuntimeError):
        async with epochs.advance(ns, "k", at_least=0, bound=5):
            raise RuntimeError("the Redis call failed")
    assert await _advance_once(epochs, "k", bound=5, namespace=ns) >= 4
    assert await _advance_once(epochs, "k", bound=5, at_least=100, namespace=ns) == 100


async def _advance_once(
    epochs: FenceEpochs, key: str, *, bound: float, at_least: int = 0, namespace: str = "ns"
) -> int:
    async with epochs.advance(namespace, key, at_least=at_least, bound=bound) as epoch:
        return epoch


async def _epoch_lock_waiters(store: PostgresStore, namespace: str, key: str) -> int:
    """Sessions queued (not granted) for the fencing epoch lock of ``key`` in ``namespace``: the
    two-int advisory lock (EPOCH_LOCK_CLASS, hashtext(namespace:key)) in ``pg_locks``."""
    waiting: int = await store.pool.fetchval(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
        " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        " AND classid = $1::bigint::oid AND objsubid = 2"
        " AND objid = (hashtext($2 || ':' || $3)::bigint & 4294967295)::oid",
        EPOCH_LOCK_CLASS,
        namespace,
        key,
    )
    return waiting


# --- many acquirers, several processes, right after an empty restart --------------------------

WORKER = textwrap.dedent(
    """
    import asyncio, json, sys, time
    from flowlock.locks.redis import RedisLocks
    from flowlock.stores.postgres import PostgresStore

    async def main(redis_url, pg_url, schema, keys, rounds):
        store = PostgresStore(pg_url, schema=schema, pool_size=4, auto_migrate=False)
        await store.open()
        async with RedisLocks(redis_url, fence_epochs=store.fence_epochs) as locks:
            async def one(key):
                out = []
                for _ in range(rounds):
                    lease = await locks.acquire(key, ttl=30, wait=30)
                    out.append([key, lease.fencing, time.monotonic()])
                    await locks.release(lease)
                return out
            done = await asyncio.gather(*(one(k) for k in keys for _ in range(3)))
        await store.aclose()
        print(json.dumps([row for rows in done for row in rows]))

    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(","),
                     int(sys.argv[5])))
    """
)

KEYS = [f"fresh-{i}" for i in range(8)]
ROUNDS = 4


@pytest.mark.slow
async def test_racing_acquirers_after_an_empty_restart_never_repeat_a_token(
    server: EmbeddedRedis, store: PostgresStore, pg_url: str, pg_schema: str
) -> None:
    """Right after an empty restart, 2 processes and 2 backends in this one (3 tasks per key
    each) race on 8 keys (half of them held before the restart, half new): no token of a key is
    handed out twice, each key's tokens rise in the order its holders held it (monotonic clock, one
    machine), and each key's tokens after the restart are above its tokens before. Two engines
    fire distributed transitions on new instances at the same time: their histories check out
    and their tokens rise."""
    before: dict[str, list[int]] = defaultdict(list)
    async with RedisLocks(server.url, fence_epochs=store.fence_epochs) as warm:
        for key in KEYS[::2]:
            before[key] += [await _token(warm, key) for _ in range(3)]
    await _empty_restart(server)

    env = {**os.environ, "PYTHONPATH": str(Path(flowlock.__file__).parents[1])}
    args = [server.url, pg_url, pg_schema, ",".join(KEYS), str(ROUNDS)]
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            WORKER,
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        for _ in range(2)
    ]
    try:
        rows, histories = await asyncio.gather(
            _local_acquirers(server.url, store, pg_url, pg_schema),
            _engines_firing(server.url, pg_url, pg_schema),
        )
        for proc in procs:
            async with asyncio.timeout(120):
                out, err = await proc.communicate()
            assert proc.returncode == 0, err.decode()
            rows += [tuple(r) for r in json.loads(out)]
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    assert len(rows) == len(KEYS) * 3 * ROUNDS * 4
    by_key: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for key, token, at in rows:
        by_key[str(key)].append((float(at), int(token)))
    assert sorted(by_key) == KEYS
    for key, held in by_key.items():
        ordered = [token for _, token in sorted(held)]
        assert len(set(ordered)) == len(ordered) == 3 * ROUNDS * 4
        _increasing(before[key] + ordered)
    for instance, (current, history) in histories.items():
        # Never down; equal within a batch, whose rows are written under its one lease.
        tokens = [e.fencing_token or 0 for e in history]
        assert tokens == sorted(tokens), tokens
        verdict = check(current, history, expected_applied=len(history))
        assert verdict.ok, (instance, verdict.violations)


async def _local_acquirers(
    redis_url: str, store: PostgresStore, pg_url: str, pg_schema: str
) -> list[tuple[str, int, float]]:
    other = PostgresStore(pg_url, schema=pg_schema, pool_size=4)
    await other.open()
    rows: list[tuple[str, int, float]] = []
    try:
        async with (
            RedisLocks(redis_url, fence_epochs=store.fence_epochs) as a,
            RedisLocks(redis_url, fence_epochs=other.fence_epochs) as b,
        ):

            async def one(locks: RedisLocks, key: str) -> None:
                for _ in range(ROUNDS):
                    lease = await locks.acquire(key, ttl=30, wait=30)
                    rows.append((key, lease.fencing, time.monotonic()))
                    await locks.release(lease)

            await asyncio.gather(*(one(x, k) for x in (a, b) for k in KEYS for _ in range(3)))
    finally:
        await other.aclose()
    return rows


async def _engines_firing(
    redis_url: str, pg_url: str, schema: str
) -> dict[str, tuple[flowlock.Instance, list[flowlock.HistoryEntry]]]:
    instances = [f"sku-{i}" for i in range(4)]
    async with (
        flowlock.Engine.connect(pg_url, schema=schema, redis_url=redis_url) as one,
        flowlock.Engine.connect(pg_url, schema=schema, redis_url=redis_url) as two,
    ):
        for engine in (one, two):
            await engine.register(examples.inventory())
        for instance in instances:
            await one.create("inventory", instance_id=instance, data={"stock": 1000})
        await asyncio.gather(
            *(
                engine.fire(instance, "reserve", strategy="distributed")
                for engine in (one, two)
                for instance in instances
                for _ in range(5)
            )
        )
        return {i: (await one.get(i), list(await one.history(i))) for i in instances}
