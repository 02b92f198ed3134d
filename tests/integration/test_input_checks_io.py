"""On the real servers: bad lock keys, ids and bounds are refused before any I/O, and nothing is
taken, written or opened.

The regressions: a NUL in an advisory lock key took the lock, then failed at the fencing insert
(a StoreError, with the lock taken); a lone surrogate in a key was a raw UnicodeEncodeError from
the advisory and Redis backends, and in an instance id a StoreError from PostgreSQL ("retry
later" about input no retry fixes); AdvisoryLocks took a NaN io_timeout (1 ms on the server) and
a NaN pool_timeout; RedisLocks took a socket_timeout of a billion seconds.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio

import flowlock
import pg_budget
from flowlock import examples
from flowlock.locks.advisory import AdvisoryLocks
from flowlock.locks.redis import RedisLocks
from flowlock.stores.postgres import PostgresStore

BAD_KEYS = ["k\x00", "\x00", "k\ud800"]


async def _value(pg_url: str, sql: str, arg: str) -> Any:
    conn = await pg_budget.connect(pg_url)
    try:
        return await conn.fetchval(sql, arg)
    finally:
        await conn.close()


async def _sessions(pg_url: str, name: str) -> int:
    sql = "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1"
    found: int = await _value(pg_url, sql, name)
    return found


async def _schema_exists(pg_url: str, schema: str) -> bool:
    sql = "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)"
    found: bool = await _value(pg_url, sql, schema)
    return found


@pytest.fixture
async def advisory(pg_url: str, pg_schema: str) -> AsyncIterator[AdvisoryLocks]:
    locks = AdvisoryLocks(
        pg_url, schema=pg_schema, namespace="inputs", application_name=f"fl-{pg_schema}"
    )
    async with locks:
        yield locks


@pytest.mark.postgres
@pytest.mark.parametrize("key", BAD_KEYS)
async def test_a_bad_advisory_key_takes_nothing_writes_nothing_opens_nothing(
    advisory: AdvisoryLocks, pg_url: str, pg_schema: str, key: str
) -> None:
    """Refused when acquire() is called: no lock in pg_locks, no fencing row, no new session."""
    before = await _sessions(pg_url, advisory.application_name)
    with pytest.raises(flowlock.InvalidInput, match="lock key"):
        await advisory.acquire(key, ttl=5, wait=1)
    with pytest.raises(flowlock.InvalidInput, match="lock key"):
        async with advisory.acquire(key, ttl=5):
            pass  # pragma: no cover - never entered
    for call in (advisory.locked(key), advisory.fence_floor(key), advisory.wait_released(key, 1)):
        with pytest.raises(flowlock.InvalidInput, match="lock key"):
            await call
    assert await _sessions(pg_url, advisory.application_name) == before
    conn = await pg_budget.connect(pg_url)
    try:
        fences = await conn.fetchval(f'SELECT count(*) FROM "{pg_schema}".flowlock_fences')
        held = await conn.fetchval(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
            "WHERE l.locktype = 'advisory' AND a.application_name = $1",
            advisory.application_name,
        )
    finally:
        await conn.close()
    assert (fences, held) == (0, 0)
    # And the backend is as usable as before.
    async with advisory.acquire("k", ttl=5) as lease:
        assert lease.lease.fencing == 1


@pytest.mark.postgres
@pytest.mark.parametrize(
    "options",
    [
        {"io_timeout": math.nan},
        {"pool_timeout": math.nan},
        {"connect_timeout": -1},
        {"pool_size": True},
        {"namespace": "n\x00"},
    ],
    ids=lambda o: next(iter(o)),
)
async def test_bad_advisory_options_open_nothing(
    pg_url: str, pg_schema: str, options: dict[str, Any]
) -> None:
    """The constructor refuses them, so open() never runs: no session, no schema migrated."""
    name = f"fl-{pg_schema}"
    with pytest.raises(flowlock.InvalidInput, match=next(iter(options))):
        AdvisoryLocks(pg_url, schema=pg_schema, application_name=name, **options)
    assert await _sessions(pg_url, name) == 0
    assert not await _schema_exists(pg_url, pg_schema)


@pytest.mark.postgres
@pytest.mark.parametrize(
    "options",
    [{"lock_timeout": math.nan}, {"acquire_timeout": math.inf}, {"dsn": "postgresql://h/\x00"}],
    ids=lambda o: next(iter(o)),
)
async def test_bad_postgres_store_options_open_nothing(
    pg_url: str, pg_schema: str, options: dict[str, Any]
) -> None:
    name = f"fl-{pg_schema}"
    dsn = options.pop("dsn", pg_url)
    with pytest.raises(flowlock.InvalidInput):
        PostgresStore(dsn, schema=pg_schema, application_name=name, **options)
    assert await _sessions(pg_url, name) == 0
    assert not await _schema_exists(pg_url, pg_schema)


@pytest.mark.postgres
@pytest.mark.parametrize("bad", ["i\x00", "i\ud800"])
async def test_bad_ids_on_postgresql_are_invalid_input_and_write_nothing(
    pg_url: str, pg_schema: str, bad: str
) -> None:
    """Not a StoreError from the server: InvalidInput before the statement, no row written,
    the version of the instance fired at unchanged."""
    async with flowlock.Engine(PostgresStore(pg_url, schema=pg_schema)) as engine:
        await engine.register(examples.approval())
        await engine.create("approval", instance_id="i")
        with pytest.raises(flowlock.InvalidInput, match="instance_id"):
            await engine.create("approval", instance_id=bad)
        with pytest.raises(flowlock.InvalidInput, match="actor"):
            await engine.fire("i", "approve", actor=bad)
        with pytest.raises(flowlock.InvalidInput, match="request_id"):
            await engine.fire("i", "approve", request_id=bad)
        with pytest.raises(flowlock.InvalidInput, match="instance_id"):
            await engine.get(bad)
        assert await engine.count() == 1
        assert (await engine.get("i")).version == 1
        assert await engine.history("i") == []


@pytest.mark.redis
@pytest.mark.parametrize("key", BAD_KEYS)
async def test_a_bad_redis_key_writes_nothing(
    redis_url: str, redis_namespace: str, key: str
) -> None:
    """The same keys as the advisory backend are refused (code moved between backends keeps
    working): nothing is written under the namespace."""
    async with RedisLocks(redis_url, namespace=redis_namespace) as locks:
        with pytest.raises(flowlock.InvalidInput, match="lock key"):
            await locks.acquire(key, ttl=5, wait=1)
        for call in (locks.locked(key), locks.wait_released(key, 1)):
            with pytest.raises(flowlock.InvalidInput, match="lock key"):
                await call
        client = redis.asyncio.from_url(redis_url)
        try:
            keys = [k async for k in client.scan_iter(match=locks.key_pattern(), count=500)]
        finally:
            await client.aclose()
        assert keys == []


@pytest.mark.redis
@pytest.mark.parametrize(
    "options",
    [{"socket_timeout": 1e9}, {"socket_timeout": math.nan}, {"max_connections": 10**12}],
    ids=lambda o: f"{next(iter(o))}={next(iter(o.values()))}",
)
def test_bad_redis_options_are_refused(redis_url: str, options: dict[str, Any]) -> None:
    with pytest.raises(flowlock.InvalidInput, match=next(iter(options))):
        RedisLocks(redis_url, namespace=f"t_{uuid.uuid4().hex[:8]}", **options)
