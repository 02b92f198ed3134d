"""`flowlock`: the command line (typer + rich), one module per command group.

The CLI is the only part of flowlock that reads the environment.
`flowlock --help` names each variable and the exit codes (see `EPILOG`).
"""

from __future__ import annotations

from typing import Annotated

import typer

import flowlock

# The command modules register their commands on ``app`` when imported, in the order --help
# lists them: the database and inspection commands, then bench and serve.
from flowlock.cli import (
    admin,
    capacity,
    db,
    definitions,
    inspect,
    migrate,
    outbox,
    replay,
    retention,
)

# isort: split
from flowlock.cli import bench, serve
from flowlock.cli._common import EXIT_INTERRUPTED, EXIT_VERDICT_FAILED, app

__all__ = [
    "EXIT_INTERRUPTED",
    "EXIT_VERDICT_FAILED",
    "admin",
    "app",
    "bench",
    "capacity",
    "db",
    "definitions",
    "inspect",
    "main",
    "migrate",
    "outbox",
    "replay",
    "retention",
    "serve",
]


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
    """flowlock: a workflow engine whose every transition is atomic and applied exactly once.

    Concurrency control is pluggable: optimistic, pessimistic and more.
    """


def main() -> None:
    """Console-script entry point (`flowlock`)."""
    app(prog_name="flowlock")
