"""Bearer tokens: with tokens configured, a request without a valid one is 401 (with
WWW-Authenticate) before its body is read, and writes nothing; a valid token's principal is the
actor in history. Reads need a token too (the scopes of each route: test_service_scopes.py)."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator

import httpx
import pytest

from flowlock.core.errors import InstanceNotFound
from flowlock.service import ServiceSettings
from flowlock.service.settings import parse_tokens
from service.kit import JSON, Service, assert_problem, served, snapshot

ALICE = "alice-secret-0123456789"
BARE = "bare-secret-abcdefghijklmnop"
BARE_PRINCIPAL = "token-" + hashlib.sha256(BARE.encode()).hexdigest()[:8]
GOOD = {"Authorization": f"Bearer {ALICE}"}

REFUSED = [
    pytest.param({}, id="no-header"),
    pytest.param({"Authorization": "Bearer not-a-token-of-this-service"}, id="wrong-token"),
    pytest.param({"Authorization": f"Bearer {ALICE}x"}, id="token-plus-one"),
    pytest.param({"Authorization": f"Bearer {ALICE[:-1]}"}, id="token-minus-one"),
    pytest.param({"Authorization": f"Basic {ALICE}"}, id="basic-scheme"),
    pytest.param({"Authorization": f"Token {ALICE}"}, id="token-scheme"),
    pytest.param({"Authorization": "Bearer"}, id="bearer-alone"),
    pytest.param({"Authorization": "Bearer   "}, id="bearer-blank"),
    pytest.param({"Authorization": ALICE}, id="no-scheme"),
]


@pytest.fixture
async def secured() -> AsyncIterator[Service]:
    """The app with a name:secret token (alice) and a bare one, and an instance 'a'."""
    tokens = parse_tokens(f"alice:{ALICE}, {BARE}")
    async with served(ServiceSettings(api_tokens=tokens)) as svc:
        created = await svc.client.post(
            "/instances", json={"workflow": "approval", "id": "a"}, headers=GOOD
        )
        assert created.status_code == 201, created.text
        yield svc


def assert_unauthorized(response: httpx.Response) -> None:
    assert_problem(response, 401, "unauthorized")
    assert response.headers["www-authenticate"] == 'Bearer realm="flowlock"'


@pytest.mark.parametrize("headers", REFUSED)
async def test_create_without_a_valid_token_is_401_and_creates_nothing(
    secured: Service, headers: dict[str, str]
) -> None:
    """POST /instances without a valid bearer token: 401, and no instance."""
    refused = await secured.client.post(
        "/instances", json={"workflow": "approval", "id": "b"}, headers=headers
    )
    assert_unauthorized(refused)
    with pytest.raises(InstanceNotFound):
        await secured.engine.get("b")
    listed = await secured.client.get("/instances", headers=GOOD)
    assert [i["id"] for i in listed.json()["items"]] == ["a"]


@pytest.mark.parametrize("headers", REFUSED)
async def test_fire_without_a_valid_token_is_401_and_writes_no_history(
    secured: Service, headers: dict[str, str]
) -> None:
    """POST /instances/{id}/events/{event} without a valid bearer token: 401, the instance at
    version 1 with no history row (read from the engine, not only through HTTP)."""
    before = await snapshot(secured.client, "a", GOOD)
    refused = await secured.client.post(
        "/instances/a/events/approve",
        json={"actor": "mallory"},
        headers={**headers, "Idempotency-Key": "k1"},
    )
    assert_unauthorized(refused)
    assert await snapshot(secured.client, "a", GOOD) == before
    assert (await secured.engine.get("a")).version == 1
    assert await secured.engine.history("a") == []


async def test_the_token_is_checked_before_the_body_is_read(secured: Service) -> None:
    """A refused request's body is never read: the stream is not pulled once (and its size or
    JSON do not matter)."""
    pulled = 0

    async def body() -> AsyncIterator[bytes]:
        nonlocal pulled
        for _ in range(1000):
            pulled += 1
            yield b"x" * 10_000

    refused = await secured.client.post("/instances/a/events/approve", content=body(), headers=JSON)
    assert_unauthorized(refused)
    assert pulled == 0


async def test_a_named_token_is_the_actor(secured: Service) -> None:
    """A 'name:secret' token authenticates as 'name', which is the history's actor whatever the
    body says; the fire goes through."""
    fired = await secured.client.post(
        "/instances/a/events/approve", json={"actor": "mallory"}, headers=GOOD
    )
    assert fired.status_code == 200, fired.text
    [entry] = (await secured.client.get("/instances/a/history", headers=GOOD)).json()["items"]
    assert entry["actor"] == "alice"
    assert (await secured.engine.history("a"))[0].actor == "alice"


async def test_a_bare_token_is_the_actor_by_its_hash(secured: Service) -> None:
    """A bare secret authenticates as 'token-' and 8 hex digits of its SHA-256; the scheme's
    case does not matter."""
    headers = {"Authorization": f"bearer {BARE}"}
    created = await secured.client.post(
        "/instances", json={"workflow": "inventory", "id": "i"}, headers=headers
    )
    assert created.status_code == 201, created.text
    fired = await secured.client.post("/instances/i/events/restock", headers=headers)
    assert fired.status_code == 200, fired.text
    [entry] = (await secured.client.get("/instances/i/history", headers=headers)).json()["items"]
    assert entry["actor"] == BARE_PRINCIPAL


@pytest.mark.parametrize("headers", REFUSED)
async def test_reads_without_a_valid_token_are_401(
    secured: Service, headers: dict[str, str]
) -> None:
    """Every GET but the probes is refused without a valid token: the instance's data, its
    history, the definitions, the metrics and the API's own document."""
    for path in [
        "/definitions",
        "/definitions/approval",
        "/definitions/approval/diagram",
        "/instances",
        "/instances/a",
        "/instances/a/history",
        "/instances/a/timers",
        "/instances/a/messages",
        "/metrics",
        "/openapi.json",
        "/docs",
        "/no/such/route",
    ]:
        assert_unauthorized(await secured.client.get(path, headers=headers))
    for path in ["/livez", "/readyz"]:
        response = await secured.client.get(path, headers=headers)
        assert response.status_code == 200, (path, response.text)


async def test_without_tokens_every_route_answers_anyone() -> None:
    """No token configured: reads and writes need none (the loopback rule of `flowlock serve`
    is what keeps such a service to its machine)."""
    async with served() as svc:
        created = await svc.client.post("/instances", json={"workflow": "approval", "id": "o"})
        assert created.status_code == 201, created.text
        for path in ["/instances/o", "/instances/o/history", "/metrics", "/openapi.json"]:
            response = await svc.client.get(path)
            assert response.status_code == 200, (path, response.text)
