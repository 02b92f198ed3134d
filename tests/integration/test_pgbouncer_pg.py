"""flowlock behind a real PgBouncer (tests/pgbouncer_harness.py: Debian's 1.18, stock settings, a
process of its own per pool mode) in front of the test PostgreSQL.

Transaction pooling, as most deployments run PgBouncer: the store and every strategy work,
batching on and off, and so does firing inside the application's own transaction; nothing
flowlock sets outlives its transaction on the pooler's server connections; what needs a session
(advisory locks, fencing epochs, run-once jobs) is refused when opening, with InvalidInput naming
session pooling, before anything is written. Session pooling: all of it works, advisory locks and
fencing epochs included. Every storm ends with the checker and the history counted with SQL.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import pytest

import flowlock
import pg_budget
from flowlock import examples
from flowlock._pg.fence import EPOCH_LOCK_CLASS
from flowlock.checker import check
from flowlock.core.models import TIMER_ACTOR
from flowlock.locks import MemoryLocks
from flowlock.locks.advisory import AdvisoryLocks
from flowlock.stores.postgres import PostgresStore
from lock_probes import wait_until
from outbox_kit import shop, status_is
from pgbouncer_harness import PgBouncer
from timer_steps import BOUND, WF, deadline

pytestmark = pytest.mark.postgres

SqlHistory = Callable[..., Awaitable[Any]]
STRATEGIES = ["optimistic", "pessimistic", "adaptive"]
STOCK = 10_000
CALLERS = 50
INSTANCES = ("s0", "s1", "s2")


def _stock_kept(data: Any) -> str | None:
    if data["stock"] + data["reserved"] != STOCK or data["stock"] < 0:
        return f"stock {data['stock']} + reserved {data['reserved']} is not {STOCK}"
    return None


async def _stock(engine: flowlock.Engine, iid: str) -> None:
    await engine.create("inventory", instance_id=iid, data={"stock": STOCK, "reserved": 0})


@contextlib.asynccontextmanager
async def _engines(
    url: str, schema: str, count: int, **options: Any
) -> AsyncIterator[list[flowlock.Engine]]:
    """`count` engines on `url` (each its own pool), the inventory workflow registered and the
    instances created by the first."""
    async with contextlib.AsyncExitStack() as stack:
        engines = []
        for _ in range(count):
            engine = flowlock.connect(url, schema=schema, **options)
            await stack.enter_async_context(engine)
            await engine.register(examples.inventory())
            engines.append(engine)
        for iid in INSTANCES:
            await _stock(engines[0], iid)
        yield engines


async def _storm(
    engines: Sequence[flowlock.Engine], strategy: str, *, callers: int = CALLERS
) -> dict[str, int]:
    """`callers` tasks at once over the engines and instances, each reserving one unit with a
    request id of its own and then repeating it (idempotent). The applied count per instance.

    An optimistic caller may lose its compare-and-swap on the hot rows too often
    (ConflictRetriesExhausted: nothing written, its request id unused); that is the strategy's
    answer, not the pooler's, and the checker counts only what applied. Any other error fails."""
    go = asyncio.Event()

    async def caller(n: int) -> flowlock.Outcome | None:
        engine, iid = engines[n % len(engines)], INSTANCES[n % len(INSTANCES)]
        await go.wait()
        request_id = f"{strategy}-{n}"
        try:
            first = await engine.fire(iid, "reserve", request_id=request_id, strategy=strategy)
        except flowlock.ConflictRetriesExhausted:
            return None
        again = await engine.fire(iid, "reserve", request_id=request_id, strategy=strategy)
        assert first.applied and again.idempotent
        assert again.instance.version >= first.instance.version
        return first

    tasks = [asyncio.create_task(caller(n)) for n in range(callers)]
    await asyncio.sleep(0)
    go.set()
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    errors = [o for o in outcomes if isinstance(o, BaseException)]
    assert not errors, errors[:3]
    applied = dict.fromkeys(INSTANCES, 0)
    for o in outcomes:
        if isinstance(o, flowlock.Outcome):
            applied[o.instance.id] += 1
    assert all(applied.values()), applied
    if strategy != "optimistic":
        assert sum(applied.values()) == callers
    return applied


