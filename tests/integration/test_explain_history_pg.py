"""A history page is a range of the history's primary key, whatever the history's length.

`flowlock bench --scale` found the history read growing with the history: the store read every
entry of the instance, and the service cut the page out of them in Python, so a page deep in
a history of 10^5 entries read 10^5 rows. The read is now ranged (`version > after ... LIMIT`).
The plan is read with EXPLAIN ANALYZE on a long history among many short ones, analysed, for
the values given and for a plan made once for any value (as a prepared statement gets).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
import pytest

import pg_budget
from flowlock.stores.postgres import PostgresStore
from flowlock.stores.postgres.sql import HISTORY

pytestmark = pytest.mark.postgres

LONG = 10_000
SHORT = 1_000
PER = 10


@pytest.fixture
async def histories(pg_url: str, pg_schema: str) -> AsyncIterator[asyncpg.Connection]:
    """A migrated schema: instance 'long' with LONG entries, SHORT others with PER each."""
    conn = await pg_budget.migrated(pg_url, pg_schema)
    try:
        await conn.execute(
            """
            INSERT INTO flowlock_instances (id, workflow, state, version)
            SELECT 'i-' || lpad(g::text, 6, '0'), 'w', 'open', $2 + 1
              FROM generate_series(1, $1) AS g
            UNION ALL SELECT 'long', 'w', 'open', $3 + 1
            """,
            SHORT,
            PER,
            LONG,
        )
        await conn.execute(
            """
            INSERT INTO flowlock_history (instance_id, version, event, from_state, to_state,
                                          request_id, strategy, data)
            SELECT i.id, v, 'step', 'open', 'open', 'r-' || v, 'optimistic', '{}'
              FROM flowlock_instances i, generate_series(2, i.version) AS v
            """
        )
        await conn.execute("VACUUM ANALYZE flowlock_instances, flowlock_history")
        yield conn
    finally:
        await conn.close()


def nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from nodes(child)


async def analysed(conn: asyncpg.Connection, args: str) -> list[dict[str, Any]]:
    """EXPLAIN ANALYZE of HISTORY for `args`, as a custom plan and as a generic plan."""
    await conn.execute("DEALLOCATE ALL")
    await conn.execute(f"PREPARE q AS {HISTORY}")
    found = []
    for mode in ("force_custom_plan", "force_generic_plan"):
        await conn.execute(f"SET plan_cache_mode = {mode}")
        doc = await conn.fetchval(f"EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE q({args})")
        found.append(json.loads(doc)[0]["Plan"])
    await conn.execute("RESET plan_cache_mode")
    return found


# (what, the arguments of HISTORY, the most rows its scan may read)
CASES = [
    ("deep", f"'long', {LONG - 99}, 101", 101),  # the last page, deep in the long history
    ("middle", f"'long', {LONG // 2}, 101", 101),  # a page in the middle
    ("short", "'i-000007', 0, 101", PER),  # a short history, whole
    ("whole", "'long', 0, NULL", LONG),  # no limit: the whole history, and no more
]


async def test_a_history_page_reads_only_its_rows(histories: asyncpg.Connection) -> None:
    """The page is an index scan of the primary key bounded by the version (an Index Cond, not
    a Filter), and reads at most the rows it returns: never a sequential scan, never a sort,
    never the instance's whole history for one page."""
    for what, args, most in CASES:
        for plan in await analysed(histories, args):
            found = list(nodes(plan))
            kinds = [n["Node Type"] for n in found]
            assert "Seq Scan" not in kinds and "Sort" not in kinds, (what, plan)
            [scan] = [n for n in found if n.get("Relation Name") == "flowlock_history"]
            assert scan["Node Type"] == "Index Scan", (what, plan)
            assert scan["Index Name"] == "flowlock_history_pkey", (what, plan)
            assert "version" in scan["Index Cond"], (what, plan)
            assert "Filter" not in scan, (what, plan)
            assert scan["Actual Rows"] <= most, (what, plan)


async def test_the_store_pages_a_long_history(
    histories: asyncpg.Connection, pg_url: str, pg_schema: str
) -> None:
    """The store's ranged read returns exactly the entries after the version, oldest first, at
    most the limit; a walk page by page returns the whole history once."""
    store = PostgresStore(pg_url, schema=pg_schema, pool_size=2)
    await store.open()
    try:
        page = await store.history("long", after=LONG - 50, limit=100)
        assert [e.version for e in page] == list(range(LONG - 49, LONG + 2))
        assert [e.version for e in await store.history("long", after=5, limit=3)] == [6, 7, 8]
        assert await store.history("long", after=LONG + 1, limit=10) == []
        walked: list[int] = []
        after = 0
        while batch := await store.history("long", after=after, limit=997):
            walked.extend(e.version for e in batch)
            after = batch[-1].version
        assert walked == list(range(2, LONG + 2))
        assert [e.version for e in await store.history("i-000003")] == list(range(2, PER + 2))
    finally:
        await store.aclose()
