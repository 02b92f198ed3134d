"""Token scopes on every route of the app, found by walking `app.routes` (a route added later,
by any module, is in the matrix without a change here).

With tokens set: `/livez` and `/readyz` answer anyone; every other route needs a bearer token
whose scope covers it: read for GET and HEAD, write for other methods, admin for any path under
`/admin/`, whatever the method. `/metrics` is open only with `open_metrics`. The console's
paths (`/ui`) are its own (a session cookie): the guard lets them through. A valid token
without the scope is 403 `insufficient-scope` naming the scope needed and the token's, before
the body is read and with nothing written.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request, WebSocket

from flowlock.service import ServiceSettings
from flowlock.service.settings import SCOPES, parse_tokens
from service.kit import JSON, Service, assert_problem, served, snapshot

SECRETS = {scope: f"{scope}-secret-0123456789abcdef" for scope in SCOPES}
TOKENS = ",".join(f"{scope}er:{secret}:{scope}" for scope, secret in SECRETS.items())
AUTH = {scope: {"Authorization": f"Bearer {secret}"} for scope, secret in SECRETS.items()}
PROBES = {"/livez", "/readyz"}
# What each path parameter is filled with: names that exist, so a route a token may call
# mostly reaches its handler (a 404 or 422 from the handler still shows the guard let it by).
SAMPLES = {"instance_id": "a", "id": "a", "workflow": "approval", "name": "approval",
           "event": "approve", "key": "a:2:0"}  # fmt: skip
PARAM = re.compile(r"{([^}:]+)(?::[^}]*)?}")


def concrete(path: str) -> str:
    return PARAM.sub(lambda m: SAMPLES.get(m.group(1), "x"), path)


def operations(app: FastAPI) -> list[tuple[str, str, str]]:
    """(method, concrete path, route path) of every route; a mount or a WebSocket route, which
    declare no methods, is entered with a GET."""
    found = []
    for route in app.routes:
        path: str = getattr(route, "path", "")
        methods = getattr(route, "methods", None) or {"GET"}
        found += [(method, concrete(path), path) for method in sorted(methods)]
    return found


def expected(method: str, path: str) -> str | None:
    """The scope the issue asks of a request: None for the probes, "console" for /ui."""
    if path in PROBES:
        return None
    if path == "/ui" or path.startswith("/ui/"):
        return "console"
    if path == "/admin" or path.startswith("/admin/"):
        return "admin"
    return "read" if method in ("GET", "HEAD") else "write"


def response_is_problem(response: httpx.Response) -> bool:
    return response.headers["content-type"] == "application/problem+json"


async def call(client: httpx.AsyncClient, method: str, path: str, **kw: Any) -> httpx.Response:
    body: dict[str, Any] | None = {} if method not in ("GET", "HEAD", "DELETE") else None
    return await client.request(method, path, json=body, **kw)


def probe_routes(app: FastAPI) -> None:
    """Routes added after the app was built, as another module would add them: each answers
    the principal and scope the guard recorded in the request's state."""

    async def state(request: Request) -> dict[str, Any]:
        return {
            "principal": getattr(request.state, "principal", None),
            "scope": getattr(request.state, "scope", None),
        }

    probes = [("/probe/state", "GET"), ("/probe/state", "PUT"),
              ("/admin/probe/state", "GET"), ("/admin/probe/state", "POST")]  # fmt: skip
    for path, method in probes:
        app.add_api_route(path, state, methods=[method], name=f"probe_{method}_{path}")


@pytest.fixture
async def secured() -> AsyncIterator[Service]:
    """The app with a read, a write and an admin token, an instance 'a', and the probe routes."""
    async with served(ServiceSettings(api_tokens=parse_tokens(TOKENS))) as svc:
        probe_routes(svc.app)
        created = await svc.client.post(
            "/instances", json={"workflow": "approval", "id": "a"}, headers=AUTH["write"]
        )
        assert created.status_code == 201, created.text
        yield svc


def test_the_matrix_covers_every_route_and_each_kind_of_scope() -> None:
    """The walk finds the app's routes, with reads, writes and the probes among them; the
    probe routes of the fixture add an admin one (admin routes, when the app has them, too)."""
    from flowlock.service import create_app

    app = create_app()
    probe_routes(app)
    ops = operations(app)
    assert len({path for _, _, path in ops}) == len(
        {getattr(r, "path", "") for r in app.routes} - {""}
    )
    kinds = {expected(method, concrete) for method, concrete, _ in ops}
    assert {None, "read", "write", "admin"} <= kinds, kinds
    assert ("GET", "/instances/a/history", "/instances/{instance_id}/history") in ops


