"""Who may see the console and post its forms: the login page, sessions and CSRF checks.

With tokens, every page but the login page and the static files needs a session cookie, made
by logging in with a token's secret. Every form posts a CSRF token bound to the session, and a
post from another origin is refused. Without tokens the console is open (the service then
listens on loopback only) and each browser gets a session of its own on its first page, so its
forms are still protected against cross-site posts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, quote, urlsplit

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from starlette.responses import Response

from flowlock.service.console.render import HEADERS, render, set_cookie
from flowlock.service.console.session import (
    LOGIN_SECONDS,
    OPEN_PRINCIPAL,
    SESSION_SECONDS,
    Keys,
    Session,
)
from flowlock.service.settings import scope_allows

__all__ = ["SESSION_COOKIE", "Gate", "LoginNeeded", "Refused", "install_login"]

SESSION_COOKIE = "flowlock_session"
LOGIN_COOKIE = "flowlock_login"
_MAX_FORM = 64 * 1024


class LoginNeeded(Exception):
    """The request has no valid session (none, forged, expired, or a token changed)."""


class Refused(Exception):
    """A post the console will not act on: no CSRF token, a wrong one, another origin, or a
    scope too small. Answered 403; nothing was changed."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


async def read_form(request: Request) -> dict[str, str]:
    """An urlencoded form body (the console's forms post nothing else), first value of each."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/x-www-form-urlencoded":
        raise Refused("the console's forms post application/x-www-form-urlencoded")
    body = await request.body()
    if len(body) > _MAX_FORM:
        raise Refused(f"a console form is at most {_MAX_FORM} bytes")
    form: dict[str, str] = {}
    for name, value in parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True):
        form.setdefault(name, value)
    return form


def _same_origin(request: Request) -> bool:
    """False when the browser says the post comes from another origin (Origin header)."""
    origin = request.headers.get("origin")
    if origin is None or origin == "null":
        return origin is None
    return urlsplit(origin).netloc == request.headers.get("host", "")


def _safe_next(target: str | None) -> str:
    """Where to go after logging in: a console path, never another host."""
    if target and target.startswith("/ui/") and not target.startswith("//"):
        return target
    return "/ui/"


class Gate:
    """Checks sessions and CSRF tokens for the console's routes."""

    def __init__(self, keys: Keys) -> None:
        self.keys = keys

    def session(self, request: Request) -> Session:
        """The request's session; LoginNeeded without one. An open console makes one."""
        found = self.keys.read(request.cookies.get(SESSION_COOKIE))
        if found is not None:
            return found
        if self.keys.open:
            cookie, made = self.keys.issue(OPEN_PRINCIPAL, "admin")
            request.state.console_cookie = cookie
            return made
        raise LoginNeeded

    async def post(
        self, request: Request, *, scope: str | None = None
    ) -> tuple[Session, dict[str, str]]:
        """The session and form of a post the console may act on; Refused otherwise."""
        session = self.session(request)
        if not _same_origin(request):
            raise Refused("this form was posted from another origin")
        form = await read_form(request)
        if not self.keys.csrf_ok(session.nonce, form.get("csrf")):
            raise Refused(
                "the form's CSRF token is missing or not this session's; reload the page and "
                "submit the form again"
            )
        if scope is not None and not scope_allows(session.scope, scope):
            raise Refused(
                f"this needs a token with the {scope} scope; {session.principal!r} has "
                f"{session.scope}"
            )
        return session, form

    def context(self, request: Request, session: Session) -> dict[str, Any]:
        """What every page's template needs about the session."""
        return {
            "who": session,
            "csrf": self.keys.csrf(session.nonce),
            "open": self.keys.open,
            "can_admin": scope_allows(session.scope, "admin"),
        }


def respond(
    request: Request, template: str, context: Mapping[str, Any], status: int = 200
) -> HTMLResponse:
    """`render`, plus the session cookie an open console made for this request."""
    response = render(request, template, context, status=status)
    made = getattr(request.state, "console_cookie", None)
    if made is not None:
        set_cookie(response, request, SESSION_COOKIE, made, SESSION_SECONDS)
    return response


def install_login(app: FastAPI, gate: Gate) -> None:
    """The login and logout routes, and the answers to LoginNeeded and Refused."""
    keys = gate.keys

    async def on_login_needed(request: Request, exc: Exception) -> Response:
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        login = f"/ui/login?next={quote(target, safe='')}"
        if request.headers.get("hx-request") or request.method != "GET":
            page = render(
                request, "error.html",
                {"title": "Log in first", "detail": "Your session has ended or never began.",
                 "login": login, "who": None},
                status=401,
            )  # fmt: skip
            page.headers["HX-Redirect"] = login
            return page
        return RedirectResponse(login, status_code=303, headers=HEADERS)

    async def on_refused(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, Refused)
        context = {"title": "Refused", "detail": exc.detail, "who": None}
        return render(request, "error.html", context, status=403)

    app.add_exception_handler(LoginNeeded, on_login_needed)
    app.add_exception_handler(Refused, on_refused)

    def login_page(request: Request, error: str | None, status: int) -> HTMLResponse:
        nonce_cookie = keys.login_nonce()
        nonce = keys.read_login_nonce(nonce_cookie)
        assert nonce is not None
        context = {
            "error": error,
            "csrf": keys.csrf("login:" + nonce),
            "next": _safe_next(request.query_params.get("next")),
            "who": None,
        }
        return render(
            request, "login.html", context, status=status,
            cookies={LOGIN_COOKIE: (nonce_cookie, LOGIN_SECONDS)},
        )  # fmt: skip

    @app.get("/ui/login", include_in_schema=False)
    async def login_form(request: Request) -> Response:
        if keys.open:
            return RedirectResponse("/ui/", status_code=303, headers=HEADERS)
        return login_page(request, None, 200)

    @app.post("/ui/login", include_in_schema=False)
    async def login(request: Request) -> Response:
        if keys.open:
            return RedirectResponse("/ui/", status_code=303, headers=HEADERS)
        if not _same_origin(request):
            raise Refused("the login form was posted from another origin")
        form = await read_form(request)
        nonce = keys.read_login_nonce(request.cookies.get(LOGIN_COOKIE))
        if nonce is None or not keys.csrf_ok("login:" + nonce, form.get("csrf")):
            return login_page(request, "The login form expired; enter the token again.", 403)
        token = keys.check_secret(form.get("secret", ""))
        if token is None:
            return login_page(request, "That token is not valid for this service.", 401)
        cookie, _ = keys.issue(token.principal, token.scope)
        response = RedirectResponse(_safe_next(form.get("next")), status_code=303, headers=HEADERS)
        set_cookie(response, request, SESSION_COOKIE, cookie, SESSION_SECONDS)
        response.delete_cookie(LOGIN_COOKIE, path="/ui", httponly=True, samesite="strict")
        return response

    @app.post("/ui/logout", include_in_schema=False)
    async def logout(request: Request) -> Response:
        await gate.post(request)
        target = "/ui/" if keys.open else "/ui/login"
        response = RedirectResponse(target, status_code=303, headers=HEADERS)
        response.delete_cookie(SESSION_COOKIE, path="/ui", httponly=True, samesite="strict")
        return response
