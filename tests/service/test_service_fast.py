"""The fast layer (flowlock.service.fast): it takes create, get and fire, and only those, and
answers each exactly as the FastAPI route it stands in for.

Every request below goes to two apps on fresh stores: the service as built, and the same
service with the fast layer taken out, so FastAPI's routes answer. Status, headers and body
must match (timestamps aside, which no two stores share)."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from flowlock.service import ServiceSettings, create_app
from flowlock.service.fast import FastRoutes
from flowlock.service.settings import parse_tokens

TOKEN = "fast-layer-test-token-0123456789"
JSON_TYPE = {"content-type": "application/json"}
_MOMENT = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?([+-]\d\d:\d\d|Z)?")

# (method, path, body, headers): in order, each answered by both apps.
Step = tuple[str, str, bytes | None, dict[str, str]]


def _json(doc: object) -> bytes:
    return json.dumps(doc).encode()


STEPS: list[Step] = [
    ("POST", "/instances", _json({"workflow": "approval", "id": "a"}), JSON_TYPE),
    ("POST", "/instances", _json({"workflow": "approval", "id": "a"}), JSON_TYPE),
    ("POST", "/instances", _json({"workflow": "approval", "instance_id": "b"}), JSON_TYPE),
    ("POST", "/instances", _json({"workflow": "approval"}), {**JSON_TYPE, "Idempotency-Key": "k"}),
    ("POST", "/instances", _json({"workflow": "approval"}), {**JSON_TYPE, "Idempotency-Key": "k"}),
    ("POST", "/instances", _json({"workflow": "inventory"}), {**JSON_TYPE, "Idempotency-Key": "k"}),
    ("POST", "/instances", _json({"workflow": "x", "id": "é/𓀀?"}), JSON_TYPE),
    ("POST", "/instances", _json({"workflow": "approval", "id": "é/𓀀?"}), JSON_TYPE),
    ("POST", "/instances", _json({"workflow": "approval", "extra": 1}), JSON_TYPE),
    ("POST", "/instances", _json({"workflow": 3}), JSON_TYPE),
    ("POST", "/instances", b"[1]", JSON_TYPE),
    ("POST", "/instances", b"{", JSON_TYPE),
    ("POST", "/instances", b'{"workflow": NaN}', JSON_TYPE),
    ("POST", "/instances", b"[" * 40 + b"]" * 40, JSON_TYPE),
    ("POST", "/instances", b"", JSON_TYPE),
    ("POST", "/instances", _json({"workflow": "approval"}), {"content-type": "text/plain"}),
    ("POST", "/instances", _json({"workflow": "approval"}), {**JSON_TYPE, "Idempotency-Key": ""}),
    ("POST", "/instances/", _json({"workflow": "approval", "id": "c"}), JSON_TYPE),
    ("GET", "/instances/a", None, {}),
    ("GET", "/instances/%C3%A9%2F%F0%93%80%80%3F", None, {}),
    ("GET", "/instances/nope", None, {}),
    ("GET", "/instances/a/", None, {}),
    ("HEAD", "/instances/a", None, {}),
    ("POST", "/instances/a/events/approve", _json({"strategy": "nope"}), JSON_TYPE),
    ("POST", "/instances/a/events/approve", None, {"If-Match": "bogus"}),
    ("POST", "/instances/a/events/approve", None, {"If-Match": '"7"'}),
    ("POST", "/instances/a/events/approve", b"{}", {**JSON_TYPE, "Idempotency-Key": "x" * 201}),
    ("POST", "/instances/a/events/nope", b"{}", JSON_TYPE),
    ("POST", "/instances/nope/events/approve", b"{}", JSON_TYPE),
    ("POST", "/instances/a/events/approve", b"{}", {"content-type": "text/plain"}),
    (
        "POST",
        "/instances/a/events/approve",
        _json({"actor": "ann", "payload": {"n": 1}}),
        {**JSON_TYPE, "If-Match": 'W/"1"', "Idempotency-Key": "f1"},
    ),
    (
        "POST",
        "/instances/a/events/approve",
        _json({"actor": "ann", "payload": {"n": 1}}),
        {**JSON_TYPE, "If-Match": 'W/"1"', "Idempotency-Key": "f1"},
    ),
    ("POST", "/instances/a/events/approve", None, {}),
    ("POST", "/instances/b/events/reject", None, {"If-Match": "*"}),
    ("GET", "/instances/a", None, {}),
    ("GET", "/instances/a/history", None, {}),
    ("GET", "/instances", None, {}),
]


def _steady(value: Any) -> Any:
    """`value` with every timestamp replaced: the two apps' stores do not share a clock."""
    if isinstance(value, dict):
        return {k: _steady(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_steady(v) for v in value]
    if isinstance(value, str):
        return _MOMENT.sub("<moment>", value)
    return value


def _without_fast_layer(app: Any) -> None:
    app.user_middleware = [m for m in app.user_middleware if m.cls is not FastRoutes]


@asynccontextmanager
async def _client(settings: ServiceSettings, *, fast: bool) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(settings)
    if not fast:
        _without_fast_layer(app)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            yield client


def _answer(response: httpx.Response) -> tuple[int, dict[str, str], Any]:
    headers = dict(response.headers)
    body: Any = response.content
    if body:
        body = _steady(response.json())
    return response.status_code, headers, body


@pytest.mark.parametrize("secured", [False, True], ids=["no-token", "token"])
async def test_the_fast_layer_answers_as_the_fastapi_routes(secured: bool) -> None:
    """Creates, reads and fires, good and bad (bodies, headers, unknown names, replays, paths
    the layer leaves to FastAPI): the same status, headers and body from both apps. With a
    token, the principal is the actor on both."""
    tokens = parse_tokens(f"svc:{TOKEN}:write") if secured else ()
    settings = ServiceSettings(api_tokens=tokens)
    auth = {"Authorization": f"Bearer {TOKEN}"} if secured else {}
    async with (
        _client(settings, fast=True) as fast,
        _client(settings, fast=False) as framework,
    ):
        for method, path, body, headers in STEPS:
            sent = {**headers, **auth}
            got = await fast.request(method, path, content=body, headers=sent)
            want = await framework.request(method, path, content=body, headers=sent)
            assert _answer(got) == _answer(want), (method, path, body, headers)
        history = (await fast.get("/instances/a/history", headers=auth)).json()
        assert history["items"][-1]["actor"] == ("svc" if secured else "ann")


async def test_the_fast_layer_takes_the_hot_routes_only() -> None:
    """Create, get and fire never reach FastAPI; every other request does."""
    app = create_app()
    reached: list[str] = []
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            await client.get("/livez")  # builds the middleware stack
            layer: Any = app.middleware_stack
            while not isinstance(layer, FastRoutes):
                layer = layer.app
            inner = layer.app

            async def counted(
                scope: MutableMapping[str, Any],
                receive: Callable[[], Awaitable[Any]],
                send: Callable[[Any], Awaitable[None]],
            ) -> None:
                reached.append(f"{scope['method']} {scope['path']}")
                await inner(scope, receive, send)

            layer.app = counted
            created = await client.post("/instances", json={"workflow": "approval", "id": "a"})
            assert created.status_code == 201
            assert (await client.get("/instances/a")).status_code == 200
            fired = await client.post("/instances/a/events/approve", json={})
            assert fired.status_code == 200
            assert (await client.get("/instances/nope")).status_code == 404
            assert reached == []
            await client.get("/instances/a/history")
            await client.get("/instances")
            await client.head("/instances/a")
            await client.post("/instances/", json={"workflow": "approval"})
            assert reached == [
                "GET /instances/a/history",
                "GET /instances",
                "HEAD /instances/a",
                "POST /instances/",
            ]
