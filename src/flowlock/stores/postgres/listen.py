"""LISTEN on a connection of its own, opened again whenever it drops: what wakes the timer
service (`timers`) and the outbox's dispatcher (`outbox`) when another engine commits.

One loop for both, told which channel to listen on (`Channel`) and what to do with what it
hears (`Hearer`). Where LISTEN cannot work (behind a transaction pooler) the event is set every
`POLL` seconds instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import asyncpg

from flowlock._pg.errors import DRIVER_ERRORS
from flowlock._pg.pooling import Pooling
from flowlock.core.errors import FlowlockError

__all__ = [
    "KEEPALIVE",
    "POLL",
    "TABLE_SCHEMA",
    "Channel",
    "Connect",
    "Hearer",
    "Listening",
    "channel_name",
    "listening",
    "opener",
]

E = TypeVar("E", bound=asyncio.Event)

POLL = 1.0
"""Seconds between two wake-ups where LISTEN cannot work (behind a transaction pooler): the
timer service and the dispatcher then look at the store about once a second."""
KEEPALIVE = 30.0
"""Seconds between two round trips on an idle LISTEN connection, which find a connection that
died without a word (a half-open network path) so that it is opened again (and, for the timers,
read the server's clock again)."""
_RECONNECT = (0.05, 1.0)  # the first and the longest pause before opening it again
# Seconds a goodbye may take before the connection is dropped without one: an engine closing
# while the server does not answer must not wait a whole round trip's bound for it.
_GOODBYE = 1.0

# The schema a table is in, where the connection's search_path finds it ($1: the table's name):
# it names the channel of the table's NOTIFY (see 010_timers.sql and 011_outbox.sql).
TABLE_SCHEMA = """
SELECT coalesce(
    (SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
      WHERE c.oid = to_regclass($1)),
    current_schema())
"""


def channel_name(table: str, schema: str) -> str:
    """The NOTIFY channel of `table` in `schema`, as the table's trigger names it: a schema
    name too long for a channel (63 bytes) is replaced by its md5."""
    raw = schema.encode()
    named = schema if len(raw) <= 47 else hashlib.md5(raw, usedforsecurity=False).hexdigest()
    return f"{table}.{named}"


Connect = Callable[[], Awaitable[asyncpg.Connection]]
# What ends one LISTEN connection (the store closed, or the server out of reach), not the loop.
_LISTEN_ERRORS: tuple[type[BaseException], ...] = (*DRIVER_ERRORS, FlowlockError)


@dataclass(frozen=True, slots=True)
class Channel:
    """What one LISTEN is about: `table`, whose schema names the channel (`name` of the
    schema, as the table's trigger names it); `suffix`, added to the store's application_name
    for the LISTEN connection (so it shows apart in `pg_stat_activity`); `what`, for the logs."""

    table: str
    name: Callable[[str], str]
    suffix: str
    what: str


class Hearer(Protocol):
    """What a LISTEN does with what it hears."""

    async def read(self, conn: asyncpg.Connection, bound: float) -> None:
        """One round trip when the connection opens and at each keepalive."""

    def heard(self, conn: object, pid: int, channel: str, payload: object) -> None:
        """asyncpg's listener: a notification arrived."""


class Listening(Protocol):
    """What `opener` needs of the store (PostgresStore)."""

    dsn: str | None
    application_name: str
    round_trip: float
    _connect_timeout: float
    _given: asyncpg.Pool | None

    @property
    def pooling(self) -> Pooling | None: ...


def opener(store: Listening, suffix: str) -> Connect | None:
    """How to open a LISTEN connection of `store`, named with `suffix`; None where LISTEN
    cannot work (a transaction pooler, or an application's pool flowlock cannot copy)."""
    if store.pooling == "transaction":
        return None
    given = store._given
    if given is not None:
        # An application's pool: a new connection built as the pool builds its own (its
        # connect arguments, its init), but never handed to the pool. Private asyncpg API,
        # so guarded: without it, the event is set every POLL seconds.
        make: Any = getattr(given, "_get_new_connection", None)
        return None if make is None else make
    dsn = store.dsn or ""
    timeout, bound = store._connect_timeout, store.round_trip
    # Named apart from the pool's connections in pg_stat_activity; nothing a pooler refuses at
    # startup (a session pooler passes LISTEN through: the client keeps its server connection).
    name = f"{store.application_name[: 63 - len(suffix)]}{suffix}"

    async def connect() -> asyncpg.Connection:
        return await asyncpg.connect(
            dsn,
            timeout=timeout,
            command_timeout=bound,
            statement_cache_size=0,
            server_settings={"application_name": name},
        )

    return connect


@asynccontextmanager
async def listening(
    connect: Connect | None,
    schema: str | None,
    channel: Channel,
    hearer: Hearer,
    event: E,
    bound: float,
) -> AsyncIterator[E]:
    """`event`, set as `hearer` says while LISTEN runs (from the `async with` to its end),
    and whenever a notification may have been missed (the connection opened again); set every
    POLL seconds instead where there is no way to LISTEN (`connect` None)."""
    if connect is None:
        work = _poll(event)
    else:
        work = _listen(connect, schema, channel, hearer, event, bound)
    task = asyncio.get_running_loop().create_task(work, name=f"flowlock-{channel.what}-listen")
    try:
        yield event
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _poll(event: asyncio.Event) -> None:
    """Where LISTEN cannot work: the event is set every POLL seconds."""
    while True:
        event.set()
        await asyncio.sleep(POLL)


async def _listen(
    connect: Connect,
    schema: str | None,
    channel: Channel,
    hearer: Hearer,
    event: asyncio.Event,
    bound: float,
) -> None:
    """LISTEN until cancelled, opening the connection again whenever it drops. While it is
    down the event is set every pause (at most `_RECONNECT[1]` seconds): its user then looks
    at the store as it would behind a transaction pooler."""
    log = logging.getLogger(f"flowlock.{channel.what}")
    pause, failing = _RECONNECT[0], False
    while True:
        conn: asyncpg.Connection | None = None
        try:
            conn = await connect()
            found = schema or await conn.fetchval(TABLE_SCHEMA, channel.table, timeout=bound)
            lost = asyncio.Event()
            conn.add_termination_listener(lambda _, lost=lost: lost.set())
            await hearer.read(conn, bound)
            await conn.add_listener(channel.name(found), hearer.heard)
            # Anything committed before LISTEN took effect sent its notification to nobody.
            event.set()
            pause, failing = _RECONNECT[0], False
            await _watch(conn, lost, hearer, bound)
            log.info(
                "flowlock %s: the LISTEN connection was closed; opening it again", channel.what
            )
        except _LISTEN_ERRORS as exc:
            if not failing:
                log.warning(
                    "flowlock %s: the LISTEN connection failed (%s); opening it again, "
                    "and looking at the store every %.0f s meanwhile",
                    channel.what,
                    exc,
                    _RECONNECT[1],
                )
            failing = True
        finally:
            if conn is not None:
                await _close(conn, min(bound, _GOODBYE))
        event.set()
        await asyncio.sleep(pause)
        pause = min(pause * 2, _RECONNECT[1])


async def _watch(
    conn: asyncpg.Connection, lost: asyncio.Event, hearer: Hearer, bound: float
) -> None:
    """Until the connection is lost: the server ended it, or a keepalive found it silent."""
    while not lost.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(lost.wait(), KEEPALIVE)
        if not lost.is_set():
            await hearer.read(conn, bound)


async def _close(conn: asyncpg.Connection, bound: float) -> None:
    if conn.is_closed():
        return
    try:
        await conn.close(timeout=bound)
    except DRIVER_ERRORS:
        with contextlib.suppress(*DRIVER_ERRORS):
            conn.terminate()
