"""Where a call's statements run: flowlock's pool, an application's pool, or a caller's transaction.

Driver errors become flowlock errors here, at the adapter's edge (`Session.conn`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import replace
from typing import Any, Protocol

import asyncpg

from flowlock._pg.borrowed import AsyncPsycopg, Borrowed
from flowlock._pg.errors import DRIVER_ERRORS, Context, broken, refused, wrap_errors
from flowlock._pg.pool import connection, terminate
from flowlock.core.errors import FlowlockError, InvalidInput, StoreError
from flowlock.stores.postgres.sql import CALLERS_SETTINGS, RESTORE, SAVEPOINT

Conn = asyncpg.Connection | asyncpg.pool.PoolConnectionProxy | Borrowed
Busy = Callable[[BaseException], FlowlockError]


class Bounds(Protocol):
    """What a session needs of its store: the pool, the bounds of a call, and how its
    statements and transactions read where the connections keep no session settings."""

    acquire_timeout: float
    command_timeout: float
    pool_size: int
    round_trip: float

    @property
    def pool(self) -> asyncpg.Pool: ...

    @property
    def begin(self) -> str: ...

    def statement(self, sql: str) -> str: ...


class Session:
    """Where the statements of one call run: a connection of the store's pool per call, or the
    one connection `joined`, inside a transaction that someone else ends (the caller's, or the
    one `PostgresStore._app_transaction` opened around the call). `callers`: that transaction
    is the caller's, so a failed statement must leave it usable (a savepoint around it)."""

    def __init__(self, store: Bounds, joined: Conn | None = None, *, callers: bool = False) -> None:
        self._store = store
        self._joined = joined
        self._callers = callers

    @property
    def joined(self) -> bool:
        return self._joined is not None

    @property
    def callers(self) -> bool:
        """Whether the statements run in the caller's own transaction."""
        return self._callers

    @property
    def timeout(self) -> float:
        """The client-side bound of one statement: the store's `lock_timeout` (any statement
        may wait that long for a lock, on the server's clock) plus its `command_timeout`."""
        return self._store.round_trip

    @property
    def command_timeout(self) -> float:
        return self._store.command_timeout

    @property
    def begin(self) -> str:
        """What opens a transaction of flowlock's own on a pooled connection: BEGIN, with the
        store's lock_timeout set LOCAL where the connection has no session setting of it."""
        return self._store.begin

    def sql(self, text: str) -> str:
        """`text` as it must be sent here: its tables named with the store's schema where the
        connections do not have it on their search_path (behind a transaction pooler)."""
        return self._store.statement(text)

    def conn(
        self, key: str = "", *, busy: Busy | None = None, writes: bool = False
    ) -> AbstractAsyncContextManager[Conn]:
        """A connection whose driver errors become flowlock errors about `key`. `busy`: what
        a lock that is not available (SQLSTATE 55P03) means to this call; by default a
        StoreError. `writes`: the block runs one autocommit write, so a session lost while it
        is in flight leaves its outcome unknown (OutcomeUnknown). On a joined connection nothing
        is autocommitted: a session lost there rolls the whole transaction back (ConnectionLost),
        and whoever ends that transaction says whether its COMMIT is in doubt."""
        context = context_of(key, busy)
        if self._joined is not None:
            return _on(self._joined, context)
        store = self._store
        return connection(
            store.pool,
            acquire_timeout=store.acquire_timeout,
            size=store.pool_size,
            context=replace(context, in_doubt=writes),
        )


@asynccontextmanager
async def _on(conn: Conn, context: Context) -> AsyncIterator[Conn]:
    with wrap_errors(context):
        yield conn


async def guarded_cas(
    conn: Conn, sql: str, args: tuple[Any, ...], bound: float
) -> asyncpg.Record | None:
    """The compare-and-swap `sql` in a savepoint of its own. In a transaction flowlock does not
    end, a duplicate request id must undo this statement only, leaving the transaction usable for
    the re-read that answers the request idempotently; so must a refused claim (the caller's
    transaction goes on)."""
    await conn.execute("SAVEPOINT flowlock_cas", timeout=bound)
    try:
        row = await conn.fetchrow(sql, *args, timeout=bound)
    except asyncpg.PostgresError as exc:
        if not isinstance(exc, asyncpg.UniqueViolationError) and not refused(exc):
            raise
        await conn.execute(
            "ROLLBACK TO SAVEPOINT flowlock_cas; RELEASE SAVEPOINT flowlock_cas", timeout=bound
        )
        raise
    await conn.execute("RELEASE SAVEPOINT flowlock_cas", timeout=bound)
    return row


