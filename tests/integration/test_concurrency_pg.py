"""Real concurrency against real PostgreSQL: the seed's storm, countersign and inventory.

Each scenario runs two ways. With batching on (the default), the first caller runs alone and
the other 99 wait for it and then go together as one batch: one read, one write. The test
holds the engine to exactly that (the batch sizes, one attempt each, no compare-and-swap
lost), so those calls never meet in the database. With batching off, every caller goes to the
database on its own, 100 callers sharing a pool of 20 connections, and the calls race there.
A session of the test's own holds the instance's row lock (``row_gate``) until every
connection of the pool waits for a lock in ``pg_locks``, so the race is certain rather than
likely. Then the optimistic callers lose compare-and-swaps (counted by the store, and in their
own ``attempts``), and the pessimistic callers queue on the row lock behind one another.

Every test ends by running the exactly-once checker over the recorded history and counting the
history rows with its own SQL (``sql_history``), so the checker does not see the history only
through the code under test.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import asyncpg
import pytest

import flowlock
import pg_budget
from flowlock.checker import check
from flowlock.core.models import HistoryEntry, Instance
from flowlock.stores.postgres import PostgresStore
from lock_probes import wait_until

pytestmark = pytest.mark.postgres

STRATEGIES = ["optimistic", "pessimistic"]
CALLERS = 100
POOL = 20
"""Connections per engine: 100 callers share them (the point is the races, not the count)."""
T = TypeVar("T")
EngineFactory = Callable[..., Awaitable[flowlock.Engine]]
SqlHistory = Callable[..., Awaitable[Any]]


class CountingStore(PostgresStore):
    """The PostgreSQL store, counting the compare-and-swaps it lost (a commit that found the
    instance's version moved on and wrote nothing)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lost = 0

    async def commit(self, entries: Sequence[HistoryEntry]) -> Instance | None:
        committed = await super().commit(entries)
        self.lost += committed is None
        return committed


@dataclass(frozen=True)
class Waiter:
    """A session of the engine waiting for a lock, and the sessions it waits behind."""

    pid: int
    blockers: frozenset[int]


@dataclass(frozen=True)
class RowGate:
    """A transaction of the test's own holding one instance's row lock (``FOR UPDATE``)."""

    conn: asyncpg.Connection
    pid: int
    app: str

    async def waiters(self) -> list[Waiter]:
        """The engine's sessions (``application_name`` = ``app``) waiting for a lock."""
        rows = await self.conn.fetch(
            "SELECT DISTINCT l.pid, pg_blocking_pids(l.pid) AS blockers FROM pg_locks l"
            " JOIN pg_stat_activity a ON a.pid = l.pid"
            " WHERE NOT l.granted AND a.application_name = $1",
            self.app,
        )
        return [Waiter(r["pid"], frozenset(r["blockers"])) for r in rows]


@contextlib.asynccontextmanager
async def row_gate(url: str, schema: str, iid: str, app: str) -> AsyncIterator[RowGate]:
    """Holds the row lock of ``iid`` until the block ends, then rolls back (nothing changed)."""
    conn = await pg_budget.connect(url)
    try:
        await conn.execute(f'SET search_path TO "{schema}"')
        held = conn.transaction()
        await held.start()
        try:
            locked = "SELECT version FROM flowlock_instances WHERE id = $1 FOR UPDATE"
            assert await conn.fetchval(locked, iid) is not None, iid
            yield RowGate(conn, conn.get_server_pid(), app)
        finally:
            await held.rollback()
    finally:
        await conn.close()


async def at_once(calls: Sequence[Callable[[], Awaitable[T]]]) -> list[T | BaseException]:
    """Start every call together (they all wait on one event), gather results and errors."""
    go = asyncio.Event()

    async def run(call: Callable[[], Awaitable[T]]) -> T:
        await go.wait()
        return await call()

    tasks = [asyncio.create_task(run(c)) for c in calls]
    await asyncio.sleep(0)
    go.set()
    return await asyncio.gather(*tasks, return_exceptions=True)


async def race(
    pg_url: str, schema: str, app: str, iid: str, calls: Sequence[Callable[[], Awaitable[T]]]
) -> tuple[list[T | BaseException], list[Waiter]]:
    """The calls, all started at once while a session of the test holds the row of ``iid``,
    let go once every connection of the pool waits for a lock (seen in ``pg_locks``): the
    answers, and the waiters seen. One waits behind the test's session, the others behind a
    caller (PostgreSQL queues a row's later waiters behind its first)."""
    seen: list[Waiter] = []
    async with row_gate(pg_url, schema, iid, app) as gate:
        storm = asyncio.ensure_future(at_once(calls))

        async def pool_waits() -> bool:
            now = await gate.waiters()
            if len(now) >= len(seen):
                seen[:] = now
            return len(seen) >= POOL or storm.done()

        try:
            await wait_until(pool_waits, within=30, what=f"{POOL} sessions waiting for a lock")
        except BaseException:
            storm.cancel()
            raise
    outs = await storm
    # Not fewer: every connection was waiting, and none of the calls had answered.
    assert len(seen) == POOL, (seen, [o for o in outs if isinstance(o, BaseException)][:3])
    callers = {w.pid for w in seen}
    assert sum(gate.pid in w.blockers for w in seen) >= 1, seen
    assert sum(bool(w.blockers & callers) for w in seen) >= POOL - 1, seen
    return outs, seen


async def verify(
    engine: flowlock.Engine, sql_history: SqlHistory, iid: str, applied: int, **kw: Any
) -> None:
    """The checker over the engine's history of ``iid``, and the history rows counted with SQL."""
    history = await engine.history(iid)
    verdict = check(await engine.get(iid), history, expected_applied=applied, **kw)
    assert verdict.ok, verdict.violations
    (await sql_history()).assert_matches({iid: history})


async def engines(
    factory: EngineFactory, schema: str, *, batching: bool, **options: Any
) -> tuple[flowlock.Engine, CountingStore, str]:
    """An engine of POOL connections on a CountingStore, named in pg_stat_activity. Every
    connection is opened up front: one still connecting when a storm starts would keep its
    callers out of the race (and the first waiters would run out of lock_timeout)."""
    app = f"races-{schema}"
    store = partial(CountingStore, min_size=POOL)
    engine = await factory(POOL, store=store, application_name=app, batching=batching, **options)
    counting = engine.store
    assert isinstance(counting, CountingStore)
    return engine, counting, app


def batched(outs: Sequence[object]) -> Counter[int]:
    """The batch sizes the outcomes among ``outs`` report, by how many reported each."""
    return Counter(o.batch_size for o in outs if isinstance(o, flowlock.Outcome))


# -- the storm ------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_storm_exactly_one_applied_per_round(
    pg_engine_factory: EngineFactory, pg_schema: str, sql_history: SqlHistory, strategy: str
) -> None:
    """Batching on, 100 callers fire one approve at once, 5 rounds: the first runs alone and
    applies, the other 99 go as one batch and are idempotent; one attempt each, no lost race."""
    engine, store, _ = await engines(pg_engine_factory, pg_schema, batching=True)
    for round_no in range(5):
        iid = f"storm-{round_no}"
        await engine.create("approval", instance_id=iid)
        outs = await at_once(
            [
                partial(engine.fire, iid, "approve", actor=f"admin-{i}", strategy=strategy)
                for i in range(CALLERS)
            ]
        )
        errors = [o for o in outs if isinstance(o, BaseException)]
        assert not errors, errors[:3]
        good = [o for o in outs if isinstance(o, flowlock.Outcome)]
        assert [o.batch_size for o in good if o.applied] == [1]
        assert batched(good) == {1: 1, CALLERS - 1: CALLERS - 1}
        assert sum(o.idempotent for o in good) == CALLERS - 1
        assert {o.attempts for o in good} == {1}
        assert {o.instance.state for o in good} == {"approved"}
        await verify(engine, sql_history, iid, 1, initial_state="pending")
        assert (await engine.get(iid)).version == 2
    assert store.lost == 0


