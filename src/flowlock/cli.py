"""``flowlock``: the command line (typer + rich).

The CLI is the one place in flowlock that reads the environment (with the service's workers,
which read the ``FLOWLOCK_*`` settings ``flowlock serve`` passes them); every variable it reads is
named in ``flowlock --help``:

- ``FLOWLOCK_DATABASE_URL``: the PostgreSQL URL for ``db migrate`` and ``bench``, and the
  PostgreSQL or SQLite URL the inspection commands (``show``, ``history``, ``list``, ``check``)
  read, when ``--database-url`` is not given.
- ``FLOWLOCK_REDIS_URL``: the Redis URL for ``bench`` when ``--redis-url`` is not given.

Exit codes: 0 success; 1 a flowlock error (printed as one red line, no traceback); 2 bad
arguments (a ``diagram`` reference that names no workflow included); 3 ``bench`` ran but a checker
verdict failed (for ``bench --soak``: any of its verdicts), or ``check`` found a violation in
the database; 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

import flowlock
from flowlock.core.errors import FlowlockError
from flowlock.core.models import HistoryEntry, Instance
from flowlock.engine import Engine, connect

if TYPE_CHECKING:
    from flowlock.bench import BenchConfig, BenchReport
    from flowlock.bench.config import SoakConfig

__all__ = ["EXIT_INTERRUPTED", "EXIT_VERDICT_FAILED", "app", "main"]

ENV_DATABASE_URL = "FLOWLOCK_DATABASE_URL"
ENV_REDIS_URL = "FLOWLOCK_REDIS_URL"
EXIT_ERROR = 1
EXIT_VERDICT_FAILED = 3
EXIT_INTERRUPTED = 130
_R = TypeVar("_R")

_EPILOG = (
    "**Environment variables** (the CLI is the only part of flowlock that reads them): "
    f"**{ENV_DATABASE_URL}**: PostgreSQL URL (postgresql://user@host/db) used by "
    "*db migrate* and *bench*, and the PostgreSQL or SQLite (sqlite:///path) URL *show*, "
    "*history*, *list* and *check* read, when --database-url is not given. "
    f"**{ENV_REDIS_URL}**: Redis URL (redis://host:6379/0) used by *bench* when --redis-url "
    "is not given.\n\n"
    "**Exit codes**: 0 ok, 1 flowlock error, 2 bad arguments, 3 bench or soak verdict failed "
    "or *check* found a violation, 130 interrupted."
)

app = typer.Typer(
    name="flowlock",
    help="flowlock: a workflow engine whose every transition is atomic and applied exactly once.",
    epilog=_EPILOG,
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="markdown",
    # Locals of a failing frame could hold a database URL with its password.
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
db_app = typer.Typer(
    help="Database schema commands.",
    no_args_is_help=True,
    epilog=_EPILOG,
    rich_markup_mode="markdown",
)
app.add_typer(db_app, name="db")


# -- output helpers -------------------------------------------------------------------------


def _stderr() -> Console:
    # Made per use, not at import: test runners swap sys.stderr after import.
    return Console(stderr=True, soft_wrap=True)


def _fail(message: str, code: int = EXIT_ERROR) -> NoReturn:
    """One red line (any further lines of the message, such as a server log tail, dimmed
    below it) and exit with ``code``."""
    first, _, rest = message.strip().partition("\n")
    console = _stderr()
    console.print(Text(f"error: {first}", style="bold red"))
    if rest.strip():
        console.print(Text(rest, style="dim"))
    raise typer.Exit(code)


@contextmanager
def _errors_as_exit() -> Iterator[None]:
    """FlowlockError -> one red line and exit 1; Ctrl-C -> exit 130. No traceback for either."""
    try:
        yield
    except FlowlockError as exc:
        _fail(str(exc))
    except KeyboardInterrupt:
        _stderr().print(Text("interrupted", style="yellow"))
        raise typer.Exit(EXIT_INTERRUPTED) from None


def _redact(url: str) -> str:
    from flowlock.bench.config import redact

    return redact(url)


# -- root -----------------------------------------------------------------------------------


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"flowlock {flowlock.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            "-V",
            help="Print the version and exit.",
            callback=_show_version,
            is_eager=True,
        ),
    ] = False,
) -> None:
    """flowlock: a workflow (state-machine) engine whose every transition is atomic and applied
    exactly once, with pluggable concurrency control (optimistic, pessimistic)."""


# -- db -------------------------------------------------------------------------------------


DatabaseUrl = Annotated[
    str | None,
    typer.Option(
        "--database-url",
        envvar=ENV_DATABASE_URL,
        help="PostgreSQL URL, e.g. postgresql://user@host:5432/db.",
        show_default=False,
    ),
]


async def _migrate(url: str, schema: str | None) -> list[str]:
    # auto_migrate=False so migrate() below is the one call that applies, and reports, them.
    async with connect(url, auto_migrate=False, max_size=1, schema=schema) as engine:
        return await engine.store.migrate()


@db_app.command("migrate")
def db_migrate(
    database_url: DatabaseUrl = None,
    schema: Annotated[
        str | None,
        typer.Option("--schema", help="Put flowlock's tables in this schema (created if missing)."),
    ] = None,
) -> None:
    """Create or update flowlock's tables (idempotent; safe to run from several machines)."""
    if not database_url:
        raise typer.BadParameter(
            f"give --database-url or set {ENV_DATABASE_URL}", param_hint="'--database-url'"
        )
    with _errors_as_exit():
        applied = asyncio.run(_migrate(database_url, schema))
    where = _redact(database_url).split("@")[-1] + (f" (schema {schema})" if schema else "")
    # soft_wrap: a long URL or schema name is never broken across lines (it is copied, grepped).
    console = Console(soft_wrap=True)
    if applied:
        console.print(f"applied {len(applied)} migration(s) to {where}:")
        for name in applied:
            console.print(f"  {name}")
    else:
        console.print(f"{where} is up to date; no migration to apply")


