"""`flowlock admin purge|restore|hold|unhold|holds`: retention from the command line."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from flowlock.cli._age import parse_age
from flowlock.cli._common import fail, stderr, stdout
from flowlock.cli._table import Column, print_rows, print_wrapped
from flowlock.cli.admin import admin_app
from flowlock.cli.inspect import AsJson, InspectSchema, _cell, _inspect, _json
from flowlock.cli.inspect import _when as when
from flowlock.cli.outbox import RepairDatabaseUrl, _confirmed
from flowlock.core.definition import Workflow
from flowlock.core.errors import InvalidInput
from flowlock.core.retention import Hold, PurgeReport, RestoreReport
from flowlock.engine import Engine

__all__ = ["hold", "holds", "purge", "restore", "unhold"]

InstanceArg = Annotated[
    str, typer.Argument(metavar="ID", help="The instance's id.", show_default=False)
]
Yes = Annotated[bool, typer.Option("--yes", "-y", help="Go ahead without asking.")]
_HOLDS = (Column("instance"), Column("reason", text=True), Column("actor"), Column("since"))

Actor = Annotated[
    str | None, typer.Option("--actor", help="Who does it (kept with the hold, logged).")
]


def _definition(app_ref: str | None, workflow: str) -> Workflow | None:
    """The definition of `workflow` in the workflows `app_ref` names. Without one, as for
    `flowlock serve`, flowlock's examples (said on stderr, since --final reads its states);
    None when the examples have no such workflow."""
    if app_ref is None:
        from flowlock import examples

        found = {wf.name: wf for wf in examples.defaults()}.get(workflow)
        if found is not None:
            finals = ", ".join(s for s in found.states if found.is_final(s))
            stderr().print(
                f"--final: the final states of flowlock's example {workflow!r} ({finals}), "
                "as flowlock serve uses without --app; give --app module:attr for your own "
                "definition",
                markup=False,
                highlight=False,
            )
        return found
    from flowlock.core.diagram import BadReference, load_workflows

    try:
        found_all = {wf.name: wf for wf in load_workflows(app_ref)}
    except BadReference as exc:
        raise typer.BadParameter(str(exc), param_hint="'--app'") from None
    if workflow not in found_all:
        raise typer.BadParameter(
            f"{app_ref} defines {sorted(found_all)}, not {workflow!r}", param_hint="'--app'"
        )
    return found_all[workflow]


async def _same_as_example(engine: Engine, example: Workflow) -> None:
    """Refuse to read final states from flowlock's example when the database holds instances of
    that name in states the example lacks: then it is the user's own workflow."""
    total = await engine.count(example.name)
    known = await engine.count(example.name, list(example.states))
    if total != known:
        raise InvalidInput(
            f"{total - known} instance(s) of {example.name!r} are in states flowlock's example "
            f"{example.name!r} does not have, so this is your own workflow: give --app "
            "module:attr (or FLOWLOCK_APP) naming its definition, or name the states with --state. "
            "Nothing was purged"
        )


def _report_dict(report: PurgeReport | RestoreReport) -> dict[str, Any]:
    out = dataclasses.asdict(report)
    for key in ("archive", "path"):
        if out.get(key) is not None:
            out[key] = str(out[key])
    return out


@contextmanager
def _bar(total: int | None, what: str) -> Iterator[Callable[[int], None]]:
    """A rich progress bar on stderr; yields the callback that advances it."""
    columns = (TextColumn(what), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=stderr(), transient=True) as progress:
        task = progress.add_task(what, total=total)
        yield lambda n: progress.advance(task, n)


