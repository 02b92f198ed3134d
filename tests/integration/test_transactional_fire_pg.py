"""``fire(..., connection=conn)`` and ``create(..., connection=conn)``: flowlock inside a
transaction the application opened on real PostgreSQL, so "insert the order row and reserve the
stock" commit or roll back together.

The application's connections here are plain asyncpg connections with the server's default
search_path and no codec of flowlock's; their own table (``orders``) is named with the test's
schema. Every test counts rows with its own SQL, and the concurrent ones run the checker too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
import pytest
from prometheus_client import CollectorRegistry

import flowlock
import pg_budget
from flowlock import examples
from flowlock.checker import check
from flowlock.core.models import InstanceQuery
from flowlock.metrics import Metrics
from flowlock.stores import MemoryStore
from flowlock.stores.postgres import PostgresStore
from lock_probes import wait_until

pytestmark = pytest.mark.postgres

SqlHistory = Callable[..., Awaitable[Any]]
SLACK = 5.0  # seconds a bounded wait may overrun its bound on a loaded machine


@pytest.fixture
async def engine(pg_url: str, pg_schema: str) -> AsyncIterator[flowlock.Engine]:
    """An engine on the test's schema with the approval and inventory workflows, one stocked
    instance ("stock", 10 units) and the application's own table ``orders`` beside flowlock's."""
    async with flowlock.Engine(PostgresStore(pg_url, schema=pg_schema, pool_size=4)) as eng:
        await eng.register(examples.approval())
        await eng.register(examples.inventory())
        await eng.create("inventory", instance_id="stock", data={"stock": 10, "reserved": 0})
        conn = await pg_budget.connect(pg_url)
        try:
            await conn.execute(f'CREATE TABLE "{pg_schema}".orders (id text PRIMARY KEY)')
        finally:
            await conn.close()
        yield eng


@pytest.fixture
async def app_conns(pg_url: str) -> AsyncIterator[Callable[[], Awaitable[asyncpg.Connection]]]:
    """Opens the application's connections (closed at the end)."""
    opened: list[asyncpg.Connection] = []

    async def open_one() -> asyncpg.Connection:
        conn = await pg_budget.connect(pg_url)
        opened.append(conn)
        return conn

    yield open_one
    for conn in opened:
        await conn.close()


async def _count(url: str, sql: str, *args: Any) -> int:
    conn = await pg_budget.connect(url)
    try:
        return int(await conn.fetchval(sql, *args))
    finally:
        await conn.close()


async def _orders(url: str, schema: str) -> int:
    return await _count(url, f'SELECT count(*) FROM "{schema}".orders')


async def _instance(url: str, schema: str, iid: str) -> tuple[int, int] | None:
    """(version, history rows) of ``iid`` by the test's own SQL, or None when it is not there."""
    conn = await pg_budget.connect(url)
    try:
        version = await conn.fetchval(
            f'SELECT version FROM "{schema}".flowlock_instances WHERE id = $1', iid
        )
        rows = await conn.fetchval(
            f'SELECT count(*) FROM "{schema}".flowlock_history WHERE instance_id = $1', iid
        )
    finally:
        await conn.close()
    return None if version is None else (int(version), int(rows))


async def _settings(conn: asyncpg.Connection) -> tuple[str, str]:
    return await conn.fetchval("SHOW search_path"), await conn.fetchval("SHOW lock_timeout")


async def _waiting_for_a_lock(url: str, pid: int) -> bool:
    return bool(
        await _count(
            url,
            "SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND wait_event_type = 'Lock'",
            pid,
        )
    )


async def _blocks_someone(url: str, pid: int) -> bool:
    """Whether a session waits for a lock that the session ``pid`` holds."""
    sql = "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))"
    return bool(await _count(url, sql, pid))


