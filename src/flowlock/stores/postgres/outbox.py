"""The PostgreSQL store's outbox: the [`OutboxStore`][flowlock.stores.base.OutboxStore] methods,
and the LISTEN that wakes an engine's dispatcher when a commit writes a message.

Messages are written by the commits themselves (`outbox_sql.outbox_cte`); what is here is what
the dispatcher and the operators ask between commits. Every time is on the database server's
clock.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from typing import Protocol

import asyncpg

from flowlock._pg.rows import message_from_row
from flowlock.core.errors import InvalidInput
from flowlock.core.outbox import MESSAGE_STATUSES, Message, key_cursor, parse_key
from flowlock.stores.postgres.calls import Calls
from flowlock.stores.postgres.listen import Channel, Listening, listening, opener
from flowlock.stores.postgres.operations import Operations
from flowlock.stores.postgres.outbox_sql import (
    CLAIM_MESSAGES,
    COUNT_MESSAGES,
    DROP_MESSAGE,
    FAIL_MESSAGE,
    FIND_MESSAGES,
    FINISH_MESSAGES,
    GET_MESSAGE,
    MESSAGES,
    NEXT_MESSAGE_DUE,
    PURGE_MESSAGES,
    RELEASE_MESSAGE,
    RETRY_MESSAGE,
    outbox_channel,
)
from flowlock.stores.postgres.session import Session

__all__ = ["OUTBOX_CHANNEL", "OutboxMethods"]

OUTBOX_CHANNEL = Channel(
    table="flowlock_outbox", name=outbox_channel, suffix="-outbox", what="outbox"
)
"""The outbox's LISTEN: the channel of the schema of `flowlock_outbox` (see 011_outbox.sql)."""


class _Store(Listening, Calls, Protocol):
    """What the outbox methods need of the store (PostgresStore)."""

    schema: str | None

    @property
    def pool(self) -> asyncpg.Pool: ...


def _parts(key: str) -> tuple[str, int, int] | None:
    """A key's primary key (instance id, version, place), or None for a key no message has."""
    try:
        return parse_key(key)
    except InvalidInput:
        return None


def _changed(tag: str) -> int:
    """How many rows a command tag ('UPDATE 3', 'DELETE 0') says were changed."""
    return int(tag.rsplit(" ", 1)[-1])