@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_storm_races_in_the_database(
    pg_engine_factory: EngineFactory,
    pg_url: str,
    pg_schema: str,
    sql_history: SqlHistory,
    strategy: str,
) -> None:
    """Batching off, 100 callers on 20 connections approve at once, 3 rounds, all in flight
    against the database together: 1 applied, 99 idempotent; optimistic callers lost
    compare-and-swaps (each such loser retried once, then answered idempotent), pessimistic
    callers queued on the row lock."""
    engine, store, app = await engines(pg_engine_factory, pg_schema, batching=False)
    for round_no in range(3):
        iid = f"storm-{round_no}"
        await engine.create("approval", instance_id=iid)
        lost_before = store.lost
        outs, seen = await race(
            pg_url,
            pg_schema,
            app,
            iid,
            [
                partial(engine.fire, iid, "approve", actor=f"admin-{i}", strategy=strategy)
                for i in range(CALLERS)
            ],
        )
        errors = [o for o in outs if isinstance(o, BaseException)]
        assert not errors, errors[:3]
        good = [o for o in outs if isinstance(o, flowlock.Outcome)]
        assert sum(o.applied for o in good) == 1
        assert sum(o.idempotent for o in good) == CALLERS - 1
        assert batched(good) == {1: CALLERS}
        attempts = Counter(o.attempts for o in good)
        lost = store.lost - lost_before
        if strategy == "optimistic":
            assert lost >= POOL - 1, (lost, attempts)
            assert attempts == {1: CALLERS - lost, 2: lost}, (lost, attempts)
        else:
            assert lost == 0 and attempts == {1: CALLERS}
        print(f"storm {strategy} round {round_no}: waiters {len(seen)}, lost CAS {lost}, "
              f"attempts {dict(attempts)}")  # fmt: skip
        await verify(engine, sql_history, iid, 1, initial_state="pending")
        assert (await engine.get(iid)).version == 2