async def test_commit_keeps_the_application_row_and_the_transition(
    engine: flowlock.Engine,
    app_conns: Callable[[], Awaitable[asyncpg.Connection]],
    pg_url: str,
    pg_schema: str,
    sql_history: SqlHistory,
) -> None:
    """The application's row, a created instance and two transitions in one transaction: all
    there once it commits; the caller's search_path and lock_timeout are as they were."""
    conn = await app_conns()
    before = await _settings(conn)
    async with conn.transaction():
        await conn.execute(f'INSERT INTO "{pg_schema}".orders (id) VALUES ($1)', "o-1")
        created = await engine.create(
            "approval", instance_id="o-1", data={"amount": 5}, connection=conn
        )
        approved = await engine.fire("o-1", "approve", actor="alice", connection=conn)
        reserved = await engine.fire(
            "stock", "reserve", payload={"qty": 3}, request_id="o-1", connection=conn
        )
        assert await _settings(conn) == before
        # Nothing is visible outside the transaction before it commits.
        assert await _instance(pg_url, pg_schema, "o-1") is None
        assert await _instance(pg_url, pg_schema, "stock") == (1, 0)
    assert created.version == 1 and approved.applied and reserved.applied
    assert reserved.instance.data == {"stock": 7, "reserved": 3}
    assert await _orders(pg_url, pg_schema) == 1
    assert await _instance(pg_url, pg_schema, "o-1") == (2, 1)
    assert await _instance(pg_url, pg_schema, "stock") == (2, 1)
    assert (await engine.get("stock")).data == {"stock": 7, "reserved": 3}
    assert await _settings(conn) == before
    histories = {i: await engine.history(i) for i in ("o-1", "stock")}
    (await sql_history()).assert_matches(histories)


async def test_rollback_leaves_neither_the_application_row_nor_the_transition(
    engine: flowlock.Engine,
    app_conns: Callable[[], Awaitable[asyncpg.Connection]],
    pg_url: str,
    pg_schema: str,
    sql_history: SqlHistory,
) -> None:
    """The same work rolled back: no order row, no instance, no history row, stock untouched."""
    conn = await app_conns()
    tx = conn.transaction()
    await tx.start()
    await conn.execute(f'INSERT INTO "{pg_schema}".orders (id) VALUES ($1)', "o-1")
    await engine.create("approval", instance_id="o-1", connection=conn)
    assert (await engine.fire("o-1", "approve", connection=conn)).applied
    assert (await engine.fire("stock", "reserve", request_id="o-1", connection=conn)).applied
    await tx.rollback()
    assert await _orders(pg_url, pg_schema) == 0
    assert await _instance(pg_url, pg_schema, "o-1") is None
    assert await _instance(pg_url, pg_schema, "stock") == (1, 0)
    with pytest.raises(flowlock.InstanceNotFound):
        await engine.get("o-1")
    assert (await engine.get("stock")).data == {"stock": 10, "reserved": 0}
    (await sql_history()).assert_matches({"stock": []})
    # The id is free again, and the request id was never used.
    await engine.create("approval", instance_id="o-1")
    assert (await engine.fire("stock", "reserve", request_id="o-1")).applied


async def test_a_repeated_request_id_inside_one_transaction_is_idempotent(
    engine: flowlock.Engine,
    app_conns: Callable[[], Awaitable[asyncpg.Connection]],
    pg_url: str,
    pg_schema: str,
) -> None:
    """The same request id twice in one transaction, and again after it committed (with and
    without connection=), answers idempotently with the first outcome."""
    conn = await app_conns()
    async with conn.transaction():
        first = await engine.fire("stock", "reserve", request_id="r", connection=conn)
        again = await engine.fire("stock", "reserve", request_id="r", connection=conn)
    later = await engine.fire("stock", "reserve", request_id="r")
    async with conn.transaction():
        inside = await engine.fire(
            "stock", "reserve", request_id="r", strategy="pessimistic", connection=conn
        )
    assert first.applied and again.idempotent and later.idempotent and inside.idempotent
    assert again.instance.version == later.instance.version == inside.instance.version == 2
    assert await _instance(pg_url, pg_schema, "stock") == (2, 1)


