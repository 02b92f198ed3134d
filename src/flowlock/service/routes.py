"""The definition and instance routes: HTTP in, the engine's API, HTTP out."""

from __future__ import annotations

import logging
import uuid
from datetime import datetime
from typing import Annotated, Any, NamedTuple
from urllib.parse import quote

from fastapi import FastAPI, Header, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from flowlock._calls import MAX_ID_LENGTH
from flowlock._inspect import (
    entry_dict,
    instance_dict,
    message_dict,
    next_timer_dict,
    timer_dict,
)
from flowlock.core.definition import Workflow
from flowlock.core.errors import DefinitionMismatch, FlowlockError, InvalidInput
from flowlock.core.models import Instance, Outcome
from flowlock.core.query import decode_cursor
from flowlock.core.settings import check_text
from flowlock.engine import Engine
from flowlock.service.apidoc import (
    CREATE_KEY_DOC,
    CREATED_HEADERS,
    ETAG,
    FIRED_HEADERS,
    IF_MATCH_DOC,
    KEY_DOC,
    RATE_LIMITED,
    body_doc,
    ok,
)
from flowlock.service.bodies import CreateBody, FireBody, read_json
from flowlock.service.problems import etag, problem
from flowlock.service.responses import (
    DefinitionList,
    DefinitionOut,
    Fired,
    HistoryPage,
    InstanceOut,
    InstancePage,
    MessageList,
    TimerList,
)
from flowlock.service.settings import ServiceSettings

log = logging.getLogger("flowlock.service")

MAX_PAGE = 1000
# The namespace of ids derived from a create's Idempotency-Key (any fixed UUID).
_KEYED_IDS = uuid.UUID("6f1e2b9a-3c4d-5e6f-8a9b-0c1d2e3f4a5b")


# -- bodies ------------------------------------------------------------------------------------


def _instance(inst: Instance, engine: Engine) -> dict[str, Any]:
    try:  # the events of the version it runs
        wf = engine.registry.pinned(inst.workflow, inst.definition_version)
    except DefinitionMismatch:
        wf = None
    return {**instance_dict(inst), "allowed": list(wf.allowed(inst.state)) if wf else []}


async def _with_timer(inst: Instance, engine: Engine) -> dict[str, Any]:
    """The instance a create or fire answers, with its `next_timer`.

    A workflow without timed transitions has none: null, and nothing is read. Otherwise the
    instance's timers are read once, after the call, and the earliest one armed at or before
    the version shown is its next timer. A timer armed later belongs to a stay begun since
    (the answer may be a replay of an older one), so it is not shown with this version.
    """
    body = _instance(inst, engine)
    wf = engine.workflows.get(inst.workflow)
    if wf is None or not wf.has_timers:
        return {**body, "next_timer": None}
    try:
        armed = await engine.timers(inst.id)
    except FlowlockError as exc:
        # The call itself succeeded: its answer must not become an error. The field is left
        # out, which the schema allows, rather than sent as a null that would say "none".
        log.warning("flowlock service: reading the timers of %r failed: %s", inst.id, exc)
        return body
    found = next((t for t in armed if t.stay <= inst.version), None)
    return {**body, "next_timer": next_timer_dict(inst.evolve(next_timer=found))}


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


class Answer(NamedTuple):
    """A hot route's answer before encoding: the FastAPI route and the fast layer
    (`flowlock.service.fast`) both send it, so they answer alike."""

    status: int
    body: dict[str, Any]
    headers: dict[str, str]

    def response(self) -> Response:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers)


async def fired_answer(outcome: Outcome, engine: Engine) -> Answer:
    """A fire's answer.

    A replay repeats the first answer's body; only the headers tell the retry apart. Its
    `next_timer` is read when answering, so it shows the timer of that stay as it is now
    (null once the stay has ended).
    """
    applied = outcome.applied or outcome.replayed
    body = {
        "applied": applied,
        "idempotent": not applied,
        "event": outcome.event,
        "request_id": outcome.request_id,
        "instance": await _with_timer(outcome.instance, engine),
    }
    headers = {
        "ETag": etag(outcome.instance.version),
        "Flowlock-Strategy": outcome.strategy,
        "Flowlock-Attempts": str(outcome.attempts),
        "Flowlock-Batch-Size": str(outcome.batch_size),
    }
    if outcome.replayed:
        headers["Idempotent-Replayed"] = "true"
    return Answer(200, body, headers)


