"""Read-only commands on a database (show, history, list, check, timers) and `diagram`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Annotated, TypeVar

import typer
from rich.text import Text

from flowlock.cli._common import (
    ENV_DATABASE_URL,
    ENV_SCHEMA,
    EXIT_VERDICT_FAILED,
    app,
    errors_as_exit,
    fail,
    stderr,
    stdout,
)
from flowlock.cli._table import Column, print_record, print_rows, print_wrapped
from flowlock.core.definition import MAX_AFTER
from flowlock.core.errors import FlowlockError, InvalidInput
from flowlock.core.models import HistoryEntry, Instance, Timer
from flowlock.core.versions import DefinitionVersion
from flowlock.engine import Engine
from flowlock.stores.base import TimerStore

__all__ = ["check_command", "diagram", "history", "list_instances", "show", "timers"]

_R = TypeVar("_R")

# The columns of each listing: tokens, never broken across lines (see cli/_table.py), but for
# history's reason, an operator's free text that wraps at spaces.
_HISTORY = [*(Column(name) for name in ("version", "event", "kind", "from -> to", "actor",
                                        "request id", "strategy", "at", "fencing token")),
            Column("reason", text=True)]  # fmt: skip
_INSTANCES = [Column(name) for name in ("id", "workflow", "state", "version", "last event",
                                        "updated")]  # fmt: skip
_TIMERS = [Column(name) for name in ("instance", "workflow", "event", "stay", "firing", "due at",
                                     "lag", "claimed until")]  # fmt: skip


@app.command()
def diagram(
    reference: Annotated[
        str,
        typer.Argument(
            metavar="MODULE:ATTR",
            help="Where the workflow is: a module and an attribute holding a Workflow, a list of "
            "them, or a function returning one or a list (e.g. myapp.flows:approval).",
            show_default=False,
        ),
    ],
) -> None:
    """Print a workflow as a Mermaid stateDiagram-v2 (states, events, guarded transitions).

    Paste the output into any Markdown that renders Mermaid, or the Mermaid live editor. The
    current directory is importable, so run it from your project's root."""
    from flowlock.core.diagram import BadReference, load_workflows, render

    try:
        workflows = load_workflows(reference)
    except BadReference as exc:
        raise typer.BadParameter(str(exc), param_hint="'MODULE:ATTR'") from None
    except FlowlockError as exc:
        fail(str(exc))
    typer.echo(render(workflows), nl=False)


# -- inspection -----------------------------------------------------------------------------


InspectDatabaseUrl = Annotated[
    str | None,
    typer.Option(
        "--database-url",
        envvar=ENV_DATABASE_URL,
        help="The database to read: postgresql://user@host:5432/db or sqlite:///path/to/file.db.",
        show_default=False,
    ),
]
InspectSchema = Annotated[
    str | None,
    typer.Option(
        "--schema",
        envvar=ENV_SCHEMA,
        help="PostgreSQL only: the schema flowlock's tables are in (as given to db migrate).",
        show_default=False,
    ),
]
InstanceId = Annotated[
    str, typer.Argument(metavar="ID", help="The instance's id.", show_default=False)
]
AsJson = Annotated[
    bool, typer.Option("--json", help="Print JSON for scripts instead of text for people.")
]


def _inspect(
    database_url: str | None,
    schema: str | None,
    read: Callable[[Engine], Awaitable[_R]],
    *,
    writes: bool = False,
) -> _R:
    """`read(engine)` on a read-only engine over the database, or, with `writes`, on one that
    may write (the repairs: it still fires and delivers nothing itself).

    A missing URL is a usage error (exit 2); a flowlock error is one red line (exit 1).
    """
    from flowlock._inspect import open_for_repair, open_readonly

    if not database_url:
        raise typer.BadParameter(
            f"give --database-url or set {ENV_DATABASE_URL}", param_hint="'--database-url'"
        )
    opener = open_for_repair if writes else open_readonly

    async def run() -> _R:
        async with opener(database_url, schema) as engine:
            return await read(engine)

    with errors_as_exit():
        return asyncio.run(run())


