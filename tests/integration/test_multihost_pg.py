"""libpq multi-host URLs (``postgresql://h1:5432,h2:5433/db?target_session_attrs=read-write``) on
the running PostgreSQL, and what a failover leaves behind without needing one: a pool whose
connections reach a server that has turned read-only (a primary demoted to a standby).

- ``Engine.connect`` takes a multi-host URL: a host that refuses the connection is skipped, the
  engine and ``flowlock inspect``'s read-only opener work on the next one.
- A URL whose hosts match no ``target_session_attrs`` (no primary yet, during a failover) fails
  each call typed, ConnectionLost: nothing was sent.
- A write refused with SQLSTATE 25006 (read_only_sql_transaction: the connection reaches a
  standby) is ConnectionLost, never OutcomeUnknown, since the server refused it; that connection
  and the pool's others are replaced; the retry with the same request id applies once.

The Patroni failover itself is tests/ha/test_patroni_failover.py.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

import flowlock
import pg_budget
from flowlock import examples
from flowlock._inspect import open_readonly
from flowlock.checker import check
from flowlock.stores.postgres import PostgresStore

pytestmark = pytest.mark.postgres

SqlHistory = Callable[..., Awaitable[Any]]
POOL = 3


def multi_host(pg_url: str, *, attrs: str = "read-write", dead: bool = True) -> str:
    """``pg_url`` with ``target_session_attrs=attrs`` and another host before its own: one
    where nothing listens (``dead``), or the same server again."""
    parts = urlsplit(pg_url)
    user, at, where = parts.netloc.rpartition("@")
    first = "127.0.0.1:1" if dead else where  # nothing listens on port 1: refused at once
    query = "&".join(q for q in (parts.query, f"target_session_attrs={attrs}") if q)
    return urlunsplit(parts._replace(netloc=f"{user}{at}{first},{where}", query=query))


@pytest.fixture
def app() -> str:
    return f"fl-multi-{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def engine(pg_url: str, pg_schema: str, app: str) -> AsyncIterator[flowlock.Engine]:
    """An engine on the multi-host URL, every pooled connection open from the start."""
    async with flowlock.Engine.connect(
        multi_host(pg_url), schema=pg_schema, max_size=POOL, min_size=POOL, application_name=app
    ) as eng:
        await eng.register(examples.countersign(1000))
        yield eng


def store_of(engine: flowlock.Engine) -> PostgresStore:
    store = engine.store
    assert isinstance(store, PostgresStore)
    return store


async def pool_pids(engine: flowlock.Engine) -> set[int]:
    """The server pids of every connection of the engine's pool, each acquired at once."""
    pool = store_of(engine).pool
    conns = [await pool.acquire(timeout=10) for _ in range(POOL)]
    try:
        return {conn.get_server_pid() for conn in conns}
    finally:
        for conn in conns:
            await pool.release(conn)


async def turn_read_only(engine: flowlock.Engine) -> None:
    """Every connection of the engine's pool made read-only, as a connection to a standby is:
    the pool keeps session settings (flowlock resets nothing on release), so each stays so."""
    pool = store_of(engine).pool
    conns = [await pool.acquire(timeout=10) for _ in range(POOL)]
    try:
        for conn in conns:
            await conn.execute("SET default_transaction_read_only = on")
    finally:
        for conn in conns:
            await pool.release(conn)


async def test_a_multi_host_url_skips_a_host_that_refuses(
    engine: flowlock.Engine, pg_url: str, app: str
) -> None:
    """The first host refuses the connection: every connection of the pool is to the second,
    the engine migrates, creates and fires on it."""
    await engine.create("countersign", instance_id="doc")
    outcome = await engine.fire("doc", "sign", actor="ann", request_id="r-ann")
    assert outcome.applied
    conn = await pg_budget.connect(pg_url)
    try:
        found = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", app
        )
    finally:
        await conn.close()
    assert found == POOL


async def test_inspect_reads_through_a_read_write_multi_host_url(
    engine: flowlock.Engine, pg_url: str, pg_schema: str
) -> None:
    """The inspection commands' opener connects through target_session_attrs=read-write (its
    sessions turn read-only only after connecting, or asyncpg would take the server for a
    standby) and still cannot write: a write is refused as the standby's would be."""
    await engine.create("countersign", instance_id="doc")
    async with open_readonly(multi_host(pg_url), pg_schema) as reader:
        assert (await reader.get("doc")).state == "pending"
        await reader.register(examples.countersign(1000))
        with pytest.raises(flowlock.ConnectionLost, match="server is read-only"):
            await reader.fire("doc", "sign", actor="ann", request_id="r-ann")
    assert await engine.history("doc") == []


