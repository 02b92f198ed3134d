"""The outbox dispatcher on PostgreSQL: two engines' dispatchers share one schema while a third
engine's callers emit thousands of messages.

Every message is delivered (a sink table with a unique index on the key holds each once), none
is delivered by two engines at once, the messages of one instance go in order, and the
reserve -> charge -> ship chains driven by handlers' Thens apply each step exactly once. The
checker finds every history whole; the crash matrix (tests/integration/test_outbox_crash_pg.py)
kills processes on top of this. An idle dispatcher sends nothing until another engine's commit
wakes it (NOTIFY).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg
import pytest

import flowlock
import pg_budget
from flowlock.checker import check
from flowlock.core.outbox import OUTBOX_ACTOR, parse_key
from flowlock.locks import MemoryLocks
from flowlock.stores.postgres import PostgresStore
from lock_probes import wait_until
from outbox_kit import noter, shop

pytestmark = pytest.mark.postgres

SqlHistory = Callable[..., Awaitable[Any]]
BOUND = 120.0
NOTERS = 600  # instances of `noter`
NOTES = 5  # notes fired at each, each emitting two messages
ORDERS = 100  # shop orders: reserve by a caller, charged and shipped by handlers' Thens

SINK = """
CREATE TABLE outbox_dispatch_sink (
    key text PRIMARY KEY,
    engine text NOT NULL
)
"""


@dataclass(frozen=True)
class Delivery:
    """One handler run: which engine, the message, from when to when (monotonic)."""

    engine: str
    key: str
    attempt: int
    start: float
    end: float


@contextlib.asynccontextmanager
async def engine_on(url: str, schema: str, **options: Any) -> AsyncIterator[flowlock.Engine]:
    store = PostgresStore(url, schema=schema, pool_size=4)
    async with flowlock.Engine(store, locks=MemoryLocks(), **options) as engine:
        await engine.register(noter())
        await engine.register(shop())
        yield engine


class Handlers:
    """An engine's handlers: each records the key in the sink (its unique index keeps one row
    a key) and the delivery in `deliveries`; `charge` and `ship` answer the chain's Thens."""

    def __init__(self, name: str, sink: asyncpg.Pool, deliveries: list[Delivery]) -> None:
        self.name, self.sink, self.deliveries = name, sink, deliveries

    async def record(self, message: flowlock.Message) -> None:
        start = time.monotonic()
        await self.sink.execute(
            "INSERT INTO outbox_dispatch_sink (key, engine) VALUES ($1, $2)"
            " ON CONFLICT (key) DO NOTHING",
            message.key,
            self.name,
        )
        end = time.monotonic()
        self.deliveries.append(Delivery(self.name, message.key, message.attempt, start, end))

    async def charge(self, message: flowlock.Message) -> flowlock.Then:
        await self.record(message)
        return flowlock.Then("charged", {"by": self.name})

    async def ship(self, message: flowlock.Message) -> flowlock.Then:
        await self.record(message)
        return flowlock.Then("shipped")

    def register(self, engine: flowlock.Engine) -> None:
        engine.on_emit("k", self.record, concurrency=16)
        engine.on_emit("charge", self.charge, concurrency=16)
        engine.on_emit("ship", self.ship, concurrency=16)


async def _sink(url: str, schema: str) -> asyncpg.Pool:
    async with engine_on(url, schema, outbox=False):
        pass  # migrated: the sink goes in the same schema
    admin = await pg_budget.connect(url)
    try:
        await admin.execute(f'SET search_path TO "{schema}"')
        await admin.execute(SINK)
    finally:
        await admin.close()
    return await asyncpg.create_pool(
        url, min_size=1, max_size=4, server_settings={"search_path": schema}
    )


def _assert_one_at_a_time_and_in_order(deliveries: list[Delivery]) -> None:
    """No key delivered by two at once; a later message of an instance is claimable only once
    the earlier one is done, so its first delivery starts after the earlier one's last ended."""
    by_key: dict[str, list[Delivery]] = defaultdict(list)
    for d in sorted(deliveries, key=lambda d: d.start):
        by_key[d.key].append(d)
    for runs in by_key.values():
        for before, after in itertools.pairwise(runs):
            assert before.end <= after.start, (before, after)
    by_instance: dict[str, list[tuple[int, int, list[Delivery]]]] = defaultdict(list)
    for key, runs in by_key.items():
        iid, version, n = parse_key(key)
        by_instance[iid].append((version, n, runs))
    for iid, messages in by_instance.items():
        messages.sort(key=lambda m: (m[0], m[1]))
        for (_, _, earlier), (_, _, later) in itertools.pairwise(messages):
            assert earlier[-1].end <= later[0].start, (iid, earlier, later)


async def _emit(caller: flowlock.Engine, noters: list[str], orders: list[str]) -> None:
    """Create every instance, then fire the notes and the reserves, 32 calls at a time."""
    await asyncio.gather(*(caller.create("noter", instance_id=i) for i in noters))
    await asyncio.gather(*(caller.create("shop", instance_id=i) for i in orders))
    lanes = asyncio.Semaphore(32)

    async def notes(iid: str) -> None:
        for _ in range(NOTES):
            async with lanes:
                await caller.fire(iid, "note", payload={"count": 2})

    async def reserve(iid: str) -> None:
        async with lanes:
            await caller.fire(iid, "reserve")

    await asyncio.gather(*(notes(i) for i in noters), *(reserve(i) for i in orders))


