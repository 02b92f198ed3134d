"""Capacities, uniqueness and rate limits on real PostgreSQL: every write path applies a
commit's claims in its own transaction (the one-statement compare-and-swap, commit_many, the
pessimistic path, a caller's transaction, create, behind a transaction pooler), a refusal
writes nothing, releases are heard through NOTIFY, a purge frees its slots. The storms are in
test_constraints_storm_pg.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import asyncpg
import pytest

import flowlock
import pg_budget
from flowlock.core.constraints import Claim, constraint_claims
from flowlock.core.models import HistoryEntry, Instance
from flowlock.stores.base import LockedResult, Plan, RowLock
from flowlock.stores.postgres import PostgresStore
from flowlock.stores.postgres.operations import Operations
from flowlock.stores.postgres.pipeline import LockedCall, apply_locked_together
from flowlock.stores.postgres.session import Session
from pg_constraints_kit import (
    BOUND,
    KIND,
    Make,
    Sql,
    engines,
    reading,
    review,
    reviews,
    store_of,
    subscription,
)
from pgbouncer_harness import PgBouncer

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
    naming the holder, and nothing of it is written (through the store and the engine); a
    create answered from its request key takes no slot; once the first ends, the customer may
    subscribe again."""
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
    with pytest.raises(flowlock.UniqueViolation) as through_engine:
        await eng.create("sub", instance_id="s3", data={"c": "cust"})
    assert through_engine.value.holder == "s2"
    assert await sql.val("SELECT count(*) FROM {s}.flowlock_instances WHERE id = 's3'") == 0


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
    """Of four batches in one commit_many, the one whose take does not fit answers its
    CapacityReached at its place, one decided on a stale version answers None and takes
    nothing, and the other two commit (one takes the last slot)."""
    eng = await make()
    store = store_of(eng)
    await reviews(eng, "bob", "a", "b", "c", "d")
    await eng.fire("a", "start")
    take = (Claim("take", KIND, "bob", 2),)
    answers = await store.commit_many(
        [
            [_entry("d", 5, "start", "in_review", take)],  # d is at version 1: lost
            [_entry("b", 2, "start", "in_review", take)],
            [_entry("c", 2, "start", "in_review", take)],
            [_entry("a", 3, "note", "in_review", ())],
        ]
    )
    d, b, c, a = answers
    assert d is None and await sql.version("d") == 1
    assert isinstance(b, Instance) and b.version == 2
    assert isinstance(c, flowlock.CapacityReached) and c.holders == ("a", "b")
    assert (c.instance_id, c.version, c.event) == ("c", 2, "start")
    assert isinstance(a, Instance) and a.version == 3
    assert await sql.version("c") == 1 and await sql.holders("bob") == ["a", "b"]