@db_app.command("sql")
def db_sql(
    schema: Annotated[
        str | None,
        typer.Option("--schema", help="Migrate into this schema (created if missing)."),
    ] = None,
    after: Annotated[
        str | None,
        typer.Option(
            "--after",
            help="Only the migrations after this one (e.g. 005_job_runs): what a database "
            "already at it still needs.",
        ),
    ] = None,
) -> None:
    """Print flowlock's PostgreSQL migrations as one SQL script (no database needed), for teams
    that run their own migrations (Alembic, Django...). Run it once, in one transaction. It also
    records each migration in flowlock_schema_migrations, so flowlock then finds nothing to
    apply."""
    from flowlock._pg.migrations import script
    from flowlock.core.errors import InvalidInput

    try:
        text = script(after=after, schema=schema)
    except InvalidInput as exc:
        raise typer.BadParameter(str(exc)) from None
    typer.echo(text, nl=False)


# -- diagram --------------------------------------------------------------------------------


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
        _fail(str(exc))
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
        help="PostgreSQL only: the schema flowlock's tables are in (as given to db migrate).",
        show_default=False,
    ),
]
InstanceId = Annotated[
    str, typer.Argument(metavar="ID", help="The instance's id.", show_default=False)
]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def _inspect(
    database_url: str | None, schema: str | None, read: Callable[[Engine], Awaitable[_R]]
) -> _R:
    """``read(engine)`` on a read-only engine over the database; a missing URL is a usage error
    (exit 2), a flowlock error one red line (exit 1)."""
    from flowlock._inspect import open_readonly

    if not database_url:
        raise typer.BadParameter(
            f"give --database-url or set {ENV_DATABASE_URL}", param_hint="'--database-url'"
        )

    async def run() -> _R:
        async with open_readonly(database_url, schema) as engine:
            return await read(engine)

    with _errors_as_exit():
        return asyncio.run(run())


def _json(value: object) -> None:
    # default=str: data is JSON already; this only guards against a store handing back odd types.
    typer.echo(json.dumps(value, indent=2, ensure_ascii=False, default=str))


def _cell(value: object) -> Text:
    # Text, not markup: ids, data and actors are the user's and may hold "[...]".
    return Text("-" if value is None else str(value))


def _when(moment: datetime | None) -> str | None:
    return None if moment is None else moment.isoformat(sep=" ", timespec="seconds")