@pytest.mark.slow  # 5 s; the crash matrix and the claim tests keep the quick suite's share
async def test_two_dispatchers_deliver_every_message_once_in_order(
    pg_url: str, pg_schema: str, sql_history: SqlHistory
) -> None:
    """Thousands of transitions emit while two engines dispatch: every message done and in the
    sink once, no two deliveries of a key at once, each instance's messages in order, each
    chain's Thens applied once under their message keys; the checker and the SQL agree."""
    sink = await _sink(pg_url, pg_schema)
    deliveries: list[Delivery] = []
    noters = [f"n{i:03}" for i in range(NOTERS)]
    orders = [f"o{i:03}" for i in range(ORDERS)]
    total = NOTERS * NOTES * 2 + ORDERS * 2
    try:
        async with (
            engine_on(pg_url, pg_schema, outbox=False) as caller,
            engine_on(pg_url, pg_schema) as one,
            engine_on(pg_url, pg_schema) as two,
        ):
            Handlers("one", sink, deliveries).register(one)
            Handlers("two", sink, deliveries).register(two)
            await _emit(caller, noters, orders)
            store = caller.store
            assert isinstance(store, PostgresStore)

            async def delivered() -> bool:
                return (await store.count_messages())["done"] == total

            await wait_until(delivered, within=BOUND, what=f"{total} messages done")
            counts = await store.count_messages()
            assert dict(counts) == {"pending": 0, "running": 0, "done": total, "dead": 0}
            assert await sink.fetchval("SELECT count(*) FROM outbox_dispatch_sink") == total
            assert {d.engine for d in deliveries} == {"one", "two"}  # both took part
            assert {d.key for d in deliveries} == {m.key for m in await _all_messages(caller)}
            _assert_one_at_a_time_and_in_order(deliveries)

            # The chains: each step once, the Thens under their message keys.
            histories = {iid: await caller.history(iid) for iid in noters + orders}
            for iid in orders:
                assert [(h.event, h.request_id, h.actor) for h in histories[iid]] == [
                    ("reserve", None, None),
                    ("charged", f"{iid}:2:0", OUTBOX_ACTOR),
                    ("shipped", f"{iid}:3:0", OUTBOX_ACTOR),
                ]
            assert all(len(histories[iid]) == NOTES for iid in noters)
            for iid, history in histories.items():
                initial = "new" if iid in orders else "open"
                verdict = check(await caller.get(iid), history, initial_state=initial)
                assert verdict.ok, verdict
            (await sql_history()).assert_matches(histories)
    finally:
        await sink.close()


async def _all_messages(engine: flowlock.Engine) -> list[flowlock.Message]:
    found: list[flowlock.Message] = []
    after: str | None = None
    while True:
        page = await engine.find_messages(after=after, limit=1000)
        found.extend(page)
        if len(page) < 1000:
            return found
        after = page[-1].key


class Counting(PostgresStore):
    """A PostgreSQL store that counts the outbox statements its dispatcher sends."""

    calls = 0

    async def claim_messages(
        self, kinds: Mapping[str, int], *, lease: float, owner: str, run: int = 1
    ) -> list[flowlock.Message]:
        self.calls += 1
        return await super().claim_messages(kinds, lease=lease, owner=owner, run=run)

    async def next_message_due(self, kinds: Sequence[str]) -> float | None:
        self.calls += 1
        return await super().next_message_due(kinds)

    async def finish_messages(self, keys: Sequence[str]) -> int:
        self.calls += 1
        return await super().finish_messages(keys)


async def test_an_idle_dispatcher_is_silent_until_another_engine_emits(
    pg_url: str, pg_schema: str
) -> None:
    """Idle, the dispatcher sends no statement (it waits on LISTEN); another engine's commit
    wakes it through NOTIFY, long before its idle bound."""
    got: list[str] = []

    async def handler(message: flowlock.Message) -> None:
        got.append(message.key)

    store = Counting(pg_url, schema=pg_schema, pool_size=2)
    async with (
        engine_on(pg_url, pg_schema, outbox=False) as caller,
        flowlock.Engine(store, locks=MemoryLocks()) as sleeper,
    ):
        await sleeper.register(noter())
        sleeper.on_emit("k", handler)
        await caller.create("noter", instance_id="n1")
        await caller.fire("n1", "note")
        await wait_until(lambda: got == ["n1:2:0"], within=BOUND, what="the first delivery")
        await asyncio.sleep(0.5)
        before = store.calls
        await asyncio.sleep(2.0)
        assert store.calls == before
        await caller.fire("n1", "note")
        await wait_until(lambda: len(got) == 2, within=30.0, what="woken by NOTIFY")
        assert got == ["n1:2:0", "n1:3:0"]