@admin_app.command("purge")
def purge(
    workflow: Annotated[
        str, typer.Option("--workflow", "-w", help="The workflow whose instances go.")
    ],
    older_than: Annotated[
        str,
        typer.Option(
            "--older-than",
            help="Only instances whose last transition is older than this, on the database's "
            "clock: 2w, 90d, 12h, 30m or 45s (at most 100 years).",
            show_default=False,
        ),
    ],
    final: Annotated[
        bool,
        typer.Option(
            "--final",
            help="Only instances in a final state of the definition: that of --app, or without "
            "it of flowlock's examples (as flowlock serve uses).",
        ),
    ] = False,
    states: Annotated[
        list[str] | None,
        typer.Option("--state", "-s", help="Only instances in this state (repeat for more)."),
    ] = None,
    archive: Annotated[
        Path | None,
        typer.Option(
            "--archive",
            help="Write every purged instance with its history here first (gzip JSON Lines, a "
            "manifest beside it). A new file: never overwritten.",
            dir_okay=False,
        ),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Count what would go; delete nothing.")
    ] = False,
    batch: Annotated[
        int, typer.Option("--batch", min=1, max=10_000, help="Instances per transaction.")
    ] = 500,
    app_ref: Annotated[
        str | None,
        typer.Option(
            "--app",
            envvar="FLOWLOCK_APP",
            help="module:attr naming the workflows (as for serve): --final reads the final "
            "states from it. Without it, flowlock's examples (approval, countersign, inventory).",
        ),
    ] = None,
    yes: Yes = False,
    as_json: AsJson = False,
    database_url: RepairDatabaseUrl = None,
    schema: InspectSchema = None,
) -> None:
    """Delete old instances of a workflow, with their history, timers, outbox messages and
    create records, in batches of short transactions.

    Shows the count first and asks before deleting, unless --yes. A held instance (`flowlock
    admin hold`) is never purged, nor one with an outbox message still to deliver; one that
    moves while the purge runs is kept. With --archive, each batch is written and fsynced to
    the archive before its delete commits; `flowlock admin restore` reads it back.

    Writes. Exits 1 on an error or when the confirmation is declined.
    """
    age = parse_age(older_than)
    if not final and not states:
        raise typer.BadParameter(
            "say what to purge: --final (the definition's final states, with --app) or "
            "--state NAME",
            param_hint="'--final' / '--state'",
        )
    definition = _definition(app_ref, workflow) if final else None
    if final and definition is None:
        raise typer.BadParameter(
            "--final reads the final states from the workflow's definition: give --app "
            "module:attr (or FLOWLOCK_APP), or name the states with --state",
            param_hint="'--app'",
        )

    async def run(engine: Engine, dry: bool, progress: Callable[[int], None] | None) -> PurgeReport:
        if definition is not None:
            await engine.register(definition)
            if app_ref is None:
                await _same_as_example(engine, definition)
        return await engine.purge(
            workflow, older_than=age, final=final, states=states, archive=archive,
            batch=batch, dry_run=dry, progress=progress,
        )  # fmt: skip

    counted = _inspect(database_url, schema, lambda e: run(e, True, None), writes=True)
    if dry_run or counted.matched == 0:
        _print_purge(counted, as_json)
        return
    print_wrapped(
        stderr(),
        Text(
            f"{counted.matched} instance(s) of {workflow!r} older than {older_than} would be "
            f"purged ({counted.held} more held)",
            style="bold",
        ),
    )
    if not yes and not _confirmed(f"Purge {counted.matched} instance(s)? This deletes them"):
        fail("nothing purged: answer y to the question, or pass --yes")
    with _bar(counted.matched, "purging") as advance:
        report = _inspect(database_url, schema, lambda e: run(e, False, advance), writes=True)
    _print_purge(report, as_json)


def _print_purge(report: PurgeReport, as_json: bool) -> None:
    if as_json:
        _json(_report_dict(report))
        return
    if report.dry_run:
        print_wrapped(
            stdout(),
            Text(
                f"dry run: {report.matched} instance(s) of {report.workflow!r} would be purged, "
                f"{report.held} more are held; nothing was deleted",
                style="green",
            ),
        )
        return
    line = (
        f"purged {report.purged} instance(s) of {report.workflow!r} in {report.batches} "
        f"batch(es); longest batch {report.longest_batch * 1000:.1f} ms"
    )
    if report.kept:
        line += f"; {report.kept} kept (they moved or were held while the purge ran)"
    print_wrapped(stdout(), Text(line, style="green"))
    if report.archive is not None:
        print_wrapped(stdout(), Text(f"archive: {report.archive} (and its .manifest.json)"))