@app.command()
def show(
    instance_id: InstanceId,
    as_json: AsJson = False,
    database_url: InspectDatabaseUrl = None,
    schema: InspectSchema = None,
) -> None:
    """Print one instance: workflow, state, version, data, last event, created and updated.

    Read-only. Exits 1 if no instance has that id."""
    from flowlock._inspect import instance_dict

    async def read(engine: Engine) -> Instance:
        return await engine.get(instance_id)

    inst = _inspect(database_url, schema, read)
    if as_json:
        _json(instance_dict(inst))
        return
    table = Table(show_header=False, box=None)
    for name, value in (
        ("id", inst.id),
        ("workflow", inst.workflow),
        ("state", inst.state),
        ("version", inst.version),
        ("last event", inst.last_event),
        ("created", _when(inst.created_at)),
        ("updated", _when(inst.updated_at)),
        ("data", json.dumps(dict(inst.data), ensure_ascii=False, default=str)),
    ):
        table.add_row(Text(name, style="bold"), _cell(value))
    _stdout().print(table)


@app.command()
def history(
    instance_id: InstanceId,
    as_json: AsJson = False,
    database_url: InspectDatabaseUrl = None,
    schema: InspectSchema = None,
) -> None:
    """Print an instance's applied transitions, oldest first: version, event, from -> to, actor,
    request id, strategy, when, fencing token (--json adds each row's data and payload).

    Read-only. Exits 1 if no instance has that id."""
    from flowlock._inspect import entry_dict

    async def read(engine: Engine) -> list[HistoryEntry]:
        await engine.get(instance_id)  # an unknown id is an error, not an empty history
        return await engine.history(instance_id)

    rows = _inspect(database_url, schema, read)
    if as_json:
        _json([entry_dict(e) for e in rows])
        return
    table = Table(title=f"history of {instance_id} ({len(rows)} transition(s))")
    for column in ("version", "event", "from -> to", "actor", "request id", "strategy", "at",
                   "fencing token"):  # fmt: skip
        table.add_column(column, overflow="fold")
    for e in rows:
        table.add_row(
            _cell(e.version),
            _cell(e.event),
            _cell(f"{e.from_state} -> {e.to_state}"),
            _cell(e.actor),
            _cell(e.request_id),
            _cell(e.strategy),
            _cell(_when(e.at)),
            _cell(e.fencing_token),
        )
    _stdout().print(table)


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
    """List instances in id order (id, workflow, state, version, last event, updated), walking
    the pages up to --limit; says how many more match.

    Read-only."""
    from flowlock._inspect import instance_dict, walk

    async def read(engine: Engine) -> tuple[list[Instance], int]:
        return await walk(engine, workflow, state, limit)

    found, total = _inspect(database_url, schema, read)
    if as_json:
        _json([instance_dict(inst) for inst in found])
    else:
        table = Table(title=f"{len(found)} of {total} instance(s)")
        for column in ("id", "workflow", "state", "version", "last event", "updated"):
            table.add_column(column, overflow="fold")
        for inst in found:
            table.add_row(
                _cell(inst.id),
                _cell(inst.workflow),
                _cell(inst.state),
                _cell(inst.version),
                _cell(inst.last_event),
                _cell(_when(inst.updated_at)),
            )
        _stdout().print(table)
    if total > len(found):
        _stderr().print(
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
    """Run the exactly-once checker on a live database: every instance's history (or one's)
    must have versions 2, 3, ... with no gap or repeat, no request id applied twice, each
    transition starting where the last ended, and the stored instance equal to what its history
    says.

    Read-only, and safe while the application runs. Exits 0 when clean, 3 when any violation
    is found (each printed), 1 on an error (an unknown --instance)."""
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
                "unsettled": list(report.unsettled),
            }
        )
    else:
        out = _stdout()
        for violation in verdict.violations:
            out.print(Text(f"{violation.kind}: {violation.message}", style="red"))
        summary = f"checked {report.instances} instance(s), {report.rows} history row(s): " + (
            "clean, exactly-once" if verdict.ok else f"{len(verdict.violations)} violation(s)"
        )
        out.print(Text(summary, style="green" if verdict.ok else "bold red"))
    if report.unsettled:
        _stderr().print(
            Text(
                f"{len(report.unsettled)} instance(s) kept changing while read; checked on the "
                "rows older than their last read: " + ", ".join(report.unsettled),
                style="yellow",
            )
        )
    if not verdict.ok:
        raise typer.Exit(EXIT_VERDICT_FAILED)


