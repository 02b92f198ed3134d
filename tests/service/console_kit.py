"""What the console's in-process tests share: a logged-in client, its CSRF token, and form
posts the way a browser makes them."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx

from flowlock.service import ServiceSettings
from flowlock.service.settings import parse_tokens
from service.kit import Service, served

OPS = "ops-secret-0123456789abcdef"
VIEWER = "viewer-secret-0123456789ab"
WRITER = "writer-secret-0123456789ab"
TOKENS = f"ops:{OPS}:admin,viewer:{VIEWER}:read,app:{WRITER}:write"
FORM = {"content-type": "application/x-www-form-urlencoded"}
_CSRF = re.compile(r'name="csrf" value="([^"]+)"')


def csrf_of(html: str) -> str:
    """The CSRF token a console page's forms carry."""
    found = _CSRF.search(html)
    assert found is not None, html[:2000]
    return found.group(1)


async def log_in(client: httpx.AsyncClient, secret: str) -> str:
    """Log `client` in with `secret` through the login form; the session's CSRF token."""
    form = await client.get("/ui/login")
    assert form.status_code == 200, form.text
    done = await client.post(
        "/ui/login", data={"csrf": csrf_of(form.text), "secret": secret, "next": "/ui/"}
    )
    assert done.status_code == 303, done.text
    assert done.headers["location"] == "/ui/"
    page = await client.get("/ui/")
    assert page.status_code == 200, page.text
    return csrf_of(page.text)


@asynccontextmanager
async def console(
    tokens: str | None = TOKENS, base_url: str = "http://127.0.0.1"
) -> AsyncIterator[Service]:
    """The app with `tokens` (None: no tokens, an open console) on the memory store."""
    settings = ServiceSettings(api_tokens=parse_tokens(tokens) if tokens else ())
    async with served(settings) as svc:
        if base_url != "http://127.0.0.1":
            svc.client.base_url = httpx.URL(base_url)
        yield svc
