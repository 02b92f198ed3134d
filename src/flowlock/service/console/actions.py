"""The console's repairs: force a state, pause, resume; each one confirmed before it runs.

A form posts to /ui/actions/<action>. The first post checks the input and answers a
confirmation page that says exactly what will happen; only its "Confirm" post calls the
engine. The confirmation carries a request id made for it, so a double click applies once,
and for a force the version it was shown, so a force confirmed on a state the instance has
since left is refused instead of applied. Every post needs the admin scope and the session's
CSRF token; the actor is the session's principal.
"""

from __future__ import annotations

import uuid
from typing import Any
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.responses import RedirectResponse
from starlette.responses import Response

from flowlock._calls import MAX_ID_LENGTH
from flowlock.core.admin import check_reason
from flowlock.core.errors import FlowlockError, InvalidInput
from flowlock.core.settings import check_text
from flowlock.engine import Engine
from flowlock.service.console.auth import Gate, respond
from flowlock.service.console.pages import failure
from flowlock.service.console.render import HEADERS
from flowlock.service.console.session import Session

__all__ = ["ACTIONS", "install_actions"]

ACTIONS = ("force", "pause", "resume")
_DONE = {"force": "forced", "pause": "paused", "resume": "resumed"}


def _reason(action: str, form: dict[str, str]) -> str | None:
    reason = form.get("reason", "").strip()
    if not reason:
        if action == "resume":
            return None
        raise InvalidInput(f"a {action} needs a reason: say why, for the history")
    return check_reason(reason)  # the engine's own check: the same bound as force and pause


def _back(target: str, name: str, done: str | None = None) -> str:
    where = (
        f"/ui/instances/{quote(name, safe='')}"
        if target == "instance"
        else (f"/ui/workflows/{quote(name, safe='')}")
    )
    return where + (f"?done={done}" if done else "")


class _Plan:
    """One checked action: what it is, on what, and what the confirmation page shows."""

    def __init__(self, action: str, target: str, name: str, form: dict[str, str]) -> None:
        self.action = action
        self.target = target
        self.name = name
        self.reason = _reason(action, form)
        self.state = form.get("state", "")
        self.request_id = form.get("request_id") or f"console:{uuid.uuid4()}"
        self.expected: int | None = None
        self.details: dict[str, Any] = {}


async def _plan(engine: Engine, action: str, form: dict[str, str]) -> _Plan:
    target = form.get("target", "")
    if target not in ("instance", "workflow") or (target == "workflow" and action == "force"):
        raise InvalidInput("target must be 'instance' (force, pause, resume) or 'workflow' "
                           "(pause, resume)")  # fmt: skip
    name = form.get("id", "")
    check_text("id", name, most=MAX_ID_LENGTH)
    plan = _Plan(action, target, name, form)
    if target == "workflow":
        if name not in engine.workflows:
            raise InvalidInput(f"this service has no workflow {name!r}")
        plan.details = {"instances": await engine.count(name)}
        return plan
    inst = await engine.get(name)
    plan.details = {"inst": inst}
    plan.expected = inst.version
    if action == "force":
        wf = engine.workflows.get(inst.workflow)
        states = wf.states if wf is not None else ()
        if plan.state not in states:
            raise InvalidInput(
                f"state {plan.state!r} is not a state of workflow {inst.workflow!r}; choose one "
                f"of {', '.join(states)}"
            )
    return plan


async def _apply(engine: Engine, plan: _Plan, who: Session, form: dict[str, str]) -> None:
    actor = who.principal
    if plan.target == "workflow":
        if plan.action == "pause":
            await engine.pause(workflow=plan.name, reason=plan.reason or "", actor=actor)
        else:
            await engine.resume(workflow=plan.name, reason=plan.reason, actor=actor)
        return
    if plan.action == "force":
        version = form.get("expected_version", "")
        if not version.isdigit():
            raise InvalidInput("the confirmation lost the version it was shown; start again")
        await engine.force(
            plan.name, plan.state, reason=plan.reason or "", actor=actor,
            expected_version=int(version), request_id=plan.request_id,
        )  # fmt: skip
    elif plan.action == "pause":
        await engine.pause(plan.name, reason=plan.reason or "", actor=actor,
                           request_id=plan.request_id)  # fmt: skip
    else:
        await engine.resume(plan.name, reason=plan.reason, actor=actor,
                            request_id=plan.request_id)  # fmt: skip


def install_actions(app: FastAPI, engine: Engine, gate: Gate) -> None:
    """POST /ui/actions/{force,pause,resume}: confirm, then apply."""

    @app.post("/ui/actions/{action}", include_in_schema=False)
    async def act(request: Request, action: str) -> Response:
        who, form = await gate.post(request, scope="admin")
        context = gate.context(request, who)
        if action not in ACTIONS:
            context |= {"title": "Not found", "detail": f"no console action {action!r}"}
            return respond(request, "error.html", context, status=404)
        try:
            plan = await _plan(engine, action, form)
            if form.get("confirmed") != "yes":
                return respond(request, "confirm.html", context | {"plan": plan})
            await _apply(engine, plan, who, form)
        except FlowlockError as exc:
            if form.get("target") in ("instance", "workflow") and form.get("id"):
                context["back"] = _back(form["target"], form["id"])
            return failure(request, context, exc)
        done = _back(plan.target, plan.name, _DONE[action])
        return RedirectResponse(done, status_code=303, headers=HEADERS)