async def test_optimistic_lost_race_raises_once_and_does_not_retry(
    engine: flowlock.Engine,
    app_conns: Callable[[], Awaitable[asyncpg.Connection]],
    pg_url: str,
    pg_schema: str,
    sql_history: SqlHistory,
) -> None:
    """B reads stock 10, then its compare-and-swap waits behind A's uncommitted reserve; A
    commits, B's swap loses and raises ConflictRetriesExhausted(attempts=1) although a retry
    would have applied (9 left); B's own row still commits, without a second reservation."""
    a, b = await app_conns(), await app_conns()
    b_pid = b.get_server_pid()
    async with a.transaction():
        assert (await engine.fire("stock", "reserve", strategy="optimistic", connection=a)).applied
        tx = b.transaction()
        await tx.start()
        await b.execute(f'INSERT INTO "{pg_schema}".orders (id) VALUES ($1)', "b")
        racing = asyncio.create_task(
            engine.fire("stock", "reserve", strategy="optimistic", connection=b)
        )
        await wait_until(lambda: _waiting_for_a_lock(pg_url, b_pid), what="B waiting on A")
    with pytest.raises(flowlock.ConflictRetriesExhausted) as lost:
        await racing
    assert lost.value.attempts == 1 and lost.value.instance_id == "stock"
    await tx.commit()  # B's transaction is usable after the lost race
    assert await _orders(pg_url, pg_schema) == 1
    assert await _instance(pg_url, pg_schema, "stock") == (2, 1)
    stock = await engine.get("stock")
    assert stock.data == {"stock": 9, "reserved": 1}
    history = await engine.history("stock")
    assert check(stock, history, expected_applied=1).ok
    (await sql_history()).assert_matches({"stock": history})


async def test_pessimistic_lock_timeout_inside_the_callers_transaction(
    engine: flowlock.Engine,
    app_conns: Callable[[], Awaitable[asyncpg.Connection]],
    pg_url: str,
    pg_schema: str,
    sql_history: SqlHistory,
) -> None:
    """A row held elsewhere: Pessimistic(lock_timeout=0.3) inside the caller's transaction
    raises LockTimeout after 0.3 s; the caller's own lock_timeout (session 7 s, transaction
    9 s) is what it was, and its transaction commits its own row."""
    holder, conn = await app_conns(), await app_conns()
    await conn.execute("SET lock_timeout = '7s'")
    async with holder.transaction():
        await holder.execute(
            f"SELECT 1 FROM \"{pg_schema}\".flowlock_instances WHERE id = 'stock' FOR UPDATE"
        )
        async with conn.transaction():
            await conn.execute("SET LOCAL lock_timeout = '9s'")
            await conn.execute(f'INSERT INTO "{pg_schema}".orders (id) VALUES ($1)', "o-1")
            started = time.monotonic()
            with pytest.raises(flowlock.LockTimeout) as caught:
                await engine.fire(
                    "stock",
                    "reserve",
                    strategy=flowlock.Pessimistic(lock_timeout=0.3),
                    connection=conn,
                )
            waited = time.monotonic() - started
            assert 0.3 <= waited < 0.3 + SLACK, waited
            assert caught.value.key == "stock"
            assert await conn.fetchval("SHOW lock_timeout") == "9s"
            # The caller's search_path is back too: its own table is found by its own name.
            assert await conn.fetchval(f'SELECT count(*) FROM "{pg_schema}".orders') == 1
            assert await conn.fetchval("SHOW search_path") == '"$user", public'
    assert await conn.fetchval("SHOW lock_timeout") == "7s"
    assert await _orders(pg_url, pg_schema) == 1
    assert await _instance(pg_url, pg_schema, "stock") == (1, 0)
    # Once the row is free the pessimistic fire applies inside a transaction, and the caller's
    # setting is put back on success too.
    async with conn.transaction():
        out = await engine.fire(
            "stock", "reserve", strategy=flowlock.Pessimistic(lock_timeout=0.3), connection=conn
        )
        assert await conn.fetchval("SHOW lock_timeout") == "7s"
    assert out.applied and out.strategy == "pessimistic"
    (await sql_history()).assert_matches({"stock": await engine.history("stock")})


async def test_a_pessimistic_fire_holds_the_row_until_the_caller_commits(
    engine: flowlock.Engine,
    app_conns: Callable[[], Awaitable[asyncpg.Connection]],
    pg_url: str,
) -> None:
    """Another pessimistic caller waits for the row until the first caller's transaction ends,
    then applies on what that transaction committed."""
    conn = await app_conns()
    tx = conn.transaction()
    await tx.start()
    await engine.fire("stock", "reserve", strategy="pessimistic", connection=conn)
    other = asyncio.create_task(engine.fire("stock", "reserve", strategy="pessimistic"))
    await wait_until(
        lambda: _blocks_someone(pg_url, conn.get_server_pid()),
        what="the second caller waiting for the row",
    )
    assert not other.done()
    await tx.commit()
    out = await other
    assert out.applied and out.instance.version == 3
    assert out.instance.data == {"stock": 8, "reserved": 2}


