"""Whether a connection pooler sits between flowlock and PostgreSQL, and which kind.

A transaction pooler (PgBouncer `pool_mode=transaction`) hands each transaction of a client
connection to whichever server connection is free. Nothing of a session survives from one
transaction to the next there: no setting, no prepared statement, no session-level lock. The
PostgreSQL adapters ask `resolve` once, when they open, and build their pool for the answer:

- `"none"`: a direct connection. Settings go as startup parameters.
- `"session"`: a session pooler (PgBouncer `pool_mode=session`). Each client connection keeps
  one server connection, but PgBouncer refuses startup parameters it does not know
  (`lock_timeout`, `search_path`), so the settings are SET once per connection instead.
- `"transaction"`: no session settings and no statement cache. The callers name their
  tables with the schema and set what they need LOCAL in each transaction; what needs a
  session (advisory locks, fencing epochs) is refused (`session_needed`).
"""

from __future__ import annotations

import contextlib
from typing import Literal, TypeAlias

import asyncpg

from flowlock._pg.errors import DRIVER_ERRORS
from flowlock.core.errors import InvalidInput
from flowlock.core.settings import PoolingChoice

__all__ = [
    "Pooling",
    "probe",
    "resolve",
    "session_needed",
]

Pooling: TypeAlias = Literal["none", "session", "transaction"]
"""What the link is: direct, through a session pooler, or through a transaction pooler."""

_PID = "SELECT pg_backend_pid()"
_ROUNDS = 3  # rounds of the move test behind a pooler (a few milliseconds each)
_SECOND_WAIT = 2.0  # seconds the second connection may wait for a server connection


def session_needed(what: str) -> InvalidInput:
    """The refusal of `what` (advisory locks, fencing epochs...) behind a transaction pooler."""
    return InvalidInput(
        f"{what} need a PostgreSQL session of their own, and the database URL goes through a "
        "transaction-pooling proxy (PgBouncer pool_mode=transaction), which hands each "
        "transaction to another server connection. Use session pooling for that connection "
        "(a PgBouncer database entry with pool_mode=session) or connect it to PostgreSQL "
        "directly. Nothing was written"
    )


async def resolve(
    choice: PoolingChoice,
    dsn: str,
    *,
    application_name: str,
    connect_timeout: float,
    command_timeout: float,
) -> Pooling:
    """The link to `dsn`: `choice` when the user said it ("session" covers a direct
    connection too: the settings are then SET per connection, which works either way), else
    what `probe` finds. Driver errors are raised as they are."""
    if choice == "transaction":
        return "transaction"
    if choice == "session":
        return "session"
    return await probe(
        dsn,
        application_name=application_name,
        connect_timeout=connect_timeout,
        command_timeout=command_timeout,
    )


async def probe(
    dsn: str, *, application_name: str, connect_timeout: float, command_timeout: float
) -> Pooling:
    """Find out what is between this process and PostgreSQL, on connections of its own.

    A pooler hands its clients a cancel key of its own, so the process id a connection was
    given at startup is not that of the backend it talks to: when they match, the link is
    direct, and one connection and one query was all it cost. Behind a pooler, two
    connections A and B each hold a transaction open at once (so on two server connections X
    and Y), commit, and ask their backend again outside any transaction. A session pooler
    keeps A on X and B on Y. A transaction pooler gives the next statement any free server
    connection: X and Y are both free then, and the first statement takes the one freed last
    (PgBouncer's default, LIFO: B lands on X) or first (FIFO: A lands on Y), so one of the
    two moves. Sound on a quiet pooler; on a busy one other clients may take X and Y in
    between and hide a transaction pooler (never the other way round), so it runs a few
    rounds; say `pooling=` to be sure."""
    a = await _connect(dsn, application_name, connect_timeout, command_timeout)
    try:
        if await a.fetchval(_PID) == a.get_server_pid():
            return "none"
        b = await _connect(dsn, application_name, connect_timeout, command_timeout)
        try:
            # Other clients may hide a move once; a session pooler never shows one.
            for _ in range(_ROUNDS):
                if await _moved(a, b, min(command_timeout, _SECOND_WAIT)):
                    return "transaction"
        finally:
            await _close(b, command_timeout)
    finally:
        await _close(a, command_timeout)
    return "session"


async def _moved(a: asyncpg.Connection, b: asyncpg.Connection, wait: float) -> bool:
    """One round of the probe: whether A or B answered from another backend after both held
    a transaction at once."""
    await a.execute("BEGIN")
    x = await a.fetchval(_PID)
    try:
        await b.execute("BEGIN", timeout=wait)
        y = await b.fetchval(_PID, timeout=wait)
    except TimeoutError:
        raise InvalidInput(
            "could not tell how the pooler in front of PostgreSQL pools: a second connection "
            f"got no server connection within {wait:g} s while the first held one (a pooler "
            "with one server connection, or a saturated one); say it with "
            "pooling='transaction' (PgBouncer pool_mode=transaction) or pooling='session'"
        ) from None
    await b.execute("COMMIT")
    await a.execute("COMMIT")
    return bool(await a.fetchval(_PID) != x or await b.fetchval(_PID) != y)


async def _connect(
    dsn: str, application_name: str, connect_timeout: float, command_timeout: float
) -> asyncpg.Connection:
    # Nothing a pooler refuses at startup, and no prepared statement kept across transactions.
    # Named apart from the pool's connections, which it must not be counted among.
    return await asyncpg.connect(
        dsn,
        timeout=connect_timeout,
        command_timeout=command_timeout,
        statement_cache_size=0,
        server_settings={"application_name": f"{application_name[:57]}-probe"},
    )


async def _close(conn: asyncpg.Connection, bound: float) -> None:
    try:
        await conn.close(timeout=bound)
    except DRIVER_ERRORS:
        with contextlib.suppress(*DRIVER_ERRORS):
            conn.terminate()
