"""The PostgreSQL store's constraints as read back: the
[`ConstraintStore`][flowlock.stores.constraint_store.ConstraintStore] methods, and the LISTEN
that hears slots released by any engine.

The writes are the commits' own (`constraint_sql` and `flowlock_claims` in
017_constraints.sql); what is here is what an engine, the checker and the views ask between
commits.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Protocol

import asyncpg

from flowlock.core.constraints import CapacityUsage
from flowlock.stores.constraint_store import (
    ConstraintRows,
    CounterRow,
    RateEvent,
    SlotEvent,
    SlotRow,
)
from flowlock.stores.postgres.calls import Calls
from flowlock.stores.postgres.listen import Channel, Listening, channel_name, listening, opener
from flowlock.stores.postgres.operations import Operations
from flowlock.stores.postgres.session import Conn, Session, roll_back

__all__ = ["SLOTS_CHANNEL", "ConstraintMethods"]

SLOTS_CHANNEL = Channel(
    table="flowlock_slots",
    name=lambda schema: channel_name("flowlock_slots", schema),
    suffix="-slots",
    what="slots",
)
"""The releases' LISTEN: the channel of the schema of `flowlock_slots` (017_constraints.sql)."""

# The holders of a key now, oldest first, and the limit last used. $1 kind, $2 key.
USAGE = """
SELECT (SELECT lim FROM flowlock_capacity WHERE kind = $1 AND key = $2) AS lim,
       ARRAY(SELECT instance_id FROM flowlock_slots WHERE kind = $1 AND key = $2
              ORDER BY seq) AS holders
"""
# The instances whose applications count in the last $3 seconds, oldest first.
RATE_USAGE = """
SELECT (SELECT lim FROM flowlock_capacity WHERE kind = $1 AND key = $2) AS lim,
       ARRAY(SELECT instance_id FROM flowlock_rate_log
              WHERE kind = $1 AND key = $2
                AND at > clock_timestamp() - $3::float8 * interval '1 second'
              ORDER BY at) AS holders
"""
# What the checker reads, four statements in one REPEATABLE READ transaction (one snapshot,
# so the log, the slots and the counters agree), each streamed as rows: no single value to
# build however long the log.
LOG = """
SELECT kind, key, seq, instance_id, version, delta, holders, lim,
       extract(epoch FROM at)::float8 AS at
  FROM flowlock_slot_log ORDER BY kind, key, seq
"""
SLOTS = "SELECT kind, key, instance_id, version FROM flowlock_slots ORDER BY kind, key, seq"
COUNTERS = "SELECT kind, key, holders, lim, seq FROM flowlock_capacity ORDER BY kind, key"
RATES = """
SELECT kind, key, instance_id, version, extract(epoch FROM at)::float8 AS at, lim, per
  FROM flowlock_rate_log ORDER BY kind, key, at
"""
_SNAPSHOT = "ISOLATION LEVEL REPEATABLE READ READ ONLY"


class _Store(Listening, Calls, Protocol):
    """What the constraint methods need of the store (PostgresStore)."""

    schema: str | None


class ConstraintMethods:
    """PostgresStore's part as a ConstraintStore (a mixin: the store is `self`)."""

    async def capacity_usage(
        self: _Store, kind: str, key: str, window: float | None = None
    ) -> CapacityUsage:
        async def read(ops: Operations) -> CapacityUsage:
            s = ops.session
            async with s.conn(key) as conn:
                if window is None:
                    row = await conn.fetchrow(s.sql(USAGE), kind, key, timeout=s.timeout)
                else:
                    row = await conn.fetchrow(
                        s.sql(RATE_USAGE), kind, key, float(window), timeout=s.timeout
                    )
            assert row is not None  # a SELECT without FROM has one row
            return CapacityUsage(
                kind,
                key,
                row["lim"],
                tuple(row["holders"]),
                rule=None if window is None else "rate",
                window=window,
            )

        return await self._call(read, key, waits=False)

    async def constraint_rows(self: _Store) -> ConstraintRows:
        """Every slot event, slot, counter and rate event, read in one REPEATABLE READ,
        read-only transaction (one snapshot)."""
        return await self._call(lambda ops: _rows(ops.session), waits=False)

    def slot_releases(
        self: _Store, heard: Callable[[str, str], None]
    ) -> AbstractAsyncContextManager[None]:
        """While inside, `heard(kind, key)` once for each slot released on this database
        (NOTIFY from any engine, sent when the release commits), and `heard("", "")` whenever one
        may have been missed: the LISTEN connection opened (again), or every `POLL` seconds
        where LISTEN cannot work (behind a transaction pooler, or on an application's pool
        flowlock cannot copy). LISTEN runs on a connection of its own, named
        `<application_name>-slots`, with the outbox's and the timers' machinery
        (`flowlock.stores.postgres.listen`)."""
        return _releases(self, heard)


