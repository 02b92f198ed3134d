"""The console's Jinja2 environment (templates are package data) and how a page is answered.

Every page is HTML with a strict Content-Security-Policy (scripts, styles and images from the
console's own static files only), no caching, and no framing.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from fastapi import Request
from fastapi.responses import HTMLResponse
from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.responses import Response

__all__ = ["HEADERS", "render", "set_cookie"]

HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "X-Frame-Options": "DENY",
}


def _when(moment: datetime | None) -> str:
    if moment is None:
        return "—"
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _ago(moment: datetime | None) -> str:
    if moment is None:
        return ""
    seconds = (datetime.now(UTC) - moment).total_seconds()
    if seconds < 0:
        return "in the future"
    for unit, size in (("d", 86_400), ("h", 3_600), ("min", 60)):
        if seconds >= size:
            return f"{seconds // size:.0f} {unit} ago"
    return f"{seconds:.0f} s ago"


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str)


def _environment() -> Environment:
    env = Environment(
        loader=PackageLoader("flowlock.service.console", "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["when"] = _when
    env.filters["ago"] = _ago
    env.filters["pretty"] = _pretty
    return env


_ENV = _environment()


def render(
    request: Request,
    template: str,
    context: Mapping[str, Any],
    *,
    status: int = 200,
    cookies: Mapping[str, tuple[str, int]] | None = None,
) -> HTMLResponse:
    """`template` rendered with `context` (plus `request`), as an HTML response.

    `cookies` maps a name to (value, max_age); each is set HttpOnly, SameSite=Strict, on path
    /ui, and Secure when the request came over https."""
    html = _ENV.get_template(template).render({"request": request, **context})
    response = HTMLResponse(html, status_code=status, headers=HEADERS)
    for name, (value, max_age) in (cookies or {}).items():
        set_cookie(response, request, name, value, max_age)
    return response


def set_cookie(response: Response, request: Request, name: str, value: str, max_age: int) -> None:
    """Set cookie `name` as every console cookie is set (see `render`)."""
    response.set_cookie(
        name,
        value,
        max_age=max_age,
        path="/ui",
        secure=request.url.scheme == "https",
        httponly=True,
        samesite="strict",
    )