# -- bench ----------------------------------------------------------------------------------


def _known(kind: str, names: list[str] | None, known: list[str]) -> list[str] | None:
    for name in names or []:
        if name not in known:
            raise typer.BadParameter(f"unknown {kind} {name!r}; choose from {', '.join(known)}")
    return names


def _check_scenarios(names: list[str] | None) -> list[str] | None:
    from flowlock.bench import SCENARIOS

    return _known("scenario", names, list(SCENARIOS))


def _check_strategies(names: list[str] | None) -> list[str] | None:
    from flowlock.bench import ALIASES, STRATEGIES

    return _known("strategy", names, [*STRATEGIES, *ALIASES])


def _check_out_path(path: Path | None) -> Path | None:
    # Checked before the run, so a typo does not cost the whole benchmark.
    if path is not None:
        if path.is_dir():
            raise typer.BadParameter(f"{path} is a directory")
        if not path.parent.is_dir():
            raise typer.BadParameter(f"directory {path.parent} does not exist")
    return path


def _names(registry: Iterable[str]) -> str:
    return ", ".join(registry)


def _scenario_help() -> str:
    from flowlock.bench import SCENARIOS

    return f"Scenario to run (repeatable): {_names(SCENARIOS)}. Default: all."


def _strategy_help() -> str:
    from flowlock.bench import ALIASES, STRATEGIES

    return (
        f"Strategy to run (repeatable): {_names(STRATEGIES)}; 'distributed' means "
        f"{' and '.join(ALIASES['distributed'])}. 'raw' is the floor: bare asyncpg, no engine. "
        "Default: all."
    )


# The bench command's options, one alias each: the command itself stays a short function.
ScenarioOption = Annotated[
    list[str] | None,
    typer.Option(
        "--scenario",
        "-s",
        help=_scenario_help(),
        callback=_check_scenarios,
        show_default=False,
    ),
]
StrategyOption = Annotated[
    list[str] | None,
    typer.Option(
        "--strategy",
        "-t",
        help=_strategy_help(),
        callback=_check_strategies,
        show_default=False,
    ),
]
WorkersOption = Annotated[
    int,
    typer.Option(
        "--workers",
        "-w",
        min=1,
        help="Concurrent callers per round (across all processes in cluster/singleton).",
    ),
]
RoundsOption = Annotated[
    int | None,
    typer.Option(
        "--rounds",
        "-r",
        min=1,
        help="Timed rounds per scenario. Default: each scenario's own (storm 10, "
        "countersign 3, inventory 5, hot/spread/cluster 1, singleton 10 ticks; fewer "
        "with --quick).",
        show_default=False,
    ),
]
OpsOption = Annotated[
    int | None,
    typer.Option(
        "--ops",
        min=1,
        help="Calls each caller makes one after another per round in hot, spread and "
        "cluster. Default: hot 20, spread 60, cluster 40 (3 with --quick).",
        show_default=False,
    ),
]
ProcessesOption = Annotated[
    int | None,
    typer.Option(
        "--processes",
        "-p",
        min=1,
        help="OS processes the cluster and singleton scenarios run their callers in. Default: 4.",
        show_default=False,
    ),
]
SeedOption = Annotated[
    int | None,
    typer.Option(
        "--seed",
        help="Seed for the retry jitter and the spread's choices, to repeat a run. "
        "Default: random (reported).",
        show_default=False,
    ),
]
QuickOption = Annotated[
    bool,
    typer.Option(
        "--quick",
        help="Fewer rounds and calls: the same matrix in 25-40 s on 2 cores (CI runs it).",
    ),
]
PoolSizeOption = Annotated[
    int | None,
    typer.Option(
        "--pool-size",
        min=1,
        help="Database connections per session pool. Default: --workers (one per "
        "caller, like the seed's experiment), lowered if the server cannot take that many.",
        show_default=False,
    ),
]
JsonOption = Annotated[
    Path | None,
    typer.Option(
        "--json",
        help="Also write every figure as JSON (the shape in docs/benchmarks.md) to this file.",
        callback=_check_out_path,
        dir_okay=False,
        show_default=False,
    ),
]
PlotOption = Annotated[
    Path | None,
    typer.Option(
        "--plot",
        help="Also draw latency percentiles, success % and throughput per strategy and "
        "scenario as a PNG (needs matplotlib, part of the 'bench' extra).",
        callback=_check_out_path,
        dir_okay=False,
        show_default=False,
    ),
]
BenchDatabaseUrl = Annotated[
    str | None,
    typer.Option(
        "--database-url",
        envvar=ENV_DATABASE_URL,
        help="Run against this PostgreSQL server, in a scratch schema (flowlock_bench_ and "
        "random hex) dropped at the end. Default: start an embedded PostgreSQL for the run.",
        show_default=False,
    ),
]
BenchRedisUrl = Annotated[
    str | None,
    typer.Option(
        "--redis-url",
        envvar=ENV_REDIS_URL,
        help="Run distributed-redis against this Redis, under a scratch key namespace "
        "deleted at the end. Default: start an embedded Redis for the run.",
        show_default=False,
    ),
]


