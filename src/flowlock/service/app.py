"""The HTTP service: ``create_app(settings)`` builds the FastAPI app ``flowlock serve`` runs.

One engine per worker process, opened by the app's lifespan and closed by it (after uvicorn has
drained the requests in flight). Routes translate HTTP to the engine's API and back, nothing
more: ``If-Match`` is ``expected_version``, ``Idempotency-Key`` is ``request_id``, the ETag is the
version, and every flowlock error becomes its problem (:mod:`flowlock.service.problems`).

A retried request (same ``Idempotency-Key``) gets the first response again, byte for byte: the
engine answers a repeated request id with the instance as the first application left it
(``Outcome.replayed``), and the body is built from that alone, so it is the same in every
worker, also while the first request is still running in another one (the engine makes the
retry wait for it). ``Idempotent-Replayed: true`` marks the replay; how the retry ran (strategy,
attempts, batch size) is in ``Flowlock-*`` headers, never in the body.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import flowlock
from flowlock._inspect import entry_dict, instance_dict
from flowlock.core.definition import Workflow
from flowlock.core.diagram import load_workflows
from flowlock.core.errors import FlowlockError, InvalidInput
from flowlock.core.models import Instance, Outcome
from flowlock.core.query import decode_cursor
from flowlock.core.settings import check_text
from flowlock.engine import MAX_ID_LENGTH, Engine, connect
from flowlock.examples import approval, countersign, inventory
from flowlock.metrics import Metrics
from flowlock.service.bodies import CreateBody, FireBody, invalid_fields, read_json
from flowlock.service.guard import RequestGuard
from flowlock.service.problems import PROBLEM_JSON, Problem, etag, from_error, problem
from flowlock.service.responses import (
    DefinitionList,
    DefinitionOut,
    Fired,
    HistoryPage,
    InstanceOut,
    InstancePage,
    Live,
    Ready,
)
from flowlock.service.settings import ServiceSettings

__all__ = ["app_from_env", "create_app", "default_workflows"]

log = logging.getLogger("flowlock.service")

READY_TIMEOUT = 2.0
"""Seconds /readyz gives each backend to answer."""
MAX_PAGE = 1000


def default_workflows() -> list[Workflow]:
    """What ``flowlock serve`` serves without ``--app``: approval, countersign (quorum 3) and
    inventory, the seed article's three cases."""
    return [approval(), countersign(3), inventory()]


def _engine(settings: ServiceSettings, metrics: Metrics) -> Engine:
    return connect(
        settings.database_url,
        redis_url=settings.redis_url,
        max_size=settings.pool_size,
        strategy=settings.strategy,
        schema=settings.schema,
        metrics=metrics,
    )


def create_app(
    settings: ServiceSettings | None = None, *, workflows: Sequence[Workflow] | None = None
) -> FastAPI:
    """The service over ``settings`` (default: an in-memory store), serving ``workflows`` (default:
    those ``settings.app`` names, else :func:`default_workflows`). Misconfiguration raises
    InvalidInput here, before anything is opened."""
    settings = settings if settings is not None else ServiceSettings()
    served = list(workflows) if workflows is not None else _served(settings.app)
    metrics = Metrics(CollectorRegistry())
    engine = _engine(settings, metrics)
    probes = _Probes()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async with engine:
            for wf in served:
                await engine.register(wf)
            try:
                yield
            finally:
                probes.cancel()

    app = FastAPI(
        title="flowlock",
        version=flowlock.__version__,
        summary="Workflow instances whose every transition is applied exactly once.",
        lifespan=lifespan,
        responses={"default": {"description": "An RFC 9457 problem", "content": _PROBLEM_DOC}},
    )
    app.state.engine = engine
    app.state.settings = settings
    app.state.metrics = metrics
    _errors(app)
    _routes(app, engine, settings, metrics, probes)
    app.add_middleware(RequestGuard, tokens=settings.api_tokens, max_body=settings.max_body_bytes)
    return app


def app_from_env() -> FastAPI:
    """The app the ``FLOWLOCK_*`` variables describe (uvicorn's factory in each worker)."""
    return create_app(ServiceSettings.from_env(os.environ))


def _served(reference: str | None) -> list[Workflow]:
    return load_workflows(reference) if reference else default_workflows()