@pytest.mark.parametrize("strategy", ["optimistic", "pessimistic"])
async def test_one_request_id_in_concurrent_caller_transactions_applies_once(
    engine: flowlock.Engine,
    app_conns: Callable[[], Awaitable[asyncpg.Connection]],
    pg_url: str,
    pg_schema: str,
    sql_history: SqlHistory,
    strategy: str,
) -> None:
    """Eight transactions, each inserting its own row and reserving with ONE request id, run at
    once and commit: one reservation applied, seven idempotent answers, eight rows."""
    conns = [await app_conns() for _ in range(8)]
    go = asyncio.Event()

    async def order(i: int, conn: asyncpg.Connection) -> flowlock.Outcome:
        await go.wait()
        async with conn.transaction():
            await conn.execute(f'INSERT INTO "{pg_schema}".orders (id) VALUES ($1)', f"o-{i}")
            return await engine.fire(
                "stock", "reserve", request_id="cart-1", strategy=strategy, connection=conn
            )

    tasks = [asyncio.create_task(order(i, c)) for i, c in enumerate(conns)]
    await asyncio.sleep(0)
    go.set()
    outcomes = await asyncio.gather(*tasks)
    assert sum(o.applied for o in outcomes) == 1
    assert sum(o.idempotent for o in outcomes) == 7
    assert {o.instance.version for o in outcomes} == {2}
    assert await _orders(pg_url, pg_schema) == 8
    stock = await engine.get("stock")
    assert stock.data == {"stock": 9, "reserved": 1}
    history = await engine.history("stock")
    assert check(stock, history, expected_applied=1).ok
    sql = await sql_history()
    sql.assert_matches({"stock": history})
    assert sql.per_request == {("stock", "cart-1"): 1}


async def test_a_duplicate_waits_for_the_first_transaction_and_answers_by_its_end(
    engine: flowlock.Engine,
    app_conns: Callable[[], Awaitable[asyncpg.Connection]],
    pg_url: str,
    pg_schema: str,
    sql_history: SqlHistory,
) -> None:
    """A applies request "r" and keeps its transaction open; B fires "r" and waits for A's row.
    A rolls back: B applies. Then the same with A committing: B answers idempotent."""
    a, b = await app_conns(), await app_conns()
    results: list[flowlock.Outcome] = []
    for a_commits in (False, True):
        rid = f"r-{a_commits}"
        tx_a = a.transaction()
        await tx_a.start()
        assert (await engine.fire("stock", "reserve", request_id=rid, connection=a)).applied
        async with b.transaction():
            waiting = asyncio.create_task(
                engine.fire("stock", "reserve", request_id=rid, connection=b)
            )
            await wait_until(
                lambda: _waiting_for_a_lock(pg_url, b.get_server_pid()), what="B waiting on A"
            )
            await (tx_a.commit() if a_commits else tx_a.rollback())
            results.append(await waiting)
    assert results[0].applied and results[1].idempotent
    assert results[1].instance.version == results[0].instance.version + 1
    stock = await engine.get("stock")
    history = await engine.history("stock")
    assert [h.request_id for h in history] == ["r-False", "r-True"]
    assert check(stock, history, expected_applied=2).ok
    sql = await sql_history()
    sql.assert_matches({"stock": history})
    assert set(sql.per_request.values()) == {1}


async def test_a_refused_step_undoes_flowlocks_part_only(
    engine: flowlock.Engine,
    app_conns: Callable[[], Awaitable[asyncpg.Connection]],
    pg_url: str,
    pg_schema: str,
) -> None:
    """A guard refusing inside the caller's transaction raises GuardRejected; the caller's
    transaction goes on (its row and an earlier transition commit) with its settings intact."""
    conn = await app_conns()
    before = await _settings(conn)
    async with conn.transaction():
        await conn.execute(f'INSERT INTO "{pg_schema}".orders (id) VALUES ($1)', "o-1")
        assert (await engine.fire("stock", "reserve", payload={"qty": 4}, connection=conn)).applied
        with pytest.raises(flowlock.GuardRejected):
            await engine.fire("stock", "reserve", payload={"qty": 7}, connection=conn)
        assert await _settings(conn) == before
    assert await _orders(pg_url, pg_schema) == 1
    assert (await engine.get("stock")).data == {"stock": 6, "reserved": 4}