async def _verify(
    engine: flowlock.Engine, sql_history: SqlHistory, applied: dict[str, int]
) -> None:
    """The checker over each instance's history, and the history rows counted with SQL."""
    histories = {}
    for iid, count in applied.items():
        history = await engine.history(iid)
        verdict = check(
            await engine.get(iid),
            history,
            initial_state="open",
            expected_applied=count,
            invariant=_stock_kept,
        )
        assert verdict.ok, verdict.violations
        histories[iid] = history
    (await sql_history()).assert_matches(histories)


async def _session_settings(url: str, clients: int) -> set[tuple[str, str]]:
    """search_path and lock_timeout of `clients` server connections at once: each client holds a
    transaction open, so each is on a server connection of its own."""
    conns = [await pg_budget.connect(url, statement_cache_size=0) for _ in range(clients)]
    try:
        seen = set()
        for conn in conns:
            await conn.execute("BEGIN")
            row = await conn.fetchrow(
                "SELECT current_setting('search_path') AS s, current_setting('lock_timeout') AS t"
            )
            assert row is not None
            seen.add((row["s"], row["t"]))
        return seen
    finally:
        for conn in conns:
            await conn.close()


# -- how flowlock finds out --------------------------------------------------------------------


async def test_the_probe_tells_each_link_apart(
    pg_url: str, pgbouncer_transaction: PgBouncer, pgbouncer_session: PgBouncer, pg_schema: str
) -> None:
    """A direct URL opens as "none", PgBouncer's session mode as "session", its transaction mode
    as "transaction"; pooling= says it without a probe."""
    for url, expected in (
        (pg_url, "none"),
        (pgbouncer_session.url(), "session"),
        (pgbouncer_transaction.url(), "transaction"),
    ):
        async with flowlock.connect(url, schema=pg_schema, max_size=2) as engine:
            assert isinstance(engine.store, PostgresStore)
            assert engine.store.pooling == expected, url
    async with flowlock.connect(pg_url, schema=pg_schema, pooling="transaction") as engine:
        assert isinstance(engine.store, PostgresStore)
        assert engine.store.pooling == "transaction"


async def test_told_transaction_pooling_a_direct_store_keeps_no_session_state(
    pg_url: str, pg_schema: str, sql_history: SqlHistory
) -> None:
    """pooling="transaction" on a direct URL: the store runs as behind a transaction pooler (no
    startup setting, no search_path), and a storm of each strategy passes the checker."""
    async with _engines(pg_url, pg_schema, 1, max_size=6, pooling="transaction") as engines:
        store = engines[0].store
        assert isinstance(store, PostgresStore)
        async with store.pool.acquire() as conn:
            path = await conn.fetchval("SELECT current_setting('search_path')")
            assert pg_schema not in path
        applied = dict.fromkeys(INSTANCES, 0)
        for strategy in STRATEGIES:
            for iid, n in (await _storm(engines, strategy, callers=12)).items():
                applied[iid] += n
        await _verify(engines[0], sql_history, applied)


# -- transaction pooling -----------------------------------------------------------------------


@pytest.mark.parametrize("batching", [True, False], ids=["batching", "no-batching"])
@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_storm_through_a_transaction_pooler(
    pgbouncer_transaction: PgBouncer,
    pg_schema: str,
    sql_history: SqlHistory,
    strategy: str,
    batching: bool,
) -> None:
    """50 callers at once on 3 instances through two engines behind PgBouncer
    pool_mode=transaction: every call applies once (its repeat answers idempotently), and the
    checker finds each history whole."""
    url = pgbouncer_transaction.url()
    async with _engines(url, pg_schema, 2, max_size=8, batching=batching) as engines:
        assert {getattr(e.store, "pooling", None) for e in engines} == {"transaction"}
        applied = await _storm(engines, strategy)
        await _verify(engines[0], sql_history, applied)


