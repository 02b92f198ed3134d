"""A caller's psycopg 3 connection, seen by the PostgreSQL store as it sees an asyncpg one.

`connection=` hands the store a connection inside a transaction the caller opened. The store's
code for that case (`flowlock.stores.postgres.session`, `operations`) speaks asyncpg: `fetch`,
`fetchrow`, `fetchval` and `execute` with `$n` placeholders and a `timeout`, asyncpg's errors.
A `Borrowed` connection gives it the same over psycopg 3, so that code runs unchanged:

- the statements go through psycopg's `RawCursor`, which takes `$n` placeholders as they are;
- psycopg's errors are raised as the asyncpg errors of the same SQLSTATE (the one table in
  `flowlock._pg.errors` then reads them);
- rows read by name or place; timestamps come back in UTC whatever the session's time zone,
  and `jsonb` as psycopg decodes it (`flowlock._pg.rows.json_object` takes text or objects).

`ThreadedPsycopg` wraps a blocking `psycopg.Connection` (Django's, or the caller's own): each
statement runs on a worker thread of its own while the engine's loop waits, so a statement
blocked on a row lock never stalls the loop. The caller's thread waits for the whole call, so
the connection is used by one thread at a time. `AsyncPsycopg` wraps a `psycopg.AsyncConnection`.

`psycopg_of` resolves what a sync caller passes (a Django connection or a psycopg one) and
refuses, before any statement, what is not inside a transaction.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import contextlib
import sys
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import asyncpg
import asyncpg.exceptions

from flowlock.core.errors import InvalidInput

if TYPE_CHECKING:
    import psycopg

__all__ = [
    "AsyncPsycopg",
    "Borrowed",
    "BorrowedRow",
    "CallerConnection",
    "ThreadedPsycopg",
    "psycopg_of",
]

_CANCEL_GRACE = 5.0
"""Seconds a statement that outlived its bound is given to end once it was cancelled."""

_DIAG_FIELDS = {
    # asyncpg's field codes (PostgreSQL's protocol) and psycopg's Diagnostic attributes.
    "S": "severity",
    "C": "sqlstate",
    "M": "message_primary",
    "D": "message_detail",
    "H": "message_hint",
    "s": "schema_name",
    "t": "table_name",
    "c": "column_name",
    "n": "constraint_name",
}


class BorrowedRow:
    """One row, read by column name or place, as an asyncpg Record is."""

    __slots__ = ("_index", "_values")

    def __init__(self, index: dict[str, int], values: Sequence[Any]) -> None:
        self._index = index
        self._values = tuple(values)

    def __getitem__(self, key: str | int) -> Any:
        if isinstance(key, int):
            return self._values[key]
        return self._values[self._index[key]]

    def get(self, key: str, default: Any = None) -> Any:
        at = self._index.get(key)
        return default if at is None else self._values[at]

    def keys(self) -> Iterator[str]:
        return iter(self._index)

    def values(self) -> Iterator[Any]:
        return iter(self._values)

    def items(self) -> Iterator[tuple[str, Any]]:
        return ((k, self._values[i]) for k, i in self._index.items())

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def __iter__(self) -> Iterator[Any]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        shown = " ".join(f"{k}={self._values[i]!r}" for k, i in self._index.items())
        return f"<BorrowedRow {shown}>"


Result = tuple[list[BorrowedRow], str]
"""The rows of a statement (none for a statement that returns none) and its status tag."""


class Borrowed(abc.ABC):
    """A connection of the caller's, inside the caller's transaction, that the store uses as
    an asyncpg connection: the part of asyncpg's interface its caller-transaction code calls."""

    # `timeout=` as asyncpg takes it (ASYNC109): the store's code passes it on every call.
    async def execute(self, sql: str, *args: Any, timeout: float | None = None) -> str:  # noqa: ASYNC109
        return (await self._run(sql, args, timeout))[1]

    # Rows are typed as asyncpg's: a BorrowedRow reads as a Record does (by name or place,
    # get, keys, values, items, iteration), which is all the store's code does with a row.
    async def fetch(
        self,
        sql: str,
        *args: Any,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> list[asyncpg.Record]:
        return cast("list[asyncpg.Record]", (await self._run(sql, args, timeout))[0])

    async def fetchrow(
        self,
        sql: str,
        *args: Any,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> asyncpg.Record | None:
        rows = await self.fetch(sql, *args, timeout=timeout)
        return rows[0] if rows else None

    async def fetchval(
        self,
        sql: str,
        *args: Any,
        column: int = 0,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> Any:
        row = await self.fetchrow(sql, *args, timeout=timeout)
        return None if row is None else row[column]

    @abc.abstractmethod
    async def _run(self, sql: str, args: tuple[Any, ...], bound: float | None) -> Result: ...

    @property
    @abc.abstractmethod
    def raw(self) -> psycopg.Connection[Any] | psycopg.AsyncConnection[Any]:
        """The psycopg connection."""

    def is_closed(self) -> bool:
        return bool(self.raw.closed)

    def is_in_transaction(self) -> bool:
        """Whether the next statement runs in the caller's transaction: one is open, or the
        connection is not in autocommit mode, so psycopg opens one with the next statement (as
        inside Django's `atomic()` before its first query). A failed one counts too: the
        store's first statement then says it has failed."""
        from psycopg.pq import TransactionStatus

        status = self.raw.info.transaction_status
        if status in (TransactionStatus.INTRANS, TransactionStatus.INERROR):
            return True
        return status == TransactionStatus.IDLE and not self.raw.autocommit

    def terminate(self) -> None:
        """Never called for a caller's connection (flowlock never ends a caller's transaction,
        nor closes its connection); here for the interface's sake, it only cancels a statement
        in flight."""
        with contextlib.suppress(Exception):
            self.raw.cancel()


class ThreadedPsycopg(Borrowed):
    """A blocking `psycopg.Connection`, each statement run on a worker thread of this
    object's own; `close()` when the call is over."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self._conn = conn
        self._worker = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="flowlock-psycopg"
        )

    @property
    def raw(self) -> psycopg.Connection[Any]:
        return self._conn

    def close(self) -> None:
        """Let the worker thread go (a statement still in flight, cancelled after its bound,
        ends on its own)."""
        self._worker.shutdown(wait=False)

    async def _run(self, sql: str, args: tuple[Any, ...], bound: float | None) -> Result:
        loop = asyncio.get_running_loop()
        job = loop.run_in_executor(self._worker, _blocking, self._conn, sql, args)
        try:
            return await asyncio.wait_for(asyncio.shield(job), bound)
        except (TimeoutError, asyncio.CancelledError):
            # The thread cannot be stopped, its statement can: ask the server to cancel it,
            # then give it a bounded while to end, so the connection is free for the caller.
            await loop.run_in_executor(None, _cancel, self._conn)
            await asyncio.wait({job}, timeout=_CANCEL_GRACE)
            if job.done() and not job.cancelled():
                job.exception()  # retrieved: its QueryCanceled is this timeout's doing
            raise


# One string: a psycopg type is named here, never imported (psycopg is the caller's).
CallerConnection: TypeAlias = "asyncpg.Connection | asyncpg.pool.PoolConnectionProxy | psycopg.AsyncConnection[Any] | Borrowed"  # noqa: E501
"""What the async engine's `connection=` takes."""


class AsyncPsycopg(Borrowed):
    """A `psycopg.AsyncConnection`, awaited on the caller's own event loop."""

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self._conn = conn

    @property
    def raw(self) -> psycopg.AsyncConnection[Any]:
        return self._conn

    async def _run(self, sql: str, args: tuple[Any, ...], bound: float | None) -> Result:
        try:
            async with asyncio.timeout(bound):
                return await _awaited(self._conn, sql, args)
        except TimeoutError:
            with contextlib.suppress(Exception):
                await self._conn.cancel_safe(timeout=_CANCEL_GRACE)
            raise


def _blocking(conn: psycopg.Connection[Any], sql: str, args: tuple[Any, ...]) -> Result:
    import psycopg

    try:
        with psycopg.RawCursor(conn) as cur:
            # No arguments: the simple protocol, which runs several statements in one text
            # (the store's "SAVEPOINT ...; SET LOCAL ...").
            cur.execute(sql, args or None)
            return _result(cur.description, cur.fetchall() if cur.description else [], cur)
    except psycopg.Error as exc:
        raise as_asyncpg(exc) from exc


async def _awaited(conn: psycopg.AsyncConnection[Any], sql: str, args: tuple[Any, ...]) -> Result:
    import psycopg

    try:
        async with psycopg.AsyncRawCursor(conn) as cur:
            await cur.execute(sql, args or None)
            rows = await cur.fetchall() if cur.description else []
            return _result(cur.description, rows, cur)
    except psycopg.Error as exc:
        raise as_asyncpg(exc) from exc


def _result(description: Any, rows: Sequence[Sequence[Any]], cur: Any) -> Result:
    if not description:
        return [], str(cur.statusmessage or "")
    index = {column.name: i for i, column in reversed(list(enumerate(description)))}
    return [BorrowedRow(index, [_utc(v) for v in row]) for row in rows], str(
        cur.statusmessage or ""
    )


def _utc(value: Any) -> Any:
    """Timestamps in UTC, as asyncpg gives them (psycopg gives the session's time zone)."""
    if isinstance(value, datetime) and value.tzinfo is not None:
        return value.astimezone(UTC)
    return value


def _cancel(conn: psycopg.Connection[Any]) -> None:
    with contextlib.suppress(Exception):
        conn.cancel_safe(timeout=_CANCEL_GRACE)


def as_asyncpg(exc: Exception) -> BaseException:
    """psycopg's error as the asyncpg error the store's rules read: a server's error as the
    asyncpg class of its SQLSTATE (with its constraint name), a lost connection as one that
    does not exist (08003), a closed one as asyncpg's InterfaceError, anything else (an
    argument psycopg could not send) as asyncpg's DataError."""
    import psycopg

    code = getattr(exc, "sqlstate", None)
    if code:
        diag = exc.diag if isinstance(exc, psycopg.Error) else None
        found = {k: getattr(diag, name, None) for k, name in _DIAG_FIELDS.items()}
        fields = {k: str(v) for k, v in found.items() if v is not None}
        fields.setdefault("M", str(exc))
        fields["C"] = code
        return asyncpg.exceptions.PostgresError.new(fields)
    if isinstance(exc, psycopg.InterfaceError) or getattr(exc, "closed", False):
        return asyncpg.InterfaceError(f"psycopg: {exc}")
    if isinstance(exc, psycopg.OperationalError):
        return asyncpg.exceptions.PostgresError.new({"C": "08003", "M": f"psycopg: {exc}"})
    return asyncpg.exceptions._base.DataError(f"psycopg: {exc}")


# -- what a sync caller passes -----------------------------------------------------------------


def _is_django(connection: object) -> bool:
    return type(connection).__module__.startswith("django.") and hasattr(
        connection, "in_atomic_block"
    )


def psycopg_of(connection: object) -> psycopg.Connection[Any]:
    """The psycopg 3 connection of `connection` (Django's `django.db.connection`, or one of
    `connections[alias]`, or a `psycopg.Connection`), checked to be open and inside a transaction
    the caller opened. InvalidInput otherwise; nothing was read or written."""
    raw: object = connection
    if _is_django(connection):
        raw = _django_raw(connection)
    driver = sys.modules.get("psycopg")
    if driver is None or not isinstance(raw, driver.Connection):
        if driver is not None and isinstance(raw, driver.AsyncConnection):
            raise InvalidInput(
                "flowlock.sync.Engine takes a blocking psycopg.Connection as connection=; a "
                "psycopg.AsyncConnection belongs to an event loop: pass it to the async "
                "flowlock.Engine instead. Nothing was read or written"
            )
        raise InvalidInput(
            "connection= on flowlock.sync.Engine takes a psycopg 3 connection "
            "(psycopg.Connection) or a Django database connection (django.db.connection) on "
            f"PostgreSQL, inside a transaction you opened; not {type(raw).__name__}. "
            "Nothing was read or written"
        )
    conn = cast("psycopg.Connection[Any]", raw)
    if conn.closed:
        raise InvalidInput("the connection given as connection= is closed")
    from psycopg.pq import TransactionStatus

    status = conn.info.transaction_status
    if status == TransactionStatus.INERROR:
        raise InvalidInput(
            "the transaction on connection= has already failed (an earlier statement raised); "
            "roll it back first. Nothing was read or written"
        )
    if status == TransactionStatus.ACTIVE:
        raise InvalidInput(
            "the connection given as connection= is running another statement; flowlock "
            "needs it to itself for the call. Nothing was read or written"
        )
    if status != TransactionStatus.INTRANS and conn.autocommit:
        raise InvalidInput(
            "connection= must be inside a transaction you opened (with conn.transaction(): "
            "..., or a connection with autocommit off): flowlock writes in that transaction "
            "and never commits it. Nothing was read or written"
        )
    return conn


def _django_raw(connection: Any) -> object:
    """The psycopg connection under a Django connection, inside `transaction.atomic()`."""
    if connection.vendor != "postgresql":
        raise InvalidInput(
            f"connection= takes a Django connection to PostgreSQL, not {connection.vendor}: "
            "flowlock's transitions can only join a transaction on the database its PostgreSQL "
            "store writes to. Nothing was read or written"
        )
    if not connection.in_atomic_block:
        raise InvalidInput(
            "connection= takes Django's connection inside transaction.atomic() (or a view "
            "under ATOMIC_REQUESTS): flowlock writes in that transaction and Django commits "
            "or rolls it back with your own rows. Nothing was read or written"
        )
    if connection.needs_rollback:
        raise InvalidInput(
            "the transaction.atomic() block on connection= is marked for rollback (an error "
            "inside it was caught); leave the block first. Nothing was read or written"
        )
    connection.ensure_connection()
    raw = connection.connection
    driver = sys.modules.get("psycopg")
    if driver is None or not isinstance(raw, driver.Connection):
        raise InvalidInput(
            "Django's connection uses psycopg2 here; connection= needs Django on psycopg 3 "
            "(pip install 'psycopg[binary]>=3.2': Django 4.2+ then uses it). Nothing was read "
            "or written"
        )
    return raw