async def test_adaptive_runs_its_current_choice_and_metrics_count_the_call(
    pg_url: str,
    pg_schema: str,
    app_conns: Callable[[], Awaitable[asyncpg.Connection]],
) -> None:
    """Adaptive on a calm instance runs optimistic inside the transaction (and says so); the
    call is counted in the metrics like any fire."""
    registry = CollectorRegistry()
    store = PostgresStore(pg_url, schema=pg_schema, pool_size=2)
    async with flowlock.Engine(store, metrics=Metrics(registry)) as eng:
        await eng.register(examples.approval())
        await eng.create("approval", instance_id="a")
        conn = await app_conns()
        async with conn.transaction():
            out = await eng.fire("a", "approve", strategy="adaptive", connection=conn)
    assert out.applied and out.strategy == "optimistic"
    assert out.reason is not None and "adaptive" in out.reason
    labels = {"workflow": "approval", "event": "approve", "strategy": "optimistic"}
    assert (
        registry.get_sample_value("flowlock_transitions_total", {**labels, "outcome": "applied"})
        == 1.0
    )


async def test_refused_calls_change_nothing(
    engine: flowlock.Engine,
    app_conns: Callable[[], Awaitable[asyncpg.Connection]],
    pg_url: str,
    pg_schema: str,
    sql_history: SqlHistory,
) -> None:
    """No transaction, not a connection, a failed transaction, the distributed strategy, an
    adaptive one that escalates to it: InvalidInput, and nothing is written anywhere."""
    conn = await app_conns()
    with pytest.raises(flowlock.InvalidInput, match="inside an open transaction"):
        await engine.fire("stock", "reserve", connection=conn)
    with pytest.raises(flowlock.InvalidInput, match="inside an open transaction"):
        await engine.create("approval", instance_id="x", connection=conn)
    with pytest.raises(flowlock.InvalidInput, match="asyncpg connection"):
        await engine.fire("stock", "reserve", connection="postgresql://")  # type: ignore[arg-type]
    async with conn.transaction():
        with pytest.raises(flowlock.InvalidInput, match="distributed"):
            await engine.fire(
                "stock",
                "reserve",
                strategy=flowlock.Distributed(locks=flowlock.locks.MemoryLocks()),
                connection=conn,
            )
        await conn.execute(f'INSERT INTO "{pg_schema}".orders (id) VALUES ($1)', "still-usable")
    tx = conn.transaction()
    await tx.start()
    with pytest.raises(asyncpg.DivisionByZeroError):
        await conn.execute("SELECT 1 / 0")
    with pytest.raises(flowlock.InvalidInput, match="already failed"):
        await engine.fire("stock", "reserve", connection=conn)
    await tx.rollback()
    assert await _orders(pg_url, pg_schema) == 1
    assert await _instance(pg_url, pg_schema, "stock") == (1, 0)
    assert await _instance(pg_url, pg_schema, "x") is None
    (await sql_history()).assert_matches({"stock": []})


async def test_an_adaptive_that_escalates_to_distributed_is_refused(
    pg_url: str, pg_schema: str, app_conns: Callable[[], Awaitable[asyncpg.Connection]]
) -> None:
    """Refused up front, whether or not the instance is escalated now."""
    from flowlock.locks import MemoryLocks
    from flowlock.strategies.monitor import ConflictMonitor

    store = PostgresStore(pg_url, schema=pg_schema, pool_size=2)
    monitor = ConflictMonitor(escalate_to="distributed")
    async with flowlock.Engine(store, locks=MemoryLocks(), monitor=monitor) as eng:
        await eng.register(examples.approval())
        await eng.create("approval", instance_id="a")
        conn = await app_conns()
        async with conn.transaction():
            with pytest.raises(flowlock.InvalidInput, match="escalates to distributed"):
                await eng.fire("a", "approve", strategy="adaptive", connection=conn)
        assert (await eng.get("a")).version == 1


