"""``flowlock``: the command line (typer + rich), one module per command group.

The CLI is the one place in flowlock that reads the environment (with the service's workers,
which read the ``FLOWLOCK_*`` settings ``flowlock serve`` passes them); every variable it reads
is named in ``flowlock --help``:

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

from typing import Annotated

import typer

import flowlock

# The command modules register their commands on ``app`` when imported, in the order --help
# lists them: the database and inspection commands, then bench and serve.
from flowlock.cli import db, inspect

# isort: split
from flowlock.cli import bench, serve
from flowlock.cli._common import EXIT_INTERRUPTED, EXIT_VERDICT_FAILED, app

__all__ = [
    "EXIT_INTERRUPTED",
    "EXIT_VERDICT_FAILED",
    "app",
    "bench",
    "db",
    "inspect",
    "main",
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
    """flowlock: a workflow (state-machine) engine whose every transition is atomic and applied
    exactly once, with pluggable concurrency control (optimistic, pessimistic)."""


def main() -> None:
    """Console-script entry point (``flowlock``)."""
    app(prog_name="flowlock")
