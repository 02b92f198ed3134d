"""The console's read pages: instances, one instance, workflows, one workflow, the monitor.

Each page reads through the engine's public API, the same calls as the HTTP service, and is
one bounded set of reads; nothing here writes.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import FastAPI, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from starlette.responses import Response

from flowlock.core.admin import WorkflowPause
from flowlock.core.errors import FlowlockError, InvalidInput
from flowlock.engine import Engine
from flowlock.http import problem as http_problem
from flowlock.metrics import Metrics
from flowlock.service.console.auth import Gate, respond
from flowlock.service.console.diagram import workflow_svg
from flowlock.service.console.monitor import monitor_view
from flowlock.service.console.render import HEADERS

__all__ = ["PAGE_SIZE", "failure", "install_pages", "parse_moment"]

PAGE_SIZE = 50
HISTORY_SHOWN = 500


def parse_moment(name: str, text: str | None) -> datetime | None:
    """A filter's moment: ISO 8601; without an offset it is UTC (what the form says)."""
    if text is None or not text.strip():
        return None
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise InvalidInput(
            f"{name} {text!r} is not a date and time; give e.g. 2026-01-31T12:00 (UTC)"
        ) from None
    return moment if moment.utcoffset() is not None else moment.replace(tzinfo=UTC)


def failure(request: Request, context: dict[str, Any], exc: FlowlockError) -> HTMLResponse:
    """The error page for what the engine refused, with the status the HTTP API would use."""
    found = http_problem(exc, request.url.path)
    body = {**context, "title": found.body.get("title", "Error"), "detail": str(exc)}
    return respond(request, "error.html", body, status=found.status)


async def _pauses(engine: Engine) -> dict[str, WorkflowPause]:
    """The paused workflows by name."""
    return {p.workflow: p for p in await engine.workflow_pauses()}


def _state_choices(engine: Engine, workflow: str | None) -> list[str]:
    """The states the filter offers: the chosen workflow's, else every served workflow's."""
    one = engine.workflows.get(workflow) if workflow else None
    chosen = [one] if one is not None else list(engine.workflows.values())
    found: list[str] = []
    for wf in chosen:
        found += [s for s in wf.states if s not in found]
    return found


def _filters_query(filters: dict[str, Any], after: str | None) -> str:
    pairs: list[tuple[str, str]] = []
    for key, value in filters.items():
        if isinstance(value, list):
            pairs += [(key, v) for v in value]
        elif value:
            pairs.append((key, value))
    if after:
        pairs.append(("after", after))
    return urlencode(pairs)


def install_pages(app: FastAPI, engine: Engine, gate: Gate, metrics: Metrics | None) -> None:
    """The read pages, on `app` under /ui."""

    @app.get("/ui", include_in_schema=False)
    async def root() -> Response:
        return RedirectResponse("/ui/", status_code=307, headers=HEADERS)

    @app.get("/ui/", include_in_schema=False)
    async def instances(
        request: Request,
        workflow: str | None = None,
        state: Annotated[list[str] | None, Query()] = None,
        updated_before: str | None = None,
        updated_after: str | None = None,
        after: str | None = None,
    ) -> Response:
        session = gate.session(request)
        context = gate.context(request, session)
        states = [s for s in (state or []) if s]
        filters = {
            "workflow": workflow or "",
            "state": states,
            "updated_before": updated_before or "",
            "updated_after": updated_after or "",
        }
        context |= {
            "filters": filters,
            "workflows": engine.workflows,
            "state_choices": _state_choices(engine, workflow),
            "section": "instances",
        }
        try:
            before = parse_moment("updated before", updated_before)
            since = parse_moment("updated after", updated_after)
            query = (workflow or None, states or None, before, since)
            page = await engine.list(*query, limit=PAGE_SIZE, after=after or None)
            total = await engine.count(*query)
        except FlowlockError as exc:
            # The filters stay on the page, with what was wrong with them.
            found = http_problem(exc, request.url.path)
            context |= {"error": str(exc), "page": (), "total": 0}
            return respond(request, "instances.html", context, status=found.status)
        next_link = None
        if page.next_cursor is not None:
            next_link = "/ui/?" + _filters_query(filters, page.next_cursor)
        first_link = "/ui/?" + _filters_query(filters, None) if after else None
        context |= {
            "page": page,
            "total": total,
            "next_link": next_link,
            "first_link": first_link,
            "pauses": await _pauses(engine),
        }
        return respond(request, "instances.html", context)

    @app.get("/ui/instances/{instance_id:path}", include_in_schema=False)
    async def instance(request: Request, instance_id: str, done: str | None = None) -> Response:
        session = gate.session(request)
        context = gate.context(request, session) | {"section": "instances"}
        try:
            inst = await engine.get(instance_id)
            history = await engine.history(instance_id)
            timers = await engine.timers(instance_id)
            messages = await engine.messages(instance_id)
        except FlowlockError as exc:
            return failure(request, context, exc)
        wf = engine.workflows.get(inst.workflow)
        pauses = await _pauses(engine)
        context |= {
            "inst": inst,
            "wf": wf,
            "diagram": workflow_svg(wf, inst.state) if wf is not None else None,
            "history": list(reversed(history))[:HISTORY_SHOWN],
            "history_total": len(history),
            "timers": timers,
            "messages": messages,
            "paused": inst.paused,
            "workflow_pause": pauses.get(inst.workflow),
            "done": done,
        }
        return respond(request, "instance.html", context)

    @app.get("/ui/workflows", include_in_schema=False)
    async def workflows(request: Request) -> Response:
        session = gate.session(request)
        context = gate.context(request, session) | {"section": "workflows"}
        try:
            counts = {name: await engine.count(name) for name in engine.workflows}
            pauses = await _pauses(engine)
        except FlowlockError as exc:
            return failure(request, context, exc)
        context |= {"workflows": engine.workflows, "counts": counts, "pauses": pauses}
        return respond(request, "workflows.html", context)

    @app.get("/ui/workflows/{name}", include_in_schema=False)
    async def workflow_page(request: Request, name: str, done: str | None = None) -> Response:
        session = gate.session(request)
        context = gate.context(request, session) | {"section": "workflows"}
        wf = engine.workflows.get(name)
        if wf is None:
            unknown = InvalidInput(
                f"this service has no workflow {name!r}; it serves "
                f"{', '.join(engine.workflows) or 'none'}"
            )
            context |= {"title": "Workflow not found", "detail": str(unknown)}
            return respond(request, "error.html", context, status=404)
        try:
            counts = {s: await engine.count(name, s) for s in wf.states}
            pauses = await _pauses(engine)
        except FlowlockError as exc:
            return failure(request, context, exc)
        context |= {
            "wf": wf,
            "diagram": workflow_svg(wf),
            "counts": counts,
            "total": sum(counts.values()),
            "pause": pauses.get(name),
            "done": done,
        }
        return respond(request, "workflow.html", context)

    @app.get("/ui/monitor", include_in_schema=False)
    async def monitor(request: Request) -> Response:
        session = gate.session(request)
        context = gate.context(request, session) | {"section": "monitor"}
        context |= {"view": monitor_view(engine, metrics)}
        return respond(request, "monitor.html", context)

    @app.get("/ui/monitor/panel", include_in_schema=False)
    async def monitor_panel(request: Request) -> Response:
        session = gate.session(request)
        context = gate.context(request, session) | {"view": monitor_view(engine, metrics)}
        return respond(request, "_monitor_panel.html", context)