class OnOff(StrEnum):
    """An on/off switch on the command line."""

    on = "on"
    off = "off"


BatchingOption = Annotated[
    OnOff,
    typer.Option(
        "--batching",
        case_sensitive=False,
        help="Whether every flowlock engine the bench builds (in this process and in the worker "
        "processes; the soak's too) batches concurrent calls on one instance, Engine(batching=): "
        "on (the engine's default) decides them in order on one read and writes them together; "
        "off runs one transaction per call. The raw floor has no engine and is the same either "
        "way. Each row reports its mean batch size (1.00 with off).",
    ),
]
EmbeddedOption = Annotated[
    bool,
    typer.Option(
        "--embedded",
        help=f"Use an embedded PostgreSQL and Redis even if {ENV_DATABASE_URL} or "
        f"{ENV_REDIS_URL} is set.",
    ),
]


HostsOption = Annotated[
    int | None,
    typer.Option(
        "--hosts",
        min=1,
        max=16,
        metavar="N",
        help="Run every scenario's callers in the worker processes spread over N Linux network "
        "namespaces (one machine, N 'hosts' on a bridge, each with its own address), against an "
        "embedded PostgreSQL and Redis listening on the bridge. Default scenarios: spread and "
        "cluster; --processes defaults to at least N. Needs root and iproute2; the namespaces "
        "are removed at the end. Not with --http.",
        show_default=False,
    ),
]
NetemDelayOption = Annotated[
    float | None,
    typer.Option(
        "--netem-delay",
        min=0,
        max=1000,
        metavar="MS",
        help="With --hosts: tc netem delay of each direction of each host's link, in ms (a "
        "round trip gains twice that). Default: 1 with 2 hosts or more where the kernel has "
        "netem (else none, noted); 0: none.",
        show_default=False,
    ),
]
HttpOption = Annotated[
    bool,
    typer.Option(
        "--http",
        help="Also run each pair through the HTTP service: a `flowlock serve` started for the "
        "run on the same database and scratch schema (one worker process, as many connections "
        "as the in-process pool), called by --workers concurrent httpx clients from this "
        "process, one connection each. Runs storm, hot and spread "
        "with optimistic, pessimistic and adaptive unless --scenario/--strategy say which of "
        "them; every pair warms up first, also with --quick. Adds a table of requests/s, p50, "
        "p99, success % and verdict per pair beside the in-process p99 of the same run, with "
        "the ratio, the difference and the aim: HTTP p99 <= 1.5 x in-process p99 + 5 ms. The "
        "callers share the machine's cores with the service and PostgreSQL. Not with --hosts.",
    ),
]
SoakOption = Annotated[
    int | None,
    typer.Option(
        "--soak",
        min=1,
        max=3600,
        metavar="SECONDS",
        help="Soak instead of measuring: mixed load (every strategy; storm, hot and spread "
        "instances) from --processes worker processes (default 3, 4 callers each, or --workers "
        "in all) for SECONDS (at most 3600), every call recorded and judged: outcomes by kind, "
        "leaks, the linearizability and exactly-once verdicts. Always on an embedded PostgreSQL "
        "and Redis of its own. Takes --strategy, --workers, --processes, --seed, --batching, "
        "--json.",
        show_default=False,
    ),
]
FaultsOption = Annotated[
    bool,
    typer.Option(
        "--faults",
        help="With --soak: every ~3 s kill -9 or pause (SIGSTOP, up to twice the 2 s lease) a "
        "worker process (a killed one is replaced), end some of the workers' PostgreSQL "
        "sessions, restart PostgreSQL, or restart Redis empty; at most 2 per 3 s of soak.",
    ),
]