async def _fired(outcome: Outcome, engine: Engine) -> Response:
    return (await fired_answer(outcome, engine)).response()


# -- headers -----------------------------------------------------------------------------------


def _if_match(value: str | None, required: bool) -> int | None:
    """`expected_version` from an `If-Match` header.

    Takes `"7"` (an ETag this service sent), a bare `7`, or `*` for any version.
    """
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


def _new_id(key: str | None) -> str:
    """The id of an instance whose create named none: random, or derived from its
    Idempotency-Key, so that a retry (to any worker, while the first still runs) names the
    same instance and the engine answers it the first create instead of making a second."""
    return str(uuid.uuid4() if key is None else uuid.uuid5(_KEYED_IDS, key))


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


# -- the hot calls: one body of logic for the FastAPI route and the fast layer -----------------


async def create_answer(engine: Engine, key: str | None, body: CreateBody) -> Answer:
    """`POST /instances` once its Idempotency-Key header (checked) and body are read."""
    instance_id = body.id if body.id is not None else _new_id(key)
    inst = await engine.create(
        body.workflow,
        instance_id=instance_id,
        data=body.data,
        request_id=key,
        version=body.version,
    )
    return Answer(
        201,
        await _with_timer(inst, engine),
        # Percent-encoded: an id may hold any character but NUL and controls, and a header
        # carries only latin-1. A raw "é" would be mojibake, a raw "𓀀" a crash after the create,
        # a raw "?" another URL.
        {"ETag": etag(inst.version), "Location": f"/instances/{quote(inst.id, safe='')}"},
    )


async def get_answer(engine: Engine, instance_id: str) -> Answer:
    """`GET /instances/{instance_id}`."""
    inst = await engine.get(instance_id)
    body = {**_instance(inst, engine), "next_timer": next_timer_dict(inst)}
    return Answer(200, body, {"ETag": etag(inst.version)})


async def fire_answer(
    engine: Engine,
    instance_id: str,
    event: str,
    body: FireBody,
    *,
    expected: int | None,
    key: str | None,
    principal: str | None,
) -> Answer:
    """`POST /instances/{instance_id}/events/{event}` once its headers and body are checked."""
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
        actor=principal if principal is not None else body.actor,
        request_id=key,
        expected_version=expected,
        payload=body.payload,
        strategy=body.strategy,
    )
    return await fired_answer(outcome, engine)