async def test_nothing_flowlock_sets_stays_on_the_pooler_connections(
    pgbouncer_transaction: PgBouncer, pg_url: str, pg_schema: str, sql_history: SqlHistory
) -> None:
    """After a storm of each strategy through the transaction pooler, every one of its server
    connections (20: the stock default_pool_size) has the server's own search_path and
    lock_timeout: flowlock set its own LOCAL only."""
    conn = await pg_budget.connect(pg_url)
    try:
        defaults = await conn.fetchrow(
            "SELECT current_setting('search_path') AS s, current_setting('lock_timeout') AS t"
        )
    finally:
        await conn.close()
    assert defaults is not None
    url = pgbouncer_transaction.url()
    async with _engines(url, pg_schema, 2, max_size=10) as engines:
        applied = dict.fromkeys(INSTANCES, 0)
        for strategy in STRATEGIES:
            for iid, n in (await _storm(engines, strategy)).items():
                applied[iid] += n
        await _verify(engines[0], sql_history, applied)
    assert await _session_settings(url, 20) == {(defaults["s"], defaults["t"])}


@pytest.mark.parametrize("strategy", ["optimistic", "pessimistic"])
async def test_a_row_lock_wait_is_bounded_behind_the_pooler(
    pgbouncer_transaction: PgBouncer, pg_url: str, pg_schema: str, strategy: str
) -> None:
    """A row held by another transaction: the call through the transaction pooler waits for it
    no longer than lock_timeout (set LOCAL, as no session keeps it there) and raises
    LockTimeout; nothing is written, and the instance moves on once the row is free."""
    url = pgbouncer_transaction.url()
    async with _engines(url, pg_schema, 1, max_size=4, lock_timeout=0.3) as (engine,):
        holder = await pg_budget.connect(pg_url)
        try:
            async with holder.transaction():
                await holder.execute(
                    f'SELECT 1 FROM "{pg_schema}".flowlock_instances WHERE id = $1 FOR UPDATE',
                    "s0",
                )
                with pytest.raises(flowlock.LockTimeout):
                    async with asyncio.timeout(20):
                        await engine.fire("s0", "reserve", strategy=strategy)
        finally:
            await holder.close()
        assert (await engine.get("s0")).version == 1
        assert (await engine.fire("s0", "reserve", strategy=strategy)).applied


async def test_keyed_creates_through_the_pooler(
    pgbouncer_transaction: PgBouncer, pg_schema: str
) -> None:
    """Creates under one idempotency key, 20 at once through the transaction pooler, make one
    instance and all answer it; another create under the key is refused."""
    url = pgbouncer_transaction.url()
    async with _engines(url, pg_schema, 2, max_size=6) as engines:

        async def create(n: int) -> flowlock.Instance:
            return await engines[n % 2].create(
                "inventory", instance_id="k1", data={"stock": 5, "reserved": 0}, request_id="key"
            )

        made = await asyncio.gather(*(create(n) for n in range(20)))
        assert {(i.id, i.version) for i in made} == {("k1", 1)}
        with pytest.raises(flowlock.CreateKeyReused):
            await engines[0].create("inventory", instance_id="k2", request_id="key")


@pytest.mark.parametrize("commit", [True, False], ids=["commit", "rollback"])
async def test_firing_in_the_applications_transaction_through_the_pooler(
    pgbouncer_transaction: PgBouncer,
    pg_url: str,
    pg_schema: str,
    sql_history: SqlHistory,
    commit: bool,
) -> None:
    """The application's connection goes through the transaction pooler too (with asyncpg's
    statement cache off, as asyncpg asks there): its order row, a pessimistic reserve and an
    optimistic approve commit together, or roll back together; its settings are as they were."""
    url = pgbouncer_transaction.url()
    async with _engines(url, pg_schema, 1, max_size=4) as (engine,):
        await engine.register(examples.approval())
        await engine.create("approval", instance_id="o-1")
        conn = await pg_budget.connect(url, statement_cache_size=0)
        try:
            await conn.execute(f'CREATE TABLE "{pg_schema}".orders (id text PRIMARY KEY)')
            tx = conn.transaction()
            await tx.start()
            before = await conn.fetchrow("SELECT current_setting('search_path') AS s")
            await conn.execute(f'INSERT INTO "{pg_schema}".orders (id) VALUES ($1)', "o-1")
            reserved = await engine.fire(
                "s0", "reserve", payload={"qty": 3}, request_id="o-1", connection=conn
            )
            approved = await engine.fire("o-1", "approve", actor="alice", connection=conn)
            assert reserved.applied and approved.applied
            assert await conn.fetchrow("SELECT current_setting('search_path') AS s") == before
            await (tx.commit() if commit else tx.rollback())
            orders = await conn.fetchval(f'SELECT count(*) FROM "{pg_schema}".orders')
        finally:
            await conn.close()
        stock = await engine.get("s0")
        assert orders == (1 if commit else 0)
        assert stock.data["reserved"] == (3 if commit else 0)
        assert (await engine.get("o-1")).state == ("approved" if commit else "pending")
        applied = {"s0": 1 if commit else 0}
        await _verify(engine, sql_history, applied)
        # The request id was used only if the transaction committed.
        again = await engine.fire("s0", "reserve", payload={"qty": 3}, request_id="o-1")
        assert again.idempotent is commit


