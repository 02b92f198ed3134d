"""The PostgreSQL store's timers: the [`TimerStore`][flowlock.stores.base.TimerStore] methods,
and the LISTEN that wakes an engine's timer service when a commit arms a timer.

Arming, voiding and moving timers on happen in the commits themselves (`timer_sql`); what is
here is what the timer service asks between commits.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Protocol

import asyncpg

from flowlock.core.models import Timer
from flowlock.stores.base import ArmedSignal
from flowlock.stores.postgres.calls import Calls
from flowlock.stores.postgres.listen import Channel, Listening, listening, opener
from flowlock.stores.postgres.sql import NOW
from flowlock.stores.postgres.timer_sql import channel

__all__ = ["TIMERS_CHANNEL", "TimerMethods"]

TIMERS_CHANNEL = Channel(table="flowlock_timers", name=channel, suffix="-timers", what="timers")
"""The timers' LISTEN: the channel of the schema of `flowlock_timers` (see 010_timers.sql)."""


class _Store(Listening, Calls, Protocol):
    """What the timer methods need of the store (PostgresStore)."""

    schema: str | None


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
        server connection: the event is then set every `POLL` seconds instead (see
        `flowlock.stores.postgres.listen`), and the service looks at the store about once a
        second. So it does on an application's pool (`pool=`) when flowlock cannot build a
        connection the way that pool does."""
        signal = ArmedSignal()
        return listening(
            opener(self, TIMERS_CHANNEL.suffix),
            self.schema,
            TIMERS_CHANNEL,
            _ServerClock(signal),
            signal,
            self.round_trip,
        )


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
