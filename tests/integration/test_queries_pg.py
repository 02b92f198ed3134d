"""Queries on PostgreSQL: the plans use the indexes of 006_queries.sql (for the values given and
for a plan made once for any value, as PostgreSQL does for a statement asyncpg keeps prepared),
and the engine's list / count while a fleet of engines fires transitions.

The plans are read with EXPLAIN on 20 000 rows whose statistics say what a real table would:
most approvals done, a few pending or rejected. No timing is asserted: a plan is the cause of a
query's cost, and the plan is what the tests look at.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import asyncpg
import pytest

import flowlock
import pg_budget
from flowlock.checker import check_many
from flowlock.core.models import InstanceQuery
from flowlock.stores.postgres import PostgresStore, count_statement, list_statement

ROWS = 20_000


@pytest.fixture
async def planned(pg_url: str, pg_schema: str) -> AsyncIterator[asyncpg.Connection]:
    """A connection to a migrated schema holding ROWS instances, analysed: one in ten a ticket,
    of the approvals 2 % pending, 2 % rejected, the rest approved."""
    conn = await pg_budget.migrated(pg_url, pg_schema)
    try:
        await conn.execute(
            """
            INSERT INTO flowlock_instances (id, workflow, state, version, updated_at)
            SELECT 'r-' || lpad(g::text, 6, '0'),
                   CASE WHEN g % 10 = 0 THEN 'ticket' ELSE 'approval' END,
                   CASE WHEN g % 10 = 0 THEN 'open' WHEN g % 50 = 1 THEN 'pending'
                        WHEN g % 50 = 3 THEN 'rejected' ELSE 'approved' END,
                   1, now() - g * interval '1 second'
              FROM generate_series(1, $1) AS g
            """,
            ROWS,
        )
        await conn.execute("ANALYZE flowlock_instances")
        yield conn
    finally:
        await conn.close()


def nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The plan's nodes, but for the probe of each row's workflow in the pauses table (a few
    rows at most, scanned as the planner likes; it reads no instance)."""
    if plan.get("Relation Name") == "flowlock_workflow_pauses":
        return
    yield plan
    for child in plan.get("Plans", []):
        yield from nodes(child)


async def literal(conn: asyncpg.Connection, value: object) -> str:
    """``value`` as an SQL literal, quoted by the server."""
    if isinstance(value, int):
        return str(value)
    if isinstance(value, datetime):
        return f"'{value.isoformat()}'::timestamptz"
    quoted: str = await conn.fetchval("SELECT quote_literal($1::text)", value)
    return quoted


async def plans(conn: asyncpg.Connection, sql: str, args: list[object]) -> list[dict[str, Any]]:
    """The plan of ``sql`` for ``args`` (a custom plan) and the plan PostgreSQL makes once for
    any arguments (a generic plan, which a prepared statement switches to after a few runs)."""
    await conn.execute("DEALLOCATE ALL")
    await conn.execute(f"PREPARE q AS {sql}")
    values = [await literal(conn, a) for a in args]
    call = f"EXECUTE q({', '.join(values)})" if values else "EXECUTE q"
    found = []
    for mode in ("force_custom_plan", "force_generic_plan"):
        await conn.execute(f"SET plan_cache_mode = {mode}")
        found.append(json.loads(await conn.fetchval(f"EXPLAIN (FORMAT JSON) {call}"))[0]["Plan"])
    await conn.execute("RESET plan_cache_mode")
    return found