@admin_app.command("restore")
def restore(
    path: Annotated[
        Path,
        typer.Argument(
            metavar="FILE",
            help="An archive `flowlock admin purge --archive` wrote.",
            dir_okay=False,
            show_default=False,
        ),
    ],
    verify: Annotated[
        bool,
        typer.Option(
            "--verify/--no-verify",
            help="Check the manifest (sha256, line count) first. --no-verify reads an archive "
            "whose purge did not finish (no manifest), up to its last complete line.",
        ),
    ] = True,
    batch: Annotated[
        int, typer.Option("--batch", min=1, max=10_000, help="Instances per transaction.")
    ] = 500,
    as_json: AsJson = False,
    database_url: RepairDatabaseUrl = None,
    schema: InspectSchema = None,
) -> None:
    """Insert an archive's instances back with their history, verbatim (versions, request ids,
    timestamps, fencing tokens). An id that exists is skipped and reported. `flowlock check`
    passes on the result.

    Writes. Exits 1 when the archive fails its manifest (nothing is restored then).
    """
    from flowlock.admin.archive import manifest_path

    total = None
    # Without a readable manifest the bar has no end; the restore says what is wrong with it.
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        total = int(json.loads(manifest_path(path).read_text(encoding="utf-8"))["lines"])

    with _bar(total, "restoring") as advance:
        report = _inspect(
            database_url,
            schema,
            lambda e: e.restore(path, verify=verify, batch=batch, progress=advance),
            writes=True,
        )
    if as_json:
        _json(_report_dict(report))
        return
    print_wrapped(
        stdout(),
        Text(
            f"restored {report.restored} of {report.lines} instance(s) from {report.path}",
            style="green",
        ),
    )
    if report.skipped:
        print_wrapped(
            stderr(),
            Text(
                f"{len(report.skipped)} skipped (the id exists): " + ", ".join(report.skipped),
                style="yellow",
            ),
        )


@admin_app.command("hold")
def hold(
    instance_id: InstanceArg,
    reason: Annotated[
        str, typer.Option("--reason", help="Why it must be kept (a case number, say).")
    ],
    actor: Actor = None,
    as_json: AsJson = False,
    database_url: RepairDatabaseUrl = None,
    schema: InspectSchema = None,
) -> None:
    """Place a legal hold on an instance: no purge deletes it until `flowlock admin unhold`.
    Idempotent (a held instance keeps its first hold). The id need not exist: a warning says
    so (purged already, or not created yet).

    Writes.
    """
    placed = _inspect(
        database_url, schema, lambda e: e.hold(instance_id, reason=reason, actor=actor),
        writes=True,
    )  # fmt: skip
    if as_json:
        _json(_hold_dict(placed))
    else:
        print_wrapped(
            stdout(), Text(f"held {instance_id} since {when(placed.at)}: {placed.reason}")
        )
    if not placed.instance_found:
        print_wrapped(
            stderr(),
            Text(
                f"no instance has the id {instance_id} (purged already, or not created or "
                "restored yet): the hold stands for it all the same",
                style="yellow",
            ),
        )


@admin_app.command("unhold")
def unhold(
    instance_id: InstanceArg,
    actor: Actor = None,
    database_url: RepairDatabaseUrl = None,
    schema: InspectSchema = None,
) -> None:
    """Lift an instance's hold. Exits 1 when it had none.

    Writes.
    """
    lifted = _inspect(
        database_url, schema, lambda e: e.unhold(instance_id, actor=actor), writes=True
    )
    if not lifted:
        fail(f"{instance_id!r} has no hold; nothing changed")
    print_wrapped(stdout(), Text(f"hold on {instance_id} lifted"))


@admin_app.command("holds")
def holds(
    limit: Annotated[int, typer.Option("--limit", "-n", min=1, max=10_000)] = 100,
    after: Annotated[
        str | None, typer.Option("--after", help="Start after this instance id (paging).")
    ] = None,
    as_json: AsJson = False,
    database_url: RepairDatabaseUrl = None,
    schema: InspectSchema = None,
) -> None:
    """List the legal holds, by instance id.

    Read-only.
    """
    found = _inspect(database_url, schema, lambda e: e.holds(after=after, limit=limit))
    if as_json:
        _json([_hold_dict(h) for h in found])
        return
    rows = [
        [_cell(h.instance_id), _cell(h.reason), _cell(h.actor), _cell(when(h.at))] for h in found
    ]
    print_rows(stdout(), f"{len(found)} hold(s)", _HOLDS, rows)


def _hold_dict(h: Hold) -> dict[str, Any]:
    found = {} if h.instance_found is None else {"instance_found": h.instance_found}
    return {
        "instance_id": h.instance_id, "reason": h.reason, "actor": h.actor, "at": when(h.at),
        **found,
    }  # fmt: skip
