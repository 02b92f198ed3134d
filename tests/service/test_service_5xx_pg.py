"""The service's 503s that need a hand on its engine, provoked for real in-process on PostgreSQL
(issue 22, item 2): ``store-busy`` (every connection of the service's pool held, so a request
waits out acquire_timeout) and ``engine-closed`` (a request arriving while the engine closes,
drained behind a request still in flight). Each with ``Retry-After`` and no server detail.
The other 5xx answers are provoked on a running ``flowlock serve``
(tests/service_proc/test_serve_5xx.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

import pg_budget
from flowlock.checker import check
from flowlock.engine import Engine
from flowlock.service import ServiceSettings
from flowlock.stores.postgres import PostgresStore
from service.kit import Service, assert_problem, served


def assert_no_server_detail(answer: httpx.Response, pg_url: str, schema: str) -> None:
    """The body names neither the server's host and port nor the database or schema."""
    text = answer.text
    for detail in ("127.0.0.1", "5432", "postgres", pg_url.rsplit("/", 1)[-1], schema):
        assert detail not in text, (detail, text)


@pytest.mark.slow
async def test_a_pool_with_every_connection_held_is_503_store_busy(
    pg_url: str, pg_schema: str
) -> None:
    """The service's pool of one connection, held by the test: a request waits the store's
    acquire_timeout and answers 503 store-busy with Retry-After; once it is given back, the same
    request is answered."""
    settings = ServiceSettings(database_url=pg_url, schema=pg_schema, pool_size=1)
    async with served(settings) as svc:
        store = svc.engine.store
        assert isinstance(store, PostgresStore) and store.pool_size == 1
        made = await svc.client.post("/instances", json={"workflow": "approval", "id": "a"})
        assert made.status_code == 201, made.text
        async with store.pool.acquire():
            answer = await svc.client.get("/instances/a")
        assert_problem(answer, 503, "store-busy")
        assert answer.headers["retry-after"] == "1"
        assert_no_server_detail(answer, pg_url, pg_schema)
        assert (await svc.client.get("/instances/a")).status_code == 200


@pytest.fixture
async def pg_svc(pg_url: str, pg_schema: str) -> AsyncIterator[Service]:
    async with served(ServiceSettings(database_url=pg_url, schema=pg_schema)) as running:
        yield running


async def _blocked_by(pg_url: str, holder: int) -> None:
    """Until a session waits for a lock ``holder`` (a backend pid) holds (a bounded wait)."""
    conn = await pg_budget.connect(pg_url)
    try:
        for _ in range(1000):
            if await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
                holder,
            ):
                return
            await asyncio.sleep(0.01)
        raise AssertionError("no session waits for the test's row lock")
    finally:
        await conn.close()


async def test_a_request_arriving_while_the_engine_closes_is_503_engine_closed(
    pg_svc: Service, pg_url: str, pg_schema: str
) -> None:
    """A request is in flight (waiting for a row lock the test holds) when the engine starts
    closing: a request arriving then is 503 engine-closed with Retry-After, writing nothing,
    and the one in flight is drained, applied once, before the store closes."""
    client, engine = pg_svc.client, pg_svc.engine
    for iid in ("held", "late"):
        made = await client.post("/instances", json={"workflow": "approval", "id": iid})
        assert made.status_code == 201, made.text
    conn = await pg_budget.connect(pg_url, server_settings={"search_path": pg_schema})
    try:
        tx = conn.transaction()
        await tx.start()
        await conn.execute("SELECT 1 FROM flowlock_instances WHERE id = 'held' FOR UPDATE")
        in_flight = asyncio.create_task(
            client.post(
                "/instances/held/events/approve",
                json={"strategy": "pessimistic"},
                headers={"Idempotency-Key": "k-held"},
            )
        )
        await _blocked_by(pg_url, conn.get_server_pid())
        closing = asyncio.create_task(engine.aclose())
        for _ in range(1000):
            if engine.closed:
                break
            await asyncio.sleep(0)
        assert engine.closed and not closing.done()
        late = await client.post("/instances/late/events/approve")
        assert_problem(late, 503, "engine-closed")
        assert late.headers["retry-after"] == "1"
        assert_no_server_detail(late, pg_url, pg_schema)
        await tx.commit()
        answer = await in_flight
        await closing
    finally:
        await conn.close()
    assert answer.status_code == 200 and answer.json()["applied"] is True, answer.text
    async with Engine(PostgresStore(pg_url, schema=pg_schema)) as reader:
        held, late_inst = await reader.get("held"), await reader.get("late")
        history = await reader.history("held")
        assert await reader.history("late") == []
    assert late_inst.version == 1
    assert [e.request_id for e in history] == ["k-held"]
    assert check(held, history, initial_state="pending", expected_applied=1).ok
