"""The operator's repair routes, under `/admin/`: force an instance's state, pause and resume an
instance or a whole workflow, list the paused workflows (the engine's `force`, `pause`,
`resume` and `workflow_pauses`). With tokens configured, every `/admin/` route needs an admin
token (the request guard); the token's name is then the actor recorded."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import FastAPI, Header, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from flowlock._inspect import _when
from flowlock.core.admin import WorkflowPause
from flowlock.core.models import Outcome
from flowlock.engine import Engine
from flowlock.service.apidoc import FIRED_HEADERS, KEY_DOC, body_doc, ok
from flowlock.service.bodies import _Body, read_json
from flowlock.service.problems import problem
from flowlock.service.responses import Fired, _Out
from flowlock.service.routes import _actor, _fired, _idempotency_key
from flowlock.service.settings import ServiceSettings

__all__ = ["ForceBody", "PauseBody", "ResumeBody", "admin_routes"]

# The header as the fire route takes it: a retry with the same key gets the first answer.
KeyHeader = Annotated[str | None, Header(json_schema_extra=KEY_DOC)]
_REASON = "Why, in words an auditor reads later (recorded in the history row)."
_ACTOR = (
    "Who does it (recorded). With bearer tokens configured, the token's name is the actor and "
    "this field is ignored."
)


class ForceBody(_Body):
    """Move the instance to `state`, any state of its workflow, with a forced history row."""

    state: str = Field(description="The state to move it to (GET /definitions/{workflow}).")
    data: dict[str, Any] | None = Field(
        default=None, description="The instance's new data; omitted: its data is kept."
    )
    reason: str = Field(description=_REASON)
    actor: str | None = Field(default=None, description=_ACTOR)
    expected_version: int | None = Field(
        default=None, ge=1, description="Refused (412) unless the instance is at this version."
    )


class PauseBody(_Body):
    """Pause: events are refused (409 instance-paused) until resumed; a force still works."""

    reason: str = Field(description=_REASON)
    actor: str | None = Field(default=None, description=_ACTOR)


class ResumeBody(_Body):
    """Resume: events are taken again. Every field is optional."""

    reason: str | None = Field(default=None, description=_REASON)
    actor: str | None = Field(default=None, description=_ACTOR)


class WorkflowPauseOut(_Out):
    """A whole workflow paused: one row, however many instances it has."""

    workflow: str
    reason: str
    actor: str | None
    at: str | None = Field(json_schema_extra={"format": "date-time"})


class WorkflowPauseList(_Out):
    items: list[WorkflowPauseOut]


class Lifted(_Out):
    """A workflow's resume: the pause it lifted, or null when the workflow was not paused."""

    lifted: WorkflowPauseOut | None


def _pause(pause: WorkflowPause) -> dict[str, Any]:
    return {
        "workflow": pause.workflow,
        "reason": pause.reason,
        "actor": pause.actor,
        "at": _when(pause.at),
    }


def _who(request: Request, given: str | None) -> str:
    """The actor of a force: the token's name, else the body's; a force without one is refused
    (an audited repair names who made it)."""
    actor = _actor(request, given)
    if actor is None:
        raise problem(
            422, "actor-required", "Actor required",
            "name who forces the state: send \"actor\" in the body (or a bearer token, whose "
            "name is then the actor)",
        )  # fmt: skip
    return actor


