"""``Engine.connect``'s bounds and names reach asyncpg and PostgreSQL: application_name in
``pg_stat_activity``, min_size connections opened, acquire_timeout, connect_timeout,
lock_timeout and lease_wait bounding their waits; an application's own pool used as it is and
left open; bad values refused before any I/O."""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
import pytest

import flowlock
import pg_budget
from flowlock import examples
from flowlock.backends import build_store
from flowlock.engine import connect
from flowlock.options import ConnectOptions
from flowlock.stores.postgres import PostgresStore

SqlHistory = Callable[..., Awaitable[Any]]
SLACK = 5.0  # seconds a bounded wait may overrun its bound on a loaded machine
UNREACHABLE = "postgresql://nobody@127.0.0.1:1/none"  # nothing listens: any I/O would fail


def _name() -> str:
    return f"fl-test-{uuid.uuid4().hex[:10]}"


async def _sessions(url: str, application_name: str) -> int:
    conn = await pg_budget.connect(url)
    try:
        return int(
            await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
                application_name,
            )
        )
    finally:
        await conn.close()


def test_the_keywords_are_defined_once() -> None:
    """Every bound the README names is a key of ConnectOptions, which every connect takes."""
    for name in (
        "pool",
        "max_size",
        "min_size",
        "acquire_timeout",
        "connect_timeout",
        "command_timeout",
        "lock_timeout",
        "lease_wait",
        "application_name",
        "pooling",
    ):
        assert name in ConnectOptions.__optional_keys__, name


async def test_application_name_and_min_size_reach_postgresql(pg_url: str, pg_schema: str) -> None:
    """application_name shows in pg_stat_activity, and min_size connections are open before
    the first call."""
    name = _name()
    async with flowlock.Engine.connect(
        pg_url, schema=pg_schema, application_name=name, min_size=3, max_size=5
    ) as engine:
        assert await _sessions(pg_url, name) == 3
        store = engine.store
        assert isinstance(store, PostgresStore)
        assert store.pool.get_min_size() == 3 and store.pool.get_max_size() == 5
    assert await _sessions(pg_url, name) == 0


async def test_an_unknown_keyword_is_refused_by_every_connect(pg_url: str) -> None:
    """pool_size (max_size's old name, removed in 0.2.0) is refused like any unknown keyword."""
    options: dict[str, Any] = {"pool_size": 3}
    for fn in (connect, flowlock.Engine.connect, flowlock.sync.Engine.connect):
        with pytest.raises(TypeError, match="unexpected keyword argument 'pool_size'"):
            fn(pg_url, **options)


async def test_acquire_timeout_bounds_the_wait_for_an_exhausted_pool(
    pg_url: str, pg_schema: str, sql_history: SqlHistory
) -> None:
    """max_size=2, both connections held: a call raises StoreBusy after acquire_timeout, and
    applies once one is free."""
    async with flowlock.Engine.connect(
        pg_url, schema=pg_schema, max_size=2, acquire_timeout=0.3
    ) as engine:
        await engine.register(examples.approval())
        await engine.create("approval", instance_id="req")
        store = engine.store
        assert isinstance(store, PostgresStore)
        held = [await store.pool.acquire() for _ in range(2)]
        started = time.monotonic()
        with pytest.raises(flowlock.StoreBusy) as busy:
            await engine.fire("req", "approve")
        assert 0.3 <= time.monotonic() - started < 0.3 + SLACK
        assert busy.value.size == 2
        for conn in held:
            await store.pool.release(conn)
        assert (await engine.fire("req", "approve")).applied
        (await sql_history()).assert_matches({"req": await engine.history("req")})


