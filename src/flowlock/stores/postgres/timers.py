"""The PostgreSQL store's timers: the [`TimerStore`][flowlock.stores.base.TimerStore] methods,
and the LISTEN that wakes an engine's timer service when a commit arms a timer.

Arming, voiding and moving timers on happen in the commits themselves (`timer_sql`); what is
here is what the timer service asks between commits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, Protocol, TypeVar

import asyncpg

from flowlock._pg.errors import DRIVER_ERRORS
from flowlock._pg.pooling import Pooling
from flowlock.core.errors import FlowlockError
from flowlock.core.models import Timer
from flowlock.stores.base import ArmedSignal
from flowlock.stores.postgres.operations import Operations
from flowlock.stores.postgres.sql import NOW
from flowlock.stores.postgres.timer_sql import TIMER_SCHEMA, channel

__all__ = ["KEEPALIVE", "POLL", "TimerMethods"]

log = logging.getLogger("flowlock.timers")

T = TypeVar("T")

POLL = 1.0
"""Seconds between two wake-ups of the timer service where LISTEN cannot work (behind a
transaction pooler): it then looks at the store about once a second."""
KEEPALIVE = 30.0
"""Seconds between two round trips on an idle LISTEN connection, which find a connection that
died without a word (a half-open network path) so that it is opened again, and read the
server's clock again."""
_RECONNECT = (0.05, 1.0)  # the first and the longest pause before opening it again
# Seconds a goodbye may take before the connection is dropped without one: an engine closing
# while the server does not answer must not wait a whole round trip's bound for it.
_GOODBYE = 1.0
_TABLE = "flowlock_timers"  # its schema names the channel

Connect = Callable[[], Awaitable[asyncpg.Connection]]
# What ends one LISTEN connection (the store closed, or the server out of reach), not the loop.
_LISTEN_ERRORS: tuple[type[BaseException], ...] = (*DRIVER_ERRORS, FlowlockError)


class _Store(Protocol):
    """What the timer methods need of the store (PostgresStore)."""

    dsn: str | None
    schema: str | None
    application_name: str
    round_trip: float
    _connect_timeout: float
    _given: asyncpg.Pool | None

    @property
    def pooling(self) -> Pooling | None: ...

    async def _call(
        self,
        op: Callable[[Operations], Awaitable[T]],
        key: str = "",
        *,
        waits: bool = True,
        writes: bool = False,
        own: bool = False,
    ) -> T: ...


class TimerMethods:
    """PostgresStore's part as a TimerStore (a mixin: the store is `self`)."""

    async def claim_timers(
        self: _Store, workflows: Sequence[str], *, limit: int, lease: float, owner: str
    ) -> list[Timer]:
        # SKIP LOCKED: a claim never waits for a row lock.
        return await self._call(
            lambda ops: ops.claim_timers(workflows, limit, lease, owner), waits=False, writes=True
        )

    async def release_timer(self: _Store, timer: Timer, owner: str) -> None:
        # May wait for a commit that holds the timer's row (its firing, by another engine).
        await self._call(lambda ops: ops.release_timer(timer, owner), timer.instance_id)

    async def cancel_timer(self: _Store, timer: Timer) -> bool:
        return await self._call(lambda ops: ops.cancel_timer(timer), timer.instance_id, writes=True)

    async def drop_timer(self: _Store, timer: Timer) -> bool:
        return await self._call(lambda ops: ops.drop_timer(timer), timer.instance_id, writes=True)

    async def next_due(self: _Store, workflows: Sequence[str]) -> float | None:
        return await self._call(lambda ops: ops.next_due(workflows), waits=False)

    async def timers(self: _Store, instance_id: str) -> list[Timer]:
        return await self._call(lambda ops: ops.timers(instance_id), instance_id, waits=False)

    async def due_timers(self: _Store, *, within: float, limit: int) -> list[Timer]:
        return await self._call(lambda ops: ops.due_timers(within, limit), waits=False)

    async def count_timers(self: _Store) -> int:
        return await self._call(lambda ops: ops.count_timers(), waits=False)

    def armed(self: _Store) -> contextlib.AbstractAsyncContextManager[ArmedSignal]:
        """A signal set whenever a commit on this database arms a timer of this store's schema
        (NOTIFY from any engine, sent when that commit commits), with the earliest due time it
        armed (the payload, a time on the server's clock, turned into one on the event loop's
        clock), and whenever the LISTEN connection was opened again (a notification may have
        been missed meanwhile; due time unknown).

        LISTEN runs on a connection of its own, opened next to the pool (which keeps its size)
        and opened again when it drops. Behind a transaction pooler (PgBouncer
        pool_mode=transaction) LISTEN cannot work, since each transaction may run on another
        server connection: the event is then set every `POLL` seconds instead, and the service
        looks at the store about once a second. So it does on an application's pool (`pool=`)
        when flowlock cannot build a connection the way that pool does."""
        return _armed(_opener(self), self.schema, self.round_trip)


