"""A transition that keeps its state is a HOT update, also on a large table of old rows.

`flowlock bench --scale` found fire growing with the instance count: on pages filled to the
brim (fillfactor 100) the new version of a row never fits on its own page, so each transition
moved its row and wrote an entry into every index of flowlock_instances, at a random place in
each. Migration 014 leaves room on each page (fillfactor 90). No plan shows a HOT update, so
this test looks at where the row is: a HOT update keeps it on its page (its ctid's block).
The statement's plan is checked too: one primary-key lookup, not a scan.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator

import asyncpg
import pytest

import pg_budget
from flowlock.core.definition import Transition, Workflow
from flowlock.engine import Engine
from flowlock.stores.postgres import PostgresStore
from flowlock.stores.postgres.sql import CAS

pytestmark = pytest.mark.postgres

ROWS = 20_000
FIRED = 300


def counter() -> Workflow:
    return Workflow(
        "counter",
        states=["open"],
        initial="open",
        transitions=[
            Transition(
                "step",
                source="open",
                target="open",
                effect=lambda inst, payload, actor: {"n": int(inst.data["n"]) + 1},
            )
        ],
    )


@pytest.fixture
async def packed(pg_url: str, pg_schema: str) -> AsyncIterator[asyncpg.Connection]:
    """A migrated schema holding ROWS instances inserted in one statement and vacuumed: every
    page as full as the table's fillfactor lets an insert make it."""
    conn = await pg_budget.migrated(pg_url, pg_schema)
    try:
        await conn.execute(
            """
            INSERT INTO flowlock_instances (id, workflow, state, version, data)
            SELECT 'c-' || lpad(g::text, 6, '0'), 'counter', 'open', 1, '{"n": 0}'
              FROM generate_series(1, $1) AS g
            """,
            ROWS,
        )
        await conn.execute("VACUUM ANALYZE flowlock_instances")
        yield conn
    finally:
        await conn.close()


async def blocks(conn: asyncpg.Connection, ids: list[str]) -> dict[str, int]:
    rows = await conn.fetch(
        "SELECT id, (ctid::text::point)[0]::bigint AS block FROM flowlock_instances "
        "WHERE id = ANY($1::text[])",
        ids,
    )
    return {r["id"]: r["block"] for r in rows}


async def test_the_table_leaves_room_for_updates(packed: asyncpg.Connection) -> None:
    options = await packed.fetchval(
        "SELECT reloptions FROM pg_class WHERE oid = 'flowlock_instances'::regclass"
    )
    assert "fillfactor=90" in options


async def test_transitions_on_old_packed_rows_stay_on_their_pages(
    packed: asyncpg.Connection, pg_url: str, pg_schema: str
) -> None:
    """Concurrent transitions on random rows of a packed table (none updated before) keep
    nearly every row on its page: HOT updates, no index writes. With fillfactor 100 nearly
    every one moved (measured: 2 % stayed)."""
    ids = random.Random(26).sample([f"c-{n:06d}" for n in range(1, ROWS + 1)], FIRED)
    before = await blocks(packed, ids)
    store = PostgresStore(pg_url, schema=pg_schema, pool_size=8)
    async with Engine(store, strategy="optimistic", timers=False) as engine:
        await engine.register(counter())
        for start in range(0, FIRED, 30):
            chunk = ids[start : start + 30]
            outcomes = await asyncio.gather(*(engine.fire(i, "step", actor="t") for i in chunk))
            assert all(o.applied for o in outcomes)
    after = await blocks(packed, ids)
    stayed = sum(before[i] == after[i] for i in ids)
    assert stayed >= 0.95 * FIRED, f"only {stayed} of {FIRED} rows stayed on their page"


async def test_the_transition_statement_is_a_primary_key_lookup(
    packed: asyncpg.Connection,
) -> None:
    """The compare-and-swap finds its row by the primary key, for a generic plan too."""
    await packed.execute("DEALLOCATE ALL")
    await packed.execute(f"PREPARE q AS {CAS}")
    args = (
        "'c-000001', 1, 'open', '{\"n\": 1}', 'step', 'open', 't', 'r1', 'optimistic', NULL, "
        "'{}', 1"
    )
    for mode in ("force_custom_plan", "force_generic_plan"):
        await packed.execute(f"SET plan_cache_mode = {mode}")
        async with packed.transaction():
            doc = await packed.fetchval(f"EXPLAIN (FORMAT JSON) EXECUTE q({args})")
            text = json.dumps(json.loads(doc))
            assert '"Seq Scan"' not in text, text
            assert "flowlock_instances_pkey" in text, text
    await packed.execute("RESET plan_cache_mode")
