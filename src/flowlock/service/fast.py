"""The hot routes without the framework: create, get and fire as a thin ASGI layer.

FastAPI spends most of a small request in its own machinery (routing through every route,
solving each parameter as a dependency, building the response). For the three calls a
client makes most, this layer answers them itself, inside the guard and before FastAPI:
it matches the path by hand, reads the headers once, parses the body once, and calls the
same logic as the FastAPI routes (`flowlock.service.routes`). The FastAPI routes stay
declared: they make the OpenAPI document and answer whatever this layer passes on (HEAD,
a trailing slash, any other path). docs/service.md ("How a request is served") says more.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette._utils import get_route_path
from starlette.datastructures import URL
from starlette.requests import ClientDisconnect

from flowlock.core.errors import FlowlockError
from flowlock.engine import Engine
from flowlock.service.bodies import CreateBody, FireBody, parse_json
from flowlock.service.handlers import answer_error, answer_problem
from flowlock.service.problems import Problem
from flowlock.service.routes import (
    Answer,
    _idempotency_key,
    _if_match,
    create_answer,
    fire_answer,
    get_answer,
)
from flowlock.service.settings import ServiceSettings

__all__ = ["FastRoutes", "encode_json"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_JSON_TYPE = (b"content-type", b"application/json")
# The headers a hot route reads; every other one is skipped in the one pass over them.
_WANTED = frozenset({b"if-match", b"idempotency-key", b"content-type"})


def encode_json(body: dict[str, Any]) -> bytes:
    """`body` as Starlette's JSONResponse encodes it: compact, UTF-8, no NaN."""
    return json.dumps(
        body, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    ).encode("utf-8")


def _headers(scope: Scope) -> dict[bytes, str]:
    """The wanted headers, the first of each name, decoded as Starlette decodes them."""
    found: dict[bytes, str] = {}
    for name, value in scope["headers"]:
        if name in _WANTED and name not in found:
            found[name] = value.decode("latin-1")
    return found


async def _body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


class FastRoutes:
    """ASGI middleware answering `POST /instances`, `GET /instances/{id}` and
    `POST /instances/{id}/events/{event}` itself; everything else goes on to `app`.

    A Problem or a flowlock error becomes the same problem answer the FastAPI handlers send;
    any other exception goes up to the app's server-error handler, as from a route.
    """

    def __init__(self, app: ASGIApp, *, engine: Engine, settings: ServiceSettings) -> None:
        self.app = app
        self.engine = engine
        self.depth = settings.max_json_depth
        self.require_if_match = settings.require_if_match

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method = scope["method"]
        path = get_route_path(scope)
        parts = path.split("/")
        # The same matches as the routes' patterns: each {name} is one non-empty segment.
        if len(parts) < 3 or parts[1] != "instances" or not parts[2]:
            if method == "POST" and path == "/instances":
                await self._answer(scope, send, self._create(scope, receive))
                return
        elif method == "GET" and len(parts) == 3:
            await self._answer(scope, send, get_answer(self.engine, parts[2]))
            return
        elif method == "POST" and len(parts) == 5 and parts[3] == "events" and parts[4]:
            await self._answer(scope, send, self._fire(scope, receive, parts[2], parts[4]))
            return
        await self.app(scope, receive, send)

    async def _create(self, scope: Scope, receive: Receive) -> Answer:
        headers = _headers(scope)
        key = _idempotency_key(headers.get(b"idempotency-key"))
        raw = await _body(receive)
        body = parse_json(
            raw, headers.get(b"content-type", ""), CreateBody, self.depth, empty_ok=False
        )
        return await create_answer(self.engine, key, body)

    async def _fire(self, scope: Scope, receive: Receive, instance_id: str, event: str) -> Answer:
        headers = _headers(scope)
        expected = _if_match(headers.get(b"if-match"), self.require_if_match)
        key = _idempotency_key(headers.get(b"idempotency-key"))
        raw = await _body(receive)
        media = headers.get(b"content-type", "")
        body = parse_json(raw, media, FireBody, self.depth, empty_ok=True)
        state = scope.get("state")
        principal = state.get("principal") if state is not None else None
        return await fire_answer(
            self.engine,
            instance_id,
            event,
            body,
            expected=expected,
            key=key,
            principal=principal,
        )

    async def _answer(self, scope: Scope, send: Send, call: Awaitable[Answer]) -> None:
        extra: list[tuple[bytes, bytes]] = []  # an error's headers carry their own type
        try:
            answer = await call
        except Problem as found:
            status, content, headers = answer_problem(found, URL(scope=scope).path)
        except FlowlockError as exc:
            status, content, headers = answer_error(exc, URL(scope=scope).path)
        else:
            content = encode_json(answer.body)
            status, headers = answer.status, answer.headers
            extra.append(_JSON_TYPE)
        raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        raw.append((b"content-length", str(len(content)).encode()))
        raw += extra
        await send({"type": "http.response.start", "status": status, "headers": raw})
        await send({"type": "http.response.body", "body": content})