@pytest.mark.parametrize("url", ["memory://", "sqlite:///:memory:"])
async def test_stores_other_than_postgresql_refuse_a_connection(
    url: str, app_conns: Callable[[], Awaitable[asyncpg.Connection]]
) -> None:
    """connection= on a memory or SQLite engine: InvalidInput naming the store; nothing read or
    written there or on the connection."""
    conn = await app_conns()
    async with flowlock.Engine.connect(url) as eng:
        await eng.register(examples.approval())
        await eng.create("approval", instance_id="a")
        async with conn.transaction():
            with pytest.raises(flowlock.InvalidInput, match="cannot join one"):
                await eng.fire("a", "approve", connection=conn)
            with pytest.raises(flowlock.InvalidInput, match="cannot join one"):
                await eng.create("approval", instance_id="b", connection=conn)
            assert await conn.fetchval("SELECT 1") == 1
        assert (await eng.get("a")).version == 1
        with pytest.raises(flowlock.InstanceNotFound):
            await eng.get("b")


async def test_memory_store_is_not_transactional() -> None:
    """The port: only the PostgreSQL store joins a caller's transaction."""
    from flowlock.stores.base import TransactionalStore

    assert not isinstance(MemoryStore(), TransactionalStore)
    assert isinstance(PostgresStore("postgresql://x@127.0.0.1:1/x"), TransactionalStore)


async def test_a_connection_of_a_pool_works_too(
    engine: flowlock.Engine, pg_url: str, pg_schema: str
) -> None:
    """A pooled connection (here one of flowlock's own pool, which decodes jsonb itself) joins
    the same way; a released one is refused."""
    store = engine.store
    assert isinstance(store, PostgresStore)
    async with store.pool.acquire() as conn, conn.transaction():
        out = await engine.fire("stock", "reserve", payload={"qty": 2}, connection=conn)
        await conn.execute(f'INSERT INTO "{pg_schema}".orders (id) VALUES ($1)', "o-1")
    assert out.applied and out.instance.data == {"stock": 8, "reserved": 2}
    assert await _orders(pg_url, pg_schema) == 1
    with pytest.raises(flowlock.InvalidInput, match="not usable"):
        await engine.fire("stock", "reserve", connection=conn)
    assert (await engine.get("stock")).version == 2


async def test_repeatable_read_sees_a_concurrent_change_as_a_store_error(
    engine: flowlock.Engine,
    app_conns: Callable[[], Awaitable[asyncpg.Connection]],
    pg_url: str,
    pg_schema: str,
) -> None:
    """A caller at REPEATABLE READ whose snapshot predates another commit on the instance gets
    PostgreSQL's serialization failure as StoreError, nothing of flowlock's written; its
    transaction is still usable and commits its own row."""
    conn = await app_conns()
    async with conn.transaction(isolation="repeatable_read"):
        await conn.execute(f'INSERT INTO "{pg_schema}".orders (id) VALUES ($1)', "o-1")
        assert (await engine.fire("stock", "reserve")).applied  # committed after the snapshot
        with pytest.raises(flowlock.StoreError, match="SerializationError"):
            await engine.fire("stock", "reserve", connection=conn)
    assert await _orders(pg_url, pg_schema) == 1
    assert await _instance(pg_url, pg_schema, "stock") == (2, 1)


async def test_a_per_workflow_strategy_is_found_through_the_callers_transaction(
    engine: flowlock.Engine,
    app_conns: Callable[[], Awaitable[asyncpg.Connection]],
    pg_url: str,
    pg_schema: str,
) -> None:
    """A workflow with its own strategy: an instance created in the caller's transaction is read
    through that transaction to pick the strategy (it is invisible to the pool), and the fire
    runs under the workflow's strategy."""
    locked = flowlock.Workflow(
        "locked",
        states=["open", "done"],
        initial="open",
        policy="inventory",
        transitions=[flowlock.Transition("finish", source="open", target="done")],
    )
    await engine.register(locked)
    conn = await app_conns()
    async with conn.transaction():
        await engine.create("locked", instance_id="l-1", connection=conn)
        out = await engine.fire("l-1", "finish", connection=conn)
    assert out.applied and out.strategy == "pessimistic"
    assert await _instance(pg_url, pg_schema, "l-1") == (2, 1)