async def test_timers_fire_through_a_transaction_pooler(
    pgbouncer_transaction: PgBouncer, pg_schema: str, sql_history: SqlHistory
) -> None:
    """Timers behind PgBouncer pool_mode=transaction: the timer statements name their tables
    with the schema, and since LISTEN cannot work there, armed() is set about once a second
    instead (bounded polling). A reminder armed through one engine is fired through another,
    once per firing, as the timer, until its limit; the deadline stays armed."""
    url = pgbouncer_transaction.url()
    workflow = deadline(every=0.1, limit=2)
    async with (
        flowlock.connect(url, schema=pg_schema, max_size=4) as firing,
        flowlock.connect(url, schema=pg_schema, max_size=4, timers=False) as caller,
    ):
        for engine in (firing, caller):
            await engine.register(workflow)
        store = firing.store
        assert isinstance(store, PostgresStore) and store.pooling == "transaction"
        async with store.armed() as armed:
            for _ in range(2):  # set, and set again: nobody armed anything
                armed.clear()
                async with asyncio.timeout(BOUND):
                    await armed.wait()
        await caller.create(WF, instance_id="a")

        async def reminded() -> bool:
            return [t.event for t in await store.timers("a")] == ["expire"]

        await wait_until(reminded, within=BOUND, what="both reminders fired")
        history = await caller.history("a")
        assert [(h.event, h.actor, h.request_id) for h in history] == [
            ("remind", TIMER_ACTOR, "timer:1:remind:0"),
            ("remind", TIMER_ACTOR, "timer:1:remind:1"),
        ]
        assert check(await caller.get("a"), history, initial_state="pending").ok
        (await sql_history()).assert_matches({"a": history})


async def test_the_outbox_delivers_through_a_transaction_pooler(
    pgbouncer_transaction: PgBouncer, pg_schema: str
) -> None:
    """The outbox behind PgBouncer pool_mode=transaction: messages are written with their
    transitions (batching on), the outbox statements name their tables with the schema, and
    pending() polls instead of LISTEN. A handler on another engine gets every message once and
    its Thens apply once."""
    url = pgbouncer_transaction.url()
    delivered: list[str] = []

    async def charge(message: flowlock.Message) -> flowlock.Then:
        delivered.append(message.key)
        return flowlock.Then("charged")

    async with (
        flowlock.connect(url, schema=pg_schema, max_size=4, outbox=False) as caller,
        flowlock.connect(url, schema=pg_schema, max_size=4) as dispatching,
    ):
        for engine in (caller, dispatching):
            await engine.register(shop())
        dispatching.on_emit("charge", charge, concurrency=4)
        ids = [f"o{n}" for n in range(40)]
        for iid in ids:
            await caller.create("shop", instance_id=iid)
        await asyncio.gather(*(caller.fire(iid, "reserve") for iid in ids))

        async def charged() -> bool:
            return await caller.count("shop", state="charged") == len(ids)

        await wait_until(charged, within=BOUND, what="every order charged")
        for iid in ids:
            await status_is(caller, f"{iid}:2:0", "done")
            history = await caller.history(iid)
            assert [(h.event, h.request_id) for h in history] == [
                ("reserve", None),
                ("charged", f"{iid}:2:0"),
            ]
    assert sorted(delivered) == sorted(f"{iid}:2:0" for iid in ids)


def _refused_openers(url: str, schema: str, redis_url: str) -> dict[str, Callable[[], Any]]:
    return {
        "advisory locks": lambda: flowlock.connect(url, schema=schema, locks="advisory"),
        "fencing epochs": lambda: flowlock.connect(url, schema=schema, redis_url=redis_url),
        "AdvisoryLocks": lambda: AdvisoryLocks(url, schema=schema),
        "RunOnce": lambda: flowlock.RunOnce(MemoryLocks(), url, schema=schema),
    }


