"""Every error a request raises, answered as an RFC 9457 problem."""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from flowlock.core.errors import FlowlockError
from flowlock.http import HttpProblem
from flowlock.http import problem as http_problem
from flowlock.service.bodies import invalid_fields
from flowlock.service.problems import PROBLEM_JSON, Problem, problem


def answer_problem(found: Problem, path: str) -> tuple[int, bytes, dict[str, str]]:
    """A Problem raised while answering the request for `path`: status, body and headers."""
    headers = {"Content-Type": PROBLEM_JSON, **found.headers}
    return _encoded(HttpProblem(found.status, found.body(path), headers))


def answer_error(exc: BaseException, path: str) -> tuple[int, bytes, dict[str, str]]:
    """Any other error (logged in full by the one mapping): status, body and headers."""
    return _encoded(http_problem(exc, path))


def _encoded(found: HttpProblem) -> tuple[int, bytes, dict[str, str]]:
    # ASCII escapes: a member may echo a client's lone surrogate, which UTF-8 cannot encode.
    return found.status, json.dumps(found.body, default=str).encode(), found.headers


def _problem_response(found: Problem, request: Request) -> Response:
    return _response(answer_problem(found, request.url.path))


def _response(answer: tuple[int, bytes, dict[str, str]]) -> Response:
    status, body, headers = answer
    return Response(body, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    async def on_problem(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, Problem)
        return _problem_response(exc, request)

    async def on_error(request: Request, exc: Exception) -> Response:
        # A flowlock error, or a crash: the one mapping logs it in full and answers safely.
        return _response(answer_error(exc, request.url.path))

    async def on_invalid(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return _problem_response(invalid_fields(list(exc.errors())), request)

    async def on_http(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        titles = {404: "Not found", 405: "Method not allowed"}
        title = titles.get(exc.status_code, "HTTP error")
        detail = (
            f"no route {request.method} {request.url.path}; see GET /docs"
            if exc.status_code in titles
            else str(exc.detail)
        )
        found = problem(
            exc.status_code, title.lower().replace(" ", "-"), title, detail, exc.headers
        )
        return _problem_response(found, request)

    app.add_exception_handler(Problem, on_problem)
    app.add_exception_handler(FlowlockError, on_error)
    app.add_exception_handler(RequestValidationError, on_invalid)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_error)