async def test_no_host_matching_target_session_attrs_is_connection_lost(pg_url: str) -> None:
    """Every host is a primary and the URL asks for a standby (as a read-write URL finds no
    primary mid-failover): each call raises ConnectionLost saying so; nothing was sent. (With
    a host that refused among them, asyncpg raises that host's refusal instead: ConnectionLost
    as well.)"""
    url = multi_host(pg_url, attrs="standby", dead=False)
    engine = flowlock.Engine.connect(url, min_size=0, auto_migrate=False)
    async with engine:
        for _ in range(2):
            with pytest.raises(flowlock.ConnectionLost, match="target_session_attrs") as caught:
                await engine.get("doc")
            assert isinstance(caught.value.__cause__, asyncpg.TargetServerAttributeNotMatched)


@pytest.mark.parametrize("strategy", ["optimistic", "pessimistic"])
async def test_a_write_refused_by_a_read_only_server_is_connection_lost_and_the_pool_renewed(
    engine: flowlock.Engine, sql_history: SqlHistory, strategy: str
) -> None:
    """The pool's connections reach a server that refuses writes (25006, as the old primary
    does after a switch-over): the fire raises ConnectionLost, not OutcomeUnknown (the server
    refused the statement, nothing of it was written, even for the one-statement optimistic
    write in flight); every connection of the pool is replaced, the retry with the same request
    id applies the signature once."""
    await engine.create("countersign", instance_id="doc")
    before = await pool_pids(engine)
    await turn_read_only(engine)
    with pytest.raises(flowlock.ConnectionLost, match="server is read-only") as caught:
        await engine.fire("doc", "sign", actor="ann", request_id="r-ann", strategy=strategy)
    assert type(caught.value) is flowlock.ConnectionLost
    assert getattr(caught.value.__cause__, "sqlstate", None) == "25006"
    # The pool's connections are expired: each is closed when next acquired or given back.
    after = await pool_pids(engine)
    assert not before & after, (before, after)
    again = await engine.fire("doc", "sign", actor="ann", request_id="r-ann", strategy=strategy)
    assert again.applied
    final, history = await engine.get("doc"), await engine.history("doc")
    verdict = check(final, history, expected_applied=1, initial_state="pending")
    assert verdict.ok, verdict.violations
    (await sql_history()).assert_matches({"doc": history})


async def test_concurrent_writes_on_a_read_only_server_all_end_typed(
    engine: flowlock.Engine, sql_history: SqlHistory
) -> None:
    """Calls in flight together (pipelined into shared statements) when the server turns
    read-only: each ends with ConnectionLost or an answer, and retried, each applies once."""
    docs = [f"doc-{i}" for i in range(3)]
    for doc in docs:
        await engine.create("countersign", instance_id=doc)
    await turn_read_only(engine)

    async def sign(doc: str, actor: str) -> None:
        for _ in range(20):
            try:
                await engine.fire(doc, "sign", actor=actor, request_id=f"r-{actor}")
            except flowlock.ConnectionLost:
                continue
            return
        raise AssertionError(f"{actor} never signed")

    await asyncio.gather(*(sign(docs[i % 3], f"a{i}") for i in range(12)))
    histories = {doc: await engine.history(doc) for doc in docs}
    for doc, history in histories.items():
        verdict = check(await engine.get(doc), history, expected_applied=4)
        assert verdict.ok, verdict.violations
    (await sql_history()).assert_matches(histories)


async def test_ping_refuses_a_read_only_server(pg_url: str, pg_schema: str) -> None:
    """A readiness probe on a server that answers but cannot write (a standby, or
    default_transaction_read_only): StoreError saying so, not ok."""
    sep = "&" if "?" in pg_url else "?"
    url = f"{pg_url}{sep}default_transaction_read_only=on"
    async with flowlock.Engine.connect(pg_url, schema=pg_schema) as engine:
        await engine.store.ping()  # type: ignore[attr-defined]
    # No schema to create and no migration: opening the pool writes nothing.
    async with flowlock.Engine.connect(url, auto_migrate=False) as engine:
        with pytest.raises(flowlock.StoreError, match="read-only"):
            await engine.store.ping()  # type: ignore[attr-defined]
