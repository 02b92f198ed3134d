"""What every request meets before a route sees it: tokens and body size.

A plain ASGI middleware, so it runs before FastAPI reads the body. Mutating requests need
a bearer token when tokens are set; tokens compare in constant time. Oversized bodies get
413. Refusals are RFC 9457 problems, and never touch the database.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from flowlock.service.problems import PROBLEM_JSON, Problem, problem
from flowlock.service.settings import ApiToken

__all__ = ["RequestGuard"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})


class _TooLarge(Exception):
    pass


def _unauthorized(detail: str) -> Problem:
    return problem(
        401, "unauthorized", "Authentication required", detail,
        {"WWW-Authenticate": 'Bearer realm="flowlock"'},
    )  # fmt: skip


def _too_large(limit: int) -> Problem:
    return problem(
        413, "request-too-large", "Request body too large",
        f"the request body is over {limit} bytes, the most this service accepts",
        limit=limit,
    )  # fmt: skip


async def send_problem(send: Send, found: Problem, path: str | None = None) -> None:
    body = found.encode(path)
    headers = [
        (b"content-type", PROBLEM_JSON.encode()),
        (b"content-length", str(len(body)).encode()),
        *((k.lower().encode(), v.encode()) for k, v in found.headers.items()),
    ]
    await send({"type": "http.response.start", "status": found.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RequestGuard:
    def __init__(self, app: ASGIApp, *, tokens: tuple[ApiToken, ...], max_body: int) -> None:
        self.app = app
        self.tokens = tokens
        self.max_body = max_body

    def principal(self, scope: Scope) -> str | Problem:
        header = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                header = value
                break
        scheme, _, credential = header.partition(b" ")
        if not header:
            return _unauthorized("this request needs an Authorization: Bearer <token> header")
        if scheme.lower() != b"bearer" or not credential.strip():
            return _unauthorized("the Authorization header must be 'Bearer <token>'")
        credential = credential.strip()
        found: str | None = None
        for token in self.tokens:
            # Every token is compared, whatever matched before: no early exit to time.
            if hmac.compare_digest(credential, token.secret):
                found = token.principal
        if found is None:
            return _unauthorized("the bearer token is not valid for this service")
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.tokens and scope["method"] in _MUTATING and not _console(scope):
            who = self.principal(scope)
            if isinstance(who, Problem):
                await send_problem(send, who, scope.get("path"))
                return
            scope.setdefault("state", {})["principal"] = who
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body:
            await send_problem(send, _too_large(self.max_body), scope.get("path"))
            return
        await self._bounded(scope, receive, send)

    async def _bounded(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The app, with a body that stops at `max_body` bytes.

        A chunked upload that declared no length gets 413 if the app has not answered yet.
        """
        seen = 0
        started = False
        limit = self.max_body

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _TooLarge
            return message

        async def tracked(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except _TooLarge:
            if not started:
                await send_problem(send, _too_large(limit), scope.get("path"))


def _console(scope: Scope) -> bool:
    """Whether the request is the console's: /ui checks its own session cookie and CSRF token
    (flowlock.service.console), not a bearer token."""
    path: str = scope.get("path", "")
    return path == "/ui" or path.startswith("/ui/")


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