async def roll_back(conn: Conn, exc: BaseException, bound: float) -> None:
    """End flowlock's own transaction on a pooled connection after `exc`."""
    if broken(exc):
        # The session is gone, asyncpg lost track of it, or a statement outlived its bound and
        # asyncpg gave up on it mid-protocol: a ROLLBACK would fail (or wait on a server that
        # does not answer) and hide this error; the server rolls back when the socket closes,
        # and the pool opens a fresh connection in its place.
        if not isinstance(conn, Borrowed):  # a caller's: never flowlock's to close
            terminate(conn)
    elif not conn.is_closed() and conn.is_in_transaction():
        await conn.execute("ROLLBACK", timeout=bound)


def caller_connection(connection: object) -> Conn:
    """`connection=` checked: an open asyncpg connection inside an open transaction, or a
    psycopg 3 one (an AsyncConnection, or a blocking one the sync engine wrapped)."""
    psycopg = sys.modules.get("psycopg")  # imported by whoever passes one of its connections
    if psycopg is not None and isinstance(connection, psycopg.AsyncConnection):
        connection = AsyncPsycopg(connection)
    if not isinstance(connection, asyncpg.Connection | asyncpg.pool.PoolConnectionProxy | Borrowed):
        raise InvalidInput(
            "connection= takes an asyncpg connection (from asyncpg.connect() or pool.acquire()) "
            "or a psycopg.AsyncConnection inside an open transaction, not "
            f"{type(connection).__name__}"
        )
    try:
        closed = connection.is_closed()
        in_transaction = connection.is_in_transaction()
    except asyncpg.InterfaceError as exc:  # a pool connection already released
        raise InvalidInput(f"the connection given as connection= is not usable: {exc}") from exc
    if closed:
        raise InvalidInput("the connection given as connection= is closed")
    if not in_transaction:
        raise InvalidInput(
            "connection= must be inside an open transaction (async with conn.transaction(): "
            "...): flowlock runs its statements in that transaction and never commits it; "
            "nothing was read or written"
        )
    return connection


async def enter(conn: Conn, settings: str, bound: float) -> tuple[str, str]:
    """Read the caller's settings, open flowlock's savepoint and set flowlock's for it."""
    try:
        prior = await conn.fetchrow(CALLERS_SETTINGS, timeout=bound)
    except asyncpg.InFailedSQLTransactionError as exc:
        raise InvalidInput(
            "the transaction on connection= has already failed (an earlier statement raised); "
            "roll it back first. Nothing was read or written"
        ) from exc
    assert prior is not None  # a SELECT of settings has one row
    if prior["read_only"] == "on":
        # Refused here: the write would fail with 25006, which elsewhere means a demoted
        # primary (ConnectionLost), not a caller's own read-only transaction.
        raise InvalidInput(
            "the transaction on connection= is read-only (transaction(readonly=True), or a "
            "standby); flowlock writes in it. Nothing was read or written"
        )
    await conn.execute(f"SAVEPOINT {SAVEPOINT}; {settings}", timeout=bound)
    return prior["search_path"], prior["lock_timeout"]


async def leave(conn: Conn, prior: tuple[str, str], bound: float) -> None:
    await conn.execute(RESTORE, *prior, timeout=bound)
    await conn.execute(f"RELEASE SAVEPOINT {SAVEPOINT}", timeout=bound)


async def undo(conn: Conn, bound: float) -> None:
    """Roll flowlock's part back, and its settings with it; the caller's transaction goes on as it
    was before. A connection that cannot take that (closed, lost) is the caller's to deal with:
    the error they see is the one that ended flowlock's part."""
    if conn.is_closed():
        return
    with contextlib.suppress(*DRIVER_ERRORS):
        await conn.execute(
            f"ROLLBACK TO SAVEPOINT {SAVEPOINT}; RELEASE SAVEPOINT {SAVEPOINT}", timeout=bound
        )


def context_of(key: str, busy: Callable[[BaseException], FlowlockError] | None = None) -> Context:
    """What the driver errors of a statement about `key` mean to the store."""
    return Context(
        what=f"PostgreSQL error for {key!r}",
        tables="flowlock tables are",
        opener="the engine",
        key=key,
        busy=busy or _unavailable,
        duplicate=DuplicateRequest.of,
    )


def _unavailable(exc: BaseException) -> FlowlockError:
    # SQLSTATE 55P03 outside commit and apply_locked (an INSERT waiting behind a concurrent
    # one, say): the lock_timeout of the session ran out.
    return StoreError(str(exc))


class DuplicateRequest(StoreError):
    """The (instance, request_id) unique constraint fired (a signal commit() catches)."""

    @classmethod
    def of(cls, exc: BaseException) -> FlowlockError:
        return cls(str(exc))


class Contended(StoreError):
    """The statement of several instances met a deadlock or a serialization failure and was
    rolled back whole (a signal commit_many() catches)."""

    def __init__(self, key: str, exc: BaseException) -> None:
        super().__init__(
            f"the compare-and-swaps of {key!r} were rolled back together "
            f"({type(exc).__name__}: {exc}); nothing of them was written"
        )