_PROBLEM_DOC: dict[str, Any] = {
    PROBLEM_JSON: {
        "schema": {
            "type": "object",
            "properties": {
                "type": {"type": "string"},
                "title": {"type": "string"},
                "status": {"type": "integer"},
                "detail": {"type": "string"},
                "instance": {"type": "string"},
            },
            "required": ["type", "title", "status", "detail"],
        }
    }
}


def _header(description: str, *, required: bool = True, **schema: Any) -> dict[str, Any]:
    return {
        "description": description,
        "required": required,
        "schema": {"type": "string", **schema},
    }


_ETAG = _header('The instance\'s version, quoted ("3"): send it back as If-Match.')
_CREATED_HEADERS = {
    "ETag": _ETAG,
    "Location": _header(
        "The new instance's path (its id percent-encoded).", format="uri-reference"
    ),
}
_FIRED_HEADERS = {
    "ETag": _ETAG,
    "Idempotent-Replayed": _header(
        "true when this is a retry answered with the first response", required=False, enum=["true"]
    ),
    "Flowlock-Strategy": _header("The strategy that ran this call."),
    "Flowlock-Attempts": _header("Attempts this call took.", pattern="^[0-9]+$"),
    "Flowlock-Batch-Size": _header("Calls committed together with this one.", pattern="^[0-9]+$"),
}


# What _if_match and _idempotency_key accept, for the document only (each checks it itself and
# answers 400 with its own problem): so that generated clients and tests send valid ones.
_IF_MATCH_DOC: dict[str, Any] = {
    "description": 'The ETag of the version the decision was made on ("3"), or *.',
    "pattern": '^ *(\\*|(W/)?"[1-9][0-9]{0,17}"|[1-9][0-9]{0,17}) *$',
}
_KEY_DOC: dict[str, Any] = {
    "description": "The request's id: a retry with the same key gets the first answer again.",
    "minLength": 1,
    "maxLength": MAX_ID_LENGTH,
    "pattern": "^[^\\x00-\\x1f\\x7f-\\x9f]+$",
}


def _ok(
    model: type[Any],
    description: str,
    status: int = 200,
    headers: dict[str, dict[str, Any]] | None = None,
) -> dict[int | str, dict[str, Any]]:
    """The documented success answer of a route: its body's model and its headers. Declared with
    ``responses=`` and ``response_model=None``: the document only, never a check on the body."""
    doc: dict[str, Any] = {"model": model, "description": description}
    if headers:
        doc["headers"] = headers
    return {status: doc}


# -- errors ------------------------------------------------------------------------------------


def _problem_response(found: Problem, request: Request) -> Response:
    return Response(
        found.encode(request.url.path),
        status_code=found.status,
        media_type=PROBLEM_JSON,
        headers=dict(found.headers),
    )


def _errors(app: FastAPI) -> None:
    async def on_problem(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, Problem)
        return _problem_response(exc, request)

    async def on_flowlock(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, FlowlockError)
        found = from_error(exc)
        if found.status >= 500:
            log.warning("%s %s: %r", request.method, request.url.path, exc)
        return _problem_response(found, request)

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

    async def on_crash(request: Request, exc: Exception) -> Response:
        log.exception("%s %s failed", request.method, request.url.path)
        found = problem(500, "internal-error", "Internal error", "the service failed")
        return _problem_response(found, request)

    app.add_exception_handler(Problem, on_problem)
    app.add_exception_handler(FlowlockError, on_flowlock)
    app.add_exception_handler(RequestValidationError, on_invalid)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_crash)


# -- bodies ------------------------------------------------------------------------------------


def _instance(inst: Instance, engine: Engine) -> dict[str, Any]:
    wf = engine.workflows.get(inst.workflow)
    return {**instance_dict(inst), "allowed": list(wf.allowed(inst.state)) if wf else []}


def _definition(wf: Workflow) -> dict[str, Any]:
    return {
        "name": wf.name,
        "states": list(wf.states),
        "initial": wf.initial,
        "final": [s for s in wf.states if wf.is_final(s)],
        "strategy": wf.strategy,
        "transitions": [
            {
                "event": t.name,
                "sources": list(t.sources),
                "targets": list(t.targets),
                "guarded": t.guard is not None,
                "strategy": t.strategy,
            }
            for t in wf.transitions.values()
        ],
    }


