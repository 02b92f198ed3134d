"""The one pool factory of the PostgreSQL adapters, and the pooled connection they work on.

`create_pool` sets, in one place, what every flowlock connection needs: the schema
(created if asked, and put on `search_path`), the `application_name` it shows in
`pg_stat_activity`, the `jsonb` codec, and no reset on release (see `_keep_session`).
Each caller still passes what is its own: sizes, timeouts, extra server settings, and what
sits between it and PostgreSQL (`flowlock._pg.pooling`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import asyncpg

from flowlock._pg.errors import (
    DRIVER_ERRORS,
    Context,
    broken,
    read_only,
    server_gone,
    too_many_clients,
    translate,
    wrap_errors,
)
from flowlock._pg.pooling import Pooling
from flowlock.core.errors import EngineClosed, InvalidInput, StoreBusy
from flowlock.core.settings import MAX_SECONDS, check_application_name, check_seconds, check_size

__all__ = [
    "InitHook",
    "SetupHook",
    "check_pool_size",
    "check_schema",
    "close_pool",
    "connection",
    "create_pool",
    "ensure_schema",
    "give_back",
    "terminate",
]

# Run on each new connection (init) and on each acquire (setup), as asyncpg calls them.
InitHook = Callable[[asyncpg.Connection], Coroutine[Any, Any, None]]
SetupHook = Callable[[asyncpg.pool.PoolConnectionProxy], Coroutine[Any, Any, None]]

# The schema reaches search_path and a CREATE SCHEMA statement: an identifier, never SQL text.
_SCHEMA = re.compile(r"[a-z_][a-z0-9_]{0,62}")


def check_schema(schema: str | None) -> None:
    """Refuse a schema name that is not a plain lower-case SQL identifier."""
    if schema is not None and (not isinstance(schema, str) or not _SCHEMA.fullmatch(schema)):
        raise InvalidInput(
            f"schema {schema!r} must be a lower-case SQL identifier (letters, digits, '_')"
        )


def check_pool_size(pool_size: int) -> None:
    check_size("pool_size", pool_size)


async def _jsonb(conn: asyncpg.Connection) -> None:
    """`jsonb` columns as dicts (and lists...) both ways, encoded compactly."""
    await conn.set_type_codec(
        "jsonb",
        encoder=lambda v: json.dumps(v, separators=(",", ":"), ensure_ascii=False),
        decoder=json.loads,
        schema="pg_catalog",
    )


async def _keep_session(conn: asyncpg.Connection) -> None:
    """Pool reset hook: nothing to undo. flowlock changes session state only with SET LOCAL and
    transaction-level advisory locks, which end with their transaction (asyncpg still rolls back
    any open transaction before calling this), and with the fencing epochs' session-level lock,
    which `flowlock._pg.fence` lets go of before giving the connection back or ends with
    the connection. The default reset (`RESET ALL; UNLISTEN *;
    ...`) would cost one extra round trip on every release, and would undo the settings SET on
    each new connection behind a session pooler."""


_STATEMENT_CACHE = 100

# Session settings of a connection behind a session pooler, in one round trip.
_SET = "SELECT set_config(name, value, false) FROM unnest($1::text[], $2::text[]) AS s(name, value)"


def _init_hook(jsonb: bool, settings: Mapping[str, str], init: InitHook | None) -> InitHook | None:
    """What runs on each new connection: the session `settings` (SET, where a pooler would
    refuse them as startup parameters), the `jsonb` codec, then the caller's `init`."""
    steps: list[InitHook] = []
    if settings:
        names, values = list(settings), list(settings.values())

        async def session(conn: asyncpg.Connection) -> None:
            await conn.fetch(_SET, names, values)

        steps.append(session)
    if jsonb:
        steps.append(_jsonb)
    if init is not None:
        steps.append(init)
    if len(steps) < 2:
        return steps[0] if steps else None

    async def each(conn: asyncpg.Connection) -> None:
        for step in steps:
            await step(conn)

    return each