def admin_routes(app: FastAPI, engine: Engine, settings: ServiceSettings) -> None:
    depth = settings.max_json_depth

    async def toggle(
        model: type[PauseBody] | type[ResumeBody],
        instance_id: str,
        request: Request,
        header: str | None,
    ) -> Response:
        """One instance's pause (a PauseBody, its reason required) or resume (a ResumeBody,
        the body optional): the same steps, the call aside."""
        key = _idempotency_key(header)
        body = await read_json(request, model, depth, empty_ok=model is ResumeBody)
        actor = _actor(request, body.actor)
        answer: Outcome | WorkflowPause | None
        if isinstance(body, PauseBody):
            answer = await engine.pause(
                instance_id, reason=body.reason, actor=actor, request_id=key
            )
        else:
            answer = await engine.resume(
                instance_id, reason=body.reason, actor=actor, request_id=key
            )
        assert isinstance(answer, Outcome)  # one instance's pause or resume answers an Outcome
        return await _fired(answer, engine)

    fired = ok(Fired, "Applied, nothing to do, or a replay of its first answer", 200, FIRED_HEADERS)

    @app.post(
        "/admin/instances/{instance_id}/force",
        tags=["admin"],
        summary="Force an instance into any state of its workflow (an audited repair)",
        openapi_extra=body_doc(ForceBody, required=True),
        response_model=None,
        responses=fired,
    )
    async def force(
        instance_id: str, request: Request, idempotency_key: KeyHeader = None
    ) -> Response:
        key = _idempotency_key(idempotency_key)
        body = await read_json(request, ForceBody, depth, empty_ok=False)
        outcome = await engine.force(
            instance_id,
            body.state,
            data=body.data,
            reason=body.reason,
            actor=_who(request, body.actor),
            expected_version=body.expected_version,
            request_id=key,
        )
        return await _fired(outcome, engine)

    @app.post(
        "/admin/instances/{instance_id}/pause",
        tags=["admin"],
        summary="Pause an instance: its events are refused until it is resumed",
        openapi_extra=body_doc(PauseBody, required=True),
        response_model=None,
        responses=fired,
    )
    async def pause_instance(
        instance_id: str, request: Request, idempotency_key: KeyHeader = None
    ) -> Response:
        return await toggle(PauseBody, instance_id, request, idempotency_key)

    @app.post(
        "/admin/instances/{instance_id}/resume",
        tags=["admin"],
        summary="Resume a paused instance",
        openapi_extra=body_doc(ResumeBody, required=False),
        response_model=None,
        responses=fired,
    )
    async def resume_instance(
        instance_id: str, request: Request, idempotency_key: KeyHeader = None
    ) -> Response:
        return await toggle(ResumeBody, instance_id, request, idempotency_key)

    @app.post(
        "/admin/workflows/{workflow}/pause",
        tags=["admin"],
        summary="Pause every instance of a workflow (one row, no instance written)",
        openapi_extra=body_doc(PauseBody, required=True),
        response_model=None,
        responses=ok(WorkflowPauseOut, "The pause in place (the first one, if already paused)"),
    )
    async def pause_workflow(workflow: str, request: Request) -> Response:
        body = await read_json(request, PauseBody, depth, empty_ok=False)
        actor = _actor(request, body.actor)
        answer = await engine.pause(workflow=workflow, reason=body.reason, actor=actor)
        assert isinstance(answer, WorkflowPause)
        return JSONResponse(_pause(answer))

    @app.post(
        "/admin/workflows/{workflow}/resume",
        tags=["admin"],
        summary="Lift the pause of a workflow",
        openapi_extra=body_doc(ResumeBody, required=False),
        response_model=None,
        responses=ok(Lifted, "The pause lifted, or null when the workflow was not paused"),
    )
    async def resume_workflow(workflow: str, request: Request) -> Response:
        body = await read_json(request, ResumeBody, depth, empty_ok=True)
        actor = _actor(request, body.actor)
        lifted = await engine.resume(workflow=workflow, reason=body.reason, actor=actor)
        assert lifted is None or isinstance(lifted, WorkflowPause)
        return JSONResponse({"lifted": None if lifted is None else _pause(lifted)})

    @app.get(
        "/admin/workflows/pauses",
        tags=["admin"],
        summary="The paused workflows",
        response_model=None,
        responses=ok(WorkflowPauseList, "Every paused workflow, by name"),
    )
    async def workflow_pauses() -> dict[str, Any]:
        return {"items": [_pause(p) for p in await engine.workflow_pauses()]}