async def test_connect_timeout_bounds_opening_a_connection() -> None:
    """A server that accepts and never answers: opening fails with StoreError after
    connect_timeout, not asyncpg's default 60 s."""
    accepted: list[asyncio.StreamWriter] = []

    async def silent(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        engine = flowlock.Engine.connect(
            f"postgresql://nobody@127.0.0.1:{port}/none", connect_timeout=0.5
        )
        started = time.monotonic()
        with pytest.raises(flowlock.StoreError, match="cannot connect"):
            await engine.open()
        assert 0.5 <= time.monotonic() - started < 0.5 + SLACK
        assert accepted
    finally:
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()


async def test_lock_timeout_bounds_the_store_and_the_pessimistic_preset(
    pg_url: str, pg_schema: str, sql_history: SqlHistory
) -> None:
    """lock_timeout=0.3: the pool's sessions carry it, the pessimistic preset has it, and an
    optimistic write behind a held row gives up after it."""
    async with flowlock.Engine.connect(pg_url, schema=pg_schema, lock_timeout=0.3) as engine:
        pessimistic = engine.strategies["pessimistic"]
        assert isinstance(pessimistic, flowlock.Pessimistic)
        assert pessimistic.lock_timeout == 0.3
        store = engine.store
        assert isinstance(store, PostgresStore) and store.lock_timeout == 0.3
        async with store.pool.acquire() as conn:
            assert await conn.fetchval("SHOW lock_timeout") == "300ms"
        await engine.register(examples.approval())
        await engine.create("approval", instance_id="req")
        holder = await pg_budget.connect(pg_url, server_settings={"search_path": pg_schema})
        try:
            async with holder.transaction():
                await holder.execute("SELECT 1 FROM flowlock_instances WHERE id = 'req' FOR UPDATE")
                for strategy in ("optimistic", "pessimistic"):
                    started = time.monotonic()
                    with pytest.raises(flowlock.LockTimeout):
                        await engine.fire("req", "approve", strategy=strategy)
                    assert 0.3 <= time.monotonic() - started < 0.3 + SLACK
        finally:
            await holder.close()
        assert (await engine.get("req")).version == 1
        (await sql_history()).assert_matches({"req": []})


async def test_lease_wait_bounds_the_distributed_preset() -> None:
    """lease_wait=0.3: the distributed preset waits 0.3 s for a held lease, then LockTimeout."""
    async with flowlock.Engine.connect("memory://", locks="memory", lease_wait=0.3) as engine:
        distributed = engine.strategies["distributed"]
        assert isinstance(distributed, flowlock.Distributed) and distributed.wait == 0.3
        await engine.register(examples.approval())
        await engine.create("approval", instance_id="req")
        assert engine.locks is not None
        async with engine.locks.acquire("req", ttl=30, wait=0):
            started = time.monotonic()
            with pytest.raises(flowlock.LockTimeout):
                await engine.fire("req", "approve", strategy="distributed")
            assert 0.3 <= time.monotonic() - started < 0.3 + SLACK
        assert (await engine.get("req")).version == 1


def test_a_strategy_object_that_says_otherwise_is_refused() -> None:
    """One wait, one bound: a keyword and a strategy object that disagree are refused; objects
    that agree, or a NOWAIT pessimistic, are fine."""
    with pytest.raises(flowlock.InvalidInput, match="two bounds"):
        connect("memory://", lock_timeout=1, strategies=[flowlock.Pessimistic(lock_timeout=2)])
    with pytest.raises(flowlock.InvalidInput, match="two bounds"):
        connect("memory://", locks="memory", lease_wait=1, strategies=[flowlock.Distributed()])
    with pytest.raises(flowlock.InvalidInput, match="no lock backend"):
        connect("memory://", lease_wait=1)
    same = connect("memory://", lock_timeout=2, strategies=[flowlock.Pessimistic(lock_timeout=2)])
    assert same.strategies["pessimistic"] == flowlock.Pessimistic(lock_timeout=2)
    nowait = flowlock.Pessimistic(nowait=True)
    assert (
        connect("memory://", lock_timeout=2, strategies=[nowait]).strategies["pessimistic"]
        is nowait
    )
    # The adaptive preset escalates to the pessimistic preset that lock_timeout configured.
    adaptive = connect("memory://", lock_timeout=0.5).strategies["adaptive"]
    assert adaptive.escalated == flowlock.Pessimistic(lock_timeout=0.5)  # type: ignore[attr-defined]


BAD_SECONDS = [math.nan, math.inf, -1, 0, True, "5", 7200]


@pytest.mark.parametrize(
    "keyword", ["acquire_timeout", "connect_timeout", "command_timeout", "lock_timeout"]
)
@pytest.mark.parametrize("value", BAD_SECONDS)
def test_bad_seconds_are_refused_before_any_io(keyword: str, value: Any) -> None:
    """NaN, infinity, negative, zero, a bool, a string, two hours: InvalidInput naming the
    keyword, with nothing listening at the URL (nothing was tried)."""
    with pytest.raises(flowlock.InvalidInput, match=keyword):
        flowlock.Engine.connect(UNREACHABLE, **{keyword: value})


@pytest.mark.parametrize("value", [math.nan, -0.5, math.inf, "1", 10_000])
def test_bad_lease_wait_is_refused(value: object) -> None:
    """lease_wait may be 0 (do not wait) but not NaN, negative, infinite, text, or hours."""
    with pytest.raises(flowlock.InvalidInput, match="lease_wait"):
        flowlock.Engine.connect(UNREACHABLE, locks="memory", lease_wait=value)  # type: ignore[arg-type]
    assert connect("memory://", locks="memory", lease_wait=0).strategies["distributed"].wait == 0  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"max_size": 0}, "max_size"),
        ({"max_size": 2.5}, "max_size"),
        ({"min_size": -1}, "min_size"),
        ({"min_size": 5, "max_size": 2}, "above max_size"),
        ({"min_size": True}, "min_size"),
        ({"application_name": ""}, "application_name"),
        ({"application_name": "x" * 64}, "application_name"),
        ({"application_name": "caf\u00e9"}, "application_name"),
        ({"application_name": 7}, "application_name"),
    ],
)
def test_bad_sizes_and_names_are_refused_before_any_io(kw: dict[str, Any], match: str) -> None:
    """Sizes below their minimum, fractions, bools, an empty, long or non-ASCII name."""
    with pytest.raises(flowlock.InvalidInput, match=match):
        flowlock.Engine.connect(UNREACHABLE, **kw)


