"""The capacity scenarios' floor: the same rule hand-written in asyncpg, without the engine.

One transaction per move, on tables of its own in the run's schema:

1. the key's counter row: `UPDATE ... SET holders = holders + 1 WHERE key = $1 AND holders <
   $limit RETURNING` (a release: `holders - 1`); no row back is a refusal, and the transaction
   rolls back. The UPDATE locks the row to commit, so two moves of one key take turns;
2. the instance: `UPDATE flowlock_instances ... WHERE id = $1 AND version = $2` (the version the
   caller last saw), with its history row, as the other floors write them;
3. COMMIT.

The counter's statement also appends the key's slot event (sequence number and holder count
after it) to a log of its own, so the floor's holders are proved like the engine's: from a
log replayed in the order the row lock gave.
"""

from __future__ import annotations

import asyncpg

from flowlock.bench.capacity_results import LogRow
from flowlock.core.constraints import CapacityReached
from flowlock.core.errors import VersionMismatch

__all__ = [
    "COUNTERS_TABLE",
    "LOG_TABLE",
    "TABLES",
    "add_counters",
    "move",
    "read_log",
]

COUNTERS_TABLE = "flowlock_bench_capacity"
LOG_TABLE = "flowlock_bench_slot_log"

TABLES = f"""
CREATE TABLE IF NOT EXISTS {COUNTERS_TABLE} (
    key text PRIMARY KEY,
    holders integer NOT NULL CHECK (holders >= 0),
    seq bigint NOT NULL
);
CREATE TABLE IF NOT EXISTS {LOG_TABLE} (
    key text NOT NULL,
    seq bigint NOT NULL,
    instance_id text NOT NULL,
    delta smallint NOT NULL,
    holders integer NOT NULL,
    PRIMARY KEY (key, seq)
);
"""
"""Created once per run in the run's schema (`Scenario.prepare`)."""

# $1 key, $2 instance id, $3 limit.
_TAKE = f"""
WITH counted AS (
    UPDATE {COUNTERS_TABLE} SET holders = holders + 1, seq = seq + 1
     WHERE key = $1 AND holders < $3
 RETURNING key, seq, holders
)
INSERT INTO {LOG_TABLE} (key, seq, instance_id, delta, holders)
SELECT key, seq, $2, 1, holders FROM counted
RETURNING holders
"""
# $1 key, $2 instance id.
_GIVE = f"""
WITH counted AS (
    UPDATE {COUNTERS_TABLE} SET holders = holders - 1, seq = seq + 1
     WHERE key = $1 AND holders > 0
 RETURNING key, seq, holders
)
INSERT INTO {LOG_TABLE} (key, seq, instance_id, delta, holders)
SELECT key, seq, $2, -1, holders FROM counted
RETURNING holders
"""
# $1 id, $2 version seen, $3 from state, $4 to state, $5 event, $6 actor.
_MOVE = """
WITH moved AS (
    UPDATE flowlock_instances
       SET state = $4, version = $2 + 1, last_event = $5, updated_at = now()
     WHERE id = $1 AND version = $2
 RETURNING id, version, state, data, updated_at
)
INSERT INTO flowlock_history (instance_id, version, event, from_state, to_state, actor,
                              strategy, data, at)
SELECT id, version, $5, $3, state, $6, 'raw', data, updated_at FROM moved
RETURNING version
"""
_ADD = f"""
INSERT INTO {COUNTERS_TABLE} (key, holders, seq)
SELECT k, 0, 0 FROM unnest($1::text[]) AS k
ON CONFLICT (key) DO NOTHING
"""
_NOW = "SELECT version, state FROM flowlock_instances WHERE id = $1"
_LOG = f"""
SELECT key, seq, instance_id, delta, holders FROM {LOG_TABLE}
 WHERE key = ANY($1::text[]) ORDER BY key, seq
"""


async def add_counters(pool: asyncpg.Pool, keys: list[str]) -> None:
    """The counter rows of a round's keys, at zero holders."""
    await pool.execute(_ADD, keys)


async def move(
    pool: asyncpg.Pool,
    *,
    instance_id: str,
    key: str,
    kind: str,
    limit: int,
    take: bool,
    version: int,
    states: tuple[str, str],
    event: str,
    actor: str | None,
) -> int:
    """Move the instance from `states[0]` to `states[1]` with its slot, in one transaction.

    `take`: enter (a slot is taken), else leave (released). Returns the instance's new
    version. Raises CapacityReached when the key is full, VersionMismatch when the instance
    is not at `version`; either writes nothing.
    """
    async with pool.acquire() as conn, conn.transaction():
        if take:
            holders = await conn.fetchval(_TAKE, key, instance_id, limit)
            if holders is None:
                raise CapacityReached(
                    instance_id=instance_id,
                    kind=kind,
                    key=key,
                    limit=limit,
                    holders=(),
                    version=version + 1,
                    event=event,
                )
        else:
            await conn.fetchval(_GIVE, key, instance_id)
        moved = await conn.fetchval(_MOVE, instance_id, version, states[0], states[1], event, actor)
        if moved is None:
            now = await conn.fetchrow(_NOW, instance_id)
            current, state = (0, "") if now is None else (int(now["version"]), now["state"])
            raise VersionMismatch(instance_id, version, current, state)
    return int(moved)


async def read_log(pool: asyncpg.Pool, keys: list[str]) -> list[LogRow]:
    """The floor's slot events of `keys`, in (key, seq) order."""
    rows = await pool.fetch(_LOG, keys)
    return [
        LogRow(r["key"], int(r["seq"]), r["instance_id"], int(r["delta"]), int(r["holders"]))
        for r in rows
    ]