def _fired(outcome: Outcome, engine: Engine) -> Response:
    """A fire's answer. A replay says what the first answer said (applied), so the body is the
    same; only the headers tell the retry apart."""
    applied = outcome.applied or outcome.replayed
    body = {
        "applied": applied,
        "idempotent": not applied,
        "event": outcome.event,
        "request_id": outcome.request_id,
        "instance": _instance(outcome.instance, engine),
    }
    headers = {
        "ETag": etag(outcome.instance.version),
        "Flowlock-Strategy": outcome.strategy,
        "Flowlock-Attempts": str(outcome.attempts),
        "Flowlock-Batch-Size": str(outcome.batch_size),
    }
    if outcome.replayed:
        headers["Idempotent-Replayed"] = "true"
    return JSONResponse(body, headers=headers)


# -- headers -----------------------------------------------------------------------------------


def _if_match(value: str | None, required: bool) -> int | None:
    """``expected_version`` from an ``If-Match`` header: ``"7"`` (an ETag this service sent), a
    bare ``7``, or ``*`` (any version: no check)."""
    if value is None:
        if required:
            raise problem(
                428, "precondition-required", "If-Match required",
                "this service requires If-Match on every event: GET the instance and send its "
                "ETag, so a decision made on an old version is refused instead of applied",
            )  # fmt: skip
        return None
    text = value.strip()
    if text == "*":
        return None
    tag = text[2:] if text.startswith("W/") else text
    tag = tag[1:-1] if len(tag) >= 2 and tag[0] == tag[-1] == '"' else tag
    if not tag.isdigit() or not tag.isascii() or len(tag) > 18 or int(tag) < 1:
        raise problem(
            400, "invalid-if-match", "Invalid If-Match",
            f"If-Match must be one ETag this service sent (such as \"3\") or *, not {value!r}",
        )  # fmt: skip
    return int(tag)


