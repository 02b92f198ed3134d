"""The console's sessions and CSRF tokens: signed cookies, no server-side state.

A session is `payload.signature`, both base64url: the payload is JSON with the principal, the
scope, the expiry (Unix seconds) and a random nonce; the signature is HMAC-SHA256 under a key
derived from every configured token. Every worker derives the same key, so any worker accepts
a session another made; changing any token changes the key, which ends every session. A CSRF
token is an HMAC of the session's nonce, so it is good for that session only. docs/console.md
says why each choice.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass

from flowlock.service.guard import find_token
from flowlock.service.settings import ApiToken

__all__ = ["OPEN_PRINCIPAL", "SESSION_SECONDS", "Keys", "Session"]

SESSION_SECONDS = 8 * 3600
"""How long a login lasts: a working day. Log in again after it."""
LOGIN_SECONDS = 600
"""How long a login form stays usable (its CSRF cookie)."""
OPEN_PRINCIPAL = "console"
"""The actor of a console action when the service has no tokens (the console is open)."""


@dataclass(frozen=True, slots=True)
class Session:
    """Who is logged in, with what scope, until when (Unix seconds), and the nonce the
    session's CSRF token is bound to."""

    principal: str
    scope: str
    expires: int
    nonce: str


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Keys:
    """Signs and checks sessions and CSRF tokens for one set of tokens.

    Without tokens the key is a constant: a session then proves nothing about who holds it (the
    console is open), but its nonce is still random and secret to the browser (an HttpOnly,
    SameSite=Strict cookie), which is what CSRF protection rests on.
    """

    def __init__(self, tokens: tuple[ApiToken, ...]) -> None:
        self.tokens = tokens
        material = b"\x00".join(
            sorted(t.principal.encode() + b"\x01" + t.secret + b"\x01" + t.scope.encode()
                   for t in tokens)
        )  # fmt: skip
        self._key = hmac.new(b"flowlock console session v1", material, hashlib.sha256).digest()

    @property
    def open(self) -> bool:
        """Whether the console needs no login (the service has no tokens)."""
        return not self.tokens

    def check_secret(self, given: str) -> ApiToken | None:
        """The token whose secret is `given`, compared in constant time with every token."""
        return find_token(self.tokens, given.strip().encode())

    def _sign(self, purpose: bytes, body: bytes) -> bytes:
        return hmac.new(self._key, purpose + b"\x00" + body, hashlib.sha256).digest()

    def issue(
        self, principal: str, scope: str, seconds: int = SESSION_SECONDS
    ) -> tuple[str, Session]:
        """A new session for `principal` and the cookie value that carries it."""
        session = Session(principal, scope, int(time.time()) + seconds, secrets.token_urlsafe(16))
        body = json.dumps(
            {"p": session.principal, "s": session.scope, "e": session.expires, "n": session.nonce},
            separators=(",", ":"),
        ).encode()
        return f"{_b64(body)}.{_b64(self._sign(b'session', body))}", session

    def _verified(self, cookie: str | None, purpose: bytes, most: int) -> bytes | None:
        """The body of a signed cookie (`<body>.<signature>`, both base64) signed for
        `purpose` with this key, or None when it is missing, malformed, too long or forged."""
        if not cookie or cookie.count(".") != 1 or len(cookie) > most:
            return None
        head, tail = cookie.split(".")
        try:
            body, signature = _unb64(head), _unb64(tail)
        except (binascii.Error, ValueError):
            return None
        if not hmac.compare_digest(signature, self._sign(purpose, body)):
            return None
        return body

    def read(self, cookie: str | None) -> Session | None:
        """The session `cookie` carries, or None when it is missing, forged, from another key
        (a token changed) or expired."""
        body = self._verified(cookie, b"session", 4096)
        if body is None:
            return None
        try:
            fields = json.loads(body)
            session = Session(
                str(fields["p"]), str(fields["s"]), int(fields["e"]), str(fields["n"])
            )
        except (ValueError, KeyError, TypeError):
            return None
        return session if session.expires > time.time() else None

    def csrf(self, nonce: str) -> str:
        """The CSRF token of the session (or login form) whose nonce is `nonce`."""
        return _b64(self._sign(b"csrf", nonce.encode()))

    def csrf_ok(self, nonce: str, given: str | None) -> bool:
        """Whether `given` is the CSRF token for `nonce` (constant time)."""
        if not given:
            return False
        return hmac.compare_digest(given.encode(), self.csrf(nonce).encode())

    def login_nonce(self) -> str:
        """The value of a login form's cookie: a nonce and its expiry, signed."""
        body = f"{secrets.token_urlsafe(16)}:{int(time.time()) + LOGIN_SECONDS}".encode()
        return f"{_b64(body)}.{_b64(self._sign(b'login', body))}"

    def read_login_nonce(self, cookie: str | None) -> str | None:
        """The nonce of a login form's cookie, or None when it is missing, forged or stale."""
        body = self._verified(cookie, b"login", 512)
        if body is None:
            return None
        nonce, _, expires = body.decode(errors="replace").rpartition(":")
        if not expires.isdigit() or int(expires) <= time.time():
            return None
        return nonce