def _opener(store: _Store) -> Connect | None:
    """How to open the LISTEN connection of `store`, or None where LISTEN cannot work."""
    if store.pooling == "transaction":
        return None
    given = store._given
    if given is not None:
        # An application's pool: a new connection built as the pool builds its own (its
        # connect arguments, its init), but never handed to the pool. Private asyncpg API,
        # so guarded: without it, the service polls.
        make: Any = getattr(given, "_get_new_connection", None)
        return None if make is None else make
    dsn = store.dsn or ""
    timeout, bound = store._connect_timeout, store.round_trip
    # Named apart from the pool's connections in pg_stat_activity; nothing a pooler refuses at
    # startup (a session pooler passes LISTEN through: the client keeps its server connection).
    name = f"{store.application_name[:56]}-timers"

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
async def _armed(
    connect: Connect | None, schema: str | None, bound: float
) -> AsyncIterator[ArmedSignal]:
    event = ArmedSignal()
    work = _poll(event) if connect is None else _listen(connect, schema, event, bound)
    task = asyncio.get_running_loop().create_task(work, name="flowlock-timers-listen")
    try:
        yield event
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _poll(event: ArmedSignal) -> None:
    """Where LISTEN cannot work: the service looks at the store every POLL seconds."""
    while True:
        event.set()
        await asyncio.sleep(POLL)


async def _listen(connect: Connect, schema: str | None, event: ArmedSignal, bound: float) -> None:
    """LISTEN until cancelled, opening the connection again whenever it drops. While it is
    down the event is set every pause (at most `_RECONNECT[1]` seconds): the service then
    looks at the store as it would behind a transaction pooler."""
    pause, failing = _RECONNECT[0], False
    while True:
        conn: asyncpg.Connection | None = None
        try:
            conn = await connect()
            found = schema or await conn.fetchval(TIMER_SCHEMA, _TABLE, timeout=bound)
            name = channel(found)
            lost = asyncio.Event()
            conn.add_termination_listener(lambda _, lost=lost: lost.set())
            clock = _ServerClock(event)
            await clock.read(conn, bound)
            await conn.add_listener(name, clock.heard)
            # Anything armed before LISTEN took effect sent its notification to nobody.
            event.set()
            pause, failing = _RECONNECT[0], False
            await _watch(conn, lost, clock, bound)
            log.info("flowlock timers: the LISTEN connection was closed; opening it again")
        except _LISTEN_ERRORS as exc:
            if not failing:
                log.warning(
                    "flowlock timers: the LISTEN connection failed (%s); opening it again, "
                    "and looking at the store every %.0f s meanwhile",
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


class _ServerClock:
    """The server's clock as seen from this event loop: read on the LISTEN connection when it
    opens and at each keepalive, so a NOTIFY's due time (seconds since the epoch on the
    server) becomes seconds from now without reading this host's wall clock."""

    def __init__(self, event: ArmedSignal) -> None:
        self._event = event
        self._ahead = 0.0  # the server's epoch seconds minus the loop's clock

    async def read(self, conn: asyncpg.Connection, bound: float) -> None:
        loop = asyncio.get_running_loop()
        sent = loop.time()
        server = float(await conn.fetchval(NOW, timeout=bound))
        self._ahead = server - (sent + loop.time()) / 2

    def heard(self, _conn: object, _pid: int, _channel: str, payload: object) -> None:
        """asyncpg's listener: the payload is the earliest due time the commit armed."""
        try:
            at = float(str(payload))
        except ValueError:
            self._event.set()  # not flowlock's payload: look anyway
            return
        self._event.due_in(at - self._ahead - asyncio.get_running_loop().time())


async def _watch(
    conn: asyncpg.Connection, lost: asyncio.Event, clock: _ServerClock, bound: float
) -> None:
    """Until the connection is lost: the server ended it, or a keepalive found it silent."""
    while not lost.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(lost.wait(), KEEPALIVE)
        if not lost.is_set():
            await clock.read(conn, bound)


async def _close(conn: asyncpg.Connection, bound: float) -> None:
    if conn.is_closed():
        return
    try:
        await conn.close(timeout=bound)
    except DRIVER_ERRORS:
        with contextlib.suppress(*DRIVER_ERRORS):
            conn.terminate()
