"""Capacities, uniqueness and rate limits on real PostgreSQL: every write path applies a
commit's claims in its own transaction (the one-statement compare-and-swap, commit_many, the
pessimistic path, a caller's transaction, create), a refusal writes nothing, releases are
heard through NOTIFY, and many concurrent callers never hold more slots than the limit (counted
with the test's own SQL).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from typing import Any

import asyncpg
import pytest

import flowlock
import pg_budget
from flowlock.core.constraints import Claim, constraint_claims
from flowlock.core.models import HistoryEntry, Instance
from flowlock.stores.postgres import PostgresStore

pytestmark = pytest.mark.postgres

KIND = "review.in_review"
BOUND = 10.0  # seconds any single wait of these tests may take on a loaded machine


def review(limit: int = 2) -> flowlock.Workflow:
    """Reviews: at most `limit` in review per reviewer (data["r"]); `reassign` moves one to
    another reviewer (payload["to"]) without leaving the state; `ping` is rate limited to 2
    per minute per reviewer."""

    def to(inst: Instance, payload: Any, actor: str | None) -> dict[str, Any]:
        return {**inst.data, "r": payload["to"]}

    in_review = flowlock.State(
        "in_review", capacity=flowlock.Capacity(key=lambda i: i.data["r"], limit=limit)
    )
    return flowlock.Workflow(
        "review",
        states=["open", in_review, "done"],
        initial="open",
        transitions=[
            flowlock.Transition("start", source="open", target="in_review"),
            flowlock.Transition("finish", source="in_review", target="done"),
            flowlock.Transition("reassign", source="in_review", target="in_review", effect=to),
            flowlock.Transition(
                "ping",
                source="open",
                target="open",
                rate=flowlock.Rate(key=lambda i: i.data["r"], per=timedelta(minutes=1), limit=2),
            ),
        ],
    )


def subscription() -> flowlock.Workflow:
    """One active subscription per customer (data["c"])."""
    return flowlock.Workflow(
        "sub",
        states=["active", "ended"],
        initial="active",
        transitions=[flowlock.Transition("end", source="active", target="ended")],
        unique=flowlock.Unique(key=lambda i: i.data["c"], states=["active"]),
    )


class Sql:
    """The test's own reads of the constraint tables (plain SQL, one connection)."""

    def __init__(self, conn: asyncpg.Connection, schema: str) -> None:
        self.conn, self.schema = conn, schema

    async def val(self, sql: str, *args: Any) -> Any:
        return await self.conn.fetchval(sql.replace("{s}", f'"{self.schema}"'), *args)

    async def holders(self, key: str, kind: str = KIND) -> list[str]:
        rows = await self.conn.fetch(
            f'SELECT instance_id FROM "{self.schema}".flowlock_slots '
            "WHERE kind = $1 AND key = $2 ORDER BY instance_id",
            kind,
            key,
        )
        return [r["instance_id"] for r in rows]

    async def counter(self, key: str, kind: str = KIND) -> int | None:
        found = await self.val(
            "SELECT holders FROM {s}.flowlock_capacity WHERE kind = $1 AND key = $2", kind, key
        )
        return None if found is None else int(found)

    async def version(self, iid: str) -> int:
        return int(await self.val("SELECT version FROM {s}.flowlock_instances WHERE id = $1", iid))

    async def history(self, iid: str) -> int:
        return int(
            await self.val("SELECT count(*) FROM {s}.flowlock_history WHERE instance_id = $1", iid)
        )

    async def log(self) -> list[tuple[str, int, str, int, int]]:
        rows = await self.conn.fetch(
            f'SELECT key, seq, instance_id, delta, holders FROM "{self.schema}".flowlock_slot_log '
            "ORDER BY kind, key, seq"
        )
        return [(r["key"], r["seq"], r["instance_id"], r["delta"], r["holders"]) for r in rows]

    async def most_held(self) -> int:
        """The most slots any key holds now, counted from the slot rows themselves."""
        found = await self.val(
            "SELECT coalesce(max(n), 0) FROM (SELECT count(*) AS n FROM {s}.flowlock_slots "
            "GROUP BY kind, key) AS per_key"
        )
        return int(found)


@pytest.fixture
async def sql(pg_url: str, pg_schema: str) -> AsyncIterator[Sql]:
    """The test's own connection, reading the test's schema."""
    conn = await pg_budget.connect(pg_url)
    try:
        yield Sql(conn, pg_schema)
    finally:
        await conn.close()