# -- countersign ----------------------------------------------------------------------------------


def signatures(outs: Sequence[object]) -> tuple[list[flowlock.Outcome], list[Any]]:
    """The applied signatures and the callers told ConflictRetriesExhausted; nothing else."""
    applied = [o for o in outs if isinstance(o, flowlock.Outcome) and o.applied]
    exhausted = [o for o in outs if isinstance(o, flowlock.ConflictRetriesExhausted)]
    assert len(applied) + len(exhausted) == len(outs), [
        o for o in outs if not isinstance(o, flowlock.Outcome | flowlock.ConflictRetriesExhausted)
    ][:3]
    return applied, exhausted


async def verify_signatures(
    engine: flowlock.Engine, sql_history: SqlHistory, applied: Sequence[flowlock.Outcome]
) -> None:
    """Each applied signature recorded once; approved (once) exactly when all 100 signed."""
    final = await engine.get("doc")
    history = await engine.history("doc")
    signers = final.data.get("signers", [])
    assert sorted(signers) == sorted(o.instance.data["signers"][-1] for o in applied)
    assert len(signers) == len(set(signers)) == len(applied)
    all_signed = len(applied) == CALLERS
    assert [h.to_state for h in history].count("approved") == (1 if all_signed else 0)
    assert final.state == ("approved" if all_signed else "pending")
    await verify(engine, sql_history, "doc", len(applied), initial_state="pending")


def sign(engine: flowlock.Engine, strategy: str) -> list[Callable[[], Awaitable[Any]]]:
    return [
        partial(engine.fire, "doc", "sign", actor=f"signer-{i}", strategy=strategy)
        for i in range(CALLERS)
    ]