@pytest.mark.parametrize("what", ["advisory locks", "fencing epochs", "AdvisoryLocks", "RunOnce"])
async def test_what_needs_a_session_is_refused_behind_transaction_pooling(
    pgbouncer_transaction: PgBouncer, pg_url: str, pg_schema: str, redis_url: str, what: str
) -> None:
    """Advisory locks, fencing epochs (the Redis backend's) and run-once jobs need a session:
    opening them through PgBouncer pool_mode=transaction raises InvalidInput that says so and
    names session pooling and a direct connection, and nothing was written (no schema)."""
    opener = _refused_openers(pgbouncer_transaction.url(), pg_schema, redis_url)[what]
    with pytest.raises(flowlock.InvalidInput) as refused:
        async with opener():
            pass
    message = str(refused.value)
    assert "pool_mode=transaction" in message and "pool_mode=session" in message
    assert "session pooling" in message and "directly" in message
    conn = await pg_budget.connect(pg_url)
    try:
        schemas = await conn.fetchval(
            "SELECT count(*) FROM pg_namespace WHERE nspname = $1", pg_schema
        )
    finally:
        await conn.close()
    assert schemas == 0


# -- session pooling ---------------------------------------------------------------------------


async def test_storm_through_a_session_pooler(
    pgbouncer_session: PgBouncer, pg_schema: str, sql_history: SqlHistory
) -> None:
    """The same storm through PgBouncer pool_mode=session (settings SET per connection, as the
    pooler refuses them at startup), each strategy in turn, within its 20 server connections."""
    async with _engines(pgbouncer_session.url(), pg_schema, 2, max_size=6) as engines:
        assert {getattr(e.store, "pooling", None) for e in engines} == {"session"}
        applied = dict.fromkeys(INSTANCES, 0)
        for strategy in STRATEGIES:
            for iid, n in (await _storm(engines, strategy)).items():
                applied[iid] += n
        await _verify(engines[0], sql_history, applied)


async def test_listen_works_through_a_session_pooler(
    pgbouncer_session: PgBouncer, pg_schema: str
) -> None:
    """Behind PgBouncer pool_mode=session, LISTEN holds its server connection: a commit arming a
    timer through another engine wakes armed(), and the deadline fires once."""
    url = pgbouncer_session.url()
    workflow = deadline(after=0.2, every=None)
    async with (
        flowlock.connect(url, schema=pg_schema, max_size=4) as firing,
        flowlock.connect(url, schema=pg_schema, max_size=4, timers=False) as caller,
    ):
        for engine in (firing, caller):
            await engine.register(workflow)
        store = firing.store
        assert isinstance(store, PostgresStore) and store.pooling == "session"
        async with store.armed() as armed:
            async with asyncio.timeout(BOUND):
                await armed.wait()  # set once LISTEN is up
            armed.clear()
            await caller.create(WF, instance_id="a")
            async with asyncio.timeout(BOUND):
                await armed.wait()

        async def expired() -> bool:
            return (await caller.get("a")).state == "rejected"

        await wait_until(expired, within=BOUND, what="the deadline fired")
        [entry] = await caller.history("a")
        assert (entry.actor, entry.request_id) == (TIMER_ACTOR, "timer:1:expire:0")


async def test_advisory_locks_work_behind_session_pooling(
    pgbouncer_session: PgBouncer, pg_url: str, pg_schema: str, sql_history: SqlHistory
) -> None:
    """Advisory locks through PgBouncer pool_mode=session: a storm of the distributed strategy
    passes the checker, fencing tokens grow, and a held lease is seen as owned (by the backend's
    own process id, not the pooler's)."""
    url = pgbouncer_session.url()
    store = PostgresStore(url, schema=pg_schema, pool_size=4)
    locks = AdvisoryLocks(url, schema=pg_schema, pool_size=6)
    async with flowlock.Engine(store, locks=locks) as engine:
        await engine.register(examples.inventory())
        for iid in INSTANCES:
            await _stock(engine, iid)
        applied = await _storm([engine], "distributed", callers=30)
        await _verify(engine, sql_history, applied)
        tokens = [e.fencing_token or 0 for e in await engine.history("s0")]
        assert tokens == sorted(tokens) and 0 not in tokens
        async with locks.acquire("held", ttl=5.0) as held:
            assert await locks.owned(held.lease)
            assert await locks.locked("held")
        assert not await locks.locked("held")