async def test_many_refusals_of_one_key_in_commit_many_cost_one_round(
    make: Make, sql: Sql, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Twenty batches taking a full key and five without claims in one commit_many: the first
    refused sets the other takes of that key aside, refused by one read that finds the key
    still full, so the statement of them all runs twice, not twenty times, and none runs
    alone; the five commit."""
    eng = await make()
    store = store_of(eng)
    takers = [f"t{n}" for n in range(20)]
    others = [f"o{n}" for n in range(5)]
    await reviews(eng, "bob", "a", "b", *takers, *others)
    await eng.fire("a", "start")
    await eng.fire("b", "start")
    rounds: list[int] = []
    original = Operations.commit_together

    async def counted(self: Operations, batches: Any) -> Any:
        rounds.append(len(batches))
        return await original(self, batches)

    monkeypatch.setattr(Operations, "commit_together", counted)
    alone: list[int] = []
    original_each = PostgresStore._commit_each

    async def each(self: PostgresStore, batches: Any) -> Any:
        alone.append(len(batches))
        return await original_each(self, batches)

    monkeypatch.setattr(PostgresStore, "_commit_each", each)
    take = (Claim("take", KIND, "bob", 2),)
    batches = [[_entry(iid, 2, "start", "in_review", take)] for iid in takers]
    batches += [[_entry(iid, 2, "note", "open", ())] for iid in others]
    answers = await store.commit_many(batches)
    assert all(isinstance(a, flowlock.CapacityReached) for a in answers[:20])
    assert all(a.holders == ("a", "b") and a.version == 2 for a in answers[:20])  # type: ignore[union-attr]
    assert alone == []
    assert all(isinstance(a, Instance) and a.version == 2 for a in answers[20:])
    assert rounds == [25, 5]
    assert await sql.holders("bob") == ["a", "b"]


async def test_a_pessimistic_group_answers_a_refusal_and_writes_the_rest(
    make: Make, sql: Sql
) -> None:
    """A pessimistic group (one transaction, rows locked together) whose write meets a full
    key: the refused call answers CapacityReached, the rest (the take before it included) are
    written in the same transaction, and the take of that key after it, set aside, is refused
    there too once the key's counter is locked and read full."""
    eng = await make()
    store = store_of(eng)
    await reviews(eng, "bob", "a", "b", "c", "d", "o")
    await eng.fire("a", "start")
    take = (Claim("take", KIND, "bob", 2),)

    def plan(iid: str, event: str, to: str, claims: tuple[Claim, ...]) -> Plan:
        return lambda snap: [_entry(iid, snap.instance.version + 1, event, to, claims)]

    calls = [
        LockedCall("b", (), plan("b", "start", "in_review", take), RowLock()),
        LockedCall("c", (), plan("c", "start", "in_review", take), RowLock()),
        LockedCall("d", (), plan("d", "start", "in_review", take), RowLock()),
        LockedCall("o", (), plan("o", "note", "open", ()), RowLock()),
    ]
    b, c, d, o = await apply_locked_together(Session(store), calls)
    assert isinstance(c, flowlock.CapacityReached) and c.holders == ("a", "b")
    assert isinstance(d, flowlock.CapacityReached) and d.holders == ("a", "b")
    assert (d.version, d.event) == (2, "start")
    for done, iid in ((b, "b"), (o, "o")):
        assert isinstance(done, LockedResult) and done.committed is not None, (iid, done)
    assert await sql.holders("bob") == ["a", "b"]
    assert [await sql.version(iid) for iid in "bcdo"] == [2, 1, 1, 2]


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


@pytest.mark.parametrize("strategy", ["optimistic", "pessimistic"])
async def test_fire_in_a_callers_transaction(
    make: Make, sql: Sql, pg_url: str, strategy: str
) -> None:
    """fire(connection=) takes the slot in the caller's transaction: rolled back, nothing is
    held; committed, the slot is held. A refusal there leaves the caller's transaction usable."""
    eng = await make(strategy=strategy)
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


async def test_two_slots_freed_by_one_transaction_are_two_notices(make: Make) -> None:
    """Two slots of one key released by one statement (commit_many) are heard twice: one
    notice per slot freed, so a waiter per slot can be woken."""
    eng = await make()
    store = store_of(eng)
    await reviews(eng, "bob", "a", "b")
    for iid in ("a", "b"):
        await eng.fire(iid, "start")
    bob: list[str] = []
    twice, listening = asyncio.Event(), asyncio.Event()

    def hear(kind: str, key: str) -> None:
        if not kind:
            listening.set()
            return
        bob.append(key)
        if len(bob) == 2:
            twice.set()

    release = (Claim("release", KIND),)
    async with store.slot_releases(hear):
        await asyncio.wait_for(listening.wait(), BOUND)
        done = await store.commit_many(
            [[_entry(iid, 3, "finish", "done", release)] for iid in ("a", "b")]
        )
        assert all(isinstance(d, Instance) for d in done)
        await asyncio.wait_for(twice.wait(), BOUND)
    assert bob == ["bob", "bob"]


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


async def test_claims_through_a_transaction_pooler(
    pgbouncer_transaction: PgBouncer, pg_schema: str, sql: Sql
) -> None:
    """Behind PgBouncer in transaction mode (no search_path kept) the claims' function and
    tables are named with the schema: a take, a refusal, a release and a purge work there,
    and slot_releases says ("", "") every so often instead of LISTEN."""
    store = PostgresStore(
        pgbouncer_transaction.url(), schema=pg_schema, pool_size=3, pooling="transaction"
    )
    async with flowlock.Engine(store) as eng:
        await eng.register(review(1))
        await reviews(eng, "bob", "a", "b")
        await eng.fire("a", "start")
        with pytest.raises(flowlock.CapacityReached):
            await eng.fire("b", "start")
        await eng.fire("a", "finish")
        await eng.fire("b", "start")
        assert await store.purge_batch([("b", 2)]) == ["b"]
        assert (await store.capacity_usage(KIND, "bob")).holders == ()
        anything = asyncio.Event()  # no LISTEN behind the pooler: ("", "") about every second

        def hear(kind: str, key: str) -> None:
            if not kind:
                anything.set()

        async with store.slot_releases(hear):
            await asyncio.wait_for(anything.wait(), BOUND)
    assert await sql.holders("bob") == [] and await sql.counter("bob") == 0


async def test_every_claimed_statement_is_valid_sql(
    make: Make, pg_url: str, pg_schema: str
) -> None:
    """Every variant of the compare-and-swaps and creates (with timers, messages and claims in
    any combination) and every constraint read is accepted by PostgreSQL (prepared on a
    migrated schema)."""
    from flowlock.stores.postgres import constraints
    from flowlock.stores.postgres import sql as statements

    await make()
    texts = [
        *statements._CAS_VARIANTS,
        *statements._BATCH_VARIANTS,
        *statements._MANY_VARIANTS,
        *(v for k, v in vars(statements).items() if k.startswith("CREATE") and "CLAIMED" in k),
        constraints.USAGE,
        constraints.RATE_USAGE,
        constraints.LOG,
        constraints.SLOTS,
        constraints.COUNTERS,
        constraints.RATES,
    ]
    conn = await pg_budget.connect(pg_url)
    try:
        await conn.execute(f'SET search_path TO "{pg_schema}"')
        for text in texts:
            await conn.prepare(text)
    finally:
        await conn.close()
    assert len(texts) == 3 * 8 + 4 + 6


async def test_fire_in_a_psycopg_transaction(make: Make, sql: Sql, pg_url: str) -> None:
    """With a psycopg AsyncConnection as connection=, the claims' arrays go through and a
    refusal is the same CapacityReached, leaving the caller's transaction usable."""
    psycopg = pytest.importorskip("psycopg")
    eng = await make()
    await reviews(eng, "bob", "a", "b", "c")
    async with await psycopg.AsyncConnection.connect(pg_url) as conn, conn.transaction():
        await eng.fire("a", "start", connection=conn)
        await eng.fire("b", "start", connection=conn)
        with pytest.raises(flowlock.CapacityReached) as refused:
            await eng.fire("c", "start", connection=conn)
        assert refused.value.holders == ("a", "b")
        await conn.execute("SELECT 1")  # still usable
    assert await sql.holders("bob") == ["a", "b"] and await sql.version("c") == 1


async def test_a_timed_unique_create_arms_its_timer_and_takes_its_slot(
    make: Make, sql: Sql
) -> None:
    """A create that arms its first state's timer and takes a unique slot does both in its one
    statement, keyed or not; a second is refused with neither written."""
    eng = await make()
    timed = flowlock.Workflow(
        "trial",
        states=["on", "off"],
        initial="on",
        transitions=[
            flowlock.Transition("lapse", source="on", target="off", after=timedelta(hours=1))
        ],
        unique=flowlock.Unique(key=lambda i: i.data["c"], states=["on"]),
    )
    await eng.register(timed)
    store = store_of(eng)
    await eng.create("trial", instance_id="t1", data={"c": "x"})
    await eng.create("trial", instance_id="t2", data={"c": "y"}, request_id="key-y")
    for iid, key in (("t3", "x"), ("t4", "y")):
        with pytest.raises(flowlock.UniqueViolation):
            await eng.create("trial", instance_id=iid, data={"c": key}, request_id=f"k-{iid}")
    assert [len(await store.timers(iid)) for iid in ("t1", "t2")] == [1, 1]
    assert await sql.holders("x", "trial.unique") == ["t1"]
    assert await sql.holders("y", "trial.unique") == ["t2"]
    assert await sql.val("SELECT count(*) FROM {s}.flowlock_timers") == 2
    assert await sql.val("SELECT count(*) FROM {s}.flowlock_create_requests") == 1


async def test_the_reads_on_an_applications_pool(make: Make, pg_url: str, pg_schema: str) -> None:
    """On an application's pool (flowlock's statements in a transaction of their own there,
    for the schema), capacity_usage and constraint_rows read what the commits wrote."""
    eng = await make()
    await reviews(eng, "bob", "a")
    await eng.fire("a", "start")
    pool = await asyncpg.create_pool(pg_url, min_size=1, max_size=2)
    try:
        store = PostgresStore(pool=pool, schema=pg_schema)
        await store.open()
        assert (await store.capacity_usage(KIND, "bob")).holders == ("a",)
        rows = await store.constraint_rows()
        assert [(s.instance_id, s.version) for s in rows.slots] == [("a", 2)]
        assert [e.delta for e in rows.log] == [1]
        await store.aclose()
    finally:
        await pool.close()