def _idempotency_key(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return check_text("Idempotency-Key", value, most=MAX_ID_LENGTH)
    except InvalidInput as exc:
        raise problem(400, "invalid-idempotency-key", "Invalid Idempotency-Key", str(exc)) from None


def _aware(**moments: datetime | None) -> None:
    for name, moment in moments.items():
        if moment is not None and moment.utcoffset() is None:
            raise problem(
                422, "invalid-request", "Invalid request",
                f"{name} has no time zone; give one, e.g. 2026-01-31T12:00:00Z",
            )  # fmt: skip


def _actor(request: Request, given: str | None) -> str | None:
    principal: str | None = getattr(request.state, "principal", None)
    return principal if principal is not None else given


# -- routes ------------------------------------------------------------------------------------


def _routes(
    app: FastAPI, engine: Engine, settings: ServiceSettings, metrics: Metrics, probes: _Probes
) -> None:
    _definition_routes(app, engine)
    _instance_routes(app, engine, settings)
    _health_routes(app, engine, settings, metrics, probes)


def _definition_routes(app: FastAPI, engine: Engine) -> None:
    def definition(name: str) -> Workflow:
        wf = engine.workflows.get(name)
        if wf is None:
            raise problem(
                404, "workflow-not-found", "Workflow not found",
                f"this service has no workflow {name!r}; it serves "
                f"{', '.join(engine.workflows) or 'none'}",
                workflow=name, known=list(engine.workflows),
            )  # fmt: skip
        return wf

    @app.get(
        "/definitions",
        tags=["definitions"],
        summary="The workflows this service runs",
        response_model=None,
        responses=_ok(DefinitionList, "Every served workflow"),
    )
    async def list_definitions() -> dict[str, Any]:
        return {"items": [_definition(wf) for wf in engine.workflows.values()]}

    @app.get(
        "/definitions/{workflow}",
        tags=["definitions"],
        summary="One workflow",
        response_model=None,
        responses=_ok(DefinitionOut, "The workflow"),
    )
    async def get_definition(workflow: str) -> dict[str, Any]:
        return _definition(definition(workflow))

    @app.get(
        "/definitions/{workflow}/diagram",
        tags=["definitions"],
        summary="The workflow as a Mermaid state diagram",
        response_class=PlainTextResponse,
    )
    async def get_diagram(workflow: str) -> str:
        return definition(workflow).to_mermaid()


def _instance_routes(app: FastAPI, engine: Engine, settings: ServiceSettings) -> None:
    depth = settings.max_json_depth

    @app.post(
        "/instances",
        tags=["instances"],
        status_code=201,
        summary="Create an instance in its workflow's initial state (version 1)",
        openapi_extra=_body_doc(CreateBody, required=True),
        response_model=None,
        responses=_ok(InstanceOut, "Created", 201, _CREATED_HEADERS),
    )
    async def create_instance(request: Request) -> Response:
        body = await read_json(request, CreateBody, depth, empty_ok=False)
        instance_id = body.id if body.id is not None else str(uuid.uuid4())
        inst = await engine.create(body.workflow, instance_id=instance_id, data=body.data)
        return JSONResponse(
            _instance(inst, engine),
            status_code=201,
            # Percent-encoded: an id may hold any character but NUL and controls, and a header
            # carries only latin-1 (a raw "é" would be mojibake, a raw "𓀀" a crash after the
            # instance was created, a raw "?" or "#" another URL).
            headers={
                "ETag": etag(inst.version),
                "Location": f"/instances/{quote(inst.id, safe='')}",
            },
        )

    @app.get(
        "/instances",
        tags=["instances"],
        summary="Instances matching every filter given",
        response_model=None,
        responses=_ok(InstancePage, "A page of instances"),
    )
    async def list_instances(
        workflow: str | None = None,
        state: Annotated[list[str] | None, Query()] = None,
        updated_before: datetime | None = None,
        updated_after: datetime | None = None,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
        cursor: str | None = None,
    ) -> dict[str, Any]:
        _aware(updated_before=updated_before, updated_after=updated_after)
        try:
            decode_cursor(cursor)
        except InvalidInput:
            raise problem(
                422, "invalid-cursor", "Invalid cursor",
                "cursor must be the next_cursor of the previous page exactly as it was sent",
            ) from None  # fmt: skip
        page = await engine.list(
            workflow, state, updated_before, updated_after, limit=limit, after=cursor
        )
        return {"items": [_instance(i, engine) for i in page], "next_cursor": page.next_cursor}

    @app.get(
        "/instances/{instance_id}",
        tags=["instances"],
        summary="One instance",
        response_model=None,
        responses=_ok(InstanceOut, "The instance", headers={"ETag": _ETAG}),
    )
    async def get_instance(instance_id: str) -> Response:
        inst = await engine.get(instance_id)
        return JSONResponse(_instance(inst, engine), headers={"ETag": etag(inst.version)})

    @app.post(
        "/instances/{instance_id}/events/{event}",
        tags=["instances"],
        summary="Fire an event at an instance; applied at most once",
        openapi_extra=_body_doc(FireBody, required=False),
        response_model=None,
        responses=_ok(
            Fired,
            "Applied, or nothing to do (idempotent), or a replay of the first answer",
            headers=_FIRED_HEADERS,
        ),
    )
    async def fire(
        instance_id: str,
        event: str,
        request: Request,
        if_match: Annotated[str | None, Header(json_schema_extra=_IF_MATCH_DOC)] = None,
        idempotency_key: Annotated[str | None, Header(json_schema_extra=_KEY_DOC)] = None,
    ) -> Response:
        expected = _if_match(if_match, settings.require_if_match)
        key = _idempotency_key(idempotency_key)
        body = await read_json(request, FireBody, depth, empty_ok=True)
        if body.strategy is not None and body.strategy not in engine.strategies:
            raise problem(
                422, "unknown-strategy", "Unknown strategy",
                f"this service runs the strategies {', '.join(sorted(engine.strategies))}, not "
                f"{body.strategy!r} (distributed needs the service started with a Redis URL)",
                strategy=body.strategy, known=sorted(engine.strategies),
            )  # fmt: skip
        outcome = await engine.fire(
            instance_id,
            event,
            actor=_actor(request, body.actor),
            request_id=key,
            expected_version=expected,
            payload=body.payload,
            strategy=body.strategy,
        )
        return _fired(outcome, engine)

    @app.get(
        "/instances/{instance_id}/history",
        tags=["instances"],
        summary="Applied transitions, oldest first, a page at a time",
        response_model=None,
        responses=_ok(HistoryPage, "A page of history"),
    )
    async def history(
        instance_id: str,
        after: Annotated[int, Query(ge=0, description="The version to start after.")] = 0,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
    ) -> dict[str, Any]:
        entries = [e for e in await engine.history(instance_id) if e.version > after]
        shown = entries[:limit]
        more = len(entries) > limit
        return {
            "items": [entry_dict(e) for e in shown],
            "next_cursor": shown[-1].version if more else None,
        }


def _health_routes(
    app: FastAPI, engine: Engine, settings: ServiceSettings, metrics: Metrics, probes: _Probes
) -> None:
    @app.get(
        "/livez",
        tags=["health"],
        summary="The process is up",
        response_model=None,
        responses=_ok(Live, "Up"),
    )
    async def livez() -> dict[str, str]:
        return {"status": "ok"}

    @app.get(
        "/readyz",
        tags=["health"],
        summary="PostgreSQL (and Redis) answer",
        response_model=None,
        responses={
            **_ok(Ready, "Every backend answered"),
            **_ok(Ready, "A backend did not answer (the checks say which)", 503),
        },
    )
    async def readyz() -> Response:
        checks = await _readiness(engine, probes)
        ok = all(v == "ok" for v in checks.values())
        body = {"status": "ok" if ok else "degraded", "checks": checks}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get(
        "/metrics",
        tags=["health"],
        summary="Prometheus metrics",
        response_class=PlainTextResponse,
        responses={200: {"description": "The Prometheus text exposition format"}},
    )
    async def prometheus() -> Response:
        return Response(_exposition(settings, metrics), media_type=CONTENT_TYPE_LATEST)


def _body_doc(model: type[Any], *, required: bool) -> dict[str, Any]:
    return {
        "requestBody": {
            "required": required,
            "content": {"application/json": {"schema": model.model_json_schema()}},
        }
    }


class _Probes:
    """The readiness pings in flight, one per backend.

    A ping is never cancelled at READY_TIMEOUT, only no longer waited for: cancelling a
    statement on a server that does not answer holds its task while asyncpg gives the connection
    back (up to the pool's acquire timeout, 10 s), and /readyz would answer that much later than
    it promises. The ping goes on to its own bounds instead, and a /readyz asked meanwhile waits
    for it again rather than sending another, so probes never pile up on a hung server."""

    def __init__(self) -> None:
        self._running: dict[str, asyncio.Task[None]] = {}

    async def check(self, name: str, ping: Callable[[], Awaitable[None]]) -> str:
        """What ``name``'s ping says within READY_TIMEOUT: "ok", or what went wrong."""
        task = self._running.get(name)
        if task is None or task.done():
            task = self._running[name] = asyncio.ensure_future(ping())
            task.add_done_callback(_retrieved)
        try:
            await asyncio.wait_for(asyncio.shield(task), READY_TIMEOUT)
        except TimeoutError:
            return f"TimeoutError: no answer within {READY_TIMEOUT:g} s"
        except (FlowlockError, OSError) as exc:
            return f"{type(exc).__name__}: {exc}"[:300]
        return "ok"

    def cancel(self) -> None:
        """At shutdown: the engine is about to close under any ping still in flight."""
        for task in self._running.values():
            task.cancel()
        self._running.clear()


def _retrieved(task: asyncio.Task[None]) -> None:
    # Marks the outcome as seen: a ping nobody waited for to the end logs nothing at exit.
    if not task.cancelled():
        task.exception()


async def _readiness(engine: Engine, probes: _Probes) -> dict[str, str]:
    """Each backend's answer to a ping within READY_TIMEOUT: "ok" or what went wrong."""
    targets: dict[str, Any] = {"database": engine.store}
    if engine.locks is not None:
        targets["locks"] = engine.locks
    checks: dict[str, str] = {}
    for name, target in targets.items():
        ping = getattr(target, "ping", None)
        checks[name] = "ok" if ping is None else await probes.check(name, ping)
    return checks


def _exposition(settings: ServiceSettings, metrics: Metrics) -> bytes:
    """The metrics of every worker when they share a directory, else this process's."""
    if settings.metrics_dir is None:
        return generate_latest(metrics.registry)
    from prometheus_client import multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=settings.metrics_dir)  # type: ignore[no-untyped-call]
    return generate_latest(registry)