NOW = datetime.now(UTC)
PENDING = InstanceQuery(workflow="approval", states=("pending",))
# (what, statement, the index it must use, whether it is a page in id order)
CASES: list[tuple[str, Callable[[], tuple[str, list[object]]], str, bool]] = [
    ("pending", lambda: list_statement(PENDING, after=None, limit=101), "by_state", True),
    ("pending, page 3", lambda: list_statement(PENDING, after="r-010001", limit=101),
     "by_state", True),
    ("pending, old", lambda: list_statement(
        InstanceQuery("approval", ("pending",), updated_before=NOW), after=None, limit=101),
     "by_state", True),
    ("pending or rejected", lambda: list_statement(
        InstanceQuery("approval", ("pending", "rejected")), after="r-000100", limit=101),
     "by_state", True),
    ("everything", lambda: list_statement(InstanceQuery(), after="r-000500", limit=101),
     "by_id", True),
    ("count pending", lambda: count_statement(PENDING), "by_state", False),
    ("count pending or rejected, recent", lambda: count_statement(
        InstanceQuery("approval", ("pending", "rejected"), updated_after=NOW.replace(year=2000))),
     "by_state", False),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
async def test_query_plans_use_the_indexes(
    planned: asyncpg.Connection,
    case: tuple[str, Callable[[], tuple[str, list[object]]], str, bool],
) -> None:
    """Each query the store sends is planned, for its values and for any values, as a scan of
    the index made for it (flowlock_instances_by_state for a workflow's states, by_id for the
    rest): never a sequential scan, and a page never sorts (the index is in id order; several
    states are merged, not sorted)."""
    _, statement, index, paged = case
    sql, args = statement()
    for plan in await plans(planned, sql, args):
        kinds = [n["Node Type"] for n in nodes(plan)]
        used = {n.get("Index Name") for n in nodes(plan)} - {None}
        assert "Seq Scan" not in kinds, plan
        assert used == {f"flowlock_instances_{index}"}, plan
        if paged:
            assert "Sort" not in kinds and "Incremental Sort" not in kinds, plan


async def test_the_planned_statements_return_what_plain_sql_finds(
    planned: asyncpg.Connection, pg_url: str, pg_schema: str
) -> None:
    """The store's pages and counts over the same rows equal what plain SQL of the test finds
    (code point order: COLLATE "C")."""
    async with flowlock.Engine(PostgresStore(pg_url, schema=pg_schema)) as engine:
        for state in (["pending"], ["pending", "rejected"]):
            expected = [
                r["id"]
                for r in await planned.fetch(
                    "SELECT id FROM flowlock_instances WHERE workflow = 'approval' "
                    'AND state = ANY($1::text[]) ORDER BY id COLLATE "C"',
                    state,
                )
            ]
            walked: list[str] = []
            page = await engine.list("approval", state, limit=150)
            walked.extend(i.id for i in page)
            while page.next_cursor is not None:
                page = await engine.list("approval", state, limit=150, after=page.next_cursor)
                walked.extend(i.id for i in page)
            assert walked == expected and len(expected) >= 360
            assert await engine.count("approval", state) == len(expected)


async def test_sweeping_pending_approvals_while_other_admins_approve(
    pg_engine_factory: Callable[..., Any], sql_history: Callable[..., Any]
) -> None:
    """One engine walks the pending approvals ten at a time and approves each one it is shown,
    while another engine (its own pool, as another process would) approves pending ones at
    random, the pages read only after that admin has approved more. The walk ends, shows no
    request twice, and every request ends approved exactly once (checker, and the history rows
    counted by SQL); count then finds none pending."""
    sweeper: flowlock.Engine = await pg_engine_factory(pool_size=4)
    admin: flowlock.Engine = await pg_engine_factory(pool_size=4)
    ids = [f"req-{n:03d}" for n in range(120)]
    for iid in ids:
        await sweeper.create("approval", instance_id=iid)
    assert await sweeper.count("approval", "pending") == 120

    applied = dict.fromkeys(ids, 0)
    progress = asyncio.Condition()
    by_admin = 0
    admin_done = False

    async def other_admin() -> None:
        nonlocal by_admin, admin_done
        try:
            for iid in random.Random(3).sample(ids, 60):
                out = await admin.fire(iid, "approve", actor="bob", request_id=f"bob-{iid}")
                applied[iid] += out.applied
                async with progress:
                    by_admin += 1
                    progress.notify_all()
        finally:
            async with progress:
                admin_done = True
                progress.notify_all()

    async def admin_moved_on(seen: int) -> int:
        async with progress:
            await asyncio.wait_for(
                progress.wait_for(lambda: admin_done or by_admin >= seen + 2), 60
            )
            return by_admin

    shown: list[str] = []
    task = asyncio.create_task(other_admin())
    try:
        seen = await admin_moved_on(0)
        page = await sweeper.list("approval", "pending", limit=10)
        while True:
            for inst in page:
                shown.append(inst.id)
                out = await sweeper.fire(
                    inst.id, "approve", actor="alice", request_id=f"alice-{inst.id}"
                )
                applied[inst.id] += out.applied
            if page.next_cursor is None:
                break
            seen = await admin_moved_on(seen)
            page = await sweeper.list("approval", "pending", limit=10, after=page.next_cursor)
    finally:
        await task

    assert shown == sorted(set(shown)), "a request shown twice, or out of order"
    assert set(applied.values()) == {1}, applied
    assert await sweeper.count("approval", "pending") == 0
    assert await admin.count("approval", "approved") == 120
    histories = {iid: await sweeper.history(iid) for iid in ids}
    verdict = check_many(
        [(await sweeper.get(iid), histories[iid]) for iid in ids],
        initial_state="pending",
        expected_applied=1,
    )
    assert verdict.ok, verdict.violations
    (await sql_history()).assert_matches(histories)


async def test_the_store_writes_only_well_formed_names_into_a_statement(
    pg_url: str, pg_schema: str
) -> None:
    """Called directly (not through the engine, which checks names first), the PostgreSQL store
    refuses a workflow or state name that is not of a Workflow's shape with InvalidInput
    instead of writing it into the statement; nothing is read or changed."""
    store = PostgresStore(pg_url, schema=pg_schema)
    await store.open()
    try:
        await store.create(flowlock.Instance(id="i", workflow="w", state="s", version=1, data={}))
        for query in [
            InstanceQuery(workflow="w' OR '1'='1"),
            InstanceQuery(states=("s", "x'); DELETE FROM flowlock_instances; --")),
            InstanceQuery(workflow=""),
        ]:
            with pytest.raises(flowlock.InvalidInput):
                await store.list_instances(query, after=None, limit=10)
            with pytest.raises(flowlock.InvalidInput):
                await store.count_instances(query)
        assert [i.id for i in await store.list_instances(InstanceQuery(), after=None, limit=9)] == [
            "i"
        ]
    finally:
        await store.aclose()
