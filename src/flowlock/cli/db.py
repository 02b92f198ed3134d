"""`flowlock db`: create or update flowlock's tables, or print them as SQL."""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer
from rich.console import Console

from flowlock.cli._common import ENV_DATABASE_URL, ENV_SCHEMA, db_app, errors_as_exit, redact
from flowlock.engine import connect

__all__ = ["db_migrate", "db_sql"]


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
        typer.Option(
            "--schema",
            envvar=ENV_SCHEMA,
            help="Put flowlock's tables in this schema (created if missing).",
        ),
    ] = None,
) -> None:
    """Create or update flowlock's tables (idempotent; safe to run from several machines)."""
    if not database_url:
        raise typer.BadParameter(
            f"give --database-url or set {ENV_DATABASE_URL}", param_hint="'--database-url'"
        )
    with errors_as_exit():
        applied = asyncio.run(_migrate(database_url, schema))
    where = redact(database_url).split("@")[-1] + (f" (schema {schema})" if schema else "")
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
        typer.Option(
            "--schema", envvar=ENV_SCHEMA, help="Migrate into this schema (created if missing)."
        ),
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
    """Print flowlock's PostgreSQL migrations as one SQL script; no database needed.

    For teams that run their own migrations (Alembic, Django...). Run it once, in one
    transaction. It records each migration in flowlock_schema_migrations, so flowlock then
    finds nothing to apply.
    """
    from flowlock._pg.migrations import script
    from flowlock.core.errors import InvalidInput

    try:
        text = script(after=after, schema=schema)
    except InvalidInput as exc:
        raise typer.BadParameter(str(exc)) from None
    typer.echo(text, nl=False)