def _json(value: object) -> None:
    # default=str: data is JSON already; this only guards against a store handing back odd types.
    typer.echo(json.dumps(value, indent=2, ensure_ascii=False, default=str))


def _cell(value: object) -> Text:
    # Text, not markup: ids, data and actors are the user's and may hold "[...]".
    return Text("-" if value is None else str(value))


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _when(moment: datetime | None) -> str | None:
    return None if moment is None else moment.isoformat(sep=" ", timespec="seconds")


@app.command()
def show(
    instance_id: InstanceId,
    as_json: AsJson = False,
    database_url: InspectDatabaseUrl = None,
    schema: InspectSchema = None,
) -> None:
    """Print one instance: workflow, state, version, the definition version it runs (and
    whether its state is missing from the newest stored definition), whether it is paused (on
    its own, or with its whole workflow), data, last event, created and updated, and its next
    timer (the earliest armed: event, due time, the stay that armed it).

    Read-only. Exits 1 if no instance has that id."""
    from flowlock._inspect import instance_dict, next_timer_dict

    async def read(engine: Engine) -> tuple[Instance, DefinitionVersion | None]:
        inst = await engine.get(instance_id)
        stored = await engine.definitions(inst.workflow)
        return inst, stored[-1] if stored else None

    inst, newest = _inspect(database_url, schema, read)
    # A state the newest stored definition lacks is not a final state: the instance runs its
    # own (older) version, or was left there by a deploy. Say so, and which version it runs.
    missing = newest is not None and inst.state not in newest.definition.get("states", ())
    if as_json:
        _json(
            {
                **instance_dict(inst),
                "next_timer": next_timer_dict(inst),
                "newest_definition_version": None if newest is None else newest.version,
                "state_in_newest_definition": None if newest is None else not missing,
            }
        )
        return
    runs = "-" if inst.definition_version is None else f"version {inst.definition_version}"
    if newest is not None and missing:
        runs += (
            f" (state {inst.state!r} is not in the newest definition, version "
            f"{newest.version}: keep its version registered, or migrate the instance)"
        )
    nxt = inst.next_timer
    upcoming = None if nxt is None else f"{nxt.event} due {_when(nxt.due_at)} (stay {nxt.stay})"
    data = json.dumps(dict(inst.data), ensure_ascii=False, default=str)
    fields = [
        (Column("id"), inst.id),
        (Column("workflow"), inst.workflow),
        (Column("state"), inst.state),
        (Column("version"), inst.version),
        (Column("definition", text=True), runs),
        (Column("paused"), _yes(inst.paused)),
        (Column("workflow paused"), _yes(inst.workflow_paused)),
        (Column("last event"), inst.last_event),
        (Column("created"), _when(inst.created_at)),
        (Column("updated"), _when(inst.updated_at)),
        (Column("next timer", text=True), upcoming),
        (Column("data", text=True), data),
    ]
    print_record(stdout(), [(column, _cell(value)) for column, value in fields])


@app.command()
def history(
    instance_id: InstanceId,
    as_json: AsJson = False,
    database_url: InspectDatabaseUrl = None,
    schema: InspectSchema = None,
) -> None:
    """Print an instance's applied transitions, oldest first.

    Each row: version, event, kind (transition, forced, pause, resume or migrated), from -> to,
    actor, request id, strategy, when, fencing token, and an operator's reason (forced, pause
    and resume rows). --json adds each row's data and payload.

    Read-only. Exits 1 if no instance has that id.
    """
    from flowlock._inspect import entry_dict

    async def read(engine: Engine) -> list[HistoryEntry]:
        await engine.get(instance_id)  # an unknown id is an error, not an empty history
        return await engine.history(instance_id)

    rows = _inspect(database_url, schema, read)
    if as_json:
        _json([entry_dict(e) for e in rows])
        return
    print_rows(
        stdout(),
        f"history of {instance_id} ({len(rows)} transition(s))",
        _HISTORY,
        [
            [
                _cell(e.version),
                _cell(e.event),
                _cell(e.kind),
                _cell(f"{e.from_state} -> {e.to_state}"),
                _cell(e.actor),
                _cell(e.request_id),
                _cell(e.strategy),
                _cell(_when(e.at)),
                _cell(e.fencing_token),
                _cell(e.reason),
            ]
            for e in rows
        ],
    )