async def test_every_route_needs_its_scope(secured: Service) -> None:
    """Each route, each token: a token whose scope covers the route gets past the guard (the
    route's own answer, never 401 or 403); one whose scope does not gets 403 insufficient-scope
    naming both scopes; no token is 401; the probes answer without one."""
    client = secured.client
    checked = 0
    for method, path, route in operations(secured.app):
        needed = expected(method, route)
        if needed == "console":
            continue  # the console's session, not a token: its own tests
        if needed is None:
            response = await call(client, method, path)
            assert response.status_code not in (401, 403), (method, path, response.text)
            continue
        refused = await call(client, method, path)
        if method == "HEAD":  # no body to read: the status and the challenge say it all
            assert refused.status_code == 401, (method, path)
            assert response_is_problem(refused)
        else:
            assert_problem(refused, 401, "unauthorized")
        for scope in SCOPES:
            response = await call(client, method, path, headers=AUTH[scope])
            covered = SCOPES.index(scope) >= SCOPES.index(needed)
            if covered:
                assert response.status_code not in (401, 403), (method, path, scope, response.text)
            elif method == "HEAD":
                assert response.status_code == 403, (method, path, scope)
                assert response_is_problem(response)
                assert f'scope="{needed}"' in response.headers["www-authenticate"]
            else:
                body = assert_problem(response, 403, "insufficient-scope")
                assert (body["needed"], body["scope"], body["principal"]) == (
                    needed,
                    scope,
                    f"{scope}er",
                ), (method, path)
                assert f"scope {needed}" in body["detail"] and f"scope {scope}" in body["detail"]
                assert f'scope="{needed}"' in response.headers["www-authenticate"]
            checked += 1
    assert checked >= 3 * 12, checked


async def test_a_refused_token_writes_nothing(secured: Service) -> None:
    """Every write route called with a token that may not call it (read on writes, read and
    write on /admin/), with a JSON body it would accept: 403 each time, and the instance, its
    history and the list of instances are as they were."""
    before = await snapshot(secured.client, "a", AUTH["read"])
    listed = (await secured.client.get("/instances", headers=AUTH["read"])).json()
    refused = 0
    for method, path, route in operations(secured.app):
        needed = expected(method, route)
        if needed not in ("write", "admin"):
            continue
        for scope in SCOPES[: SCOPES.index(needed)]:
            body = {"workflow": "approval", "id": "b", "state": "approved", "reason": "r"}
            response = await secured.client.request(method, path, json=body, headers=AUTH[scope])
            assert_problem(response, 403, "insufficient-scope")
            refused += 1
    assert refused >= 3
    assert await snapshot(secured.client, "a", AUTH["read"]) == before
    assert (await secured.client.get("/instances", headers=AUTH["read"])).json() == listed
    assert [e.event for e in await secured.engine.history("a")] == []


async def test_a_read_token_reads_and_cannot_fire(secured: Service) -> None:
    """read: the instance and its history, yes; a fire, 403, and no history row."""
    got = await secured.client.get("/instances/a", headers=AUTH["read"])
    assert got.status_code == 200 and got.json()["state"] == "pending", got.text
    fired = await secured.client.post("/instances/a/events/approve", headers=AUTH["read"])
    body = assert_problem(fired, 403, "insufficient-scope")
    assert body["needed"] == "write"
    assert await secured.engine.history("a") == []


async def test_a_write_token_fires_and_cannot_use_admin(secured: Service) -> None:
    """write: a fire goes through with the token's name as actor; any /admin/ path, GET
    included, is 403 naming admin."""
    fired = await secured.client.post("/instances/a/events/approve", headers=AUTH["write"])
    assert fired.status_code == 200, fired.text
    [entry] = await secured.engine.history("a")
    assert entry.actor == "writeer"
    for method in ("GET", "POST"):
        response = await call(secured.client, method, "/admin/probe/state", headers=AUTH["write"])
        body = assert_problem(response, 403, "insufficient-scope")
        assert body["needed"] == "admin" and body["scope"] == "write"


async def test_the_guard_records_principal_and_scope(secured: Service) -> None:
    """The request's state holds the token's principal and scope for the route to use."""
    for scope in SCOPES:
        got = await secured.client.get("/probe/state", headers=AUTH[scope])
        assert got.json() == {"principal": f"{scope}er", "scope": scope}, got.text
    got = await secured.client.post("/admin/probe/state", headers=AUTH["admin"])
    assert got.json() == {"principal": "adminer", "scope": "admin"}, got.text