Make = Callable[..., Awaitable[flowlock.Engine]]


@pytest.fixture
async def make(pg_url: str, pg_schema: str) -> AsyncIterator[Make]:
    """Opens engines on the test's schema with the review (capacity `limit`) and subscription
    workflows."""
    opened: list[flowlock.Engine] = []

    async def build(pool_size: int = 4, limit: int = 2, **options: Any) -> flowlock.Engine:
        store = PostgresStore(
            pg_url, schema=pg_schema, pool_size=pool_size, pipeline=options.get("batching", True)
        )
        eng = await flowlock.Engine(store, **options).open()
        opened.append(eng)
        await eng.register(review(limit))
        await eng.register(subscription())
        return eng

    yield build
    for eng in opened:
        await eng.aclose()


async def reviews(eng: flowlock.Engine, reviewer: str, *ids: str) -> None:
    for iid in ids:
        await eng.create("review", instance_id=iid, data={"r": reviewer})


def store_of(eng: flowlock.Engine) -> PostgresStore:
    store = eng.store
    assert isinstance(store, PostgresStore)
    return store


async def test_full_key_refuses_entry_and_writes_nothing(make: Make, sql: Sql) -> None:
    """A third review entering a full key is refused with CapacityReached naming the key, the
    limit and both holders; its row, its history and every slot row stay as they were."""
    eng = await make()
    await reviews(eng, "bob", "a", "b", "c")
    await eng.fire("a", "start")
    await eng.fire("b", "start")
    log_before = await sql.log()
    with pytest.raises(flowlock.CapacityReached) as refused:
        await eng.fire("c", "start")
    err = refused.value
    assert (err.instance_id, err.kind, err.key, err.limit) == ("c", KIND, "bob", 2)
    assert (err.holders, err.version, err.event) == (("a", "b"), 2, "start")
    assert await sql.version("c") == 1 and await sql.history("c") == 0
    assert await sql.holders("bob") == ["a", "b"] and await sql.counter("bob") == 2
    assert await sql.log() == log_before == [("bob", 1, "a", 1, 1), ("bob", 2, "b", 1, 2)]
    usage = await store_of(eng).capacity_usage(KIND, "bob")
    assert (usage.holders, usage.limit, usage.free) == (("a", "b"), 2, 0)


async def test_leaving_the_state_gives_the_slot_back(make: Make, sql: Sql) -> None:
    """Finishing a review releases its slot in the same commit, and the next one enters."""
    eng = await make()
    await reviews(eng, "bob", "a", "b", "c")
    for iid in ("a", "b"):
        await eng.fire(iid, "start")
    await eng.fire("a", "finish")
    assert await sql.holders("bob") == ["b"] and await sql.counter("bob") == 1
    await eng.fire("c", "start")
    assert await sql.holders("bob") == ["b", "c"]
    assert [(seq, iid, delta, held) for _, seq, iid, delta, held in await sql.log()] == [
        (1, "a", 1, 1),
        (2, "b", 1, 2),
        (3, "a", -1, 1),
        (4, "c", 1, 2),
    ]


async def test_a_key_that_changes_moves_the_slot(make: Make, sql: Sql) -> None:
    """Reassigning a review in the state moves its slot from the old key to the new one in one
    commit; into a full key it is refused and both keys stay as they were."""
    eng = await make()
    await reviews(eng, "bob", "a")
    await reviews(eng, "ann", "x", "y")
    for iid in ("a", "x", "y"):
        await eng.fire(iid, "start")
    with pytest.raises(flowlock.CapacityReached):
        await eng.fire("a", "reassign", payload={"to": "ann"})
    assert await sql.holders("bob") == ["a"] and await sql.holders("ann") == ["x", "y"]
    await eng.fire("x", "finish")
    await eng.fire("a", "reassign", payload={"to": "ann"})
    assert await sql.holders("bob") == [] and await sql.counter("bob") == 0
    assert await sql.holders("ann") == ["a", "y"] and await sql.counter("ann") == 2


