"""POST /instances honours Idempotency-Key as the event route does (issue 22, item 7): a retry
answers the first response and creates nothing, with or without an id in the body; the same key
with another body is 422 idempotency-key-reused; a bad key is 400 and creates nothing."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from flowlock._inspect import check_instances
from service.kit import Service, assert_problem


async def _count(client: httpx.AsyncClient) -> int:
    page = await client.get("/instances")
    assert page.status_code == 200, page.text
    return len(page.json()["items"])


@pytest.mark.parametrize("with_id", [True, False], ids=["id-given", "no-id"])
async def test_a_retried_create_answers_the_first_response(service: Service, with_id: bool) -> None:
    """The same key and body again, after the instance moved on: 201, the first body and ETag
    and Location exactly, and still one instance."""
    client = service.client
    body = {"workflow": "approval", "data": {"amount": 5}, **({"id": "r"} if with_id else {})}
    key = {"Idempotency-Key": "create-1"}
    first = await client.post("/instances", json=body, headers=key)
    assert first.status_code == 201, first.text
    iid = first.json()["id"]
    assert (iid == "r") is with_id
    moved = await client.post(f"/instances/{iid}/events/approve")
    assert moved.status_code == 200, moved.text
    again = await client.post("/instances", json=body, headers=key)
    assert again.status_code == 201, again.text
    assert again.json() == first.json()
    for name in ("etag", "location"):
        assert again.headers[name] == first.headers[name]
    assert await _count(client) == 1
    assert (await check_instances(service.engine, None)).verdict.ok


async def test_without_a_key_a_create_without_an_id_makes_a_new_instance(
    service: Service,
) -> None:
    """No key: each create without an id is a new instance (a random id), as before."""
    client = service.client
    for _ in range(2):
        made = await client.post("/instances", json={"workflow": "approval"})
        assert made.status_code == 201, made.text
    assert await _count(client) == 2


@pytest.mark.parametrize(
    "other",
    [
        {"workflow": "approval", "data": {"amount": 6}},
        {"workflow": "approval", "id": "elsewhere", "data": {"amount": 5}},
        {"workflow": "countersign", "data": {"amount": 5}},
    ],
    ids=["other-data", "other-id", "other-workflow"],
)
async def test_the_key_with_another_body_is_422(service: Service, other: dict[str, object]) -> None:
    """The key of a create sent with another body: 422 idempotency-key-reused, naming what
    differs, and no second instance."""
    client = service.client
    key = {"Idempotency-Key": "create-1"}
    first = await client.post(
        "/instances", json={"workflow": "approval", "data": {"amount": 5}}, headers=key
    )
    assert first.status_code == 201, first.text
    refused = await client.post("/instances", json=other, headers=key)
    body = assert_problem(refused, 422, "idempotency-key-reused")
    assert body["request_id"] == "create-1"
    assert body["original_instance_id"] == first.json()["id"]
    assert body["mismatch"] in {"data", "instance_id", "workflow"}
    assert await _count(client) == 1


@pytest.mark.parametrize("bad", ["", "x" * 201, "a\tb"])
async def test_a_bad_key_is_400_and_creates_nothing(service: Service, bad: str) -> None:
    """A key the event route refuses is refused here too, before anything is written."""
    refused = await service.client.post(
        "/instances", json={"workflow": "approval"}, headers={"Idempotency-Key": bad}
    )
    assert_problem(refused, 400, "invalid-idempotency-key")
    assert await _count(service.client) == 0


async def test_concurrent_retries_on_postgres_make_one_instance(pg_service: Service) -> None:
    """Twenty creates without an id under one key at once, on PostgreSQL: one instance, twenty
    equal 201 answers."""
    client = pg_service.client
    key = {"Idempotency-Key": "burst"}
    answers = await asyncio.gather(
        *(client.post("/instances", json={"workflow": "approval"}, headers=key) for _ in range(20))
    )
    assert {a.status_code for a in answers} == {201}
    assert len({a.content for a in answers}) == 1
    assert await _count(client) == 1
    assert (await check_instances(pg_service.engine, None)).verdict.ok