async def test_an_insufficient_scope_is_refused_before_the_body_is_read(
    secured: Service,
) -> None:
    """A 403 pulls nothing of a streamed body."""
    pulled = 0

    async def body() -> AsyncIterator[bytes]:
        nonlocal pulled
        for _ in range(100):
            pulled += 1
            yield b"x" * 10_000

    refused = await secured.client.post(
        "/instances/a/events/approve", content=body(), headers={**JSON, **AUTH["read"]}
    )
    assert_problem(refused, 403, "insufficient-scope")
    assert pulled == 0


async def test_the_console_paths_are_passed_through() -> None:
    """Paths under /ui reach the app without a token (the console checks its own session):
    here no console is mounted, so the router's 404, not the guard's 401."""
    async with served(ServiceSettings(api_tokens=parse_tokens(TOKENS))) as svc:
        for path in ("/ui", "/ui/instances", "/ui/login"):
            response = await svc.client.get(path)
            assert response.status_code != 401, (path, response.text)
        # A path that only starts with the same letters is not the console's.
        assert_problem(await svc.client.get("/uix"), 401, "unauthorized")


@pytest.mark.parametrize("open_metrics", [False, True])
async def test_metrics_are_open_only_with_the_flag(open_metrics: bool) -> None:
    """/metrics without a token: 401 by default, 200 with open_metrics; the other reads still
    need a token either way."""
    settings = ServiceSettings(api_tokens=parse_tokens(TOKENS), open_metrics=open_metrics)
    async with served(settings) as svc:
        metrics = await svc.client.get("/metrics")
        if open_metrics:
            assert metrics.status_code == 200 and "flowlock" in metrics.text, metrics.text
        else:
            assert_problem(metrics, 401, "unauthorized")
        assert (await svc.client.get("/metrics", headers=AUTH["read"])).status_code == 200
        assert_problem(await svc.client.get("/instances"), 401, "unauthorized")


async def test_the_document_names_the_scope_of_every_operation() -> None:
    """The OpenAPI document has the bearer scheme, and each operation the scope the guard asks
    of it (the probes none); with open_metrics, /metrics needs none either."""
    for open_metrics in (False, True):
        async with served(ServiceSettings(open_metrics=open_metrics)) as svc:
            doc = (await svc.client.get("/openapi.json")).json()
        assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
        for path, item in doc["paths"].items():
            for method, operation in item.items():
                needed = expected(method.upper(), path)
                if needed is None or (path == "/metrics" and open_metrics):
                    assert operation["security"] == [], (method, path)
                else:
                    assert operation["security"] == [{"bearer": [needed]}], (method, path)
                    assert operation["x-flowlock-scope"] == needed
                    assert {"401", "403"} <= set(operation["responses"]), (method, path)


async def test_a_websocket_needs_a_read_token_too() -> None:
    """A WebSocket route (none today; one added later) is guarded as a GET: its handshake is
    refused (closed with 1008 before it is accepted) without a valid token, and accepted with a
    read one, whose principal the route sees. Driven as an ASGI server drives it."""

    async def echo(websocket: WebSocket) -> None:
        await websocket.accept()
        await websocket.send_json({"principal": websocket.state.principal})
        await websocket.close()

    async def handshake(svc: Service, headers: dict[str, str]) -> list[dict[str, Any]]:
        incoming = [{"type": "websocket.connect"}]
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return incoming.pop(0) if incoming else {"type": "websocket.disconnect", "code": 1000}

        async def send(message: Any) -> None:
            sent.append(dict(message))

        scope = {
            "type": "websocket", "asgi": {"version": "3.0"}, "scheme": "ws", "path": "/probe/ws",
            "raw_path": b"/probe/ws", "root_path": "", "query_string": b"", "subprotocols": [],
            "server": ("t", 80), "client": ("c", 1), "state": {},
            "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        }  # fmt: skip
        await svc.app(scope, receive, send)
        return sent

    async with served(ServiceSettings(api_tokens=parse_tokens(TOKENS))) as svc:
        svc.app.add_api_websocket_route("/probe/ws", echo)
        for headers in ({}, {"Authorization": "Bearer not-a-token-of-this-service"}):
            assert await handshake(svc, headers) == [{"type": "websocket.close", "code": 1008}]
        sent = await handshake(svc, AUTH["read"])
        assert [m["type"] for m in sent] == [
            "websocket.accept",
            "websocket.send",
            "websocket.close",
        ]
        assert json.loads(sent[1]["text"]) == {"principal": "reader"}