async def test_unique_create_is_refused_and_a_keyed_retry_applies_nothing(
    make: Make, sql: Sql
) -> None:
    """A second active subscription of one customer is refused at create with UniqueViolation
    naming the holder, and nothing of it is written; a create answered from its request key
    takes no slot; once the first ends, the customer may subscribe again."""
    eng = await make()
    store = store_of(eng)
    rules = subscription().constraints

    def new(iid: str) -> tuple[Instance, tuple[Claim, ...]]:
        inst = Instance(iid, "sub", "active", 1, {"c": "cust"}, definition_version=1)
        return inst, constraint_claims(rules, None, inst, None)

    first, claims = new("s1")
    assert claims and claims[0].unique
    await store.create(first, "key-1", claims=claims)
    again = await store.create(first, "key-1", claims=claims)  # a retry: answered from its key
    assert again.id == "s1"
    second, claims2 = new("s2")
    with pytest.raises(flowlock.UniqueViolation) as refused:
        await store.create(second, "key-2", claims=claims2)
    assert (refused.value.holder, refused.value.version, refused.value.event) == ("s1", 1, None)
    assert await sql.val("SELECT count(*) FROM {s}.flowlock_instances WHERE id = 's2'") == 0
    assert await sql.val("SELECT count(*) FROM {s}.flowlock_create_requests") == 1
    assert await sql.holders("cust", "sub.unique") == ["s1"]
    await eng.fire("s1", "end")
    await store.create(second, "key-2", claims=claims2)
    assert await sql.holders("cust", "sub.unique") == ["s2"]


async def test_rate_limit_refuses_with_retry_after(make: Make, sql: Sql) -> None:
    """Two pings per minute per reviewer: the third is refused with RateLimited and a
    retry_after within the window, and is not counted; another reviewer is not limited."""
    eng = await make()
    await reviews(eng, "bob", "a", "b")
    await reviews(eng, "ann", "z")
    await eng.fire("a", "ping")
    await eng.fire("b", "ping")
    with pytest.raises(flowlock.RateLimited) as refused:
        await eng.fire("a", "ping")
    err = refused.value
    assert (err.key, err.limit, err.per, err.version, err.event) == ("bob", 2, 60.0, 3, "ping")
    assert 0 < err.retry_after <= 60
    await eng.fire("z", "ping")
    assert await sql.val("SELECT count(*) FROM {s}.flowlock_rate_log WHERE key = 'bob'") == 2
    assert await sql.version("a") == 2
    usage = await store_of(eng).capacity_usage("review.ping.rate", "bob", window=60)
    assert usage.holders == ("a", "b") and usage.limit == 2


def _entry(iid: str, version: int, event: str, to: str, claims: tuple[Claim, ...]) -> HistoryEntry:
    return HistoryEntry(
        instance_id=iid,
        version=version,
        event=event,
        from_state="open",
        to_state=to,
        actor=None,
        request_id=None,
        strategy="optimistic",
        data={"r": "bob"},
        claims=claims,
    )


async def test_commit_many_answers_a_refused_batch_at_its_place(make: Make, sql: Sql) -> None:
    """Of three batches in one commit_many, the one whose take does not fit answers its
    CapacityReached at its place, and the other two commit (one takes the last slot)."""
    eng = await make()
    store = store_of(eng)
    await reviews(eng, "bob", "a", "b", "c")
    await eng.fire("a", "start")
    take = (Claim("take", KIND, "bob", 2),)
    answers = await store.commit_many(
        [
            [_entry("b", 2, "start", "in_review", take)],
            [_entry("c", 2, "start", "in_review", take)],
            [_entry("a", 3, "note", "in_review", ())],
        ]
    )
    b, c, a = answers
    assert isinstance(b, Instance) and b.version == 2
    assert isinstance(c, flowlock.CapacityReached) and c.holders == ("a", "b")
    assert (c.instance_id, c.version, c.event) == ("c", 2, "start")
    assert isinstance(a, Instance) and a.version == 3
    assert await sql.version("c") == 1 and await sql.holders("bob") == ["a", "b"]


async def test_pessimistic_path_applies_and_refuses_claims(make: Make, sql: Sql) -> None:
    """Under the pessimistic strategy (alone and pipelined in a group), entering takes a slot
    and a full key refuses with nothing written."""
    eng = await make(strategy="pessimistic")
    await reviews(eng, "bob", *"abcde")
    await eng.fire("a", "start")
    results = await asyncio.gather(
        *(eng.fire(iid, "start") for iid in "bcde"), return_exceptions=True
    )
    refused = [r for r in results if isinstance(r, flowlock.CapacityReached)]
    assert len(refused) == 3, results
    holders = await sql.holders("bob")
    assert len(holders) == 2 and "a" in holders
    for iid in "bcde":
        assert (await sql.version(iid) == 2) == (iid in holders)
    assert await sql.counter("bob") == 2


