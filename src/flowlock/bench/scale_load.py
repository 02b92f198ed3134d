"""The tables of `flowlock bench --scale`, filled in the server.

Rows are made by `INSERT ... SELECT` over `generate_series`, one statement per table, never
one call each: ten million history rows load in minutes, not hours. `load_to` can also grow
loaded tables to a larger size (only the new rows are loaded).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any, Final

import asyncpg

from flowlock.core.definition import Transition, Workflow
from flowlock.core.models import Instance

__all__ = [
    "HISTORY_PER_INSTANCE",
    "LONG_ID",
    "WORKFLOW",
    "instance_id",
    "is_open",
    "load_to",
    "long_length",
    "scale_workflow",
    "sizes_of",
]

WORKFLOW: Final = "scale"
LONG_ID: Final = "sc-long"
"""The instance with the long history: a tenth of the instance count in rows."""
HISTORY_PER_INSTANCE: Final = 10
"""History rows per loaded instance (10^7 at 10^6 instances, with the long one's)."""
_MINUTES: Final = 43_200
"""Loaded rows were last updated at some minute of the last 30 days."""


def scale_workflow() -> Workflow:
    """The loaded instances' workflow: `step` (a counter + 1) keeps an instance open.

    90 % of the loaded instances are open, 9 % done and 1 % held, so the list and count filters
    have a common state, a less common one and a rare one to find.
    """

    def add(inst: Instance, payload: Mapping[str, Any], actor: str | None) -> dict[str, Any]:
        return {**inst.data, "n": int(inst.data.get("n", 0)) + 1}

    return Workflow(
        WORKFLOW,
        states=["open", "done", "held"],
        initial="open",
        transitions=[
            Transition("step", source="open", target="open", effect=add),
            Transition("finish", source="open", target="done"),
            Transition("hold", source="open", target="held"),
        ],
    )


def instance_id(n: int) -> str:
    """The id of the n-th loaded instance (from 1); ids sort as their numbers do."""
    return f"sc-{n:08d}"


def is_open(n: int) -> bool:
    """Whether the n-th loaded instance is open (the others are done or held)."""
    return n % 10 != 0


def long_length(size: int) -> int:
    """How many history rows the long instance has at `size` instances."""
    return max(100, size // 10)


def sizes_of(size: int) -> int:
    """All history rows at `size` instances."""
    return size * HISTORY_PER_INSTANCE + long_length(size)


# $1 the first number, $2 the last. The state: 1 % held, 9 % done, 90 % open.
_STATE: Final = "CASE WHEN g % 100 = 0 THEN 'held' WHEN g % 10 = 0 THEN 'done' ELSE 'open' END"
# The event of each instance's last history row.
_LAST: Final = "CASE WHEN g % 100 = 0 THEN 'hold' WHEN g % 10 = 0 THEN 'finish' ELSE 'step' END"
_INSTANCES: Final = f"""
INSERT INTO flowlock_instances (id, workflow, state, version, data, last_event, created_at,
                                updated_at)
SELECT 'sc-' || lpad(g::text, 8, '0'), '{WORKFLOW}', {_STATE}, {HISTORY_PER_INSTANCE + 1},
       jsonb_build_object('n', {HISTORY_PER_INSTANCE}), {_LAST},
       now() - interval '31 days',
       now() - ((g * 7919) % {_MINUTES}) * interval '1 minute'
FROM generate_series($1::bigint, $2::bigint) AS g
"""
# Versions 2.. of each instance: the last row of a done or held one is the step that ended it.
_HISTORY: Final = f"""
INSERT INTO flowlock_history (instance_id, version, event, from_state, to_state, actor,
                              request_id, strategy, data, at)
SELECT 'sc-' || lpad(g::text, 8, '0'), v,
       CASE WHEN v = {HISTORY_PER_INSTANCE + 1} THEN {_LAST} ELSE 'step' END,
       'open',
       CASE WHEN v = {HISTORY_PER_INSTANCE + 1} THEN {_STATE} ELSE 'open' END,
       'loader', 'load-' || v, 'optimistic', jsonb_build_object('n', v - 1),
       now() - interval '31 days'
FROM generate_series($1::bigint, $2::bigint) AS g,
     generate_series(2, {HISTORY_PER_INSTANCE + 1}) AS v
"""
_LONG: Final = f"""
INSERT INTO flowlock_instances (id, workflow, state, version, data, last_event)
VALUES ('{LONG_ID}', '{WORKFLOW}', 'open', 1, '{{"n": 0}}', NULL)
ON CONFLICT (id) DO NOTHING
"""
# The long instance's rows from its version + 1 to $1, then its version moved to $1.
_LONG_HISTORY: Final = f"""
WITH grown AS (
    INSERT INTO flowlock_history (instance_id, version, event, from_state, to_state, actor,
                                  request_id, strategy, data, at)
    SELECT '{LONG_ID}', v, 'step', 'open', 'open', 'loader', 'load-' || v, 'optimistic',
           jsonb_build_object('n', v - 1), now() - interval '31 days'
    FROM flowlock_instances i, generate_series(i.version + 1, $1::bigint) AS v
    WHERE i.id = '{LONG_ID}'
)
UPDATE flowlock_instances
   SET version = $1, data = jsonb_build_object('n', $1::bigint - 1), last_event = 'step'
 WHERE id = '{LONG_ID}' AND version < $1
"""


async def load_to(conn: asyncpg.Connection, loaded: int, size: int) -> None:
    """Grow the tables from `loaded` instances to `size` (and the long history to match),
    in one transaction, then vacuum and analyze them as autovacuum would, in time."""
    async with conn.transaction():
        # Why: the history's foreign key would check ten million rows one by one. Every row
        # loaded here names an instance loaded in the same transaction. A role that may not
        # skip triggers loads with them, only slower.
        with contextlib.suppress(asyncpg.InsufficientPrivilegeError):
            async with conn.transaction():
                await conn.execute("SET LOCAL session_replication_role = replica")
        await conn.execute(_LONG)
        if size > loaded:
            await conn.execute(_INSTANCES, loaded + 1, size)
            await conn.execute(_HISTORY, loaded + 1, size)
        await conn.execute(_LONG_HISTORY, long_length(size) + 1)
    # VACUUM cannot run in a transaction: the visibility map it sets is what lets a count be
    # an index-only scan, as on a table autovacuum has caught up with.
    await conn.execute("VACUUM (ANALYZE) flowlock_instances, flowlock_history")


async def relation_sizes(conn: asyncpg.Connection, tables: Sequence[str]) -> dict[str, int]:
    """Bytes of each table's heap and of its indexes: `<table>` and `<table> indexes`."""
    sizes: dict[str, int] = {}
    for table in tables:
        row = await conn.fetchrow(
            "SELECT pg_table_size(c.oid) AS heap, pg_indexes_size(c.oid) AS idx "
            "FROM pg_class c WHERE c.oid = to_regclass($1)",
            table,
        )
        if row is not None:
            sizes[table] = int(row["heap"])
            sizes[f"{table} indexes"] = int(row["idx"])
    return sizes
