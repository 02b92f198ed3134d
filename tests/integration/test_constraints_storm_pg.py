"""Many concurrent callers on PostgreSQL constraints: never more holders than the limit,
counted with the test's own SQL after every step and replayed from the store's log, under the
optimistic, pessimistic and distributed strategies; keys swapped both ways at once without a
deadlock."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import pytest

import flowlock
from flowlock._inspect import check_instances
from flowlock.stores.constraint_store import ConstraintRows
from flowlock.stores.postgres import PostgresStore
from pg_constraints_kit import Make, Sql, engines, reading, store_of

pytestmark = pytest.mark.postgres


@pytest.fixture
async def sql(pg_url: str, pg_schema: str) -> AsyncIterator[Sql]:
    """The test's own connection, reading the test's schema."""
    async with reading(pg_url, pg_schema) as found:
        yield found


@pytest.fixture
async def make(pg_url: str, pg_schema: str) -> AsyncIterator[Make]:
    """Opens engines on the test's schema (closed at the end)."""
    async with engines(pg_url, pg_schema) as build:
        yield build


@pytest.mark.parametrize("strategy", ["optimistic", "pessimistic"])
async def test_many_callers_never_hold_more_than_the_limit(
    make: Make, sql: Sql, strategy: str
) -> None:
    """200 tasks over 20 keys of capacity 3 move in and out of review concurrently (two
    engines, batching on): after every step the slot rows never show more than 3 holders of a
    key, the counters agree with the rows, and every key's log, replayed, never goes above
    its limit."""
    await storm([await make(pool_size=6, limit=3, strategy=strategy) for _ in range(2)], sql)


@pytest.mark.slow
async def test_many_callers_under_the_distributed_strategy(
    make: Make, sql: Sql, redis_url: str, redis_namespace: str
) -> None:
    """The same storm under the distributed strategy (Redis leases, fencing tokens checked by
    the same statement that applies the claims)."""
    from flowlock.locks.redis import RedisLocks

    def locks(store: PostgresStore) -> RedisLocks:
        return RedisLocks(redis_url, namespace=redis_namespace, fence_floor=store.fencing_floor)

    engines = [
        await make(pool_size=6, limit=3, strategy="distributed", locks=locks) for _ in range(2)
    ]
    await storm(engines, sql)


async def storm(engines: list[flowlock.Engine], sql: Sql) -> None:
    """200 reviews over 20 keys, each entering (retrying while full) and leaving once, the
    most held of any key counted after every step; then `flowlock check` (the checker over
    every history and the constraint rows) finds nothing wrong."""
    ids = [f"t{n}" for n in range(200)]
    for n, iid in enumerate(ids):
        await engines[0].create("review", instance_id=iid, data={"r": f"k{n % 20}"})
    seen: list[int] = []
    check = asyncio.Lock()

    async def observe() -> None:
        async with check:
            seen.append(await sql.most_held())

    async def task(n: int) -> None:
        eng = engines[n % 2]
        rng = random.Random(n)
        for _ in range(200):
            try:
                await eng.fire(ids[n], "start")
                break
            except flowlock.CapacityReached:
                await asyncio.sleep(rng.uniform(0.001, 0.01))
        else:
            raise AssertionError(f"{ids[n]} never got a slot")
        await observe()
        await asyncio.sleep(rng.uniform(0, 0.005))
        await eng.fire(ids[n], "finish")
        await observe()

    await asyncio.wait_for(asyncio.gather(*(task(n) for n in range(200))), 120)
    assert max(seen) <= 3, max(seen)
    assert await sql.most_held() == 0
    assert await sql.val("SELECT coalesce(max(holders), 0) FROM {s}.flowlock_slot_log") <= 3
    assert await sql.val("SELECT coalesce(sum(holders), 0) FROM {s}.flowlock_capacity") == 0
    assert await sql.val("SELECT count(*) FROM {s}.flowlock_slot_log") == 400
    replay(await store_of(engines[0]).constraint_rows())
    report = await check_instances(engines[0], None)
    assert report.verdict.ok, report.verdict.violations
    assert report.slot_events == 400


def replay(rows: ConstraintRows) -> None:
    """Each key's log numbered from 1 without a gap, each event's holders the one before plus
    its delta, never above its limit nor below 0; each counter its log's last state."""
    last: dict[tuple[str, str], tuple[int, int]] = {}
    for e in rows.log:
        seq, held = last.get((e.kind, e.key), (0, 0))
        assert (e.seq, e.holders) == (seq + 1, held + e.delta), e
        assert 0 <= e.holders <= e.limit, e
        last[(e.kind, e.key)] = (e.seq, e.holders)
    for c in rows.counters:
        if (c.kind, c.key) in last:
            assert (c.seq, c.holders) == last[(c.kind, c.key)], c
    held_now: dict[tuple[str, str], int] = {}
    for slot in rows.slots:
        held_now[(slot.kind, slot.key)] = held_now.get((slot.kind, slot.key), 0) + 1
    assert held_now == {(c.kind, c.key): c.holders for c in rows.counters if c.holders}


async def test_keys_swapped_both_ways_at_once_never_deadlock(make: Make, sql: Sql) -> None:
    """40 reviews reassigned back and forth between two keys concurrently, half each way (each
    commit gives back a slot of one key and takes one of the other): every reassign applies,
    none meets a deadlock, and the counters agree with the slot rows."""
    eng = await make(pool_size=8, limit=100)
    ids = [f"r{n}" for n in range(40)]
    for n, iid in enumerate(ids):
        await eng.create("review", instance_id=iid, data={"r": "ab"[n % 2]})
        await eng.fire(iid, "start")

    async def swap(n: int) -> None:
        keys = ["b", "a"] if n % 2 == 0 else ["a", "b"]
        for i in range(6):
            await eng.fire(ids[n], "reassign", payload={"to": keys[i % 2]})

    await asyncio.wait_for(asyncio.gather(*(swap(n) for n in range(40))), 60)
    assert await sql.counter("a") == len(await sql.holders("a")) == 20
    assert await sql.counter("b") == len(await sql.holders("b")) == 20
    replay(await store_of(eng).constraint_rows())
