"""`flowlock check-definition`: replay the live histories through a new definition before it is
deployed, for CI."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.text import Text

from flowlock.cli._common import app, fail, stdout
from flowlock.cli._table import Column, print_rows, print_wrapped
from flowlock.cli.inspect import AsJson, InspectDatabaseUrl, InspectSchema, _inspect
from flowlock.core.definition import Workflow
from flowlock.core.errors import FlowlockError
from flowlock.core.replay import KINDS, ReplayReport
from flowlock.engine import Engine

__all__ = ["check_definition"]

_SHOWN = 50
"""Divergences printed per workflow (all of them with --json)."""
# Recorded and new values may be whole data objects: free text that wraps, like the detail.
_COLUMNS = [
    *(Column(name) for name in ("instance", "version", "event", "kind")),
    *(Column(name, text=True) for name in ("recorded", "now", "detail")),
]


def _value(value: object) -> Text:
    if value is None:
        return Text("-")
    shown = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return Text(shown)


def _print(report: ReplayReport) -> None:
    out = stdout()
    if report.divergences:
        rows = [
            [
                Text(d.instance_id),
                Text(str(d.version)),
                Text(d.event or "-"),
                Text(d.kind, style="red"),
                _value(d.expected),
                _value(d.found),
                Text(d.detail),
            ]
            for d in report.divergences[:_SHOWN]
        ]
        print_rows(out, f"divergences of workflow {report.workflow!r}", _COLUMNS, rows)
        more = len(report.divergences) - _SHOWN
        if more > 0:
            print_wrapped(out, Text(f"{more} more; --json prints them all", style="yellow"))
    checked = (
        f"workflow {report.workflow!r}: replayed {report.checked_transitions} transition(s) of "
        f"{report.checked_instances} instance(s) in {report.seconds:.2f} s"
    )
    if report.unreplayed_first:
        checked += (
            f"; {report.unreplayed_first} instance(s) created before their data was stored: "
            "first transition not replayed"
        )
    if report.ok:
        print_wrapped(out, Text(f"{checked}: no divergence", style="green"))
        return
    counts = ", ".join(f"{n} {kind}" for kind, n in report.counts().items() if n)
    print_wrapped(out, Text(f"{checked}: {len(report.divergences)} divergence(s) ({counts})"))


@app.command("check-definition")
def check_definition(
    reference: Annotated[
        str,
        typer.Argument(
            metavar="MODULE:ATTR",
            help="The new definition: a module and an attribute holding a Workflow, a list of "
            "them, or a function returning one or a list (e.g. myapp.flows:approval).",
            show_default=False,
        ),
    ],
    sample: Annotated[
        int | None,
        typer.Option(
            "--sample",
            min=1,
            help="Replay N instances of each workflow picked at random (default: every one).",
            show_default=False,
        ),
    ] = None,
    as_json: AsJson = False,
    database_url: InspectDatabaseUrl = None,
    schema: InspectSchema = None,
) -> None:
    """Replay the recorded histories of live instances through a new definition, before
    deploying it.

    Each applied transition is decided again by the new definition, from the instance as
    recorded before it; every difference is a divergence: refused (it would no longer apply),
    guard (its guard now rejects), target (another state), data (other data), state (a state it
    lacks), event (an event it lacks). Operator rows (force, pause, resume, migrate) are taken
    as recorded. Guards and effects run, so import the module as the application does; the
    current directory is importable.

    Read-only, and safe while the application runs. Exits 0 when no divergence is found, 1 on
    any divergence (each printed) or on an error, 2 on bad arguments.
    """
    from flowlock.core.diagram import BadReference, load_workflows

    try:
        workflows: list[Workflow] = load_workflows(reference)
    except BadReference as exc:
        raise typer.BadParameter(str(exc), param_hint="'MODULE:ATTR'") from None
    except FlowlockError as exc:
        fail(str(exc))

    async def read(engine: Engine) -> list[ReplayReport]:
        return [await engine.check_definition(wf, sample=sample) for wf in workflows]

    reports = _inspect(database_url, schema, read)
    ok = all(report.ok for report in reports)
    if as_json:
        body = {"ok": ok, "kinds": list(KINDS), "reports": [r.as_json() for r in reports]}
        typer.echo(json.dumps(body, indent=2, ensure_ascii=False, default=str))
    else:
        for report in reports:
            _print(report)
    if not ok:
        raise typer.Exit(1)
