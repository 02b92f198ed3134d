"""The PostgreSQL migration runner, shared by every PostgreSQL adapter.

Versioned SQL files applied in name order, in one transaction, under an advisory lock.
`script` renders the same migrations for `flowlock db sql`.
"""

from __future__ import annotations

import contextlib

import asyncpg

from flowlock._pg.errors import DRIVER_ERRORS, Context, broken, wrap_connect
from flowlock._pg.pool import check_schema, close_pool, connection, create_pool
from flowlock._pg.pooling import Pooling
from flowlock.core.errors import FlowlockError, InvalidInput, MigrationError, StoreError
from flowlock.core.migrations import load
from flowlock.core.settings import DEFAULT_COMMAND_TIMEOUT, check_seconds

__all__ = ["MIGRATION_LOCK", "RECORDS_TABLE", "apply", "migrate", "migrate_database", "script"]

# Any fixed 64-bit number; two processes migrating at once serialise on it.
MIGRATION_LOCK = 0x666C6F776C6F636B  # "flowlock"
# How long a migration waits for a lock (the migration lock behind another process migrating,
# a table lock behind the application's transactions), on the server's clock.
_LOCK_WAIT = 60.0

RECORDS_TABLE = (
    "CREATE TABLE IF NOT EXISTS flowlock_schema_migrations ("
    " name text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
)
"""Where the applied migrations are recorded, by name."""

# A migration's statements are store statements about no instance in particular: worded as the
# store words them, for the key ''.
_CONTEXT = Context(
    what="PostgreSQL error for ''",
    tables="flowlock tables are",
    opener="the engine",
    key="",
    busy=lambda exc: StoreError(str(exc)),
)