@asynccontextmanager
async def _releases(store: _Store, heard: Callable[[str, str], None]) -> AsyncIterator[None]:
    async with listening(
        opener(store, SLOTS_CHANNEL.suffix),
        store.schema,
        SLOTS_CHANNEL,
        _Hearer(heard),
        _Anything(heard),
        store.round_trip,
    ):
        yield


class _Anything(asyncio.Event):
    """What the LISTEN loop sets when a release may have been missed: `heard("", "")`."""

    def __init__(self, heard: Callable[[str, str], None]) -> None:
        super().__init__()
        self._heard = heard

    def set(self) -> None:
        self._heard("", "")


class _Hearer:
    """The releases' hearer: a payload "kind<US>key<US>seq" (one per slot freed) is
    `heard(kind, key)`."""

    def __init__(self, heard: Callable[[str, str], None]) -> None:
        self._heard = heard

    async def read(self, conn: asyncpg.Connection, bound: float) -> None:
        # The keepalive: a round trip that finds a connection dead without a word.
        await conn.fetchval("SELECT 1", timeout=bound)

    def heard(self, _conn: object, _pid: int, _channel: str, payload: object) -> None:
        named, _, _seq = str(payload).rpartition("\x1f")
        kind, _, key = named.partition("\x1f")
        self._heard(kind, key)


async def _rows(s: Session) -> ConstraintRows:
    """The checker's rows in one snapshot: a transaction of their own on a connection of the
    pool, or, in the transaction flowlock opened around the call on an application's pool
    (nothing read in it yet), that one set to REPEATABLE READ."""
    async with s.conn() as conn:
        if s.joined:
            await conn.execute(f"SET TRANSACTION {_SNAPSHOT}", timeout=s.timeout)
            return await _read_rows(conn, s)
        await conn.execute(f"BEGIN {_SNAPSHOT}", timeout=s.timeout)
        try:
            rows = await _read_rows(conn, s)
            await conn.execute("COMMIT", timeout=s.timeout)
        except asyncio.CancelledError:
            conn.terminate()  # it may be mid-statement: it cannot take a ROLLBACK
            raise
        except BaseException as exc:
            await roll_back(conn, exc, s.timeout)
            raise
        return rows


async def _read_rows(conn: Conn, s: Session) -> ConstraintRows:
    bound = s.timeout
    log = await conn.fetch(s.sql(LOG), timeout=bound)
    slots = await conn.fetch(s.sql(SLOTS), timeout=bound)
    counters = await conn.fetch(s.sql(COUNTERS), timeout=bound)
    rates = await conn.fetch(s.sql(RATES), timeout=bound)
    return ConstraintRows(
        log=tuple(
            SlotEvent(
                r["kind"], r["key"], r["seq"], r["instance_id"], r["version"], r["delta"],
                r["holders"], r["lim"], r["at"],
            )
            for r in log
        ),
        slots=tuple(SlotRow(r["kind"], r["key"], r["instance_id"], r["version"]) for r in slots),
        counters=tuple(
            CounterRow(r["kind"], r["key"], r["holders"], r["lim"], r["seq"]) for r in counters
        ),
        rates=tuple(
            RateEvent(
                r["kind"], r["key"], r["instance_id"], r["version"], r["at"], r["lim"], r["per"]
            )
            for r in rates
        ),
    )  # fmt: skip
