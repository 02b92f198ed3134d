"""The PostgreSQL store's constraints as read back: the
[`ConstraintStore`][flowlock.stores.constraint_store.ConstraintStore] methods, and the LISTEN
that hears slots released by any engine.

The writes are the commits' own (`constraint_sql` and `flowlock_claims` in
017_constraints.sql); what is here is what an engine, the checker and the views ask between
commits.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Protocol

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
# Everything the checker reads, as JSON, in ONE statement: one snapshot, so the log, the slots
# and the counters agree with each other wherever the statement runs (flowlock's pool, an
# application's transaction, behind a transaction pooler).
ROWS = """
SELECT
  (SELECT coalesce(json_agg(json_build_array(kind, key, seq, instance_id, version, delta,
                                             holders, lim, extract(epoch FROM at))
                            ORDER BY kind, key, seq), '[]')
     FROM flowlock_slot_log) AS log,
  (SELECT coalesce(json_agg(json_build_array(kind, key, instance_id, version)
                            ORDER BY kind, key, seq), '[]')
     FROM flowlock_slots) AS slots,
  (SELECT coalesce(json_agg(json_build_array(kind, key, holders, lim, seq)
                            ORDER BY kind, key), '[]')
     FROM flowlock_capacity) AS counters,
  (SELECT coalesce(json_agg(json_build_array(kind, key, instance_id, version,
                                             extract(epoch FROM at), lim, per)
                            ORDER BY kind, key, at), '[]')
     FROM flowlock_rate_log) AS rates
"""


class _Store(Listening, Calls, Protocol):
    """What the constraint methods need of the store (PostgresStore)."""

    schema: str | None


def _loaded(value: Any) -> list[list[Any]]:
    """A JSON column as asyncpg gives it (text, unless the connection has a json codec)."""
    found: list[list[Any]] = json.loads(value) if isinstance(value, str) else value
    return found


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
        async def read(ops: Operations) -> ConstraintRows:
            s = ops.session
            async with s.conn() as conn:
                row = await conn.fetchrow(s.sql(ROWS), timeout=s.timeout)
            assert row is not None
            return ConstraintRows(
                log=tuple(
                    SlotEvent(k, key, int(seq), iid, int(v), int(d), int(h), int(lim), float(at))
                    for k, key, seq, iid, v, d, h, lim, at in _loaded(row["log"])
                ),
                slots=tuple(
                    SlotRow(k, key, iid, int(v)) for k, key, iid, v in _loaded(row["slots"])
                ),
                counters=tuple(
                    CounterRow(k, key, int(h), int(lim), int(seq))
                    for k, key, h, lim, seq in _loaded(row["counters"])
                ),
                rates=tuple(
                    RateEvent(k, key, iid, int(v), float(at), int(lim), float(per))
                    for k, key, iid, v, at, lim, per in _loaded(row["rates"])
                ),
            )

        return await self._call(read, waits=False)

    def slot_releases(
        self: _Store, heard: Callable[[str, str], None]
    ) -> AbstractAsyncContextManager[None]:
        """While inside, `heard(kind, key)` for each slot released on this database (NOTIFY
        from any engine, sent when the release commits), and `heard("", "")` whenever one
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
    """The releases' hearer: a payload "kind<US>key" is `heard(kind, key)`."""

    def __init__(self, heard: Callable[[str, str], None]) -> None:
        self._heard = heard

    async def read(self, conn: asyncpg.Connection, bound: float) -> None:
        # The keepalive: a round trip that finds a connection dead without a word.
        await conn.fetchval("SELECT 1", timeout=bound)

    def heard(self, _conn: object, _pid: int, _channel: str, payload: object) -> None:
        kind, _, key = str(payload).partition("\x1f")
        self._heard(kind, key)