async def ensure_schema(
    dsn: str, schema: str, *, connect_timeout: float, command_timeout: float
) -> None:
    """Create `schema` if it is missing, on a connection of its own (a pool's search_path names
    the schema, so it must exist before the pool's connections do). Each round trip, the
    goodbye included, takes at most `command_timeout` seconds."""
    check_schema(schema)
    conn = await asyncpg.connect(dsn, timeout=connect_timeout, command_timeout=command_timeout)
    try:
        await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
    except asyncpg.UniqueViolationError:
        pass  # created by a concurrent opener
    finally:
        try:
            await conn.close(timeout=command_timeout)
        except DRIVER_ERRORS:
            terminate(conn)


async def create_pool(
    dsn: str,
    *,
    max_size: int,
    application_name: str,
    connect_timeout: float,
    command_timeout: float,
    min_size: int = 1,
    schema: str | None = None,
    create_schema: bool = False,
    server_settings: Mapping[str, str] | None = None,
    jsonb: bool = True,
    reset: bool = False,
    init: InitHook | None = None,
    setup: SetupHook | None = None,
    pooling: Pooling = "none",
) -> asyncpg.Pool:
    """A pool of at most `max_size` connections to `dsn` (`min_size` opened up front).

    `schema`: put on `search_path` (and created first if `create_schema`). `jsonb`: decode
    and encode `jsonb` as Python values. `reset`: run asyncpg's default reset on every release
    (off: flowlock's session state is transaction-scoped, see `_keep_session`; on, it would undo
    the settings a session pooler's connections are given by SET).
    `command_timeout`: seconds any round trip on these connections may take when the call
    names no `timeout=` of its own (asyncpg's own statements too: the type introspection of a
    new connection, the ROLLBACK of a release, the goodbye of a close); past it asyncpg raises
    TimeoutError and the connection must be terminated (`give_back` does).
    `server_settings`: more settings for every connection (`lock_timeout`...). `init` runs on
    each new connection (after the codec), `setup` on each acquire. Driver errors are raised as
    they are: the caller says what a failure to connect means to it. Sizes, the timeout and the
    name are checked first (InvalidInput, before any connection is tried).

    `pooling`: what is between this process and PostgreSQL (`flowlock._pg.pooling`). Direct
    (`"none"`), the settings and `search_path` go as startup parameters. Behind a session
    pooler they are SET once on each new connection instead (PgBouncer refuses startup
    parameters it does not know). Behind a transaction pooler no connection keeps anything
    from one transaction to the next: neither `server_settings` nor `search_path` is set (the
    caller names its tables with the schema and sets what it needs LOCAL in each transaction),
    and asyncpg's statement cache is off (a statement prepared in one transaction would be
    missing on the server connection of the next).
    """
    check_schema(schema)
    check_size("max_size", max_size)
    check_size("min_size", min_size, least=0)
    check_seconds("connect_timeout", connect_timeout)
    # Not capped at MAX_SECONDS: a caller's bound is a lock wait plus a margin, each checked.
    check_seconds("command_timeout", command_timeout, most=2 * MAX_SECONDS)
    check_application_name(application_name)
    if schema is not None and create_schema:
        await ensure_schema(
            dsn, schema, connect_timeout=connect_timeout, command_timeout=command_timeout
        )
    settings = dict(server_settings or {})
    if schema is not None:
        settings["search_path"] = schema
    startup = {"application_name": application_name}
    if pooling == "none":
        startup.update(settings)
    session = settings if pooling == "session" else {}
    return await asyncpg.create_pool(
        dsn,
        min_size=min(min_size, max_size),
        max_size=max_size,
        init=_init_hook(jsonb, session, init),
        setup=setup,
        reset=None if reset else _keep_session,
        server_settings=startup,
        timeout=connect_timeout,
        command_timeout=command_timeout,
        # asyncpg's documented setting for a transaction pooler: unnamed statements only
        # (100, asyncpg's default, elsewhere).
        statement_cache_size=0 if pooling == "transaction" else _STATEMENT_CACHE,
    )