def test_keywords_that_mean_nothing_to_the_store_are_refused() -> None:
    """PostgreSQL-only keywords on SQLite, pool keywords on the memory store or with pool=, a
    pool passed as database_url, and neither URL nor pool."""
    with pytest.raises(flowlock.InvalidInput, match="application_name"):
        connect("sqlite:///:memory:", application_name="app")
    with pytest.raises(flowlock.InvalidInput, match="acquire_timeout"):
        connect("memory://", acquire_timeout=1)
    with pytest.raises(flowlock.InvalidInput, match="command_timeout"):
        connect("sqlite:///:memory:", command_timeout=1)
    with pytest.raises(flowlock.InvalidInput, match="command_timeout"):
        connect("memory://", command_timeout=1)
    with pytest.raises(flowlock.InvalidInput, match="pool="):
        connect(pool=object(), max_size=3)  # type: ignore[arg-type]
    with pytest.raises(flowlock.InvalidInput, match="pool="):
        connect(object())  # type: ignore[arg-type]
    with pytest.raises(flowlock.InvalidInput, match="database_url"):
        connect()
    # SQLite takes the bounds it has: the pool's size and wait, and its busy timeout.
    store = build_store("sqlite:///:memory:", acquire_timeout=2, lock_timeout=1.5)
    assert (store.acquire_timeout, store.busy_timeout) == (2.0, 1.5)  # type: ignore[attr-defined]


@pytest.fixture
async def app_pool(pg_url: str) -> AsyncIterator[asyncpg.Pool]:
    """The application's own pool: asyncpg's defaults, no codec, the default search_path."""
    pool = await pg_budget.create_pool(pg_url, min_size=1, max_size=3)
    yield pool
    await pool.close()


async def test_an_applications_own_pool_is_used_as_it_is_and_left_open(
    app_pool: asyncpg.Pool, pg_url: str, pg_schema: str, sql_history: SqlHistory
) -> None:
    """Engine.connect(pool=...): migrates into the schema, runs every strategy, leaves the pool's
    connections as they were (search_path, lock_timeout, jsonb as text) and the pool open."""
    async with flowlock.Engine.connect(pool=app_pool, schema=pg_schema) as engine:
        store = engine.store
        assert isinstance(store, PostgresStore) and not store.owns_pool
        assert store.pool is app_pool and store.pool_size == 3
        await engine.register(examples.inventory())
        await engine.create("inventory", instance_id="s", data={"stock": 5, "reserved": 0})
        for strategy in ("optimistic", "pessimistic", "adaptive"):
            out = await engine.fire("s", "reserve", strategy=strategy, request_id=strategy)
            assert out.applied
        again = await engine.fire("s", "reserve", request_id="optimistic")
        assert again.idempotent and again.instance.version == 2
        assert (await engine.get("s")).data == {"stock": 2, "reserved": 3}
        history = await engine.history("s")
        assert [h.strategy for h in history] == ["optimistic", "pessimistic", "optimistic"]
        (await sql_history()).assert_matches({"s": history})
    assert not app_pool.is_closing()
    async with app_pool.acquire() as conn:
        assert await conn.fetchval("SHOW search_path") == '"$user", public'
        assert await conn.fetchval("SHOW lock_timeout") == "0"
        assert await conn.fetchval("SELECT '{\"a\": 1}'::jsonb") == '{"a": 1}'
        assert not conn.is_in_transaction()
        rows = await conn.fetchval(f'SELECT count(*) FROM "{pg_schema}".flowlock_history')
        assert rows == 3


