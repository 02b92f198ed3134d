"""What every request meets before a route sees it: its host, tokens, scopes and body size.

A plain ASGI middleware, so it runs before FastAPI reads the body. When tokens are set,
every request but the probes needs a bearer token whose scope covers the request
([`needed_scope`][flowlock.service.guard.needed_scope]). Tokens compare in constant time.
Without tokens (and without `insecure`), a request whose Host header is not a loopback name or
address is refused: a web page could otherwise reach the service through DNS rebinding.
Oversized bodies get 413. Refusals are RFC 9457 problems, and never touch the database.
The rules are in docs/operations.md ("Access: tokens and scopes").
"""

from __future__ import annotations

import functools
import hmac
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from flowlock.service.problems import PROBLEM_JSON, Problem, problem
from flowlock.service.server import is_loopback
from flowlock.service.settings import ApiToken

__all__ = [
    "ADMIN_PREFIX",
    "CONSOLE_PREFIX",
    "OPEN_PATHS",
    "RequestGuard",
    "find_token",
    "loopback_host",
    "needed_scope",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/livez", "/readyz"})
"""Answered without a token: an orchestrator's probes carry none."""
ADMIN_PREFIX = "/admin"
"""Every path under it needs the admin scope, whatever the method."""
CONSOLE_PREFIX = "/ui"
"""The console's: it checks its own session cookie, so the guard lets it through."""
METRICS_PATH = "/metrics"
_READS = frozenset({"GET", "HEAD"})
_WHY = {
    "admin": "every path under /admin/ needs admin",
    "write": "a request that is not GET or HEAD needs write",
    "read": "a GET or HEAD needs read",
}


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + "/")


def needed_scope(method: str, path: str, *, open_metrics: bool = False) -> str | None:
    """The scope a request needs when the service has tokens, or None when it needs none.

    None: the probes, `/metrics` when opened, and the console's paths (which check their
    own session). Else `admin` under `/admin/`, `read` for GET and HEAD, `write` for the rest.
    """
    # A doubled slash reaches no route, but is judged as the path it looks like all the same.
    while "//" in path:
        path = path.replace("//", "/")
    if path in OPEN_PATHS or _under(path, CONSOLE_PREFIX):
        return None
    if path == METRICS_PATH and open_metrics:
        return None
    if _under(path, ADMIN_PREFIX):
        return "admin"
    return "read" if method.upper() in _READS else "write"


@functools.lru_cache(maxsize=256)
def loopback_host(host: str) -> bool:
    """Whether a Host header names a loopback host: `localhost`, an address of 127.0.0.0/8,
    or `[::1]`, with or without a port (a trailing dot allowed).

    Cached: a service sees few Host values, and parsing an address costs more than the rest
    of the guard."""
    text = host.strip()
    if text.startswith("["):
        inside, closed, rest = text[1:].partition("]")
        port_ok = not rest or (rest.startswith(":") and rest[1:].isdigit())
        return bool(closed) and port_ok and is_loopback(inside)
    name, colon, port = text.rpartition(":")
    if colon and ":" not in name:  # name:port (a bare IPv6 address has several colons)
        if not port.isdigit():
            return False
        text = name
    return bool(text) and is_loopback(text.removesuffix("."))


def _host(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"host":
            return str(value.decode("latin-1"))
    return None


def _untrusted_host(host: str | None) -> Problem:
    said = "no Host header" if host is None else f"Host {host[:200]!r}"
    return problem(
        403, "untrusted-host", "Untrusted host",
        f"this service has no token, so it answers only requests addressed to a loopback name "
        f"or address (localhost, 127.0.0.1, [::1]); this one came with {said}, which a web "
        "page can send through DNS rebinding. Use a loopback address, or set "
        "FLOWLOCK_API_TOKEN (or start with --insecure when a proxy in front controls who "
        "reaches the service)",
    )  # fmt: skip


def find_token(tokens: tuple[ApiToken, ...], secret: bytes) -> ApiToken | None:
    """The token whose secret is `secret`, or None; in constant time over every token.

    The guard checks bearer headers with it; the console's login checks a typed token alike.
    """
    found: ApiToken | None = None
    for token in tokens:
        # Every token is compared, whatever matched before: no early exit to time.
        if hmac.compare_digest(secret, token.secret):
            found = token
    return found


class _TooLarge(Exception):
    pass


def _unauthorized(detail: str) -> Problem:
    return problem(
        401, "unauthorized", "Authentication required", detail,
        {"WWW-Authenticate": 'Bearer realm="flowlock"'},
    )  # fmt: skip


def _insufficient(token: ApiToken, needed: str) -> Problem:
    # RFC 6750's error code, so a generic client learns the scope it lacks from the header too.
    challenge = f'Bearer realm="flowlock", error="insufficient_scope", scope="{needed}"'
    return problem(
        403, "insufficient-scope", "Insufficient scope",
        f"this request needs a token with scope {needed} ({_WHY[needed]}); the token of "
        f"{token.principal!r} has scope {token.scope}. Scopes: read < write < admin; use a "
        "token with the scope needed",
        {"WWW-Authenticate": challenge},
        needed=needed, scope=token.scope, principal=token.principal,
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
    """Tokens and scopes (when any token is set), then the body's size, for every request.

    A request let through carries its token's principal and scope in the ASGI scope's state
    (`request.state.principal`, `request.state.scope`): routes make the principal the actor.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        tokens: tuple[ApiToken, ...],
        max_body: int,
        open_metrics: bool = False,
        insecure: bool = False,
    ) -> None:
        self.app = app
        self.tokens = tokens
        self.max_body = max_body
        self.open_metrics = open_metrics
        self.insecure = insecure

    def token(self, scope: Scope) -> ApiToken | Problem:
        """The token the request's Authorization header carries, or the 401 to answer."""
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
        found = find_token(self.tokens, credential.strip())
        if found is None:
            return _unauthorized("the bearer token is not valid for this service")
        return found

    def admit(self, scope: Scope) -> Problem | None:
        """None when the request may go on (its token recorded in its state), else the refusal."""
        if not self.tokens:
            # No token: the only wall is that the caller is on this machine. A browser on it
            # may be driven by a page whose name resolves to 127.0.0.1 (DNS rebinding): its
            # requests then carry that name as their Host, which is how they are told apart.
            host = _host(scope)
            if self.insecure or (host is not None and loopback_host(host)):
                return None
            return _untrusted_host(host)
        method = scope.get("method", "GET")  # a WebSocket handshake is a GET
        needed = needed_scope(method, scope.get("path", "/"), open_metrics=self.open_metrics)
        if needed is None:
            return None
        found = self.token(scope)
        if isinstance(found, Problem):
            return found
        if not found.allows(needed):
            return _insufficient(found, needed)
        state = scope.setdefault("state", {})
        state["principal"] = found.principal
        state["scope"] = found.scope
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            if self.admit(scope) is not None:
                # Refused before the handshake is accepted: the server answers it with 403.
                await receive()
                await send({"type": "websocket.close", "code": 1008})
                return
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refused = self.admit(scope)
        if refused is not None:
            await send_problem(send, refused, scope.get("path"))
            return
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


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