@asynccontextmanager
async def connection(
    pool: asyncpg.Pool, *, acquire_timeout: float, size: int, context: Context
) -> AsyncIterator[asyncpg.pool.PoolConnectionProxy]:
    """A connection of `pool` (of `size` at most), given back on the way out (see
    `give_back`: a connection broken inside is terminated, not given back); driver errors
    raised inside become flowlock errors of `context`. No connection free within
    `acquire_timeout` seconds: StoreBusy. The pool had room, but the server refused a new
    connection (all of its max_connections in use): TooManyConnections. The pool closed while
    this call waited for a connection: EngineClosed, and nothing is sent on the connection it
    may have been handed (a closing pool closes that connection under it, and asyncpg then
    fails with errors of its own, InternalClientError among them)."""
    try:
        conn = await pool.acquire(timeout=acquire_timeout)
    except TimeoutError:
        raise StoreBusy(acquire_timeout, size) from None
    except DRIVER_ERRORS as exc:
        if pool.is_closing():
            raise _closed_while_waiting(context) from exc
        # The pool had room and tried to grow, but the server is full.
        full = too_many_clients(exc, size=size)
        if full is not None:
            raise full from exc
        # Nothing was sent yet: whatever the block would write, its outcome is not in doubt.
        raise translate(exc, context=replace(context, in_doubt=False)) from exc
    if pool.is_closing():
        # The pool is closing this connection (or has closed it): giving it back cannot fail
        # in any way that matters to the caller.
        await give_back(pool, conn)
        raise _closed_while_waiting(context)
    failure: BaseException | None = None
    try:
        with wrap_errors(context):
            yield conn
    except BaseException as exc:
        failure = exc
        raise
    finally:
        await give_back(pool, conn, failure)


def terminate(conn: asyncpg.Connection | asyncpg.pool.PoolConnectionProxy) -> None:
    """Close `conn` at once, without a word to the server: a pooled connection's pool then
    opens a fresh one on its next acquire. The server ends the session (and rolls back its
    transaction, and frees its locks) when it sees the socket close."""
    # InterfaceError: already closed by the server, and handed back to the pool by asyncpg.
    with contextlib.suppress(*DRIVER_ERRORS):
        conn.terminate()


async def give_back(
    pool: asyncpg.Pool,
    conn: asyncpg.pool.PoolConnectionProxy,
    error: BaseException | None = None,
) -> None:
    """Give `conn` back to `pool` after a call that raised `error` (None: it succeeded);
    never raises a driver error.

    Why terminate: a connection whose session ended, or that asyncpg has seen fail mid-protocol,
    would fail the next call that acquires it, and the next, with errors such as "cannot switch
    to state 15; another operation is in progress" (`broken` says
    which). And when the error says that the server ended the session or that the network
    failed (`server_gone`: a restart, a failover,
    `pg_terminate_backend`), the pool's other connections are likely dead too: they are
    replaced as they are next acquired or given back, so the calls after this one recover at
    once instead of each finding a dead connection of its own. A write refused because the
    server is read-only (`read_only`: a primary demoted to a standby
    by a failover) is the same for the pool: the session goes on, but every connection to that
    server is useless for writing, so all of them are replaced, and a multi-host URL's
    `target_session_attrs=read-write` then finds the new primary. Giving a connection back can
    fail too (asyncpg's reset runs a ROLLBACK on it); asyncpg has terminated it then, and the
    call's own outcome stands."""
    if error is not None and (broken(error) or read_only(error)):
        terminate(conn)
        if server_gone(error) or read_only(error):
            await pool.expire_connections()
    try:
        await pool.release(conn)
    except DRIVER_ERRORS:
        terminate(conn)


async def close_pool(pool: asyncpg.Pool, *, bound: float | None = None) -> None:
    """Close `pool` gracefully, waiting for connections in use to come back (at most `bound`
    seconds); terminate it when that fails or takes longer (a connection broken under it cannot
    say goodbye). Never raises a driver error."""
    try:
        async with asyncio.timeout(bound):
            await pool.close()
    except DRIVER_ERRORS:
        pool.terminate()


def _closed_while_waiting(context: Context) -> EngineClosed:
    about = "" if context.key is None else f" on {context.key!r}"
    return EngineClosed(
        f"the PostgreSQL pool was closed while this call{about} waited for a connection; "
        "nothing was sent, nothing was written"
    )
