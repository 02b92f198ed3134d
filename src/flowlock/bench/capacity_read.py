"""The capacity scenarios' readback of the engine's constraint rows: a round's keys only.

The store's own `constraint_rows()` reads every row of the schema, which grows with every
pair of the run; a round needs its own keys' rows, read in one snapshot as the store reads
them (so the log, the slots and the counters agree).
"""

from __future__ import annotations

import asyncpg

from flowlock.bench.capacity_results import LogRow
from flowlock.stores.constraint_store import ConstraintRows, CounterRow, SlotEvent, SlotRow

__all__ = ["log_rows", "read_rows"]

# $1 kind, $2 the round's keys.
_LOG = """
SELECT kind, key, seq, instance_id, version, delta, holders, lim,
       extract(epoch FROM at)::float8 AS at
  FROM flowlock_slot_log WHERE kind = $1 AND key = ANY($2::text[]) ORDER BY key, seq
"""
_SLOTS = """
SELECT kind, key, instance_id, version FROM flowlock_slots
 WHERE kind = $1 AND key = ANY($2::text[]) ORDER BY key, seq
"""
_COUNTERS = """
SELECT kind, key, holders, lim, seq FROM flowlock_capacity
 WHERE kind = $1 AND key = ANY($2::text[]) ORDER BY key
"""


async def read_rows(pool: asyncpg.Pool, kind: str, keys: list[str]) -> ConstraintRows | None:
    """The slot events, slots and counters of `keys` of `kind`, in one snapshot; None when
    the schema has no constraint tables (a store without constraints)."""
    async with pool.acquire() as conn:
        try:
            async with conn.transaction(isolation="repeatable_read", readonly=True):
                log = await conn.fetch(_LOG, kind, keys)
                slots = await conn.fetch(_SLOTS, kind, keys)
                counters = await conn.fetch(_COUNTERS, kind, keys)
        except asyncpg.UndefinedTableError:
            return None
    return ConstraintRows(
        log=tuple(
            SlotEvent(
                r["kind"],
                r["key"],
                int(r["seq"]),
                r["instance_id"],
                int(r["version"]),
                int(r["delta"]),
                int(r["holders"]),
                int(r["lim"]),
                float(r["at"]),
            )
            for r in log
        ),
        slots=tuple(
            SlotRow(r["kind"], r["key"], r["instance_id"], int(r["version"])) for r in slots
        ),
        counters=tuple(
            CounterRow(r["kind"], r["key"], int(r["holders"]), int(r["lim"]), int(r["seq"]))
            for r in counters
        ),
        rates=(),
    )


def log_rows(rows: ConstraintRows) -> list[LogRow]:
    """The slot events as the bench's replay reads them."""
    return [LogRow(e.key, e.seq, e.instance_id, e.delta, e.holders) for e in rows.log]
