"""Pessimistic row-lock bounds on real PostgreSQL: NOWAIT, lock_timeout, clean connections.

A bound that is the promise (a wait gives up) is asserted tightly from below and generously from
above (``bound <= took < bound + 5``); "immediately" is shown against a lock_timeout far longer
than the assertion's bound. Each test counts the history rows with its own SQL.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
import pytest

import flowlock
import pg_budget
from flowlock import examples
from flowlock.stores.postgres import PostgresStore

pytestmark = pytest.mark.postgres

SqlHistory = Callable[..., Awaitable[Any]]
SLACK = 5.0  # seconds a bounded wait may overrun its bound on a loaded machine


@pytest.fixture
async def one_conn_engine(pg_url: str, pg_schema: str) -> AsyncIterator[flowlock.Engine]:
    """An engine whose pool has ONE connection, so a dirty connection would show at once."""
    async with flowlock.Engine(PostgresStore(pg_url, schema=pg_schema, pool_size=1)) as eng:
        await eng.register(examples.approval())
        await eng.create("approval", instance_id="req")
        yield eng


@pytest.fixture
async def holder(pg_url: str, pg_schema: str) -> AsyncIterator[asyncpg.Connection]:
    """A separate connection holding the instance's row lock in an open transaction."""
    conn = await pg_budget.connect(pg_url, server_settings={"search_path": pg_schema})
    try:
        tx = conn.transaction()
        await tx.start()
        await conn.execute("SELECT 1 FROM flowlock_instances WHERE id = 'req' FOR UPDATE")
        yield conn
        await tx.rollback()
    finally:
        await conn.close()


async def _assert_clean(engine: flowlock.Engine, lock_timeout: str = "5s") -> None:
    """The pool's only connection is idle, outside any transaction, with default settings."""
    store = engine.store
    assert isinstance(store, PostgresStore)
    async with store.pool.acquire() as conn:
        assert not conn.is_in_transaction()
        # Back to the session's bound (the store's lock_timeout), not the call's SET LOCAL.
        assert await conn.fetchval("SHOW lock_timeout") == lock_timeout
        assert (
            await conn.fetchval(
                "SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() "
                "AND locktype = 'transactionid'"
            )
            == 0
        )


async def test_nowait_on_held_row_is_lock_busy_at_once(
    one_conn_engine: flowlock.Engine,
    holder: asyncpg.Connection,
    pg_url: str,
    pg_schema: str,
    sql_history: SqlHistory,
) -> None:
    """NOWAIT on a held row raises LockBusy immediately and writes nothing."""
    # The session's lock_timeout is 60 s: a NOWAIT that waited would take that long.
    store = PostgresStore(pg_url, schema=pg_schema, pool_size=1, lock_timeout=60)
    async with flowlock.Engine(store) as engine:
        await engine.register(examples.approval())
        started = time.monotonic()
        with pytest.raises(flowlock.LockBusy) as caught:
            await engine.fire("req", "approve", strategy=flowlock.Pessimistic(nowait=True))
        assert time.monotonic() - started < SLACK
        assert caught.value.key == "req"
        await holder.execute("SELECT 1")  # the holder still has its lock and its transaction
        inst = await engine.get("req")
        assert (inst.state, inst.version) == ("pending", 1)
        assert await engine.history("req") == []
        (await sql_history()).assert_matches({"req": []})
        await _assert_clean(engine, lock_timeout="1min")


async def test_lock_timeout_on_held_row(
    one_conn_engine: flowlock.Engine, holder: asyncpg.Connection, sql_history: SqlHistory
) -> None:
    """lock_timeout=200 ms on a held row raises LockTimeout once 200 ms have passed (not the
    session's 5 s), nothing written, pool clean."""
    started = time.monotonic()
    with pytest.raises(flowlock.LockTimeout) as caught:
        await one_conn_engine.fire(
            "req", "approve", strategy=flowlock.Pessimistic(lock_timeout=0.2)
        )
    waited = time.monotonic() - started
    assert 0.2 <= waited < 0.2 + SLACK, waited
    assert 0.2 <= caught.value.waited <= waited
    assert isinstance(caught.value, flowlock.ConcurrencyError)
    assert (await one_conn_engine.get("req")).version == 1
    (await sql_history()).assert_matches({"req": await one_conn_engine.history("req")})
    await _assert_clean(one_conn_engine)


