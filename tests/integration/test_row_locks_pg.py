"""Pessimistic row-lock bounds on real PostgreSQL: NOWAIT, lock_timeout, clean connections."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import asyncpg
import pytest

import flowlock
from flowlock import examples
from flowlock.stores.postgres import PostgresStore

pytestmark = pytest.mark.postgres


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
    conn = await asyncpg.connect(pg_url, server_settings={"search_path": pg_schema})
    tx = conn.transaction()
    await tx.start()
    await conn.execute("SELECT 1 FROM flowlock_instances WHERE id = 'req' FOR UPDATE")
    yield conn
    await tx.rollback()
    await conn.close()


async def _assert_clean(engine: flowlock.Engine) -> None:
    """The pool's only connection is idle, outside any transaction, with default settings."""
    store = engine.store
    assert isinstance(store, PostgresStore)
    async with store.pool.acquire() as conn:
        assert not conn.is_in_transaction()
        # Back to the session's bound (the store's lock_timeout), not the call's SET LOCAL.
        assert await conn.fetchval("SHOW lock_timeout") == "5s"
        assert (
            await conn.fetchval(
                "SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() "
                "AND locktype = 'transactionid'"
            )
            == 0
        )


async def test_nowait_on_held_row_is_lock_busy_at_once(
    one_conn_engine: flowlock.Engine, holder: asyncpg.Connection
) -> None:
    """NOWAIT on a held row raises LockBusy immediately and writes nothing."""
    started = time.monotonic()
    with pytest.raises(flowlock.LockBusy) as caught:
        await one_conn_engine.fire("req", "approve", strategy=flowlock.Pessimistic(nowait=True))
    assert time.monotonic() - started < 0.5
    assert caught.value.key == "req"
    await holder.execute("SELECT 1")  # the holder still has its lock and its transaction
    inst = await one_conn_engine.get("req")
    assert (inst.state, inst.version) == ("pending", 1)
    assert await one_conn_engine.history("req") == []
    await _assert_clean(one_conn_engine)


async def test_lock_timeout_on_held_row(
    one_conn_engine: flowlock.Engine, holder: asyncpg.Connection
) -> None:
    """lock_timeout=200 ms on a held row raises LockTimeout after about 200 ms, pool clean."""
    started = time.monotonic()
    with pytest.raises(flowlock.LockTimeout) as caught:
        await one_conn_engine.fire(
            "req", "approve", strategy=flowlock.Pessimistic(lock_timeout=0.2)
        )
    waited = time.monotonic() - started
    # Bounds loose enough for a loaded shared machine; the point is "about 200 ms, not 5 s".
    assert 0.18 <= waited < 2.0, waited
    assert 0.18 <= caught.value.waited < 2.0
    assert isinstance(caught.value, flowlock.ConcurrencyError)
    assert (await one_conn_engine.get("req")).version == 1
    await _assert_clean(one_conn_engine)


async def test_after_the_holder_commits_the_waiter_proceeds(
    one_conn_engine: flowlock.Engine, pg_url: str, pg_schema: str
) -> None:
    """Once the lock is released the pessimistic call applies normally on the same pool."""
    conn = await asyncpg.connect(pg_url, server_settings={"search_path": pg_schema})
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
    await _assert_clean(one_conn_engine)


async def test_optimistic_write_waits_at_most_lock_timeout(
    one_conn_engine: flowlock.Engine, holder: asyncpg.Connection, pg_url: str, pg_schema: str
) -> None:
    """An optimistic write behind a held row lock waits at most the store's lock_timeout,
    then raises LockTimeout with nothing written and the connection clean."""
    store = PostgresStore(pg_url, schema=pg_schema, pool_size=1, lock_timeout=0.2)
    async with flowlock.Engine(store) as eng:
        await eng.register(examples.approval())
        started = time.monotonic()
        with pytest.raises(flowlock.LockTimeout):
            await eng.fire("req", "approve")
        assert 0.18 <= time.monotonic() - started < 2.0
        assert (await eng.get("req")).version == 1
        async with store.pool.acquire() as conn:
            assert not conn.is_in_transaction()


async def test_pool_exhaustion_is_store_busy(pg_url: str, pg_schema: str) -> None:
    """When no connection comes free within acquire_timeout the call raises StoreBusy."""
    store = PostgresStore(pg_url, schema=pg_schema, pool_size=1, acquire_timeout=0.2)
    async with flowlock.Engine(store) as eng:
        await eng.register(examples.approval())
        await eng.create("approval", instance_id="req")
        async with store.pool.acquire():
            with pytest.raises(flowlock.StoreBusy):
                await eng.fire("req", "approve")
        assert (await eng.fire("req", "approve")).applied


async def test_cancelled_lock_wait_leaves_the_pool_clean(
    one_conn_engine: flowlock.Engine, holder: asyncpg.Connection
) -> None:
    """A pessimistic call cancelled while it waits for the row lock writes nothing, and the
    pool's connection is usable right after (the lock is released by its holder)."""
    task = asyncio.create_task(one_conn_engine.fire("req", "approve", strategy="pessimistic"))
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await holder.execute("SELECT 1")
    assert (await one_conn_engine.get("req")).version == 1
