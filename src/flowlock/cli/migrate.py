"""`flowlock admin migrate`: move a workflow's instances to another definition version, one
`migrated` history row each, through the engine (the compare-and-swap, never a bare UPDATE)."""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from flowlock.cli._common import EXIT_ERROR, fail, stderr, stdout
from flowlock.cli._table import Column, print_rows, print_wrapped
from flowlock.cli.admin import (
    Actor,
    AppRef,
    Batch,
    Concurrency,
    DatabaseUrl,
    DryRun,
    MaxFailures,
    OperationId,
    Sample,
    States,
    Yes,
    _open,
    _user,
    admin_app,
)
from flowlock.cli.inspect import AsJson, InspectSchema, _cell, _json
from flowlock.cli.inspect import _when as when
from flowlock.core.bulk import derive_operation_id
from flowlock.core.migration import MigrationReport
from flowlock.engine import Engine

__all__ = ["migrate"]

_MOVES = [Column(name) for name in ("from version", "from state", "to state", "instances")]
_SAMPLE = [Column(name) for name in ("id", "state", "version", "definition", "updated")]
_SHOWN_FAILURES = 20

_HELP = (
    "It reads every selected instance first and prints how many go from each (version, "
    "state) to each state of the target version. A state the target version lacks, and "
    "that no --map names, is stranded: the run is refused and nothing is written (exit 1; "
    "--dry-run exits 1 too). Otherwise it asks to confirm (unless --yes; --dry-run stops "
    "after the counts), then walks the instances in pages, a few calls at once, with a "
    "progress bar. Each instance's row has the request id bulk:OPERATION:INSTANCE, so a retry "
    "never writes it twice; instances on the target version already are left alone, so the "
    "same command run again after a crash does the rest. Live traffic may go on: each row is "
    "decided on the instance as it is when written. Exit 1 when any instance failed."
)


def _state_map(pairs: list[str] | None) -> dict[str, str]:
    renames: dict[str, str] = {}
    for pair in pairs or ():
        old, sep, new = pair.partition("=")
        if not sep or not old.strip() or not new.strip():
            raise typer.BadParameter(f"give OLD=NEW, not {pair!r}", param_hint="'--map'")
        if old.strip() in renames:
            raise typer.BadParameter(f"state {old.strip()!r} is mapped twice", param_hint="'--map'")
        renames[old.strip()] = new.strip()
    return renames


def _print_survey(report: MigrationReport) -> None:
    console = stdout()
    stranded = report.stranded
    print_rows(
        console,
        f"{report.matched} instance(s) of {report.workflow!r} to migrate to version "
        f"{report.to_version}; {report.already} on it already",
        _MOVES,
        [
            [
                _cell(m.from_version),
                _cell(m.from_state),
                Text(m.to_state)
                if m.from_state not in stranded
                else Text(f"{m.to_state} (stranded)", style="bold red"),
                _cell(m.count),
            ]
            for m in report.moves
        ],
    )
    if report.sample:
        print_rows(
            console,
            f"the first {len(report.sample)}",
            _SAMPLE,
            [
                [
                    _cell(i.id),
                    _cell(i.state),
                    _cell(i.version),
                    _cell(i.definition_version),
                    _cell(when(i.updated_at)),
                ]
                for i in report.sample
            ],
        )
    print_wrapped(console, Text(f"operation id: {report.operation_id}"))


def _report_json(report: MigrationReport) -> dict[str, Any]:
    from flowlock._inspect import instance_dict

    return {**report.summary(), "sample": [instance_dict(i) for i in report.sample]}


def _stranded(report: MigrationReport) -> str:
    listed = ", ".join(f"{state!r} ({n})" for state, n in report.stranded.items())
    return (
        f"stranded: version {report.to_version} has no state for {listed}; map each "
        "(--map OLD=NEW). Nothing was written"
    )


def _print_summary(report: MigrationReport) -> None:
    console = stdout()
    print_wrapped(
        console,
        Text(
            f"migrate {report.operation_id}: {report.applied} migrated, {report.skipped} "
            f"skipped, {report.replayed} replayed, {len(report.failed)} failed (of "
            f"{report.matched}) in {report.seconds:.1f} s ({report.rate:.0f} instances/s)",
            style="bold" if report.ok else "bold red",
        ),
    )
    for iid, why in sorted(report.failed.items())[:_SHOWN_FAILURES]:
        print_wrapped(console, Text(f"{iid}: {why}", style="red"))
    if len(report.failed) > _SHOWN_FAILURES:
        print_wrapped(
            console, Text(f"... and {len(report.failed) - _SHOWN_FAILURES} more (--json)")
        )
    if report.stopped:
        print_wrapped(console, Text(report.stopped, style="yellow"))


