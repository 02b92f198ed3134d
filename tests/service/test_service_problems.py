"""Every flowlock error the service can meet comes back as its RFC 9457 problem: the status, the
``type`` URI a client branches on, ``application/problem+json``, and the facts as members; and a
refused request leaves the instance as it was."""

from __future__ import annotations

import httpx
import pytest

from flowlock.service import ServiceSettings
from service.kit import assert_problem, create, served, snapshot


async def test_unknown_instance_is_404(client: httpx.AsyncClient) -> None:
    """GET, history and an event on an id nobody created: 404 instance-not-found."""
    for response in (
        await client.get("/instances/ghost"),
        await client.get("/instances/ghost/history"),
        await client.post("/instances/ghost/events/approve"),
    ):
        body = assert_problem(response, 404, "instance-not-found")
        assert body["instance_id"] == "ghost"


async def test_unknown_event_workflow_and_route(client: httpx.AsyncClient) -> None:
    """An event the workflow lacks (404 with the known events), a workflow the service lacks
    (404 on its definition, 422 on a create), a route that does not exist (404) and a method a
    route does not take (405 with Allow)."""
    await create(client, "approval", "a")
    body = assert_problem(await client.post("/instances/a/events/fly"), 404, "unknown-event")
    assert body["known"] == ["approve", "reject"]
    body = assert_problem(await client.get("/definitions/nope"), 404, "workflow-not-found")
    assert body["known"] == ["approval", "countersign", "inventory"]
    created = await client.post("/instances", json={"workflow": "nope", "id": "n"})
    assert_problem(created, 422, "unknown-workflow")
    assert_problem(await client.get("/nowhere"), 404, "not-found")
    not_allowed = await client.delete("/instances/a")
    assert_problem(not_allowed, 405, "method-not-allowed")
    assert "GET" in not_allowed.headers["allow"]
    assert_problem(await client.get("/instances/n"), 404, "instance-not-found")


async def test_transition_not_allowed_is_409_with_allowed_state_version(
    client: httpx.AsyncClient,
) -> None:
    """Rejecting an approved request: 409 naming the state, the version and the allowed
    events (none: a final state), and nothing written."""
    await create(client, "approval", "a")
    assert (await client.post("/instances/a/events/approve")).status_code == 200
    before = await snapshot(client, "a")
    body = assert_problem(
        await client.post("/instances/a/events/reject"), 409, "transition-not-allowed"
    )
    assert body["allowed"] == []
    assert body["state"] == "approved"
    assert body["version"] == 2
    assert body["event"] == "reject"
    assert body["instance_id"] == "a"
    assert await snapshot(client, "a") == before


async def test_stale_if_match_is_412_with_the_current_version(client: httpx.AsyncClient) -> None:
    """If-Match names version 1 after the instance moved to 2: 412 with current/version 2 and
    the current ETag, and nothing written."""
    await create(client, "inventory", "i")
    moved = await client.post("/instances/i/events/restock", headers={"If-Match": '"1"'})
    assert moved.status_code == 200, moved.text
    assert moved.headers["etag"] == '"2"'
    before = await snapshot(client, "i")
    stale = await client.post("/instances/i/events/restock", headers={"If-Match": '"1"'})
    body = assert_problem(stale, 412, "version-mismatch")
    assert body["current"] == 2
    assert body["version"] == 2
    assert body["expected"] == 1
    assert body["state"] == "open"
    assert stale.headers["etag"] == '"2"'
    assert await snapshot(client, "i") == before


@pytest.mark.parametrize("tag", ['"2"', "2", 'W/"2"', "*", ' "2" '])
async def test_if_match_forms_that_are_accepted(client: httpx.AsyncClient, tag: str) -> None:
    """An ETag as sent, a bare version, a weak ETag and * are each a valid If-Match."""
    await create(client, "inventory", "i")
    assert (await client.post("/instances/i/events/restock")).status_code == 200
    fired = await client.post("/instances/i/events/restock", headers={"If-Match": tag})
    assert fired.status_code == 200, fired.text
    assert fired.headers["etag"] == '"3"'


@pytest.mark.parametrize(
    # Headers are bytes: b'"\xb2"' is '"²"' read as latin-1, a digit to str.isdigit.
    "tag",
    [b"abc", b'"0"', b'"-1"', b'"1", "2"', b'"1', b"", b'"1.0"', b'"\xb2"', b"9" * 19],
)
async def test_malformed_if_match_is_400(client: httpx.AsyncClient, tag: bytes) -> None:
    """An If-Match that is no ETag of this service (a non-ASCII digit included): 400, and
    nothing written."""
    await create(client, "inventory", "i")
    before = await snapshot(client, "i")
    bad = await client.post("/instances/i/events/restock", headers={b"If-Match": tag})
    assert_problem(bad, 400, "invalid-if-match")
    assert await snapshot(client, "i") == before