async def test_a_create_behind_an_uncommitted_one_of_the_same_id_times_out(
    app_conns: Callable[[], Awaitable[asyncpg.Connection]], pg_url: str, pg_schema: str
) -> None:
    """An instance created in an open caller transaction: creating the same id elsewhere waits
    the store's lock_timeout, then raises LockTimeout; after the caller commits, InstanceExists."""
    store = PostgresStore(pg_url, schema=pg_schema, pool_size=2, lock_timeout=0.3)
    async with flowlock.Engine(store) as eng:
        await eng.register(examples.approval())
        conn = await app_conns()
        async with conn.transaction():
            await eng.create("approval", instance_id="a", connection=conn)
            started = time.monotonic()
            with pytest.raises(flowlock.LockTimeout):
                await eng.create("approval", instance_id="a")
            assert 0.3 <= time.monotonic() - started < 0.3 + SLACK
        with pytest.raises(flowlock.InstanceExists):
            await eng.create("approval", instance_id="a")
        assert await _instance(pg_url, pg_schema, "a") == (1, 0)


async def test_queries_and_payloads_inside_the_callers_transaction(
    engine: flowlock.Engine,
    app_conns: Callable[[], Awaitable[asyncpg.Connection]],
    pg_url: str,
    pg_schema: str,
    sql_history: SqlHistory,
) -> None:
    """Inside a caller's transaction the store's list_instances and count_instances see the
    transaction's own uncommitted instances (and nobody else does), and a fire's payload is kept
    in its history row (read back from a connection without flowlock's jsonb codec)."""
    store = engine.store
    assert isinstance(store, PostgresStore)
    query = InstanceQuery(workflow="approval", states=("pending",))
    conn = await app_conns()
    async with conn.transaction():
        for iid in ("q-2", "q-1", "q-3"):
            await engine.create("approval", instance_id=iid, connection=conn)
        out = await engine.fire(
            "q-3", "approve", payload={"comment": "ok", "n": 1}, request_id="p", connection=conn
        )
        assert out.applied
        async with store.in_transaction(conn) as inside:
            assert await inside.count_instances(query) == 2
            page = await inside.list_instances(query, after=None, limit=10)
            assert [i.id for i in page] == ["q-1", "q-2"]
            assert [i.id for i in await inside.list_instances(query, after="q-1", limit=1)] == [
                "q-2"
            ]
            assert [h.payload for h in await inside.history("q-3")] == [{"comment": "ok", "n": 1}]
        # Not committed yet: the engine's own pool sees none of them.
        assert await engine.count(workflow="approval") == 0
        # The same request id and payload again: idempotent (the payload read back compares).
        again = await engine.fire(
            "q-3", "approve", payload={"comment": "ok", "n": 1}, request_id="p", connection=conn
        )
        assert again.idempotent
    assert await engine.count(workflow="approval", state="pending") == 2
    assert [i.id for i in await engine.list(workflow="approval")] == ["q-1", "q-2", "q-3"]
    assert [h.payload for h in await engine.history("q-3")] == [{"comment": "ok", "n": 1}]
    payload = await _count(
        pg_url,
        f'SELECT count(*) FROM "{pg_schema}".flowlock_history '
        'WHERE instance_id = \'q-3\' AND payload = \'{"comment": "ok", "n": 1}\'::jsonb',
    )
    assert payload == 1
    (await sql_history()).assert_matches({"q-3": await engine.history("q-3")})


async def test_a_read_only_caller_transaction_is_refused_before_anything(
    engine: flowlock.Engine, app_conns: Callable[[], Awaitable[asyncpg.Connection]]
) -> None:
    """A caller's ``transaction(readonly=True)``: InvalidInput saying so, not the
    ConnectionLost a write refused by a demoted primary (25006) means; the caller's
    transaction stays usable and nothing was written."""
    conn = await app_conns()
    async with conn.transaction(readonly=True):
        with pytest.raises(flowlock.InvalidInput, match="read-only"):
            await engine.fire("stock", "reserve", connection=conn)
        with pytest.raises(flowlock.InvalidInput, match="read-only"):
            await engine.create("approval", instance_id="ro", connection=conn)
        assert await conn.fetchval("SELECT 1") == 1
    assert (await engine.get("stock")).version == 1
