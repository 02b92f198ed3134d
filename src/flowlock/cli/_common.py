"""What every command shares: the apps, the environment's names, exit codes, and output."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console
from rich.text import Text

from flowlock.core.errors import FlowlockError
from flowlock.core.extras import require

__all__ = [
    "ENV_DATABASE_URL",
    "ENV_REDIS_URL",
    "ENV_SCHEMA",
    "EPILOG",
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_REPLAYED",
    "EXIT_VERDICT_FAILED",
    "app",
    "db_app",
    "errors_as_exit",
    "fail",
    "redact",
    "stderr",
    "stdout",
    "write_file",
]

ENV_DATABASE_URL = "FLOWLOCK_DATABASE_URL"
ENV_REDIS_URL = "FLOWLOCK_REDIS_URL"
ENV_SCHEMA = "FLOWLOCK_SCHEMA"
EXIT_ERROR = 1
EXIT_VERDICT_FAILED = 3
EXIT_REPLAYED = 3
"""`flowlock admin force|pause|resume|fire`: nothing applied, every instance done earlier
under the run's operation id (the same command sent again)."""
EXIT_INTERRUPTED = 130

EPILOG = (
    "**Environment variables** (the CLI is the only part of flowlock that reads them): "
    f"**{ENV_DATABASE_URL}**: PostgreSQL URL (postgresql://user@host/db) used by "
    "*db migrate* and *bench*, and the PostgreSQL or SQLite (sqlite:///path) URL *show*, "
    "*history*, *list*, *check*, *check-definition*, *timers*, *capacity* and *outbox* read, when "
    "--database-url is not given. "
    f"**{ENV_SCHEMA}**: the PostgreSQL schema of flowlock's tables, when --schema is not given "
    "(*serve*, *db*, and the commands that read). "
    f"**{ENV_REDIS_URL}**: Redis URL (redis://host:6379/0) used by *bench* when --redis-url "
    "is not given. **COLUMNS**: the width tables are printed to, also when piped (default: "
    "the terminal's, else 80).\n\n"
    "**Exit codes**: 0 ok, 1 flowlock error, 2 bad arguments, 3 bench or soak verdict failed, "
    "*check* found a violation, or an *admin* bulk command applied nothing because every "
    "instance was done earlier under its operation id, 130 interrupted; *check-definition* "
    "exits 1 when it finds a divergence."
)

app = typer.Typer(
    name="flowlock",
    help="flowlock: a workflow engine whose every transition is atomic and applied exactly once.",
    epilog=EPILOG,
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
    epilog=EPILOG,
    rich_markup_mode="markdown",
)
app.add_typer(db_app, name="db")


# -- output helpers ---------------------------------------------------------------------------


def stderr() -> Console:
    # Made per use, not at import: test runners swap sys.stderr after import.
    return Console(stderr=True, soft_wrap=True)


def fail(message: str, code: int = EXIT_ERROR) -> NoReturn:
    """Print one red line and exit with `code`.

    Any further lines of the message, such as a server log tail, are dimmed below it.
    """
    first, _, rest = message.strip().partition("\n")
    console = stderr()
    console.print(Text(f"error: {first}", style="bold red"))
    if rest.strip():
        console.print(Text(rest, style="dim"))
    raise typer.Exit(code)


@contextmanager
def errors_as_exit() -> Iterator[None]:
    """FlowlockError -> one red line and exit 1; Ctrl-C -> exit 130. No traceback for either."""
    try:
        yield
    except FlowlockError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        stderr().print(Text("interrupted", style="yellow"))
        raise typer.Exit(EXIT_INTERRUPTED) from None


def need(extra: str, command: str, *modules: str) -> None:
    """One error line naming the extra when `command` cannot import one of `modules`."""
    with errors_as_exit():
        for module in modules:
            require(module, extra, command)


def redact(url: str) -> str:
    """`url` without its password. Imported here, not at the top: only bench needs bench."""
    from flowlock.bench import config

    return config.redact(url)


def stdout(*, piped: int | None = None) -> Console:
    """The console of tables: COLUMNS wide when it is set, also when piped; else the
    terminal's width (of stdout, or of stdin or stderr when stdout is piped); else 80.

    `piped` is the width when stdout is not a terminal and COLUMNS is unset: the bench's
    reports, read in CI logs, keep the room they had (160).
    """
    width = columns()
    if width is None and piped is not None and not Console().is_terminal:
        width = piped
    return Console(width=width)


def columns() -> int | None:
    """COLUMNS as a width, or None when it is unset or not a positive whole number."""
    raw = os.environ.get("COLUMNS", "").strip()
    # rich reads COLUMNS too, but not on a dumb terminal (TERM=dumb): read here, it always counts.
    return int(raw) if raw.isdigit() and int(raw) > 0 else None


def write_file(path: Path | None, write: Callable[[Path], None]) -> None:
    """`write(path)` unless no path was given; an OS error is one red line and exit 1."""
    if path is None:
        return
    try:
        write(path)
    except OSError as exc:
        fail(f"cannot write {path}: {exc.strerror or exc}")
    stderr().print(Text(f"wrote {path}", style="dim"))
