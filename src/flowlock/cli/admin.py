"""`flowlock admin`: the operator's repairs (force, pause, resume, fire in bulk) and retention
(purge, restore). Each writes through the engine: the compare-and-swap, the fencing and the
history, never a bare UPDATE."""

from __future__ import annotations

import typer

from flowlock.cli._common import EPILOG, app

__all__ = ["admin_app"]

admin_app = typer.Typer(
    help="Operator repairs and retention: *force*, *pause*, *resume* and *fire* in bulk (with "
    "*--dry-run*), *purge* and *restore*.",
    no_args_is_help=True,
    epilog=EPILOG,
    rich_markup_mode="markdown",
)
app.add_typer(admin_app, name="admin")
