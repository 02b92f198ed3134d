"""Idempotency-Key replays: a retried request gets the first response byte for byte (marked
``Idempotent-Replayed: true``) and the transition is applied once, whether the retries come one
after another or 50 at once; concurrent buyers never oversell. The checker reads the history
after each concurrent run, and on PostgreSQL the rows are counted with plain SQL too."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import httpx

from conftest import SqlHistory
from flowlock.checker import check
from service.kit import JSON, Service, assert_problem, create

CALLS = 50


def no_oversell(data: Mapping[str, Any]) -> str | None:
    stock = data.get("stock", 0)
    return f"stock went below zero: {stock}" if stock < 0 else None


async def assert_exactly_once(
    svc: Service, iid: str, initial: str, applied: int, *, oversell: bool = False
) -> None:
    """The checker's verdict on ``iid``'s history as the engine reads it: ``applied`` rows, no
    gap, no request id twice, the instance what its history says."""
    inst = await svc.engine.get(iid)
    history = await svc.engine.history(iid)
    verdict = check(
        inst,
        history,
        initial_state=initial,
        expected_applied=applied,
        invariant=no_oversell if oversell else None,
        invariant_kind="oversell",
    )
    assert verdict, verdict.violations


async def test_a_sequential_replay_is_the_first_response_byte_for_byte(service: Service) -> None:
    """The same key again, after another transition moved the instance on: the first body and
    ETag exactly, marked replayed, and one history row for the key."""
    client = service.client
    await create(client, "inventory", "i", stock=0)
    key = {"Idempotency-Key": "restock-1", **JSON}
    first = await client.post("/instances/i/events/restock", content=b'{"payload":{"qty":3}}',
                              headers=key)  # fmt: skip
    assert first.status_code == 200, first.text
    assert "idempotent-replayed" not in first.headers
    assert first.json()["applied"] is True
    later = await client.post("/instances/i/events/restock", json={"payload": {"qty": 1}})
    assert later.status_code == 200, later.text
    # The same request in another spelling of the same JSON is the same request.
    for body in (b'{"payload":{"qty":3}}', b'{ "payload" : { "qty" : 3 } }'):
        again = await client.post("/instances/i/events/restock", content=body, headers=key)
        assert again.status_code == 200, again.text
        assert again.content == first.content
        assert again.headers["etag"] == first.headers["etag"] == '"2"'
        assert again.headers["idempotent-replayed"] == "true"
    current = await client.get("/instances/i")
    assert current.json()["version"] == 3
    assert current.json()["data"]["stock"] == 4
    history = (await client.get("/instances/i/history")).json()["items"]
    assert [e["request_id"] for e in history] == ["restock-1", None]
    await assert_exactly_once(service, "i", "open", 2)


async def test_a_replay_of_a_no_op_answer_is_the_same_answer(service: Service) -> None:
    """Approving an approved request with a key (the idempotent answer, nothing applied), then
    retrying it: the same body both times, and one history row in all."""
    client = service.client
    await create(client, "approval", "a")
    assert (await client.post("/instances/a/events/approve")).status_code == 200
    key = {"Idempotency-Key": "second-admin"}
    first = await client.post("/instances/a/events/approve", headers=key)
    assert first.status_code == 200, first.text
    assert first.json()["idempotent"] is True
    again = await client.post("/instances/a/events/approve", headers=key)
    assert again.content == first.content
    await assert_exactly_once(service, "a", "pending", 1)


async def fifty_retries(svc: Service, iid: str) -> list[httpx.Response]:
    """CALLS identical requests with one key, all at once."""
    return await asyncio.gather(
        *(
            svc.client.post(
                f"/instances/{iid}/events/reserve",
                json={"payload": {"qty": 1}, "actor": "buyer"},
                headers={"Idempotency-Key": "order-7"},
            )
            for _ in range(CALLS)
        )
    )


def assert_one_answer(responses: list[httpx.Response]) -> None:
    """Every retry got the same 200 body; exactly one was the first (not replayed)."""
    assert {r.status_code for r in responses} == {200}, [r.text for r in responses]
    assert len({r.content for r in responses}) == 1
    assert len({r.headers["etag"] for r in responses}) == 1
    fresh = [r for r in responses if "idempotent-replayed" not in r.headers]
    assert len(fresh) == 1
    assert fresh[0].json()["applied"] is True


async def test_fifty_concurrent_retries_apply_once(service: Service) -> None:
    """50 requests with one key at once: identical bodies, one history row, checker clean."""
    await create(service.client, "inventory", "i", stock=10)
    assert_one_answer(await fifty_retries(service, "i"))
    history = (await service.client.get("/instances/i/history")).json()["items"]
    assert [e["request_id"] for e in history] == ["order-7"]
    assert (await service.engine.get("i")).data == {"stock": 9, "reserved": 1}
    await assert_exactly_once(service, "i", "open", 1, oversell=True)


async def buyers(svc: Service, iid: str) -> list[httpx.Response]:
    """CALLS buyers, each with a key of its own, reserving one unit each at once."""
    return await asyncio.gather(
        *(
            svc.client.post(
                f"/instances/{iid}/events/reserve",
                json={"payload": {"qty": 1}},
                headers={"Idempotency-Key": f"buyer-{n}"},
            )
            for n in range(CALLS)
        )
    )


async def test_fifty_concurrent_buyers_never_oversell(service: Service) -> None:
    """50 buyers for 20 units: 20 reservations applied, 30 refused as out of stock (422),
    stock 0, and the checker finds every row once and stock never below zero."""
    await create(service.client, "inventory", "i", stock=20)
    responses = await buyers(service, "i")
    sold = [r for r in responses if r.status_code == 200]
    assert len(sold) == 20
    for refused in (r for r in responses if r.status_code != 200):
        assert_problem(refused, 422, "guard-rejected")
    assert (await service.engine.get("i")).data == {"stock": 0, "reserved": 20}
    await assert_exactly_once(service, "i", "open", 20, oversell=True)


async def test_fifty_concurrent_retries_apply_once_on_postgresql(
    pg_service: Service, sql_history: Callable[[], Awaitable[SqlHistory]]
) -> None:
    """The same 50 retries on PostgreSQL: identical bodies, one row (counted by SQL too)."""
    await create(pg_service.client, "inventory", "i", stock=10)
    assert_one_answer(await fifty_retries(pg_service, "i"))
    await assert_exactly_once(pg_service, "i", "open", 1, oversell=True)
    counted = await sql_history()
    counted.assert_matches({"i": await pg_service.engine.history("i")})
    assert counted.per_request == {("i", "order-7"): 1}


async def test_fifty_concurrent_buyers_never_oversell_on_postgresql(
    pg_service: Service, sql_history: Callable[[], Awaitable[SqlHistory]]
) -> None:
    """50 buyers for 20 units on PostgreSQL: 20 sold, 30 refused, rows counted by SQL."""
    await create(pg_service.client, "inventory", "i", stock=20)
    responses = await buyers(pg_service, "i")
    assert sorted(r.status_code for r in responses) == [200] * 20 + [422] * 30
    await assert_exactly_once(pg_service, "i", "open", 20, oversell=True)
    (await sql_history()).assert_matches({"i": await pg_service.engine.history("i")})