def definition_routes(app: FastAPI, engine: Engine) -> None:
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
        summary="The workflows this service runs, with their stored versions",
        response_model=None,
        responses=ok(DefinitionList, "Every served workflow (or the one asked for)"),
    )
    async def list_definitions(
        workflow: Annotated[
            str | None, Query(description="Only this workflow (404 when not served).")
        ] = None,
    ) -> dict[str, Any]:
        names = list(engine.workflows) if workflow is None else [definition(workflow).name]
        stored = await engine.definitions(workflow)
        registry = engine.registry
        items = []
        for name in names:
            served = registry.versions(name)
            versions = [
                {
                    "version": v.version,
                    "hash": v.hash,
                    "created_at": None if v.created_at is None else v.created_at.isoformat(),
                    "instances": v.instances,
                    "served": v.version in served,
                }
                for v in stored
                if v.workflow == name
            ]
            items.append(
                {
                    **_definition(registry[name]),
                    "version": registry.newest_version(name),
                    "versions": versions,
                }
            )
        return {"items": items}

    @app.get(
        "/definitions/{workflow}",
        tags=["definitions"],
        summary="One workflow",
        response_model=None,
        responses=ok(DefinitionOut, "The workflow"),
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


def instance_routes(app: FastAPI, engine: Engine, settings: ServiceSettings) -> None:
    depth = settings.max_json_depth

    @app.post(
        "/instances",
        tags=["instances"],
        status_code=201,
        summary="Create an instance in its workflow's initial state (version 1)",
        openapi_extra=body_doc(CreateBody, required=True),
        response_model=None,
        responses=ok(InstanceOut, "Created", 201, CREATED_HEADERS),
    )
    async def create_instance(
        request: Request,
        idempotency_key: Annotated[str | None, Header(json_schema_extra=CREATE_KEY_DOC)] = None,
    ) -> Response:
        key = _idempotency_key(idempotency_key)
        body = await read_json(request, CreateBody, depth, empty_ok=False)
        return (await create_answer(engine, key, body)).response()

    @app.get(
        "/instances",
        tags=["instances"],
        summary="Instances matching every filter given",
        response_model=None,
        responses=ok(InstancePage, "A page of instances"),
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
        responses=ok(InstanceOut, "The instance", headers={"ETag": ETAG}),
    )
    async def get_instance(instance_id: str) -> Response:
        return (await get_answer(engine, instance_id)).response()

    @app.post(
        "/instances/{instance_id}/events/{event}",
        tags=["instances"],
        summary="Fire an event at an instance; applied at most once",
        openapi_extra=body_doc(FireBody, required=False),
        response_model=None,
        responses={
            **ok(
                Fired,
                "Applied, or nothing to do (idempotent), or a replay of the first answer",
                headers=FIRED_HEADERS,
            ),
            **RATE_LIMITED,
        },
    )
    async def fire(
        instance_id: str,
        event: str,
        request: Request,
        if_match: Annotated[str | None, Header(json_schema_extra=IF_MATCH_DOC)] = None,
        idempotency_key: Annotated[str | None, Header(json_schema_extra=KEY_DOC)] = None,
    ) -> Response:
        expected = _if_match(if_match, settings.require_if_match)
        key = _idempotency_key(idempotency_key)
        body = await read_json(request, FireBody, depth, empty_ok=True)
        answer = await fire_answer(
            engine,
            instance_id,
            event,
            body,
            expected=expected,
            key=key,
            principal=_actor(request, None),
        )
        return answer.response()

    @app.get(
        "/instances/{instance_id}/history",
        tags=["instances"],
        summary="Applied transitions, oldest first, a page at a time",
        response_model=None,
        responses=ok(HistoryPage, "A page of history"),
    )
    async def history(
        instance_id: str,
        after: Annotated[int, Query(ge=0, description="The version to start after.")] = 0,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
    ) -> dict[str, Any]:
        # One entry more than the page: whether it exists says if there is a next page.
        entries = await engine.history(instance_id, after=after, limit=limit + 1)
        shown = entries[:limit]
        more = len(entries) > limit
        return {
            "items": [entry_dict(e) for e in shown],
            "next_cursor": shown[-1].version if more else None,
        }

    @app.get(
        "/instances/{instance_id}/timers",
        tags=["instances"],
        summary="Armed timers, earliest due first",
        response_model=None,
        responses=ok(TimerList, "The instance's armed timers (none: an empty list)"),
    )
    async def timers(instance_id: str) -> dict[str, Any]:
        await engine.get(instance_id)  # an unknown id is a 404, not an empty list
        return {"items": [timer_dict(t) for t in await engine.timers(instance_id)]}

    @app.get(
        "/instances/{instance_id}/messages",
        tags=["instances"],
        summary="Outbox messages, in the order they were emitted",
        response_model=None,
        responses=ok(
            MessageList,
            "The instance's outbox messages: key, kind, status, attempts, last error, next "
            "attempt (none: an empty list)",
        ),
    )
    async def messages(instance_id: str) -> dict[str, Any]:
        await engine.get(instance_id)  # an unknown id is a 404, not an empty list
        return {"items": [message_dict(m) for m in await engine.messages(instance_id)]}
