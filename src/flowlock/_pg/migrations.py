"""The PostgreSQL migration runner: the versioned SQL files of ``stores/sql/postgres`` applied in
name order, each recorded in ``flowlock_schema_migrations``, all in one transaction under a
transaction-level advisory lock.

Functions over a connection or a pool, so that every PostgreSQL adapter (the store, the advisory
locks, the run-once jobs) migrates the same way without building another adapter to do it.
"""

from __future__ import annotations

import asyncpg

from flowlock._pg.errors import Context, wrap_connect
from flowlock._pg.pool import close_pool, connection, create_pool
from flowlock.errors import FlowlockError, MigrationError, StoreError
from flowlock.stores.migrations import load

__all__ = ["MIGRATION_LOCK", "apply", "migrate", "migrate_database"]

# Any fixed 64-bit number; two processes migrating at once serialise on it.
MIGRATION_LOCK = 0x666C6F776C6F636B  # "flowlock"

# A migration's statements are store statements about no instance in particular: worded as the
# store words them, for the key ''.
_CONTEXT = Context(
    what="PostgreSQL error for ''",
    tables="flowlock tables are",
    opener="the engine",
    key="",
    busy=lambda exc: StoreError(str(exc)),
)


async def apply(conn: asyncpg.Connection | asyncpg.pool.PoolConnectionProxy) -> list[str]:
    """Apply the migrations not yet recorded, on ``conn``, in one transaction. Returns the names
    applied (none when the schema is up to date). Driver errors are raised as they are."""
    applied: list[str] = []
    async with conn.transaction():
        await conn.execute("SET LOCAL lock_timeout = '60s'")
        # Why a transaction-level advisory lock: two processes starting at once must not both
        # run 001; the second waits here, then sees 001 recorded and skips it.
        await conn.execute("SELECT pg_advisory_xact_lock($1)", MIGRATION_LOCK)
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS flowlock_schema_migrations ("
            " name text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        done = {r["name"] for r in await conn.fetch("SELECT name FROM flowlock_schema_migrations")}
        for m in load("postgres"):
            if m.name in done:
                continue
            await conn.execute(m.sql)
            await conn.execute("INSERT INTO flowlock_schema_migrations (name) VALUES ($1)", m.name)
            applied.append(m.name)
    return applied


async def migrate(pool: asyncpg.Pool, *, acquire_timeout: float, pool_size: int) -> list[str]:
    """:func:`apply` on a connection of ``pool``; any failure is a MigrationError (from the
    flowlock error it was translated to)."""
    try:
        async with connection(
            pool, acquire_timeout=acquire_timeout, size=pool_size, context=_CONTEXT
        ) as conn:
            return await apply(conn)
    except FlowlockError as exc:
        raise MigrationError(f"migrating the flowlock schema failed: {exc}") from exc


async def migrate_database(
    dsn: str, *, schema: str | None, application_name: str, connect_timeout: float
) -> list[str]:
    """Migrate the database at ``dsn`` (``schema`` created if missing) on a connection of its
    own, for adapters with no pool to spare. StoreError if it cannot connect, MigrationError if
    migrating fails."""
    with wrap_connect(dsn):
        pool = await create_pool(
            dsn,
            max_size=1,
            schema=schema,
            create_schema=True,
            application_name=application_name,
            connect_timeout=connect_timeout,
            jsonb=False,
        )
    try:
        return await migrate(pool, acquire_timeout=connect_timeout, pool_size=1)
    finally:
        await close_pool(pool)