class OutboxMethods:
    """PostgresStore's part as an OutboxStore (a mixin: the store is `self`)."""

    async def claim_messages(
        self: _Store, kinds: Mapping[str, int], *, lease: float, owner: str, run: int = 1
    ) -> list[Message]:
        wanted = {kind: limit for kind, limit in kinds.items() if limit > 0}
        if not wanted:
            self.pool  # noqa: B018 - a closed store refuses even an empty claim (EngineClosed)
            return []
        names, limits = list(wanted), list(wanted.values())

        async def claim(ops: Operations) -> list[Message]:
            s = ops.session
            async with s.conn(writes=True) as conn:
                rows = await conn.fetch(
                    s.sql(CLAIM_MESSAGES),
                    names,
                    limits,
                    lease,
                    owner,
                    max(1, run),
                    timeout=s.timeout,
                )
            return [message_from_row(r) for r in rows]

        # SKIP LOCKED on the heads; a follower may be held for an instant by a done mark or an
        # operator's retry, so the claim may wait (bounded by the lock timeout).
        return await self._call(claim, writes=True)

    async def finish_messages(self: _Store, keys: Sequence[str]) -> int:
        wanted = [p for key in dict.fromkeys(keys) if (p := _parts(key)) is not None]
        if not wanted:
            self.pool  # noqa: B018 - EngineClosed when closed, as any other call
            return 0
        columns = tuple(list(column) for column in zip(*wanted, strict=True))
        first = wanted[0][0]
        # May wait for a claim that holds the row for an instant (it never outlasts one
        # statement), or for an operator's retry.
        return await self._call(
            lambda ops: _execute(ops.session, FINISH_MESSAGES, *columns, key=first),
            first,
            writes=True,
        )

    async def fail_message(
        self: _Store,
        message: Message,
        owner: str,
        error: str,
        retry_in: float | None,
        *,
        counted: bool = True,
    ) -> bool:
        one = (message.instance_id, message.version, message.n)
        args = (*one, owner, message.attempts, error, retry_in, 0 if counted else 1)
        changed = await self._call(
            lambda ops: _execute(ops.session, FAIL_MESSAGE, *args, key=message.key),
            message.key,
            writes=True,
        )
        return changed == 1

    async def release_message(
        self: _Store, message: Message, owner: str, *, begun: bool = True
    ) -> None:
        back = 0 if begun else 1  # a delivery that never began gives its attempt back

        async def release(ops: Operations) -> None:
            s = ops.session
            async with s.conn(message.key, writes=True) as conn:
                one = (message.instance_id, message.version, message.n)
                await conn.fetchval(
                    s.sql(RELEASE_MESSAGE),
                    *one,
                    owner,
                    message.attempts,
                    back,
                    timeout=s.timeout,
                )

        await self._call(release, message.key, writes=True)

    async def next_message_due(self: _Store, kinds: Sequence[str]) -> float | None:
        wanted = list(dict.fromkeys(kinds))
        if not wanted:
            self.pool  # noqa: B018 - EngineClosed when closed, as any other call
            return None

        async def due(ops: Operations) -> float | None:
            s = ops.session
            async with s.conn() as conn:
                seconds = await conn.fetchval(s.sql(NEXT_MESSAGE_DUE), wanted, timeout=s.timeout)
            return None if seconds is None else max(0.0, float(seconds))

        return await self._call(due, waits=False)

    async def messages(self: _Store, instance_id: str) -> list[Message]:
        return await self._call(
            lambda ops: _fetch(ops.session, MESSAGES, instance_id, key=instance_id),
            instance_id,
            waits=False,
        )

    async def find_messages(
        self: _Store,
        *,
        status: str | None = None,
        kind: str | None = None,
        after: str | None = None,
        limit: int = 100,
    ) -> list[Message]:
        if status is not None and status not in MESSAGE_STATUSES:
            return []  # no message has it (the engine refuses it before asking)
        args = (*key_cursor(after), status, kind, max(0, limit))
        return await self._call(lambda ops: _fetch(ops.session, FIND_MESSAGES, *args), waits=False)

    async def get_message(self: _Store, key: str) -> Message | None:
        one = _parts(key)
        if one is None:
            self.pool  # noqa: B018 - EngineClosed when closed, as any other call
            return None
        found = await self._call(
            lambda ops: _fetch(ops.session, GET_MESSAGE, *one, key=key), key, waits=False
        )
        return found[0] if found else None

    async def retry_message(self: _Store, key: str) -> Message | None:
        one = _parts(key)
        if one is None:
            self.pool  # noqa: B018 - EngineClosed when closed, as any other call
            return None
        # May wait for a claim that holds the row for an instant.
        found = await self._call(
            lambda ops: _fetch(ops.session, RETRY_MESSAGE, *one, key=key, writes=True),
            key,
            writes=True,
        )
        return found[0] if found else None

    async def drop_message(self: _Store, key: str) -> bool:
        one = _parts(key)
        if one is None:
            self.pool  # noqa: B018 - EngineClosed when closed, as any other call
            return False

        async def drop(ops: Operations) -> bool:
            s = ops.session
            async with s.conn(key, writes=True) as conn:
                return bool(await conn.fetchval(s.sql(DROP_MESSAGE), *one, timeout=s.timeout))

        return await self._call(drop, key, writes=True)

    async def count_messages(self: _Store) -> Mapping[str, int]:
        async def count(ops: Operations) -> dict[str, int]:
            s = ops.session
            async with s.conn() as conn:
                row = await conn.fetchrow(s.sql(COUNT_MESSAGES), timeout=s.timeout)
            assert row is not None  # an aggregate without GROUP BY has one row
            return {status: int(row[status]) for status in MESSAGE_STATUSES}

        return await self._call(count, waits=False)

    async def purge_messages(self: _Store, older_than: float, limit: int) -> int:
        if limit <= 0:
            self.pool  # noqa: B018 - EngineClosed when closed, as any other call
            return 0
        # SKIP LOCKED: two engines purging at once never wait for each other.
        return await self._call(
            lambda ops: _execute(ops.session, PURGE_MESSAGES, older_than, limit),
            waits=False,
            writes=True,
        )

    def pending(self: _Store) -> contextlib.AbstractAsyncContextManager[asyncio.Event]:
        """An event set whenever a commit on this database writes a message to this store's
        schema (NOTIFY from any engine, one per transaction, sent when it commits; an
        operator's retry or drop too), and whenever the LISTEN connection was opened again
        (a notification may have been missed meanwhile).

        LISTEN runs on a connection of its own (named `<application_name>-outbox`), opened next
        to the pool and again when it drops; the timers' LISTEN machinery
        (`flowlock.stores.postgres.listen`). Behind a transaction pooler, or on an
        application's pool whose connections flowlock cannot copy, the event is set every
        `POLL` seconds instead."""
        event = asyncio.Event()
        return listening(
            opener(self, OUTBOX_CHANNEL.suffix),
            self.schema,
            OUTBOX_CHANNEL,
            _Wake(event),
            event,
            self.round_trip,
        )


class _Wake:
    """The outbox's hearer: any notification sets the event (its payload says nothing more)."""

    def __init__(self, event: asyncio.Event) -> None:
        self._event = event

    async def read(self, conn: asyncpg.Connection, bound: float) -> None:
        # The keepalive: a round trip that finds a connection dead without a word.
        await conn.fetchval("SELECT 1", timeout=bound)

    def heard(self, _conn: object, _pid: int, _channel: str, _payload: object) -> None:
        self._event.set()


async def _execute(s: Session, sql: str, *args: object, key: str = "") -> int:
    """Run a write of the outbox; how many rows it changed."""
    async with s.conn(key, writes=True) as conn:
        return _changed(await conn.execute(s.sql(sql), *args, timeout=s.timeout))


async def _fetch(
    s: Session, sql: str, *args: object, key: str = "", writes: bool = False
) -> list[Message]:
    """The messages a statement returns (`writes`: it changes them too)."""
    async with s.conn(key, writes=writes) as conn:
        rows = await conn.fetch(s.sql(sql), *args, timeout=s.timeout)
    return [message_from_row(r) for r in rows]