@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_countersign_every_signature_once(
    pg_engine_factory: EngineFactory, pg_schema: str, sql_history: SqlHistory, strategy: str
) -> None:
    """Batching on, 100 signers at once: the first signs alone, the other 99 sign as one
    batch; all 100 applied, one attempt each, approved once at quorum."""
    engine, store, _ = await engines(pg_engine_factory, pg_schema, batching=True)
    await engine.create("countersign", instance_id="doc")
    outs = await at_once(sign(engine, strategy))
    applied, exhausted = signatures(outs)
    assert len(applied) == CALLERS and not exhausted
    assert batched(applied) == {1: 1, CALLERS - 1: CALLERS - 1}
    assert {o.attempts for o in applied} == {1} and store.lost == 0
    await verify_signatures(engine, sql_history, applied)


@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_countersign_races_in_the_database(
    pg_engine_factory: EngineFactory,
    pg_url: str,
    pg_schema: str,
    sql_history: SqlHistory,
    strategy: str,
) -> None:
    """Batching off, 100 signers on 20 connections at once: pessimistic signers queue on the
    row lock and all 100 apply; optimistic signers lose compare-and-swaps, and one that loses
    all 3 attempts is told so (ConflictRetriesExhausted, nothing written): every lost race is
    one attempt of a caller, and every applied signature is recorded once."""
    engine, store, app = await engines(pg_engine_factory, pg_schema, batching=False)
    await engine.create("countersign", instance_id="doc")
    outs, seen = await race(pg_url, pg_schema, app, "doc", sign(engine, strategy))
    applied, exhausted = signatures(outs)
    assert batched(applied) == {1: len(applied)}
    attempts = Counter(o.attempts for o in applied)
    if strategy == "optimistic":
        assert store.lost >= POOL - 1, store.lost
        assert all(e.attempts == 3 for e in exhausted)
        # Each lost compare-and-swap is a lost attempt of one caller: an applied one lost all
        # but its last, an exhausted one lost all three.
        assert store.lost == sum(o.attempts - 1 for o in applied) + 3 * len(exhausted)
        # Each caller that gave up saw the version move in each of its 3 attempts: 3 commits.
        assert not exhausted or len(applied) >= 3
    else:
        assert len(applied) == CALLERS and store.lost == 0 and attempts == {1: CALLERS}
    print(f"countersign {strategy}: waiters {len(seen)}, lost CAS {store.lost}, applied "
          f"{len(applied)}, exhausted {len(exhausted)}, attempts {dict(attempts)}")  # fmt: skip
    await verify_signatures(engine, sql_history, applied)


# -- inventory ------------------------------------------------------------------------------------


def reservations(outs: Sequence[object]) -> list[flowlock.Outcome]:
    """Exactly 50 applied and 50 refused as out of stock; the applied ones."""
    applied = [o for o in outs if isinstance(o, flowlock.Outcome) and o.applied]
    refused = [o for o in outs if isinstance(o, flowlock.GuardRejected)]
    assert len(applied) == 50, [o for o in outs if not isinstance(o, flowlock.Outcome)][:3]
    assert len(refused) == 50
    assert all("out of stock" in r.reason for r in refused)
    return applied


async def verify_stock(engine: flowlock.Engine, sql_history: SqlHistory) -> None:
    """Stock 0, 50 reserved, and the stock never below zero in the history."""
    final = await engine.get("sku")
    assert dict(final.data) == {"stock": 0, "reserved": 50}

    def stock_never_negative(data: Any) -> str | None:
        return None if data["stock"] >= 0 else f"stock below zero: {data['stock']}"

    await verify(engine, sql_history, "sku", 50, invariant=stock_never_negative)


# Optimistic must apply every reserve that stock allows, so give it room to retry: the
# inventory preset is pessimistic; this shows optimistic stays correct when it is used anyway.
ROOMY = flowlock.Optimistic(max_attempts=200, backoff_cap=0.05)


def reserve(engine: flowlock.Engine, strategy: str) -> list[Callable[[], Awaitable[Any]]]:
    return [partial(engine.fire, "sku", "reserve", strategy=strategy) for _ in range(CALLERS)]


