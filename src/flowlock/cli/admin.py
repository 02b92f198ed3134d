"""`flowlock admin`: the operator's repairs (force, pause, resume, fire in bulk) and retention
(purge, restore). Each writes through the engine: the compare-and-swap, the fencing and the
history, never a bare UPDATE."""

from __future__ import annotations

import getpass
import json
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime
from typing import Annotated, Any, TypeVar

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from flowlock.cli._age import AGE_FORMS, age_or_none
from flowlock.cli._common import (
    ENV_DATABASE_URL,
    EPILOG,
    EXIT_ERROR,
    EXIT_REPLAYED,
    app,
    fail,
    stderr,
    stdout,
)
from flowlock.cli._table import Column, print_rows, print_wrapped
from flowlock.cli.inspect import AsJson, InspectSchema, _cell, _inspect, _json
from flowlock.cli.inspect import _when as when
from flowlock.core.bulk import BulkAction, BulkReport, derive_operation_id
from flowlock.core.query import MAX_LIMIT
from flowlock.engine import Engine

__all__ = ["admin_app", "fire", "force", "pause", "resume"]

_R = TypeVar("_R")

admin_app = typer.Typer(
    help="Operator repairs and retention: *force*, *pause*, *resume* and *fire* in bulk (with "
    "*--dry-run*), *migrate* to another definition version, *purge* and *restore*.",
    no_args_is_help=True,
    epilog=EPILOG,
    rich_markup_mode="markdown",
)
app.add_typer(admin_app, name="admin")

_SHOWN_FAILURES = 20
# The sample's columns: tokens all, never broken across lines (see cli/_table.py).
_SAMPLE = [Column(name) for name in ("id", "workflow", "state", "version", "updated")]

# -- the options every bulk command shares ------------------------------------------------------

Workflow = Annotated[
    str | None,
    typer.Option("--workflow", "-w", help="Only instances of this workflow.", show_default=False),
]
States = Annotated[
    list[str] | None,
    typer.Option(
        "--state",
        "-s",
        help="Only instances in this state (repeatable: any of them).",
        show_default=False,
    ),
]
Before = Annotated[
    str | None,
    typer.Option(
        "--updated-before",
        help="Only instances last changed before this: a time with its zone "
        "(2026-01-31T12:00:00Z) or an age (30m, 2h, 7d, 2w: that long before now, on this "
        "machine's clock).",
        show_default=False,
    ),
]
After = Annotated[
    str | None,
    typer.Option(
        "--updated-after",
        help="Only instances last changed after this (the same forms as --updated-before).",
        show_default=False,
    ),
]
Actor = Annotated[
    str | None,
    typer.Option(
        "--actor",
        help="Who does it, kept in each history row. Default: your user name.",
        show_default=False,
    ),
]
DryRun = Annotated[
    bool, typer.Option("--dry-run", help="Show the count and a sample; write nothing.")
]
Yes = Annotated[bool, typer.Option("--yes", "-y", help="Run without asking to confirm.")]
OperationId = Annotated[
    str | None,
    typer.Option(
        "--operation-id",
        help="The run's id (each instance's request id is bulk:OPERATION:INSTANCE). "
        "Default: derived from this command's options, so the same command run again "
        "finishes an interrupted run without doing anything twice.",
        show_default=False,
    ),
]
Batch = Annotated[
    int, typer.Option("--batch", min=1, max=MAX_LIMIT, help="Instances per page read.")
]
Concurrency = Annotated[
    int, typer.Option("--concurrency", min=1, max=256, help="Engine calls at once.")
]
Sample = Annotated[
    int, typer.Option("--sample", min=0, max=MAX_LIMIT, help="Instances shown before the run.")
]
MaxFailures = Annotated[
    int,
    typer.Option(
        "--max-failures",
        min=0,
        help="Stop taking new instances after this many failures (0: never stop).",
    ),
]
AppRef = Annotated[
    str | None,
    typer.Option(
        "--app",
        envvar="FLOWLOCK_APP",
        help="module:attr naming the workflows (as *flowlock serve --app*); force, fire and "
        "migrate need their definitions, pause and resume do not.",
        show_default=False,
    ),
]
DatabaseUrl = Annotated[
    str | None,
    typer.Option(
        "--database-url",
        envvar=ENV_DATABASE_URL,
        help="The database: postgresql://user@host:5432/db or sqlite:///path/to/file.db.",
        show_default=False,
    ),
]


# -- parsing -----------------------------------------------------------------------------------


