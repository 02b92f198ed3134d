"""`flowlock-lab`, and what `flowlock bench` forwards to the lab.

`flowlock bench --soak/--faults/--hosts/--http` import this module (the only import of the
lab in flowlock). `flowlock-lab soak` runs a soak directly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from flowlock.bench.report import RichProgress
from flowlock.cli._common import (
    EXIT_VERDICT_FAILED,
    errors_as_exit,
    fail,
    stderr,
    stdout,
    write_file,
)
from flowlock.cli.bench_options import (
    BatchingOption,
    FaultsOption,
    JsonOption,
    OnOff,
    ProcessesOption,
    SeedOption,
    StrategyOption,
)
from flowlock.core.errors import FlowlockError
from flowlock_lab.matrix import LAB
from flowlock_lab.soak import soak
from flowlock_lab.soak_config import SoakConfig
from flowlock_lab.soak_report import render_soak, write_soak_json

__all__ = ["LAB", "app", "main", "run_soak", "soak_config"]

app = typer.Typer(
    name="flowlock-lab",
    help="flowlock's lab: the soak and fault harness. The namespaced hosts (--hosts) and the "
    "HTTP driver (--http) run through `flowlock bench`, which forwards them here; so does "
    "`flowlock bench --soak`.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="markdown",
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def soak_config(
    *,
    seconds: int,
    faults: bool,
    processes: int | None,
    callers: int | None,
    strategies: tuple[str, ...] | None,
    seed: int | None,
    database_url: str | None,
    redis_url: str | None,
    batching: bool,
) -> SoakConfig:
    """A validated soak config (InvalidInput for anything it cannot run)."""
    config = SoakConfig(
        seconds=seconds,
        faults=faults,
        processes=processes,
        callers=callers,
        strategies=strategies,
        seed=seed,
        database_url=database_url,
        redis_url=redis_url,
        batching=batching,
    )
    config.validate()
    return config


def run_soak(config: SoakConfig, json_file: Path | None) -> None:
    """Run the soak with progress on stderr, print its table and write its JSON.

    Exit 3 when any verdict is not clean.
    """
    with errors_as_exit(), RichProgress(stderr()) as progress:
        report = soak(config, progress)
    render_soak(report, stdout(piped=160))
    write_file(json_file, lambda path: write_soak_json(report, path))
    if not report.ok:
        fail("soak verdict FAILED\n" + "\n".join(report.problems()), EXIT_VERDICT_FAILED)


@app.command("soak")
def soak_command(
    seconds: Annotated[
        int,
        typer.Argument(min=1, max=3600, metavar="SECONDS", help="How long to soak (at most 3600)."),
    ],
    faults: FaultsOption = False,
    strategy: StrategyOption = None,
    callers: Annotated[
        int | None,
        typer.Option(
            "--workers",
            "-w",
            min=1,
            help="Caller tasks in all. Default: 4 per worker process.",
            show_default=False,
        ),
    ] = None,
    processes: ProcessesOption = None,
    seed: SeedOption = None,
    batching: BatchingOption = OnOff.on,
    json_file: JsonOption = None,
) -> None:
    """Soak: mixed load from worker processes for SECONDS, every call recorded and judged.

    It reports outcomes by kind, leaks, and the linearizability and exactly-once verdicts.
    It runs on an embedded PostgreSQL and Redis of its own.
    The same as `flowlock bench --soak SECONDS`.
    """
    try:
        config = soak_config(
            seconds=seconds,
            faults=faults,
            processes=processes,
            callers=callers,
            strategies=tuple(strategy) if strategy else None,
            seed=seed,
            database_url=None,
            redis_url=None,
            batching=batching is OnOff.on,
        )
    except FlowlockError as exc:  # a usage error, as under flowlock bench
        raise typer.BadParameter(str(exc)) from None
    run_soak(config, json_file)


@app.callback()
def _root() -> None:
    """flowlock's lab: soak and faults, namespaced hosts, the HTTP driver."""


def main() -> None:
    """Console-script entry point (`flowlock-lab`)."""
    app(prog_name="flowlock-lab")