@app.command("list")
def list_instances(
    workflow: Annotated[
        str | None,
        typer.Option(
            "--workflow", "-w", help="Only instances of this workflow.", show_default=False
        ),
    ] = None,
    state: Annotated[
        list[str] | None,
        typer.Option(
            "--state",
            "-s",
            help="Only instances in this state (repeatable: any of them).",
            show_default=False,
        ),
    ] = None,
    limit: Annotated[
        int, typer.Option("--limit", "-n", min=1, help="Print at most this many instances.")
    ] = 100,
    as_json: AsJson = False,
    database_url: InspectDatabaseUrl = None,
    schema: InspectSchema = None,
) -> None:
    """List instances in id order: id, workflow, state, version, last event, updated.

    It walks the pages up to --limit and says how many more match.

    Read-only.
    """
    from flowlock._inspect import instance_dict, walk

    async def read(engine: Engine) -> tuple[list[Instance], int]:
        return await walk(engine, workflow, state, limit)

    found, total = _inspect(database_url, schema, read)
    if as_json:
        _json([instance_dict(inst) for inst in found])
    else:
        print_rows(
            stdout(),
            f"{len(found)} of {total} instance(s)",
            _INSTANCES,
            [
                [
                    _cell(inst.id),
                    _cell(inst.workflow),
                    _cell(inst.state),
                    _cell(inst.version),
                    _cell(inst.last_event),
                    _cell(_when(inst.updated_at)),
                ]
                for inst in found
            ],
        )
    if total > len(found):
        stderr().print(
            Text(f"{total - len(found)} more match; raise --limit to see them", style="yellow")
        )


@app.command("check")
def check_command(
    instance_id: Annotated[
        str | None,
        typer.Option(
            "--instance",
            "-i",
            help="Check only this instance (default: every instance).",
            show_default=False,
        ),
    ] = None,
    as_json: AsJson = False,
    database_url: InspectDatabaseUrl = None,
    schema: InspectSchema = None,
) -> None:
    """Run the exactly-once checker on a live database, on every instance or one.

    Each history must have versions 2, 3, ... with no gap or repeat.
    No request id may be applied twice, and each transition starts where the last ended.
    The stored instance must equal what its history says. An instance made by a create
    under an idempotency key must start from the state (and, with no history, still hold the
    data) that create recorded. Timers: each firing (actor flowlock:timer, request id
    timer:STAY:EVENT:N) applied in the stay that armed it and once, and every armed timer
    belongs to its instance's current stay. Outbox: every message belongs to a transition in
    its instance's history (same version and fencing token) under its own key
    ID:VERSION:N, none is done after 0 attempts, and a transition fired under a message's key
    (its handler's Then) comes after the one that emitted it. Legal holds: each names an
    id once and says when it was placed (the id need not exist: a hold is about an id).
    Definition versions: each row runs under the version of the row before it, except a
    migrated row, which sets the version its payload names; the instance runs its last
    row's version; and each row follows the stored rules of the version it records (its
    event, source, target and state are that version's). Constraints (every instance
    checked): no key ever held more slots than its limit (replayed from the slot events), the
    counters and slots are what the events leave, no slot is held outside its rule's states
    or by an instance that is gone, every event belongs to a commit of its instance, and no
    rate window holds more applications than its limit.

    Read-only, and safe while the application runs. Exits 0 when clean, 3 when any violation
    is found (each printed), 1 on an error (an unknown --instance).
    """
    from flowlock._inspect import CheckReport, check_instances

    async def read(engine: Engine) -> CheckReport:
        return await check_instances(engine, instance_id)

    report = _inspect(database_url, schema, read)
    verdict = report.verdict
    if as_json:
        _json(
            {
                **verdict.to_dict(),
                "instances": report.instances,
                "rows": report.rows,
                "messages": report.messages,
                "holds": report.holds,
                "slot_events": report.slot_events,
                "rate_events": report.rate_events,
                "unsettled": list(report.unsettled),
            }
        )
    else:
        out = stdout()
        for violation in verdict.violations:
            print_wrapped(out, Text(f"{violation.kind}: {violation.message}", style="red"))
        checked = f"checked {report.instances} instance(s), {report.rows} history row(s)"
        if report.messages:
            checked += f", {report.messages} outbox message(s)"
        if report.holds:
            checked += f", {report.holds} hold(s)"
        if report.slot_events:
            checked += f", {report.slot_events} slot event(s)"
        if report.rate_events:
            checked += f", {report.rate_events} rate event(s)"
        summary = f"{checked}: " + (
            "clean, exactly-once" if verdict.ok else f"{len(verdict.violations)} violation(s)"
        )
        print_wrapped(out, Text(summary, style="green" if verdict.ok else "bold red"))
    if report.unsettled:
        stderr().print(
            Text(
                f"{len(report.unsettled)} instance(s) kept changing while read; checked on the "
                "rows older than their last read: " + ", ".join(report.unsettled),
                style="yellow",
            )
        )
    if not verdict.ok:
        raise typer.Exit(EXIT_VERDICT_FAILED)