def _run_bench(config: BenchConfig, plot: bool) -> BenchReport:
    """Validate ``config`` (and the plot support) before starting anything, then run it with
    a progress display on stderr; flowlock errors and Ctrl-C become exits."""
    from flowlock.bench import runner
    from flowlock.bench.report import RichProgress, check_plot_support

    with _errors_as_exit():
        config.validate()  # before starting anything: a bad URL must not cost a server start
        if plot:
            check_plot_support()
        with RichProgress(_stderr()) as progress:
            report = runner.run(config, progress)
    return report


def _stdout() -> Console:
    out = Console()
    if not out.is_terminal:
        # Piped or redirected: rich would assume 80 columns and fold the table; use room.
        out = Console(width=160)
    return out


def _write(path: Path | None, write: Callable[[Path], None]) -> None:
    """``write(path)`` unless no path was given; an OS error is one red line and exit 1."""
    if path is None:
        return
    try:
        write(path)
    except OSError as exc:
        _fail(f"cannot write {path}: {exc.strerror or exc}")
    _stderr().print(Text(f"wrote {path}", style="dim"))


def _show(report: BenchReport, json_file: Path | None, plot_file: Path | None) -> None:
    """The tables on stdout, the JSON and the chart where asked; exit 3 on a failed verdict."""
    from flowlock.bench.report import failures, plot, render, write_json

    render(report, _stdout())
    _write(json_file, lambda path: write_json(report, path))
    _write(plot_file, lambda path: plot(report, path))
    if not report.ok:
        _fail(
            "checker verdict FAILED: the history is not exactly-once\n"
            + "\n".join(failures(report)),
            EXIT_VERDICT_FAILED,
        )


def _run_soak(config: SoakConfig, json_file: Path | None) -> None:
    """Run the soak with a progress display on stderr, print its table, write its JSON, and
    exit 3 when any verdict is not clean."""
    from flowlock.bench import soak as soak_run
    from flowlock.bench.report import RichProgress, render_soak, write_soak_json

    with _errors_as_exit(), RichProgress(_stderr()) as progress:
        report = soak_run.soak(config, progress)
    render_soak(report, _stdout())
    _write(json_file, lambda path: write_soak_json(report, path))
    if not report.ok:
        _fail("soak verdict FAILED\n" + "\n".join(report.problems()), EXIT_VERDICT_FAILED)


def _soak_config(
    ctx: typer.Context,
    seconds: int,
    faults: bool,
    meaningless: Mapping[str, object],
    **given: Any,
) -> SoakConfig:
    """The soak's config from the bench options; a usage error (exit 2) for an option that means
    nothing to a soak, and for anything the config refuses (a server URL, too many callers)."""
    from flowlock.bench.config import SoakConfig

    named = [name for name, value in meaningless.items() if value]
    if named:
        raise typer.BadParameter(f"{', '.join(named)} mean(s) nothing to --soak; drop it")
    # By name: typer may bring click's ParameterSource under another module.
    source = ctx.get_parameter_source("workers")
    workers_given = source is not None and source.name == "COMMANDLINE"
    config = SoakConfig(
        seconds=seconds,
        faults=faults,
        processes=given["processes"],
        callers=given["workers"] if workers_given else None,
        strategies=given["strategies"],
        seed=given["seed"],
        database_url=given["database_url"],
        redis_url=given["redis_url"],
        batching=given["batching"],
    )
    try:
        config.validate()
    except FlowlockError as exc:
        raise typer.BadParameter(str(exc)) from None
    return config