@admin_app.command(epilog=_HELP)
def migrate(
    workflow: Annotated[str, typer.Argument(help="The workflow whose instances to migrate.")],
    to: Annotated[
        int,
        typer.Option(
            "--to", min=1, help="The definition version to migrate to.", show_default=False
        ),
    ],
    state_map: Annotated[
        list[str] | None,
        typer.Option(
            "--map",
            help="OLD=NEW: instances in state OLD go to state NEW of the target version "
            "(repeatable). A state not named keeps its name.",
            show_default=False,
        ),
    ] = None,
    state: States = None,
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
    """Migrate the instances of WORKFLOW to definition version --to: each gets a `migrated`
    history row that moves it to its mapped state and makes it run that version.

    --app must name the workflow's definition of that version (the engine registers it;
    an older version's instances need not be registered here)."""
    renames = _state_map(state_map)
    who = actor if actor is not None else _user()
    raw = {"workflow": workflow, "to": to, "map": renames, "states": state, "actor": who}
    op = operation_id or derive_operation_id("cli:migrate", raw)
    args: dict[str, Any] = {
        "state_map": renames, "state": state or None, "actor": who, "operation_id": op,
        "batch": batch, "concurrency": concurrency, "sample": sample,
        "max_failures": max_failures or None,
    }  # fmt: skip

    async def look(engine: Engine) -> MigrationReport:
        return await engine.migrate(workflow, to, dry_run=True, **args)

    # The survey is read as a dry run; it reports the run asked for (nothing to do, or refused).
    seen = replace(_open(database_url, schema, app_ref, True, look), dry_run=dry_run)
    if as_json:
        if dry_run or seen.stranded or not seen.matched:
            _json(_report_json(seen))
    else:
        _print_survey(seen)
    idle = sorted(set(renames) - {m.from_state for m in seen.moves})
    if idle and seen.matched:  # a typo in --map would otherwise pass unseen
        stderr().print(
            Text(f"--map names no state a selected instance is in: {', '.join(idle)}", "yellow")
        )
    if seen.stranded:
        if not as_json:
            print_wrapped(stdout(), Text(_stranded(seen), style="bold red"))
        raise typer.Exit(EXIT_ERROR)
    if dry_run:
        return
    if seen.matched == 0:
        if not as_json:
            stderr().print(Text("nothing to migrate", style="yellow"))
        return
    if not yes:
        _confirm(seen)
    report = _run(seen, workflow, to, args, database_url, schema, app_ref)
    if as_json:
        _json(_report_json(report))
    else:
        _print_summary(report)
    if not report.ok:
        raise typer.Exit(EXIT_ERROR)


def _confirm(seen: MigrationReport) -> None:
    try:
        go = typer.confirm(
            f"migrate {seen.matched} instance(s) of {seen.workflow!r} to version "
            f"{seen.to_version} (operation {seen.operation_id})?",
            err=True,
        )
    except typer.Abort:  # no answer (end of input, Ctrl-D)
        go = False
    if not go:
        fail("not confirmed; nothing was written (pass --yes to run without asking)")


def _run(
    seen: MigrationReport,
    workflow: str,
    to: int,
    args: dict[str, Any],
    database_url: str | None,
    schema: str | None,
    app_ref: str | None,
) -> MigrationReport:
    console = stderr()
    with Progress(
        TextColumn("migrate"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=not console.is_terminal,
        transient=False,
    ) as bar:
        task = bar.add_task("migrate", total=seen.matched)

        def progress(done: int) -> None:
            bar.update(task, completed=done)

        async def act(engine: Engine) -> MigrationReport:
            return await engine.migrate(workflow, to, progress=progress, **args)

        try:
            return _open(database_url, schema, app_ref, True, act)
        except typer.Exit as stopped:
            if stopped.exit_code:  # an error or Ctrl-C: said already; say how to finish
                console.print(
                    Text(
                        f"operation {seen.operation_id} did not finish: run the same command "
                        "again to do the rest (what was done is left alone, not done twice)",
                        style="yellow",
                    )
                )
            raise
