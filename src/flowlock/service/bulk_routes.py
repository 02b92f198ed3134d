"""`POST /admin/bulk`: the engine's bulk operations over HTTP (force, pause, resume, fire every
instance the `list` filters select; `dry_run` counts and samples only)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from flowlock._inspect import instance_dict
from flowlock.admin.bulk import DEFAULT_MAX_FAILURES, MAX_CONCURRENCY, MAX_SAMPLE
from flowlock.core.bulk import BulkReport
from flowlock.core.query import MAX_LIMIT
from flowlock.engine import Engine
from flowlock.service.apidoc import body_doc, ok
from flowlock.service.bodies import read_json
from flowlock.service.problems import problem
from flowlock.service.responses import InstanceOut
from flowlock.service.settings import ServiceSettings

__all__ = ["BulkBody", "BulkOut", "bulk_dict", "bulk_routes"]


class BulkBody(BaseModel):
    """One bulk operation: what selects (the `GET /instances` filters) and what is done."""

    model_config = ConfigDict(extra="forbid", strict=True)

    action: Literal["force", "pause", "resume", "fire"]
    workflow: str | None = Field(default=None, description="Only instances of this workflow.")
    states: list[str] | None = Field(default=None, description="Only instances in these states.")
    updated_before: datetime | None = Field(
        default=None, strict=False, description="Only instances last changed before (with zone)."
    )
    updated_after: datetime | None = Field(
        default=None, strict=False, description="Only instances last changed after (with zone)."
    )
    state: str | None = Field(default=None, description="force: the state to force to.")
    event: str | None = Field(default=None, description="fire: the event to fire.")
    payload: dict[str, Any] | None = Field(default=None, description="fire: the payload.")
    data: dict[str, Any] | None = Field(
        default=None, description="force: the data to set (omitted: each keeps its own)."
    )
    reason: str | None = Field(
        default=None, description="Why (force and pause need one; kept in each history row)."
    )
    actor: str | None = Field(
        default=None,
        description="Who does it (force needs one). With bearer tokens configured, the "
        "token's principal is the actor and this field is ignored.",
    )
    operation_id: str | None = Field(
        default=None,
        description="The run's id (each instance's request id is bulk:<operation_id>:<id>); "
        "omitted: derived from the other fields, so the same body sent again finishes the run.",
    )
    dry_run: bool = Field(default=False, description="Count and sample only; write nothing.")
    batch: int = Field(default=500, ge=1, le=MAX_LIMIT, description="Instances per page read.")
    concurrency: int = Field(default=16, ge=1, le=MAX_CONCURRENCY, description="Calls at once.")
    sample: int = Field(default=10, ge=0, le=MAX_SAMPLE, description="Instances shown first.")
    max_failures: int | None = Field(
        default=DEFAULT_MAX_FAILURES,
        ge=1,
        description="Stop taking new instances after this many failures; null: never.",
    )


class BulkOut(BaseModel):
    """What a bulk operation did (or, dry run, would select)."""

    model_config = ConfigDict(extra="forbid")

    operation_id: str
    action: str
    dry_run: bool
    matched: int = Field(description="Instances matching when the run began.")
    applied: int
    skipped: int = Field(description="Nothing to do (already as wanted), or moved since.")
    replayed: int = Field(
        description="Done earlier under this operation id (a rerun): answered from the "
        "history, not done again. Send another operation_id to run the operation again."
    )
    failed: dict[str, str] = Field(description="Instance id -> the error that refused it.")
    sample: list[InstanceOut] = Field(description="The first instances selected, in id order.")
    stopped: str | None = Field(description="Why the run stopped early (max_failures), or null.")
    note: str | None = Field(
        description="Said when instances were replayed: how many, by which operation, and how "
        "to run it again; null otherwise."
    )


def bulk_dict(report: BulkReport, engine: Engine) -> dict[str, Any]:
    """The report as the route answers it (its sample as GET /instances lists instances)."""
    shown = []
    for inst in report.sample:
        wf = engine.workflows.get(inst.workflow)
        allowed = list(wf.allowed(inst.state)) if wf else []
        shown.append({**instance_dict(inst), "allowed": allowed})
    note = report.replay_note("send another operation_id")
    return {**report.summary(), "note": note, "sample": shown}


def bulk_routes(app: FastAPI, engine: Engine, settings: ServiceSettings) -> None:
    depth = settings.max_json_depth

    @app.post(
        "/admin/bulk",
        tags=["admin"],
        summary="Force, pause, resume or fire every instance the filters select",
        description="Counts the selection and samples it first; with dry_run it stops there. "
        "Otherwise it answers once every selected instance is done (large runs take a while: "
        "a client that times out sends the same body again, and the run replays what was done "
        "and does the rest). The same body sent again later does nothing to what it did "
        "before (counted in replayed, with a note): send another operation_id to run the "
        "operation again.",
        openapi_extra=body_doc(BulkBody, required=True),
        response_model=None,
        responses=ok(BulkOut, "The run's report"),
    )
    async def bulk(request: Request) -> dict[str, Any]:
        body = await read_json(request, BulkBody, depth, empty_ok=False)
        for name in ("updated_before", "updated_after"):
            moment = getattr(body, name)
            if moment is not None and moment.utcoffset() is None:
                raise problem(
                    422, "invalid-request", "Invalid request",
                    f"{name} has no time zone; give one, e.g. 2026-01-31T12:00:00Z",
                )  # fmt: skip
        principal: str | None = getattr(request.state, "principal", None)
        report = await engine.bulk(
            body.action,
            workflow=body.workflow,
            states=body.states,
            updated_before=body.updated_before,
            updated_after=body.updated_after,
            state=body.state,
            event=body.event,
            payload=body.payload,
            data=body.data,
            reason=body.reason,
            actor=principal if principal is not None else body.actor,
            operation_id=body.operation_id,
            dry_run=body.dry_run,
            batch=body.batch,
            concurrency=body.concurrency,
            sample=body.sample,
            max_failures=body.max_failures,
        )
        return bulk_dict(report, engine)