async def test_after_the_holder_commits_the_waiter_proceeds(
    one_conn_engine: flowlock.Engine, pg_url: str, pg_schema: str, sql_history: SqlHistory
) -> None:
    """Once the lock is released the pessimistic call applies normally on the same pool."""
    conn = await pg_budget.connect(pg_url, server_settings={"search_path": pg_schema})
    try:
        async with conn.transaction():
            await conn.execute("SELECT 1 FROM flowlock_instances WHERE id = 'req' FOR UPDATE")
            with pytest.raises(flowlock.LockBusy):
                await one_conn_engine.fire(
                    "req", "approve", strategy=flowlock.Pessimistic(nowait=True)
                )
    finally:
        await conn.close()
    out = await one_conn_engine.fire("req", "approve", strategy="pessimistic")
    assert out.applied and out.instance.version == 2
    (await sql_history()).assert_matches({"req": await one_conn_engine.history("req")})
    await _assert_clean(one_conn_engine)


async def test_optimistic_write_waits_at_most_lock_timeout(
    one_conn_engine: flowlock.Engine,
    holder: asyncpg.Connection,
    pg_url: str,
    pg_schema: str,
    sql_history: SqlHistory,
) -> None:
    """An optimistic write behind a held row lock waits the store's lock_timeout, then raises
    LockTimeout with nothing written and the connection clean."""
    store = PostgresStore(pg_url, schema=pg_schema, pool_size=1, lock_timeout=0.2)
    async with flowlock.Engine(store) as eng:
        await eng.register(examples.approval())
        started = time.monotonic()
        with pytest.raises(flowlock.LockTimeout):
            await eng.fire("req", "approve")
        assert 0.2 <= time.monotonic() - started < 0.2 + SLACK
        assert (await eng.get("req")).version == 1
        (await sql_history()).assert_matches({"req": await eng.history("req")})
        async with store.pool.acquire() as conn:
            assert not conn.is_in_transaction()


async def test_pool_exhaustion_is_store_busy(
    pg_url: str, pg_schema: str, sql_history: SqlHistory
) -> None:
    """When no connection comes free within acquire_timeout the call raises StoreBusy (after
    that bound); once one is free the next call applies."""
    store = PostgresStore(pg_url, schema=pg_schema, pool_size=1, acquire_timeout=0.2)
    async with flowlock.Engine(store) as eng:
        await eng.register(examples.approval())
        await eng.create("approval", instance_id="req")
        async with store.pool.acquire():
            started = time.monotonic()
            with pytest.raises(flowlock.StoreBusy):
                await eng.fire("req", "approve")
            assert 0.2 <= time.monotonic() - started < 0.2 + SLACK
        assert (await eng.fire("req", "approve")).applied
        (await sql_history()).assert_matches({"req": await eng.history("req")})


async def test_cancelled_lock_wait_leaves_the_pool_clean(
    one_conn_engine: flowlock.Engine,
    holder: asyncpg.Connection,
    pg_url: str,
    sql_history: SqlHistory,
) -> None:
    """A pessimistic call cancelled while it waits for the row lock writes nothing, and the
    pool's connection is usable right after (the lock is released by its holder)."""
    holder_pid = await holder.fetchval("SELECT pg_backend_pid()")
    task = asyncio.create_task(one_conn_engine.fire("req", "approve", strategy="pessimistic"))
    # Cancel only once the call is queued behind the holder's row lock, as the server sees it.
    assert await _blocked_behind(pg_url, holder_pid, task) == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await holder.execute("SELECT 1")
    assert (await one_conn_engine.get("req")).version == 1
    (await sql_history()).assert_matches({"req": await one_conn_engine.history("req")})


async def _blocked_behind(pg_url: str, holder_pid: int, task: asyncio.Future[Any]) -> int:
    """How many sessions wait for a lock held by ``holder_pid``, polled (on a connection of
    its own: pg_stat_activity is a snapshot per transaction) until there is one; fails if
    ``task`` ends first or nothing queues within 30 s."""
    conn = await pg_budget.connect(pg_url)
    try:
        deadline = time.monotonic() + 30
        while True:
            waiting: int = await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
                holder_pid,
            )
            if waiting:
                return waiting
            assert not task.done(), task
            assert time.monotonic() < deadline, "the call never queued behind the row lock"
            await asyncio.sleep(0.02)
    finally:
        await conn.close()