async def test_fire_in_a_callers_transaction(make: Make, sql: Sql, pg_url: str) -> None:
    """fire(connection=) takes the slot in the caller's transaction: rolled back, nothing is
    held; committed, the slot is held. A refusal there leaves the caller's transaction usable."""
    eng = await make()
    await reviews(eng, "bob", "a", "b", "c")
    conn = await pg_budget.connect(pg_url)
    try:
        tx = conn.transaction()
        await tx.start()
        await eng.fire("a", "start", connection=conn)
        await tx.rollback()
        assert await sql.holders("bob") == [] and await sql.version("a") == 1
        assert await sql.counter("bob") in (None, 0)
        async with conn.transaction():
            await eng.fire("a", "start", connection=conn)
            await eng.fire("b", "start", connection=conn)
            with pytest.raises(flowlock.CapacityReached):
                await eng.fire("c", "start", connection=conn)
            assert await conn.fetchval("SELECT 1") == 1  # still usable
        assert await sql.holders("bob") == ["a", "b"] and await sql.version("c") == 1
    finally:
        await conn.close()


async def test_releases_are_heard_through_notify(make: Make, pg_url: str) -> None:
    """slot_releases hears a release committed by another engine as (kind, key), and nothing
    of a release rolled back (sent before it, it would have been heard first)."""
    eng, other = await make(), await make()
    await reviews(eng, "bob", "a", "b")
    await reviews(eng, "ann", "x")
    for iid in ("a", "b", "x"):
        await eng.fire(iid, "start")
    heard: list[tuple[str, str]] = []
    got, listening = asyncio.Event(), asyncio.Event()

    def hear(kind: str, key: str) -> None:
        heard.append((kind, key))
        (got if kind else listening).set()

    async with store_of(eng).slot_releases(hear):
        await asyncio.wait_for(listening.wait(), BOUND)  # LISTEN is in force from here
        conn = await pg_budget.connect(pg_url)
        try:
            tx = conn.transaction()
            await tx.start()
            await other.fire("x", "finish", connection=conn)
            await tx.rollback()
        finally:
            await conn.close()
        await other.fire("a", "finish")
        await asyncio.wait_for(got.wait(), BOUND)
    assert (KIND, "bob") in heard and (KIND, "ann") not in heard


async def test_purge_frees_a_slot_its_instance_held(make: Make, sql: Sql) -> None:
    """Purging an instance that still holds a slot frees it (and its counter) in the purge's
    own transaction."""
    eng = await make()
    store = store_of(eng)
    await reviews(eng, "bob", "a")
    await eng.fire("a", "start")
    assert await store.purge_batch([("a", 2)]) == ["a"]
    assert await sql.holders("bob") == [] and await sql.counter("bob") == 0
    assert (await sql.log())[-1] == ("bob", 2, "a", -1, 0)


async def test_constraint_rows_read_everything_at_once(make: Make) -> None:
    """constraint_rows gives the log, the slots, the counters and the rate events, each in
    order, agreeing with each other."""
    eng = await make()
    await reviews(eng, "bob", "a", "b")
    await eng.fire("a", "start")
    await eng.fire("b", "ping")
    await eng.fire("b", "start")
    await eng.fire("a", "finish")
    rows = await store_of(eng).constraint_rows()
    assert [(e.seq, e.instance_id, e.delta, e.holders) for e in rows.log] == [
        (1, "a", 1, 1),
        (2, "b", 1, 2),
        (3, "a", -1, 1),
    ]
    assert [(s.key, s.instance_id, s.version) for s in rows.slots] == [("bob", "b", 3)]
    counters = {(c.kind, c.key): (c.holders, c.limit, c.seq) for c in rows.counters}
    assert counters == {(KIND, "bob"): (1, 2, 3), ("review.ping.rate", "bob"): (0, 2, 1)}
    assert [(r.instance_id, r.version, r.limit, r.per) for r in rows.rates] == [("b", 2, 2, 60)]
    assert all(e.at > 0 for e in rows.log) and rows.log[0].at <= rows.log[-1].at


async def test_many_callers_never_hold_more_than_the_limit(make: Make, sql: Sql) -> None:
    """200 tasks over 20 keys of capacity 3 move in and out of review concurrently (two
    engines, batching on): after every step the slot rows never show more than 3 holders of a
    key, the counters agree with the rows, and every key's log never goes above its limit."""
    engines = [await make(pool_size=6, limit=3), await make(pool_size=6, limit=3)]
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