async def test_fencing_epochs_work_behind_session_pooling(
    pgbouncer_session: PgBouncer,
    pg_url: str,
    pg_schema: str,
    redis_url: str,
    redis_namespace: str,
    sql_history: SqlHistory,
) -> None:
    """The Redis lock backend with the store's fencing epochs through PgBouncer pool_mode=session:
    a distributed storm passes the checker, and each key's counter was started from an epoch
    bumped in PostgreSQL through the pooler."""
    url = pgbouncer_session.url()
    async with flowlock.connect(
        url, schema=pg_schema, max_size=4, redis_url=redis_url, namespace=redis_namespace
    ) as engine:
        await engine.register(examples.inventory())
        for iid in INSTANCES:
            await _stock(engine, iid)
        applied = await _storm([engine], "distributed", callers=30)
        await _verify(engine, sql_history, applied)
    conn = await pg_budget.connect(pg_url)
    try:
        epochs = await conn.fetchval(
            f'SELECT count(*) FROM "{pg_schema}".flowlock_fence_epochs WHERE namespace = $1',
            redis_namespace,
        )
    finally:
        await conn.close()
    assert epochs >= 1


async def test_a_session_pooler_keeps_the_fencing_lock_for_its_client(
    pgbouncer_session: PgBouncer, pg_url: str, pg_schema: str
) -> None:
    """The fencing epoch's session lock is held while the caller starts its counter and let go
    after, through PgBouncer pool_mode=session (one server connection per client); a second
    bump of the key takes the next epoch."""
    store = PostgresStore(pgbouncer_session.url(), schema=pg_schema, pool_size=2)
    await store.open()
    try:
        epochs = store.fence_epochs
        async with epochs.advance(pg_schema, "k", at_least=1, bound=5.0) as epoch:
            assert epoch == 1
            assert await _epoch_locked(pg_url, pg_schema, "k")
        assert not await _epoch_locked(pg_url, pg_schema, "k")
        async with epochs.advance(pg_schema, "k", at_least=1, bound=5.0) as epoch:
            assert epoch == 2
    finally:
        await store.aclose()


async def _epoch_locked(url: str, namespace: str, key: str) -> bool:
    """Whether some session holds the fencing epoch lock of (namespace, key)."""
    conn = await pg_budget.connect(url)
    try:
        return bool(
            await conn.fetchval(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
                " AND classid = $1::bigint::oid AND objsubid = 2"
                " AND objid = (hashtext($2 || ':' || $3)::bigint & 4294967295)::oid",
                EPOCH_LOCK_CLASS,
                namespace,
                key,
            )
        )
    finally:
        await conn.close()


async def test_inspecting_goes_through_a_session_pooler_not_a_transaction_pooler(
    pgbouncer_session: PgBouncer,
    pgbouncer_transaction: PgBouncer,
    pg_url: str,
    pg_schema: str,
) -> None:
    """The inspection commands make their sessions read-only with SET: through PgBouncer
    pool_mode=session they read (the schema SET too, as the pooler refuses it at startup);
    through pool_mode=transaction, where that SET would stay on a server connection the
    application gets next, they are refused with InvalidInput naming session pooling."""
    from flowlock._inspect import open_readonly

    async with _engines(pg_url, pg_schema, 1, max_size=2):
        pass
    async with open_readonly(pgbouncer_session.url(), pg_schema) as engine:
        assert (await engine.get("s0")).data == {"stock": STOCK, "reserved": 0}
        store = engine.store
        assert isinstance(store, PostgresStore)
        async with store.pool.acquire() as conn:
            assert await conn.fetchval("SHOW default_transaction_read_only") == "on"
            assert await conn.fetchval("SHOW search_path") == pg_schema
    with pytest.raises(flowlock.InvalidInput, match="pool_mode=session"):
        async with open_readonly(pgbouncer_transaction.url(), pg_schema):
            pass
