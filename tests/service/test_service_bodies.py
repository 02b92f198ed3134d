"""Bad request bodies are refused as problems (4xx, never a 5xx) before they reach the engine:
the instance's state, version, data and history are the same after each refusal."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from flowlock.service import ServiceSettings
from service.kit import JSON, assert_problem, create, served, snapshot

DEEP = b"[" * 10_000 + b"]" * 10_000
HUGE_INT = b'{"payload": {"x": 1' + b"0" * 5000 + b"}}"
DEEP_OBJECTS = b'{"payload": {"a": ' + b'{"a": ' * 40 + b"1" + b"}" * 42
TEXT = {"content-type": "text/plain"}
FORM = {"content-type": "application/x-www-form-urlencoded"}
WRONG_TYPE = "unsupported-media-type"

# (body, content type, status, problem slug): each refused on both POST routes.
BAD_BODIES = [
    pytest.param(b'{"actor": ', JSON, 400, "invalid-json", id="truncated-json"),
    pytest.param(b"{'actor': 'x'}", JSON, 400, "invalid-json", id="single-quotes"),
    pytest.param(b"\xff\xfe{}", JSON, 400, "invalid-json", id="not-utf8"),
    pytest.param(b'{"payload": {"x": NaN}}', JSON, 400, "invalid-json", id="nan"),
    pytest.param(b'{"payload": {"x": Infinity}}', JSON, 400, "invalid-json", id="infinity"),
    pytest.param(b'{"payload": {"x": -Infinity}}', JSON, 400, "invalid-json", id="-infinity"),
    pytest.param(b'{"payload": {"x": 1e999}}', JSON, 400, "invalid-json", id="1e999"),
    pytest.param(HUGE_INT, JSON, 400, "invalid-json", id="5000-digit-int"),
    pytest.param(DEEP, JSON, 400, "json-too-deep", id="10000-deep-array"),
    pytest.param(b'{"payload": ' + DEEP + b"}", JSON, 400, "json-too-deep", id="10000-deep-field"),
    pytest.param(DEEP_OBJECTS, JSON, 400, "json-too-deep", id="40-deep-objects"),
    pytest.param(b"[]", JSON, 422, "invalid-body", id="array"),
    pytest.param(b'"approve"', JSON, 422, "invalid-body", id="string"),
    pytest.param(b"1", JSON, 422, "invalid-body", id="number"),
    pytest.param(b"null", JSON, 422, "invalid-body", id="null"),
    pytest.param(b'{"actor": "a", "extra": 1}', JSON, 422, "invalid-request", id="extra-field"),
    pytest.param(b'{"payload": [1]}', JSON, 422, "invalid-request", id="payload-not-object"),
    pytest.param(b'{"data": "x"}', JSON, 422, "invalid-request", id="data-not-object"),
    pytest.param(b'{"actor": "a"}', TEXT, 415, WRONG_TYPE, id="text-plain"),
    pytest.param(b'{"actor": "a"}', FORM, 415, WRONG_TYPE, id="form"),
    pytest.param(b'{"actor": "a"}', {}, 415, WRONG_TYPE, id="no-content-type"),
]


@pytest.mark.parametrize(("body", "headers", "status", "slug"), BAD_BODIES)
async def test_a_bad_fire_body_is_a_problem_and_writes_nothing(
    client: httpx.AsyncClient, body: bytes, headers: dict[str, str], status: int, slug: str
) -> None:
    """Each bad body on POST /instances/{id}/events/{event}: its problem, and the instance as
    it was."""
    await create(client, "inventory", "i", stock=2)
    before = await snapshot(client, "i")
    refused = await client.post("/instances/i/events/restock", content=body, headers=headers)
    assert_problem(refused, status, slug)
    assert await snapshot(client, "i") == before


@pytest.mark.parametrize(("body", "headers", "status", "slug"), BAD_BODIES)
async def test_a_bad_create_body_is_a_problem_and_creates_nothing(
    client: httpx.AsyncClient, body: bytes, headers: dict[str, str], status: int, slug: str
) -> None:
    """Each bad body on POST /instances: its problem, and no instance created."""
    refused = await client.post("/instances", content=body, headers=headers)
    assert_problem(refused, status, slug)
    listed = await client.get("/instances")
    assert listed.json() == {"items": [], "next_cursor": None}


@pytest.mark.parametrize(
    ("body", "where"),
    [
        ({"actor": 5}, "actor"),
        ({"strategy": ["optimistic"]}, "strategy"),
        ({"payload": {"qty": 1}, "actor": True}, "actor"),
        ({"actor": "a", "instance": "i"}, "instance"),
    ],
)
async def test_a_wrong_field_is_named(
    client: httpx.AsyncClient, body: dict[str, object], where: str
) -> None:
    """A field of the wrong type, or one the body does not have: 422 naming it (strict: no
    coercion of 5 to "5"), and nothing written."""
    await create(client, "inventory", "i")
    before = await snapshot(client, "i")
    refused = await client.post("/instances/i/events/restock", json=body)
    problem = assert_problem(refused, 422, "invalid-request")
    assert [e["where"] for e in problem["errors"]] == [where]
    assert await snapshot(client, "i") == before


async def test_values_the_engine_refuses_are_422(client: httpx.AsyncClient) -> None:
    """A body that parses but that the engine refuses (an unknown strategy, a NUL in the data,
    a create without a workflow or without a body): 422, and nothing written."""
    await create(client, "inventory", "i")
    before = await snapshot(client, "i")
    for body, slug in [
        ({"strategy": "bogus"}, "unknown-strategy"),
        ({"payload": {"note": "a\u0000b"}}, "invalid-input"),
        ({"actor": ""}, "invalid-input"),
    ]:
        refused = await client.post("/instances/i/events/restock", json=body)
        assert_problem(refused, 422, slug)
    assert await snapshot(client, "i") == before
    for created, slug in [
        ({"id": "j"}, "invalid-request"),
        ({"workflow": "inventory", "id": "j", "data": {"k\u0000": 1}}, "invalid-input"),
        ({"workflow": "inventory", "id": ""}, "invalid-input"),
    ]:
        assert_problem(await client.post("/instances", json=created), 422, slug)
    assert_problem(await client.post("/instances", content=b"", headers=JSON), 422, "invalid-body")
    assert (await client.get("/instances/j")).status_code == 404


async def test_a_lone_surrogate_echoed_in_a_problem_is_not_a_500(
    client: httpx.AsyncClient,
) -> None:
    """JSON may spell a lone surrogate (\\ud800), which no store (and no UTF-8) can hold. The
    problem quotes the value back; it is sent ASCII-escaped, so the answer is the 422, not a
    500 from encoding it."""
    await create(client, "inventory", "i")
    before = await snapshot(client, "i")
    fire = await client.post(
        "/instances/i/events/restock", content=b'{"strategy": "\\ud800"}', headers=JSON
    )
    assert assert_problem(fire, 422, "unknown-strategy")["strategy"] == "\ud800"
    made = await client.post("/instances", content=b'{"workflow": "\\ud800"}', headers=JSON)
    assert_problem(made, 422, "unknown-workflow")
    assert await snapshot(client, "i") == before


async def test_an_empty_fire_body_is_an_empty_object(client: httpx.AsyncClient) -> None:
    """No body, or an empty one, fires with no actor and no payload (the one accepted
    non-object)."""
    await create(client, "inventory", "i")
    assert (await client.post("/instances/i/events/restock")).status_code == 200
    blank = await client.post("/instances/i/events/restock", content=b" \n", headers=JSON)
    assert blank.status_code == 200, blank.text
    assert blank.json()["instance"]["version"] == 3


LIMIT = 1000


async def chunks(total: int, size: int = 100) -> AsyncIterator[bytes]:
    """``total`` bytes of a JSON object, streamed in chunks (httpx sends it chunked, with no
    Content-Length)."""
    body = b'{"payload": {"pad": "' + b"x" * (total - 24) + b'"}}'
    assert len(body) == total
    for start in range(0, total, size):
        yield body[start : start + size]


async def test_a_body_over_the_limit_is_413_with_or_without_content_length() -> None:
    """A body over max_body_bytes: 413 when Content-Length says so, and 413 when it streams in
    chunked with no length; nothing written either way. A body at the limit is accepted."""
    async with served(ServiceSettings(max_body_bytes=LIMIT)) as svc:
        client = svc.client
        await create(client, "inventory", "i")
        before = await snapshot(client, "i")
        big = b'{"payload": {"pad": "' + b"x" * LIMIT + b'"}}'
        declared = await client.post("/instances/i/events/restock", content=big, headers=JSON)
        assert declared.request.headers["content-length"] == str(len(big))
        assert assert_problem(declared, 413, "request-too-large")["limit"] == LIMIT
        streamed = await client.post(
            "/instances/i/events/restock", content=chunks(LIMIT + 1), headers=JSON
        )
        assert "content-length" not in streamed.request.headers
        assert streamed.request.headers["transfer-encoding"] == "chunked"
        assert_problem(streamed, 413, "request-too-large")
        created = await client.post("/instances", content=big, headers=JSON)
        assert_problem(created, 413, "request-too-large")
        assert await snapshot(client, "i") == before
        assert len((await client.get("/instances")).json()["items"]) == 1
        # At the limit exactly, streamed: read whole and applied.
        at_limit = await client.post(
            "/instances/i/events/restock", content=chunks(LIMIT), headers=JSON
        )
        assert at_limit.status_code == 200, at_limit.text


async def test_a_lying_content_length_is_bounded_by_the_bytes_read() -> None:
    """A Content-Length under the limit is no pass: the bytes that arrive are counted, so a
    larger body sent after it is still refused (the ASGI server would normally cut it)."""
    async with served(ServiceSettings(max_body_bytes=LIMIT)) as svc:
        await create(svc.client, "inventory", "i")
        before = await snapshot(svc.client, "i")
        request = svc.client.build_request(
            "POST", "/instances/i/events/restock", content=chunks(LIMIT * 3), headers=JSON
        )
        request.headers["content-length"] = "10"
        del request.headers["transfer-encoding"]
        assert_problem(await svc.client.send(request), 413, "request-too-large")
        assert await snapshot(svc.client, "i") == before