async def apply(
    conn: asyncpg.Connection | asyncpg.pool.PoolConnectionProxy,
    *,
    schema: str | None = None,
    command_timeout: float = DEFAULT_COMMAND_TIMEOUT,
) -> list[str]:
    """Apply the migrations not yet recorded, on `conn`, in one transaction. Returns the names
    applied (none when the schema is up to date). Driver errors are raised as they are.

    `schema`: create it if missing and put it on this transaction's `search_path` (for a
    connection flowlock did not open, whose own `search_path` it leaves alone); without it the
    tables go where the connection's `search_path` says. Each statement waits at most 60 s
    for a lock (on the server) and `command_timeout` seconds more (on the client: asyncpg
    raises TimeoutError, and the connection must then be terminated, not reused)."""
    check_schema(schema)
    # Every statement with timeout= of its own (so no conn.transaction(), whose BEGIN and
    # COMMIT would take the connection's default, None on an application's pool).
    timeout = _LOCK_WAIT + check_seconds("command_timeout", command_timeout)

    async def run(sql: str, *args: object) -> None:
        await conn.execute(sql, *args, timeout=timeout)

    applied: list[str] = []
    await run(f"BEGIN; SET LOCAL lock_timeout = '{_LOCK_WAIT:g}s'")
    try:
        # Why a transaction-level advisory lock: two processes starting at once must not both
        # run 001; the second waits here, then sees 001 recorded and skips it.
        await run("SELECT pg_advisory_xact_lock($1)", MIGRATION_LOCK)
        if schema is not None:
            await run(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
            await run(f'SET LOCAL search_path = "{schema}"')
        await run(RECORDS_TABLE)
        rows = await conn.fetch("SELECT name FROM flowlock_schema_migrations", timeout=timeout)
        done = {r["name"] for r in rows}
        for m in load("postgres"):
            if m.name in done:
                continue
            await run(m.sql)
            await run("INSERT INTO flowlock_schema_migrations (name) VALUES ($1)", m.name)
            applied.append(m.name)
        await run("COMMIT")
    except BaseException as exc:
        # A connection that failed mid-protocol (lost, timed out) cannot take the ROLLBACK: the
        # server rolls back when its owner terminates it.
        if not broken(exc) and not conn.is_closed() and conn.is_in_transaction():
            with contextlib.suppress(*DRIVER_ERRORS):
                await conn.execute("ROLLBACK", timeout=timeout)
        raise
    return applied


async def migrate(
    pool: asyncpg.Pool,
    *,
    acquire_timeout: float,
    pool_size: int,
    schema: str | None = None,
    command_timeout: float = DEFAULT_COMMAND_TIMEOUT,
) -> list[str]:
    """`apply` (into `schema`, each round trip bounded by `command_timeout`: see
    there) on a connection of `pool`; any failure is a MigrationError (from the flowlock error
    it was translated to), and a connection that failed mid-protocol is terminated."""
    try:
        async with connection(
            pool, acquire_timeout=acquire_timeout, size=pool_size, context=_CONTEXT
        ) as conn:
            return await apply(conn, schema=schema, command_timeout=command_timeout)
    except FlowlockError as exc:
        raise MigrationError(f"migrating the flowlock schema failed: {exc}") from exc


async def migrate_database(
    dsn: str,
    *,
    schema: str | None,
    application_name: str,
    connect_timeout: float,
    command_timeout: float = DEFAULT_COMMAND_TIMEOUT,
    pooling: Pooling = "none",
) -> list[str]:
    """Migrate the database at `dsn` (`schema` created if missing) on a connection of its
    own, for adapters with no pool to spare. StoreError if it cannot connect, MigrationError if
    migrating fails; each round trip bounded by `command_timeout` (see `apply`). `pooling`:
    what is between this process and PostgreSQL (see `create_pool`)."""
    with wrap_connect(dsn):
        pool = await create_pool(
            dsn,
            max_size=1,
            schema=schema,
            create_schema=True,
            application_name=application_name,
            connect_timeout=connect_timeout,
            command_timeout=_LOCK_WAIT + command_timeout,
            jsonb=False,
            pooling=pooling,
        )
    try:
        return await migrate(
            pool,
            acquire_timeout=connect_timeout,
            pool_size=1,
            command_timeout=command_timeout,
            # A transaction pooler's connections keep no search_path: set for the migration.
            schema=schema if pooling == "transaction" else None,
        )
    finally:
        await close_pool(pool, bound=connect_timeout + command_timeout)


def script(*, after: str | None = None, schema: str | None = None) -> str:
    """The PostgreSQL migrations as one SQL script, oldest first, each under a comment naming it
    and followed by the INSERT that records it in `flowlock_schema_migrations`, as
    `apply` does: a database migrated with the script is one flowlock finds up to date.

    `after`: only the migrations after this one (those a database at `after` still needs).
    `schema`: create it if missing and migrate into it (`SET search_path` for the script,
    `RESET` at its end). Run the script once, in one transaction (`psql --single-transaction`,
    or inside a migration of Alembic, Django...): it takes flowlock's migration lock, so an
    engine opening at the same moment waits for it instead of migrating too."""
    check_schema(schema)
    migrations = load("postgres")
    names = [m.name for m in migrations]
    if after is not None:
        if after not in names:
            raise InvalidInput(
                f"no PostgreSQL migration named {after!r}; the migrations are {', '.join(names)}"
            )
        migrations = migrations[names.index(after) + 1 :]
    listed = [f"--   {m.name}" for m in migrations] or ["--   (none left to apply)"]
    lines = [
        "-- flowlock's PostgreSQL schema migrations, oldest first:",
        *listed,
        "-- Run it once, in one transaction. Each migration is recorded in",
        "-- flowlock_schema_migrations, so Engine.connect (auto_migrate=True) and",
        "-- `flowlock db migrate` find nothing left to apply.",
        "",
    ]
    if schema is not None:
        lines += [f'CREATE SCHEMA IF NOT EXISTS "{schema}";', f'SET search_path TO "{schema}";']
    lines += [
        "-- flowlock's migration lock: an engine migrating at the same moment waits for this one.",
        f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK});",
        f"{RECORDS_TABLE};",
    ]
    for m in migrations:
        sql = m.sql.strip()
        # A file whose last statement has no ';' (or ends in a comment) must not run into the
        # INSERT below it.
        lines += [
            "",
            f"-- migration {m.name}",
            sql if sql.endswith(";") else sql + "\n;",
            f"INSERT INTO flowlock_schema_migrations (name) VALUES ('{m.name}')"
            " ON CONFLICT (name) DO NOTHING;",
        ]
    if schema is not None:
        lines += ["", "RESET search_path;"]
    return "\n".join(lines) + "\n"