async def test_require_if_match_refuses_a_fire_without_it_with_428() -> None:
    """With require_if_match, a fire without If-Match is 428 and writes nothing; with it, the
    fire goes through."""
    async with served(ServiceSettings(require_if_match=True)) as svc:
        await create(svc.client, "approval", "a")
        before = await snapshot(svc.client, "a")
        missing = await svc.client.post("/instances/a/events/approve")
        assert_problem(missing, 428, "precondition-required")
        assert await snapshot(svc.client, "a") == before
        fired = await svc.client.post("/instances/a/events/approve", headers={"If-Match": '"1"'})
        assert fired.status_code == 200, fired.text


async def test_guard_refusal_is_422(client: httpx.AsyncClient) -> None:
    """Reserving from an empty stock: 422 guard-rejected with the rule's reason, and nothing
    written."""
    await create(client, "inventory", "i", stock=1)
    assert (await client.post("/instances/i/events/reserve")).status_code == 200
    before = await snapshot(client, "i")
    refused = await client.post("/instances/i/events/reserve", json={"payload": {"qty": 1}})
    body = assert_problem(refused, 422, "guard-rejected")
    assert "out of stock" in body["reason"]
    assert body["version"] == 2
    assert body["state"] == "open"
    assert await snapshot(client, "i") == before


async def test_an_idempotency_key_reused_for_another_request_is_422(
    client: httpx.AsyncClient,
) -> None:
    """A key first used for restock {qty: 1}, then sent with another event or another
    payload: 422 idempotency-key-reused naming what differs, and nothing written."""
    await create(client, "inventory", "i", stock=5)
    key = {"Idempotency-Key": "order-1"}
    first = await client.post(
        "/instances/i/events/restock", json={"payload": {"qty": 1}}, headers=key
    )
    assert first.status_code == 200, first.text
    before = await snapshot(client, "i")
    other_event = await client.post(
        "/instances/i/events/reserve", json={"payload": {"qty": 1}}, headers=key
    )
    body = assert_problem(other_event, 422, "idempotency-key-reused")
    assert body["request_id"] == "order-1"
    assert body["original_event"] == "restock"
    assert body["event"] == "reserve"
    other_payload = await client.post(
        "/instances/i/events/restock", json={"payload": {"qty": 2}}, headers=key
    )
    body = assert_problem(other_payload, 422, "idempotency-key-reused")
    assert body["mismatch"] == "payload"
    assert await snapshot(client, "i") == before


@pytest.mark.parametrize("key", ["", "a\tb", "k" * 201, "a\x7fb"])
async def test_an_invalid_idempotency_key_is_400(client: httpx.AsyncClient, key: str) -> None:
    """An empty key, one with a control character, one over the id limit: 400, and nothing
    written."""
    await create(client, "inventory", "i")
    before = await snapshot(client, "i")
    bad = await client.post("/instances/i/events/restock", headers={"Idempotency-Key": key})
    assert_problem(bad, 400, "invalid-idempotency-key")
    assert await snapshot(client, "i") == before


async def test_creating_an_existing_instance_is_409(client: httpx.AsyncClient) -> None:
    """A second create with the same id: 409 instance-exists, the first instance untouched."""
    await create(client, "inventory", "i", stock=3)
    before = await snapshot(client, "i")
    again = await client.post("/instances", json={"workflow": "approval", "id": "i"})
    body = assert_problem(again, 409, "instance-exists")
    assert body["instance_id"] == "i"
    assert await snapshot(client, "i") == before


async def test_bad_query_and_path_values_are_422(client: httpx.AsyncClient) -> None:
    """Values the engine refuses (a cursor it did not give, a naive datetime, an id over the
    limit or with a NUL) and values out of the documented range: 422, never a 5xx."""
    for path, slug in [
        ("/instances?cursor=abc", "invalid-cursor"),
        ("/instances?updated_before=2020-01-01T00:00:00", "invalid-request"),
        ("/instances?state=", "invalid-input"),
        ("/instances?limit=0", "invalid-request"),
        ("/instances?limit=1001", "invalid-request"),
        ("/instances?updated_after=yesterday", "invalid-request"),
        ("/instances/" + "x" * 201, "invalid-input"),
        ("/instances/%00", "invalid-input"),
        ("/instances/i/history?after=-1", "invalid-request"),
        ("/instances/i/history?limit=abc", "invalid-request"),
    ]:
        body = assert_problem(await client.get(path), 422, slug)
        assert body["detail"]