@app.command("timers")
def timers(
    within: Annotated[
        float,
        typer.Option(
            "--within",
            min=0,
            max=MAX_AFTER.total_seconds(),  # no timer is due further out than that
            help="Also list timers due within this many seconds (default: only those due now).",
        ),
    ] = 0.0,
    limit: Annotated[
        int, typer.Option("--limit", "-n", min=1, help="Print at most this many timers.")
    ] = 100,
    as_json: AsJson = False,
    database_url: InspectDatabaseUrl = None,
    schema: InspectSchema = None,
) -> None:
    """List due and overdue timers, earliest first, and how late each is.

    Each row: instance, workflow, event, stay (the version that armed it), firing number,
    due time, lag (seconds past due, on the database's clock) and, while an engine fires it,
    when its claim runs out. The title says how many timers are armed in all. A lag that
    keeps growing means no running engine fires that workflow's timers (none registers it,
    or every engine runs with --no-timers).

    Read-only.
    """
    from flowlock._inspect import timer_dict

    async def read(engine: Engine) -> tuple[list[Timer], int]:
        store = engine.store
        if not isinstance(store, TimerStore):
            raise InvalidInput(
                f"{type(store).__name__} keeps no timers; use a store that does (memory, "
                "SQLite or PostgreSQL of this flowlock version)"
            )
        return await store.due_timers(within=within, limit=limit), await store.count_timers()

    found, armed = _inspect(database_url, schema, read)
    if as_json:
        _json({"armed": armed, "within": within, "timers": [timer_dict(t) for t in found]})
        return
    when = f"within {within:g} s" if within else "now"
    print_rows(
        stdout(),
        f"{len(found)} timer(s) due {when}; {armed} armed in all",
        _TIMERS,
        [
            [
                _cell(t.instance_id),
                _cell(t.workflow),
                _cell(t.event),
                _cell(t.stay),
                _cell(t.n),
                _cell(_when(t.due_at)),
                _cell(f"{t.lag:.3f} s" if t.lag > 0 else "not due"),
                _cell(_when(t.claimed_until)),
            ]
            for t in found
        ],
    )
    if len(found) == limit:
        more = f"showing the first {limit}; raise --limit to see more"
        stderr().print(Text(more, style="yellow"))