@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_inventory_never_oversells(
    pg_engine_factory: EngineFactory, pg_schema: str, sql_history: SqlHistory, strategy: str
) -> None:
    """Batching on, 100 reserves on stock 50: the first runs alone, the other 99 as one batch
    that applies 49 and refuses 50 as out of stock; stock never < 0."""
    engine, store, _ = await engines(
        pg_engine_factory, pg_schema, batching=True, strategies=[ROOMY]
    )
    await engine.create("inventory", instance_id="sku", data={"stock": 50})
    applied = reservations(await at_once(reserve(engine, strategy)))
    assert batched(applied) == {1: 1, CALLERS - 1: 49}
    assert {o.attempts for o in applied} == {1} and store.lost == 0
    await verify_stock(engine, sql_history)


@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_inventory_races_in_the_database(
    pg_engine_factory: EngineFactory,
    pg_url: str,
    pg_schema: str,
    sql_history: SqlHistory,
    strategy: str,
) -> None:
    """Batching off, 100 reserves on stock 50 from 20 connections, all in flight at once:
    exactly 50 applied and 50 refused; optimistic lost compare-and-swaps on the way,
    pessimistic queued on the row lock; stock never < 0."""
    engine, store, app = await engines(
        pg_engine_factory, pg_schema, batching=False, strategies=[ROOMY]
    )
    await engine.create("inventory", instance_id="sku", data={"stock": 50})
    outs, seen = await race(pg_url, pg_schema, app, "sku", reserve(engine, strategy))
    applied = reservations(outs)
    assert batched(applied) == {1: 50}
    attempts = Counter(o.attempts for o in applied)
    if strategy == "optimistic":
        # A refused caller may have lost races before it was refused: its attempts are not in
        # an Outcome, so the store's count is at least the applied callers' lost attempts.
        assert store.lost >= max(POOL - 1, sum(o.attempts - 1 for o in applied)), store.lost
    else:
        assert store.lost == 0 and attempts == {1: 50}
    print(f"inventory {strategy}: waiters {len(seen)}, lost CAS {store.lost}, "
          f"attempts {dict(attempts)}")  # fmt: skip
    await verify_stock(engine, sql_history)


# -- the rest -------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_duplicate_request_ids_under_concurrency(
    pg_engine_factory: EngineFactory, sql_history: SqlHistory, strategy: str
) -> None:
    """5 concurrent duplicates of one request id: applied once, identical outcomes."""
    engine = await pg_engine_factory(pool_size=10)
    await engine.create("ticket", instance_id="t")
    outs = await at_once(
        [lambda: engine.fire("t", "close", request_id="req-1", strategy=strategy) for _ in range(5)]
    )
    assert all(isinstance(o, flowlock.Outcome) for o in outs), outs
    good = [o for o in outs if isinstance(o, flowlock.Outcome)]
    assert sum(o.applied for o in good) == 1
    assert len({(o.instance.state, o.instance.version, o.request_id) for o in good}) == 1
    await verify(engine, sql_history, "t", 1, initial_state="open")


async def test_mixed_strategies_on_one_instance(
    pg_engine_factory: EngineFactory, sql_history: SqlHistory
) -> None:
    """Optimistic and pessimistic callers on the same instance still apply each step once:
    each strategy's callers are batched apart (the first alone, the other 29 together), and
    the two batches race in the database."""
    engine = await pg_engine_factory(
        pool_size=POOL, strategies=[flowlock.Optimistic(max_attempts=100, backoff_cap=0.05)]
    )
    await engine.create("inventory", instance_id="sku", data={"stock": 1000})
    outs = await at_once(
        [
            partial(engine.fire, "sku", "reserve", strategy=STRATEGIES[i % 2], request_id=f"r{i}")
            for i in range(60)
        ]
    )
    assert all(isinstance(o, flowlock.Outcome) and o.applied for o in outs), outs[:3]
    good = [o for o in outs if isinstance(o, flowlock.Outcome)]
    assert {o.strategy for o in good} == set(STRATEGIES)
    for strategy in STRATEGIES:
        assert batched([o for o in good if o.strategy == strategy]) == {1: 1, 29: 29}
    assert (await engine.get("sku")).data["stock"] == 940
    await verify(engine, sql_history, "sku", 60)