@app.command()
def bench(
    ctx: typer.Context,
    scenario: ScenarioOption = None,
    strategy: StrategyOption = None,
    workers: WorkersOption = 100,
    rounds: RoundsOption = None,
    ops: OpsOption = None,
    processes: ProcessesOption = None,
    seed: SeedOption = None,
    quick: QuickOption = False,
    pool_size: PoolSizeOption = None,
    json_file: JsonOption = None,
    plot_file: PlotOption = None,
    database_url: BenchDatabaseUrl = None,
    redis_url: BenchRedisUrl = None,
    embedded: EmbeddedOption = False,
    batching: BatchingOption = OnOff.on,
    hosts: HostsOption = None,
    netem_delay: NetemDelayOption = None,
    http: HttpOption = False,
    soak: SoakOption = None,
    faults: FaultsOption = False,
) -> None:
    """Reproduce the seed article's experiment and every scenario, against a floor.

    Runs each scenario (storm, countersign, inventory, hot, spread, cluster, singleton) with each
    strategy, plus 'raw' (bare asyncpg, measured in the same run), on an embedded PostgreSQL and
    Redis it starts and removes (or your servers). Prints one row per scenario x strategy
    (latency, success %, attempts, mean batch size, throughput, peak connections, lock wait)
    with the checker's exactly-once verdict, the seed's published figures beside storm, and the
    aims against the floor of the same run, each with its ratio and met or not met. Exits 3 if
    any verdict fails.

    With --hosts N the worker processes run on N namespaced hosts of this machine: see --hosts.

    With --http each pair runs in-process and then through `flowlock serve`, and a table shows
    the HTTP overhead: see --http, and docs/benchmarks.md. --http and --hosts do not combine.

    With --soak SECONDS (and --faults) it soaks instead: see --soak, and docs/benchmarks.md.
    """
    from flowlock.bench import BenchConfig

    if faults and soak is None:
        raise typer.BadParameter("--faults needs --soak SECONDS")
    if soak is not None:
        meaningless = {
            "--scenario": scenario,
            "--rounds": rounds,
            "--ops": ops,
            "--quick": quick,
            "--pool-size": pool_size,
            "--plot": plot_file,
            "--hosts": hosts,
            "--netem-delay": netem_delay is not None,
            "--http": http,
        }
        soak_config = _soak_config(
            ctx,
            soak,
            faults,
            meaningless,
            processes=processes,
            workers=workers,
            strategies=tuple(strategy) if strategy else None,
            seed=seed,
            database_url=None if embedded else database_url,
            redis_url=None if embedded else redis_url,
            batching=batching is OnOff.on,
        )
        _run_soak(soak_config, json_file)
        return

    config = BenchConfig(
        scenarios=tuple(scenario) if scenario else None,
        strategies=tuple(strategy) if strategy else None,
        workers=workers,
        rounds=rounds,
        ops=ops,
        processes=processes,
        quick=quick,
        seed=seed,
        pool_size=pool_size,
        database_url=None if embedded else database_url,
        redis_url=None if embedded else redis_url,
        batching=batching is OnOff.on,
        hosts=hosts,
        netem_delay_ms=netem_delay,
        http=http,
    )
    _show(_run_bench(config, plot_file is not None), json_file, plot_file)


# -- serve ----------------------------------------------------------------------------------


def _opt(flag: str, var: str, text: str) -> Any:
    return typer.Option(flag, envvar=var, help=f"{text} [env: {var}]", show_envvar=False)


