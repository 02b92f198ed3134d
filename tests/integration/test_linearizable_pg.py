"""What callers saw, judged linearizable, on real PostgreSQL under every strategy.

The quick Recorder run on a real server: one engine with batching off (so every call goes to
the database on its own and calls on one instance race there), an instance per strategy
(optimistic, pessimistic, adaptive, distributed on Redis and distributed on advisory locks),
eight tasks per instance starting together, each making a seeded mix of reservations,
restocks and reads. Every call is recorded as it is made (``Recorder``), and
``check_linearizable`` must find one order of them per instance that explains what every
caller saw. The test also shows from the recorded times that calls were in flight together:
a history of calls made one after another would be linearizable trivially.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

import flowlock
from flowlock import examples
from flowlock.checker import CallRecord, Recorder, check, check_linearizable
from flowlock.locks import AdvisoryLocks
from flowlock.locks.redis import RedisLocks
from flowlock.stores.postgres import PostgresStore

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

TASKS = 8  # callers per instance, all started together
CALLS = 6  # calls per caller
STOCK = 1000  # never runs out: every reservation can apply
SEED = 20_22


@dataclass
class Setup:
    engine: flowlock.Engine
    strategies: dict[str, str | flowlock.Distributed]  # instance id -> what its calls ask for


@pytest.fixture
async def setup(
    pg_url: str, pg_schema: str, redis_url: str, redis_namespace: str
) -> AsyncIterator[Setup]:
    """An engine without batching on a pool of 12 connections, leasing from Redis; advisory
    locks (6 connections) for a Distributed strategy object of their own."""
    store = PostgresStore(pg_url, schema=pg_schema, pool_size=12, pipeline=False)
    redis = RedisLocks(redis_url, namespace=redis_namespace, fence_floor=store.fencing_floor)
    advisory = AdvisoryLocks(pg_url, namespace=redis_namespace, schema=pg_schema, pool_size=6)
    async with flowlock.Engine(store, locks=redis, batching=False) as engine, advisory:
        await engine.register(examples.inventory())
        # One lock backend per instance: two would each grant a lease on it.
        yield Setup(
            engine,
            {
                "optimistic": "optimistic",
                "pessimistic": "pessimistic",
                "adaptive": "adaptive",
                "distributed-redis": "distributed",
                "distributed-advisory": flowlock.Distributed(locks=advisory),
            },
        )


async def caller(
    setup: Setup, recorder: Recorder, iid: str, rng: random.Random, go: asyncio.Event
) -> None:
    """CALLS recorded calls on ``iid``: reserve one, restock two, or read."""
    engine, strategy = setup.engine, setup.strategies[iid]
    await go.wait()
    for _ in range(CALLS):
        roll = rng.random()
        if roll < 0.25:
            with recorder.invoke(iid, "get") as call:
                call.ok(await engine.get(iid))
            continue
        event, qty = ("restock", 2) if roll < 0.45 else ("reserve", 1)
        # Plain optimistic may give up after losing 3 races: recorded as a call that failed
        # (nothing written), which the checker holds to having had no effect.
        with (
            contextlib.suppress(flowlock.ConflictRetriesExhausted),
            recorder.invoke(iid, "fire", event=event) as call,
        ):
            call.ok(await engine.fire(iid, event, payload={"qty": qty}, strategy=strategy))


def most_in_flight(calls: list[CallRecord]) -> int:
    """The most calls in flight at one moment (invoked, not yet completed)."""
    moments = sorted(
        [(c.invoked_at, 1) for c in calls]
        + [(c.completed_at if c.completed_at is not None else float("inf"), -1) for c in calls],
        key=lambda m: (m[0], m[1]),  # a call ending when another starts did not overlap it
    )
    most = now = 0
    for _, step in moments:
        now += step
        most = max(most, now)
    return most


def overlapping_writes(calls: list[CallRecord]) -> int:
    """Pairs of applied fires that were in flight together."""
    applied = [c for c in calls if c.op == "fire" and c.outcome == "ok" and not c.idempotent]
    return sum(
        1
        for i, a in enumerate(applied)
        for b in applied[i + 1 :]
        if a.invoked_at < (b.completed_at or 0) and b.invoked_at < (a.completed_at or 0)
    )


async def test_every_strategy_is_linearizable_on_postgresql(setup: Setup) -> None:
    """Eight callers per instance at once, batching off, one instance per strategy (Redis and
    advisory leases included): check_linearizable finds every instance's history linearizable,
    the calls overlapped in time, and the stored history is exactly once."""
    recorder = Recorder()
    engine = setup.engine
    for iid in setup.strategies:
        with recorder.invoke(iid, "create") as call:
            call.ok(await engine.create("inventory", instance_id=iid, data={"stock": STOCK}))
    master = random.Random(SEED)
    go = asyncio.Event()
    tasks = [
        asyncio.create_task(
            caller(setup, recorder, iid, random.Random(master.randrange(2**32)), go)
        )
        for iid in setup.strategies
        for _ in range(TASKS)
    ]
    await asyncio.sleep(0)
    go.set()
    errors = [e for e in await asyncio.gather(*tasks, return_exceptions=True) if e is not None]
    assert not errors, errors[:3]

    calls = recorder.calls
    verdict = check_linearizable(calls, examples.inventory())
    assert verdict.ok, verdict.violations
    assert verdict.instances == len(setup.strategies)
    assert verdict.calls == len(setup.strategies) * (1 + TASKS * CALLS)
    for iid in setup.strategies:
        mine = [c for c in calls if c.instance_id == iid]
        outcomes = Counter(c.outcome for c in mine)
        in_flight, writes = most_in_flight(mine), overlapping_writes(mine)
        print(f"{iid}: {dict(outcomes)}, at most {in_flight} calls in flight at once, "
              f"{writes} pairs of applied fires overlapping")  # fmt: skip
        assert outcomes["unknown"] == 0, [c for c in mine if c.outcome == "unknown"]
        assert in_flight >= 2 and writes >= 1, iid
        applied = sum(c.op == "fire" and c.outcome == "ok" and not c.idempotent for c in mine)
        history = await engine.history(iid)
        final = await engine.get(iid)
        exactly_once = check(final, history, initial_state="open", expected_applied=applied)
        assert exactly_once.ok, exactly_once.violations