def _moment(raw: str | None, option: str, now: datetime) -> datetime | None:
    """`raw` as a time: an ISO 8601 time with its zone, or an age before `now`."""
    if raw is None:
        return None
    text = raw.strip()
    age = age_or_none(text, option)
    if age is not None:
        return now - age
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        moment = None
    if moment is None or moment.utcoffset() is None:
        raise typer.BadParameter(
            f"{raw!r} is neither a time with its zone (2026-01-31T12:00:00Z) nor an age "
            f"({AGE_FORMS})",
            param_hint=f"'{option}'",
        )
    return moment


def _user() -> str | None:
    """Who runs the command, for the history rows when --actor is not given."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no user name in this environment (a bare container)
        return None


def _object(raw: str | None, option: str) -> dict[str, Any] | None:
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise typer.BadParameter(f"not JSON: {exc}", param_hint=f"'{option}'") from None
    if not isinstance(value, dict):
        raise typer.BadParameter("give a JSON object, {...}", param_hint=f"'{option}'")
    return value


class _Run:
    """One bulk command: its arguments as the engine takes them, and its operation id derived
    from the raw command-line values (so an age such as 2h, which names another time on every
    run, still names the same operation)."""

    def __init__(
        self, action: BulkAction, raw: Mapping[str, Any], operation_id: str | None
    ) -> None:
        self.action = action
        now = datetime.now(UTC)
        self.filters: dict[str, Any] = {
            "workflow": raw["workflow"],
            "states": raw["states"] or None,
            "updated_before": _moment(raw["updated_before"], "--updated-before", now),
            "updated_after": _moment(raw["updated_after"], "--updated-after", now),
        }
        self.does: dict[str, Any] = {
            name: value
            for name, value in {
                "state": raw.get("to"),
                "event": raw.get("event"),
                "payload": _object(raw.get("payload"), "--payload"),
                "data": _object(raw.get("data"), "--data"),
                "reason": raw.get("reason"),
                "actor": raw["actor"] if raw["actor"] is not None else _user(),
            }.items()
            if value is not None
        }
        self.operation_id = operation_id or derive_operation_id(f"cli:{action}", raw)

    async def report(self, engine: Engine, **run: Any) -> BulkReport:
        return await engine.bulk(
            self.action, **self.filters, **self.does, operation_id=self.operation_id, **run
        )


def _open(
    database_url: str | None,
    schema: str | None,
    app_ref: str | None,
    needs_app: bool,
    act: Callable[[Engine], Awaitable[_R]],
) -> _R:
    """`act(engine)` on an engine that may write, with the workflows of `app_ref` registered."""
    from flowlock.core.diagram import BadReference, load_workflows

    if needs_app and not app_ref:
        raise typer.BadParameter(
            "give --app module:attr (or set FLOWLOCK_APP) naming the workflows: this command "
            "runs their definitions",
            param_hint="'--app'",
        )
    try:
        workflows = load_workflows(app_ref) if app_ref else []
    except BadReference as exc:
        raise typer.BadParameter(str(exc), param_hint="'--app'") from None

    async def run(engine: Engine) -> _R:
        for wf in workflows:
            await engine.register(wf)
        return await act(engine)

    return _inspect(database_url, schema, run, writes=True)


# -- output ------------------------------------------------------------------------------------


def _print_selection(report: BulkReport, as_json: bool) -> None:
    if as_json or not report.matched:
        return
    console = stdout()
    print_rows(
        console,
        f"{report.matched} instance(s) match; the first {len(report.sample)}",
        _SAMPLE,
        [
            [
                _cell(inst.id),
                _cell(inst.workflow),
                _cell(inst.state),
                _cell(inst.version),
                _cell(when(inst.updated_at)),
            ]
            for inst in report.sample
        ],
    )
    print_wrapped(console, Text(f"operation id: {report.operation_id}"))


_NEW_ID = "pass --operation-id NEW"


def _report_json(report: BulkReport) -> dict[str, Any]:
    from flowlock._inspect import instance_dict

    return {
        **report.summary(),
        "note": report.replay_note(_NEW_ID),
        "sample": [instance_dict(i) for i in report.sample],
    }


def _print_summary(report: BulkReport) -> None:
    console = stdout()
    print_wrapped(
        console,
        Text(
            f"{report.action} {report.operation_id}: {report.applied} applied, "
            f"{report.skipped} skipped, {report.replayed} replayed, {len(report.failed)} "
            f"failed (of {report.matched} matched)",
            style="bold" if report.ok else "bold red",
        ),
    )
    note = report.replay_note(_NEW_ID)
    if note is not None:
        # Said on every rerun: a crash rerun that finished the rest is fine; the same command
        # sent again to redo what was undone since (a resume after a pause) did nothing.
        print_wrapped(console, Text(note, style="bold yellow" if report.only_replayed else ""))
    for iid, why in sorted(report.failed.items())[:_SHOWN_FAILURES]:
        print_wrapped(console, Text(f"{iid}: {why}", style="red"))
    if len(report.failed) > _SHOWN_FAILURES:
        print_wrapped(
            console, Text(f"... and {len(report.failed) - _SHOWN_FAILURES} more (--json)")
        )
    if report.stopped:
        print_wrapped(console, Text(report.stopped, style="yellow"))


def _confirm(report: BulkReport) -> None:
    try:
        go = typer.confirm(
            f"{report.action} {report.matched} instance(s) (operation {report.operation_id})?",
            err=True,
        )
    except typer.Abort:  # no answer (end of input, Ctrl-D)
        go = False
    if not go:
        fail("not confirmed; nothing was written (pass --yes to run without asking)")


def _bulk(
    run: _Run,
    *,
    dry_run: bool,
    yes: bool,
    as_json: bool,
    options: Mapping[str, Any],
    database_url: str | None,
    schema: str | None,
    app_ref: str | None,
) -> None:
    """Count and sample, show them, confirm, run with a progress bar, summarize."""
    needs_app = run.action in ("force", "fire")
    sample = options["sample"]

    async def look(engine: Engine) -> BulkReport:
        return await run.report(engine, dry_run=True, sample=sample)

    seen = _open(database_url, schema, app_ref, needs_app, look)
    _print_selection(seen, as_json)
    if dry_run or seen.matched == 0:
        if as_json:
            _json(_report_json(seen))
        elif seen.matched == 0:
            stderr().print(Text("nothing matches; nothing to do", style="yellow"))
        return
    if not yes:
        _confirm(seen)
    console = stderr()
    with Progress(
        TextColumn(f"{run.action}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=not console.is_terminal,
        transient=False,
    ) as bar:
        task = bar.add_task(run.action, total=seen.matched)

        def progress(done: int) -> None:
            bar.update(task, completed=done)

        async def act(engine: Engine) -> BulkReport:
            return await run.report(engine, progress=progress, **options)

        try:
            report = _open(database_url, schema, app_ref, needs_app, act)
        except typer.Exit as stopped:
            if stopped.exit_code:  # an error or Ctrl-C: said already; say how to finish
                stderr().print(
                    Text(
                        f"operation {run.operation_id} did not finish: run the same command "
                        "again to do the rest (what was done is replayed, not done twice)",
                        style="yellow",
                    )
                )
            raise
    if as_json:
        _json(_report_json(report))
    else:
        _print_summary(report)
    if not report.ok:
        raise typer.Exit(EXIT_ERROR)
    if report.only_replayed:
        raise typer.Exit(EXIT_REPLAYED)


def _options(batch: int, concurrency: int, sample: int, max_failures: int) -> dict[str, Any]:
    return {
        "batch": batch,
        "concurrency": concurrency,
        "sample": sample,
        "max_failures": max_failures or None,
    }


_BULK_HELP = (
    "It counts the instances the filters select and shows the first few, then asks to "
    "confirm (unless --yes; --dry-run stops after showing them). It walks them in pages, a "
    "few calls at once, with a progress bar, and prints what was applied, skipped and failed "
    "(--json for scripts). Each instance's call has the request id bulk:OPERATION:INSTANCE: "
    "the same command run again after a crash replays what was done (not done twice) and "
    "does the rest; to run it again on purpose (pause again what was resumed since), pass a "
    "new --operation-id. Exit 1 when any instance failed; exit 3 when nothing was applied "
    "because every instance was done earlier under this operation id."
)


@admin_app.command(epilog=_BULK_HELP)
def force(
    to: Annotated[
        str, typer.Option("--to", help="The state to force each instance to.", show_default=False)
    ],
    reason: Annotated[
        str, typer.Option("--reason", help="Why; kept in each history row.", show_default=False)
    ],
    workflow: Workflow = None,
    state: States = None,
    updated_before: Before = None,
    updated_after: After = None,
    data: Annotated[
        str | None,
        typer.Option(
            "--data",
            help="JSON object to set as each instance's data (default: keep it).",
            show_default=False,
        ),
    ] = None,
    actor: Actor = None,
    dry_run: DryRun = False,
    yes: Yes = False,
    operation_id: OperationId = None,
    as_json: AsJson = False,
    batch: Batch = 500,
    concurrency: Concurrency = 16,
    sample: Sample = 10,
    max_failures: MaxFailures = 100,
    app_ref: AppRef = None,
    database_url: DatabaseUrl = None,
    schema: InspectSchema = None,
) -> None:
    """Force every selected instance to the state --to, with a reason: a history row of its
    own (a repair through the compare-and-swap, never a bare UPDATE).

    The selection is checked again on the read each write is decided on: an instance that
    left it meanwhile is skipped."""
    raw = {
        "workflow": workflow, "states": state, "updated_before": updated_before,
        "updated_after": updated_after, "to": to, "data": data, "reason": reason, "actor": actor,
    }  # fmt: skip
    _bulk(
        _Run("force", raw, operation_id), dry_run=dry_run, yes=yes, as_json=as_json,
        options=_options(batch, concurrency, sample, max_failures),
        database_url=database_url, schema=schema, app_ref=app_ref,
    )  # fmt: skip


@admin_app.command(epilog=_BULK_HELP)
def pause(
    reason: Annotated[
        str, typer.Option("--reason", help="Why; kept in each history row.", show_default=False)
    ],
    workflow: Workflow = None,
    state: States = None,
    updated_before: Before = None,
    updated_after: After = None,
    actor: Actor = None,
    dry_run: DryRun = False,
    yes: Yes = False,
    operation_id: OperationId = None,
    as_json: AsJson = False,
    batch: Batch = 500,
    concurrency: Concurrency = 16,
    sample: Sample = 10,
    max_failures: MaxFailures = 100,
    app_ref: AppRef = None,
    database_url: DatabaseUrl = None,
    schema: InspectSchema = None,
) -> None:
    """Pause every selected instance: it refuses events until resumed (one history row each;
    one already paused is skipped). A whole workflow is paused in one row instead, by
    engine.pause(workflow=...) or POST /admin/workflows/NAME/pause."""
    raw = {
        "workflow": workflow, "states": state, "updated_before": updated_before,
        "updated_after": updated_after, "reason": reason, "actor": actor,
    }  # fmt: skip
    _bulk(
        _Run("pause", raw, operation_id), dry_run=dry_run, yes=yes, as_json=as_json,
        options=_options(batch, concurrency, sample, max_failures),
        database_url=database_url, schema=schema, app_ref=app_ref,
    )  # fmt: skip


@admin_app.command(epilog=_BULK_HELP)
def resume(
    workflow: Workflow = None,
    state: States = None,
    updated_before: Before = None,
    updated_after: After = None,
    reason: Annotated[
        str | None,
        typer.Option("--reason", help="Why; kept in each history row.", show_default=False),
    ] = None,
    actor: Actor = None,
    dry_run: DryRun = False,
    yes: Yes = False,
    operation_id: OperationId = None,
    as_json: AsJson = False,
    batch: Batch = 500,
    concurrency: Concurrency = 16,
    sample: Sample = 10,
    max_failures: MaxFailures = 100,
    app_ref: AppRef = None,
    database_url: DatabaseUrl = None,
    schema: InspectSchema = None,
) -> None:
    """Resume every selected instance that is paused (one not paused is skipped)."""
    raw = {
        "workflow": workflow, "states": state, "updated_before": updated_before,
        "updated_after": updated_after, "reason": reason, "actor": actor,
    }  # fmt: skip
    _bulk(
        _Run("resume", raw, operation_id), dry_run=dry_run, yes=yes, as_json=as_json,
        options=_options(batch, concurrency, sample, max_failures),
        database_url=database_url, schema=schema, app_ref=app_ref,
    )  # fmt: skip


@admin_app.command(epilog=_BULK_HELP)
def fire(
    event: Annotated[
        str, typer.Option("--event", "-e", help="The event to fire.", show_default=False)
    ],
    workflow: Workflow = None,
    state: States = None,
    updated_before: Before = None,
    updated_after: After = None,
    payload: Annotated[
        str | None,
        typer.Option("--payload", help="JSON object passed to each call.", show_default=False),
    ] = None,
    actor: Actor = None,
    dry_run: DryRun = False,
    yes: Yes = False,
    operation_id: OperationId = None,
    as_json: AsJson = False,
    batch: Batch = 500,
    concurrency: Concurrency = 16,
    sample: Sample = 10,
    max_failures: MaxFailures = 100,
    app_ref: AppRef = None,
    database_url: DatabaseUrl = None,
    schema: InspectSchema = None,
) -> None:
    """Fire an event at every selected instance, as engine.fire would (guards and effects
    run; a refused one is a failure)."""
    raw = {
        "workflow": workflow, "states": state, "updated_before": updated_before,
        "updated_after": updated_after, "event": event, "payload": payload, "actor": actor,
    }  # fmt: skip
    _bulk(
        _Run("fire", raw, operation_id), dry_run=dry_run, yes=yes, as_json=as_json,
        options=_options(batch, concurrency, sample, max_failures),
        database_url=database_url, schema=schema, app_ref=app_ref,
    )  # fmt: skip