@app.command()
def serve(
    database_url: Annotated[
        str | None,
        _opt(
            "--database-url",
            ENV_DATABASE_URL,
            "PostgreSQL URL (postgresql://user@host/db); sqlite:///path or memory:// for one "
            "worker. Required unless --dev.",
        ),
    ] = None,
    redis_url: Annotated[
        str | None,
        _opt("--redis-url", ENV_REDIS_URL, "Redis URL for the 'distributed' strategy."),
    ] = None,
    app_ref: Annotated[
        str | None,
        _opt(
            "--app",
            "FLOWLOCK_APP",
            "module:attr naming the workflows to serve (a Workflow, a list, or a function "
            "returning them). Default: the examples approval, countersign, inventory.",
        ),
    ] = None,
    host: Annotated[str, _opt("--host", "FLOWLOCK_HOST", "Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, _opt("--port", "FLOWLOCK_PORT", "Port to listen on.")] = 8000,
    workers: Annotated[
        int, _opt("--workers", "FLOWLOCK_WORKERS", "Worker processes (PostgreSQL only above 1).")
    ] = 1,
    require_if_match: Annotated[
        bool,
        _opt(
            "--require-if-match",
            "FLOWLOCK_REQUIRE_IF_MATCH",
            "Refuse an event without If-Match (428).",
        ),
    ] = False,
    max_body_bytes: Annotated[
        int, _opt("--max-body-bytes", "FLOWLOCK_MAX_BODY_BYTES", "Larger bodies get 413.")
    ] = 1_048_576,
    max_json_depth: Annotated[
        int, _opt("--max-json-depth", "FLOWLOCK_MAX_JSON_DEPTH", "Deeper JSON gets 400.")
    ] = 32,
    pool_size: Annotated[
        int | None,
        _opt("--pool-size", "FLOWLOCK_POOL_SIZE", "PostgreSQL connections per worker (20)."),
    ] = None,
    default_strategy: Annotated[
        str, _opt("--strategy", "FLOWLOCK_STRATEGY", "The default concurrency strategy.")
    ] = "optimistic",
    schema: Annotated[
        str | None,
        _opt("--schema", "FLOWLOCK_SCHEMA", "PostgreSQL schema of flowlock's tables."),
    ] = None,
    drain_timeout: Annotated[
        float,
        _opt(
            "--drain-timeout",
            "FLOWLOCK_DRAIN_TIMEOUT",
            "Seconds SIGTERM waits for requests in flight.",
        ),
    ] = 10.0,
    dev: Annotated[
        bool,
        typer.Option(
            "--dev",
            help="Without --database-url: run on an embedded PostgreSQL (and Redis) started "
            "and removed with the service.",
        ),
    ] = False,
    log_level: Annotated[str, typer.Option("--log-level", help="uvicorn's log level.")] = "info",
) -> None:
    """Run flowlock as an HTTP service (FastAPI on uvicorn): definitions, instances, events
    with If-Match and Idempotency-Key, history, /livez, /readyz, /metrics; OpenAPI at
    /openapi.json, docs at /docs.

    **FLOWLOCK_API_TOKEN** (environment only, never a flag: argv is visible to every user of
    the machine): bearer tokens, comma-separated, each `name:secret` (the principal `name` is
    the actor of its calls) or `secret`; when set, every POST needs one. SIGTERM drains the
    requests in flight (--drain-timeout) and releases connections and leases.
    """
    from flowlock.service.server import Listen
    from flowlock.service.server import serve as run
    from flowlock.service.settings import ENV, ServiceSettings

    if database_url is None and not dev:
        raise typer.BadParameter(
            f"give --database-url (or {ENV_DATABASE_URL}), or --dev for an embedded PostgreSQL"
        )
    with _errors_as_exit():
        tokens = ServiceSettings.from_env(
            {ENV["api_tokens"]: os.environ.get(ENV["api_tokens"], "")}
        ).api_tokens
        settings = ServiceSettings(
            database_url=database_url or "memory://",
            redis_url=redis_url,
            app=app_ref,
            api_tokens=tokens,
            require_if_match=require_if_match,
            max_body_bytes=max_body_bytes,
            max_json_depth=max_json_depth,
            pool_size=pool_size,
            strategy=default_strategy,
            schema=schema,
            drain_timeout=drain_timeout,
        )
        if app_ref is not None:
            from flowlock.core.diagram import load_workflows

            load_workflows(app_ref)  # a bad reference fails here, not in every worker
        run(settings, Listen(host, port, workers, log_level), dev=dev and database_url is None)


def main() -> None:
    """Console-script entry point (``flowlock``)."""
    app(prog_name="flowlock")