@pytest.mark.parametrize("schema", [True, False], ids=["schema", "default-search-path"])
async def test_queries_and_payloads_on_an_applications_pool(
    app_pool: asyncpg.Pool, pg_url: str, pg_schema: str, sql_history: SqlHistory, schema: bool
) -> None:
    """Engine.list / Engine.count and the payload kept in history on the application's pool,
    with a schema (each call in a transaction of flowlock's) and without one (the reads run on
    the pool's connections as they are); the pool's connections stay as they were."""
    if schema:
        options: dict[str, Any] = {"schema": pg_schema}
    else:
        # The application's own search_path names the test's schema: flowlock sets nothing.
        await app_pool.execute(f'CREATE SCHEMA IF NOT EXISTS "{pg_schema}"')
        await app_pool.close()
        app_pool = await pg_budget.create_pool(
            pg_url, min_size=1, max_size=3, server_settings={"search_path": pg_schema}
        )
        options = {}
    try:
        async with flowlock.Engine.connect(pool=app_pool, **options) as engine:
            await engine.register(examples.approval())
            for iid in ("b", "a", "c"):
                await engine.create("approval", instance_id=iid)
            for strategy in ("optimistic", "pessimistic"):
                out = await engine.fire(
                    "c" if strategy == "optimistic" else "b",
                    "approve",
                    payload={"by": strategy},
                    request_id=strategy,
                    strategy=strategy,
                )
                assert out.applied
            again = await engine.fire(
                "c", "approve", payload={"by": "optimistic"}, request_id="optimistic"
            )
            assert again.idempotent
            assert await engine.count(workflow="approval", state="pending") == 1
            first = await engine.list(workflow="approval", limit=2)
            assert [i.id for i in first] == ["a", "b"] and first.next_cursor is not None
            rest = await engine.list(workflow="approval", limit=2, after=first.next_cursor)
            assert [i.id for i in rest] == ["c"] and rest.next_cursor is None
            histories = {i: await engine.history(i) for i in ("b", "c")}
            assert [h.payload for h in histories["b"]] == [{"by": "pessimistic"}]
            assert [h.payload for h in histories["c"]] == [{"by": "optimistic"}]
            (await sql_history()).assert_matches(histories)
        assert not app_pool.is_closing()
        async with app_pool.acquire() as conn:
            assert await conn.fetchval("SHOW lock_timeout") == "0"
            assert not conn.is_in_transaction()
            stored = await conn.fetch(
                f'SELECT payload FROM "{pg_schema}".flowlock_history ORDER BY instance_id'
            )
            assert [r["payload"] for r in stored] == [
                '{"by": "pessimistic"}',
                '{"by": "optimistic"}',
            ]
    finally:
        if not schema:
            await app_pool.close()


async def test_an_applications_pool_still_bounds_every_wait(
    app_pool: asyncpg.Pool, pg_url: str, pg_schema: str
) -> None:
    """On the application's pool (whose sessions have no lock_timeout) an optimistic write
    behind a held row still gives up after lock_timeout, and acquire_timeout bounds the wait for
    a connection."""
    async with flowlock.Engine.connect(
        pool=app_pool, schema=pg_schema, lock_timeout=0.3, acquire_timeout=0.3
    ) as engine:
        await engine.register(examples.approval())
        await engine.create("approval", instance_id="req")
        holder = await pg_budget.connect(pg_url, server_settings={"search_path": pg_schema})
        try:
            async with holder.transaction():
                await holder.execute("SELECT 1 FROM flowlock_instances WHERE id = 'req' FOR UPDATE")
                started = time.monotonic()
                with pytest.raises(flowlock.LockTimeout):
                    await engine.fire("req", "approve")
                assert 0.3 <= time.monotonic() - started < 0.3 + SLACK
        finally:
            await holder.close()
        held = [await app_pool.acquire() for _ in range(3)]
        try:
            started = time.monotonic()
            with pytest.raises(flowlock.StoreBusy):
                await engine.fire("req", "approve")
            assert 0.3 <= time.monotonic() - started < 0.3 + SLACK
        finally:
            for conn in held:
                await app_pool.release(conn)
        assert (await engine.fire("req", "approve")).applied
    assert not app_pool.is_closing()


async def test_a_closed_pool_is_refused_on_open(pg_url: str) -> None:
    """pool= with a pool already closed: InvalidInput when the engine opens."""
    pool = await pg_budget.create_pool(pg_url, min_size=0, max_size=1)
    await pool.close()
    engine = flowlock.Engine.connect(pool=pool)
    with pytest.raises(flowlock.InvalidInput, match="closed"):
        await engine.open()
