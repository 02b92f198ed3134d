"""Claiming the outbox on PostgreSQL from many connections and processes at once.

Thousands of messages, several instances' worth each in order, claimed by claimers that each
have connections of their own (tasks of this process, and two OS processes running
tests/integration/outbox_claim_worker.py, which write into a sink table with a unique key): no
message is claimed twice, each instance's messages are delivered in order, and every one is
delivered. The claim and the dispatcher's other reads walk the indexes made for them (checked
on their plans).
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from proc_worker import Gate

import flowlock
import pg_budget
from flowlock.core.outbox import Emit
from flowlock.locks import MemoryLocks
from flowlock.stores.postgres import PostgresStore
from flowlock.stores.postgres.outbox_sql import (
    CLAIM_MESSAGES,
    FIND_MESSAGES,
    FINISH_MESSAGES,
    NEXT_MESSAGE_DUE,
    PURGE_MESSAGES,
)
from outbox_store_kit import BOUND, WF, emitting, order

pytestmark = pytest.mark.postgres

INSTANCES = 300
ENTRIES = 5  # per instance, each emitting one "a" and one "b" message: 10 messages in order
KINDS = ("a", "b")
WORKER = Path(__file__).with_name("outbox_claim_worker.py")


async def fill(url: str, schema: str) -> int:
    """INSTANCES instances, each with ENTRIES entries emitting an "a" then a "b" message, written
    by one commit_many; how many messages that is."""
    store = PostgresStore(url, schema=schema, pool_size=2)
    async with flowlock.Engine(store, locks=MemoryLocks(), timers=False) as engine:
        await engine.register(order())
        made = [await engine.create(WF, instance_id=f"i{i:03}") for i in range(INSTANCES)]
        batches = [
            [
                emitting(inst, "x", [Emit("a", {"e": e}), Emit("b", {"e": e})], offset=e + 1)
                for e in range(ENTRIES)
            ]
            for inst in made
        ]
        answers = await store.commit_many(batches)
        assert all(a is not None for a in answers)
        counts = await store.count_messages()
    total = INSTANCES * ENTRIES * len(KINDS)
    assert counts["pending"] == total
    return total


async def test_claimers_on_their_own_connections_share_nothing_and_keep_the_order(
    pg_url: str, pg_schema: str
) -> None:
    """Four claimers, each a store with its own connections, claim 3,000 messages at once (a
    limit per kind) and finish them: no message is claimed while another claimer holds it or
    twice at all (attempts stay 1), no instance has two messages out at once, each instance's
    are delivered in (version, n) order, and every message is delivered."""
    total = await fill(pg_url, pg_schema)
    in_flight: dict[str, str] = {}
    last: dict[str, tuple[int, int]] = {}
    delivered: Counter[str] = Counter()
    by_claimer: Counter[int] = Counter()
    busiest = 0

    async def claimer(number: int) -> None:
        nonlocal busiest
        rng = random.Random(number)
        store = PostgresStore(pg_url, schema=pg_schema, pool_size=2, auto_migrate=False)
        await store.open()
        try:
            async with asyncio.timeout(BOUND):
                while True:
                    claimed = await store.claim_messages(
                        dict.fromkeys(KINDS, 20), lease=60.0, owner=f"c{number}"
                    )
                    if not claimed:
                        counts = await store.count_messages()
                        if counts["pending"] + counts["running"] == 0:
                            return
                        await asyncio.sleep(0.002)
                        continue
                    for m in claimed:
                        assert m.attempts == 1, m
                        assert m.instance_id not in in_flight, (m.key, in_flight[m.instance_id])
                        in_flight[m.instance_id] = m.key
                        assert (m.version, m.n) > last.get(m.instance_id, (0, -1)), m.key
                        last[m.instance_id] = (m.version, m.n)
                        delivered[m.key] += 1
                    busiest = max(busiest, len(in_flight))
                    by_claimer[number] += len(claimed)
                    await asyncio.sleep(rng.uniform(0, 0.005))  # the handlers run
                    for m in claimed:
                        del in_flight[m.instance_id]  # before the finish: any later claim of
                    await store.finish_messages([m.key for m in claimed])  # the instance is new
        finally:
            await store.aclose()

    await asyncio.gather(*(claimer(n) for n in range(4)))
    assert len(delivered) == total and set(delivered.values()) == {1}
    assert all(last[f"i{i:03}"] == (ENTRIES + 1, 1) for i in range(INSTANCES))
    assert len(by_claimer) == 4, by_claimer  # every claimer got its share
    assert busiest > 20  # claims of several claimers were out at once
    conn = await pg_budget.connect(pg_url)
    try:
        row = await conn.fetchrow(
            f"SELECT count(*) FILTER (WHERE status = 'done') AS done, max(attempts) AS most"
            f' FROM "{pg_schema}".flowlock_outbox'
        )
    finally:
        await conn.close()
    assert row is not None and (row["done"], row["most"]) == (total, 1)


async def test_two_processes_deliver_every_message_once_in_order(
    pg_url: str, pg_schema: str, tmp_path: Path
) -> None:
    """Two OS processes, each a store of its own, claim 3,000 messages at once and deliver
    them into a sink table with a unique key before finishing them: the sink holds every
    message once (no duplicate met), both processes delivered, at overlapping times, and each
    instance's messages reached the sink in (version, n) order."""
    total = await fill(pg_url, pg_schema)
    conn = await pg_budget.connect(pg_url)
    try:
        await conn.execute(
            f'CREATE TABLE "{pg_schema}".claim_sink (seq bigserial, key text PRIMARY KEY,'
            " instance_id text NOT NULL, version bigint NOT NULL, n int NOT NULL,"
            " owner text NOT NULL)"
        )
        gate = Gate(tmp_path / "gate", 2)
        procs = []
        for p in range(2):
            conf = {
                "url": pg_url,
                "schema": pg_schema,
                "proc": p,
                "gate": str(gate),
                "kinds": list(KINDS),
                "batch": 25,
            }
            procs.append(
                await asyncio.create_subprocess_exec(
                    sys.executable,
                    str(WORKER),
                    json.dumps(conf),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                )
            )
        await gate.open_when_ready(procs)
        outputs: list[dict[str, Any]] = []
        async with asyncio.timeout(4 * BOUND):
            for proc in procs:
                out, err = await proc.communicate()
                assert proc.returncode == 0, err.decode()[-3000:]
                outputs.append(json.loads(out.decode().strip().splitlines()[-1]))
        gate.assert_overlapped()
        rows = await conn.fetch(
            f'SELECT instance_id, version, n, owner FROM "{pg_schema}".claim_sink ORDER BY seq'
        )
    finally:
        await conn.close()
    assert [o["duplicates"] for o in outputs] == [0, 0]
    assert sum(o["delivered"] for o in outputs) == total == len(rows)
    assert all(o["delivered"] > 0 for o in outputs), outputs
    seen: dict[str, list[tuple[int, int]]] = {}
    for r in rows:
        seen.setdefault(r["instance_id"], []).append((r["version"], r["n"]))
    expected = [(v, n) for v in range(2, ENTRIES + 2) for n in range(len(KINDS))]
    assert all(order == expected for order in seen.values())
    assert len(seen) == INSTANCES


# -- the plans ---------------------------------------------------------------------------------


def _rows_read(node: dict[str, Any]) -> int:
    """The rows the scans of flowlock_outbox under an EXPLAIN ANALYZE plan node read: the rows
    they returned and the rows their filter removed, over all their loops (never a Seq Scan:
    the index scans, a bitmap of one, and the TID scan that updates the rows claimed)."""
    own = 0
    if node.get("Relation Name") == "flowlock_outbox" and node["Node Type"] != "ModifyTable":
        scans = ("Index Scan", "Index Only Scan", "Tid Scan", "Bitmap Heap Scan")
        assert node["Node Type"] in scans, node["Node Type"]
        per_loop = node["Actual Rows"] + node.get("Rows Removed by Filter", 0)
        own = round(per_loop * node["Actual Loops"])
    return own + sum(_rows_read(child) for child in node.get("Plans", ()))


async def test_the_dispatchers_statements_read_their_indexes(pg_url: str, pg_schema: str) -> None:
    """The claim walks the pending due index and probes the order index; next_message_due the
    due index; find_messages and finish_messages the primary key; the purge the done index
    (plans over 20,000 messages, half of them done, with sequential scans off)."""
    store = PostgresStore(pg_url, schema=pg_schema, pool_size=2)
    await store.open()
    await store.aclose()
    conn: asyncpg.Connection = await pg_budget.connect(pg_url)
    try:
        await conn.execute(f'SET search_path TO "{pg_schema}"')
        await conn.execute(
            "INSERT INTO flowlock_outbox (instance_id, version, n, workflow, kind, payload,"
            " status, done_at)"
            " SELECT 'i' || g, 2, 0, 'w', 'k' || g % 3, '{}',"
            "        CASE WHEN g % 2 = 0 THEN 'done' ELSE 'pending' END,"
            "        CASE WHEN g % 2 = 0 THEN now() END"
            "   FROM generate_series(1, 20000) g"
        )
        await conn.execute("ANALYZE flowlock_outbox; SET enable_seqscan = off")
        async with conn.transaction():
            plans = {
                "claim": await conn.fetch(
                    "EXPLAIN " + CLAIM_MESSAGES, ["a", "b"], [10, 10], 30.0, "me", 32
                ),
                "due": await conn.fetch("EXPLAIN " + NEXT_MESSAGE_DUE, ["a", "b"]),
                "find": await conn.fetch("EXPLAIN " + FIND_MESSAGES, "", 0, -1, None, None, 100),
                "finish": await conn.fetch(
                    "EXPLAIN " + FINISH_MESSAGES, ["i7", "i9"], [2, 2], [0, 0]
                ),
                "purge": await conn.fetch("EXPLAIN " + PURGE_MESSAGES, 60.0, 100),
            }
    finally:
        await conn.close()
    wanted = {
        "claim": ["flowlock_outbox_due", "flowlock_outbox_order"],
        "due": ["flowlock_outbox_due"],
        "find": ["flowlock_outbox_pkey"],
        # The primary key, or its pending part (the order index): a probe per message either way.
        "finish": ["flowlock_outbox_"],
        "purge": ["flowlock_outbox_done"],
    }
    for name, plan in plans.items():
        text = "\n".join(r[0] for r in plan)
        for index in wanted[name]:
            assert index in text, (name, text)
        assert "Seq Scan" not in text, (name, text)


async def test_a_claim_over_a_backlog_reads_only_the_earliest_rows_of_each_kind(
    pg_url: str, pg_schema: str
) -> None:
    """With 30,000 pending messages over 3 kinds (each instance's second message held back by
    its first), a claim of 64 per kind walks each kind's part of the due index and reads a few
    rows per message claimed, never the whole backlog (EXPLAIN ANALYZE, rolled back)."""
    backlog, limit, kinds = 30_000, 64, ["k0", "k1", "k2"]
    store = PostgresStore(pg_url, schema=pg_schema, pool_size=2)
    await store.open()
    await store.aclose()
    conn: asyncpg.Connection = await pg_budget.connect(pg_url)
    try:
        await conn.execute(f'SET search_path TO "{pg_schema}"')
        await conn.execute(
            "INSERT INTO flowlock_outbox (instance_id, version, n, workflow, kind, payload,"
            " due_at, created_at)"
            " SELECT 'i' || (g / 2), 2, g % 2, 'w', 'k' || (g / 2) % 3, '{}',"
            "        now() - interval '1 hour' + g * interval '1 ms', now() - interval '1 hour'"
            "   FROM generate_series(0, $1 - 1) g",
            backlog,
        )
        await conn.execute("ANALYZE flowlock_outbox")
        tx = conn.transaction()
        await tx.start()
        try:
            [(plan,)] = await conn.fetch(
                "EXPLAIN (ANALYZE, FORMAT JSON) " + CLAIM_MESSAGES,
                kinds,
                [limit] * len(kinds),
                30.0,
                "me",
                1,
            )
        finally:
            await tx.rollback()
    finally:
        await conn.close()
    [top] = json.loads(plan) if isinstance(plan, str) else plan
    read = _rows_read(top["Plan"])
    # Per kind: about 2 * limit rows walked (every other one held back), one order probe each,
    # and the rows claimed found again by their key to update them.
    assert limit * len(kinds) <= read <= 6 * limit * len(kinds), read


def _subplan(node: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The plan node of the CTE `name` under `node`, or None."""
    if node.get("Subplan Name") == f"CTE {name}":
        return node
    for child in node.get("Plans", ()):
        found = _subplan(child, name)
        if found is not None:
            return found
    return None


async def test_a_run_of_a_hot_instance_reads_about_the_run_behind_its_head(
    pg_url: str, pg_schema: str
) -> None:
    """A hot instance with 2,000 pending messages of one kind: a claim with run=32 takes its
    first 32 in order, and finding the 31 behind the head reads about as many rows, not the
    backlog (EXPLAIN ANALYZE of the followers' part, rolled back)."""
    backlog, run = 2000, 32
    store = PostgresStore(pg_url, schema=pg_schema, pool_size=2)
    await store.open()
    await store.aclose()
    conn: asyncpg.Connection = await pg_budget.connect(pg_url)
    try:
        await conn.execute(f'SET search_path TO "{pg_schema}"')
        await conn.execute(
            "INSERT INTO flowlock_outbox (instance_id, version, n, workflow, kind, payload,"
            " due_at)"
            " SELECT 'hot', g, 0, 'w', 'k', '{}', now() - interval '1 hour' + g * interval '1 ms'"
            "   FROM generate_series(2, $1 + 1) g",
            backlog,
        )
        await conn.execute("ANALYZE flowlock_outbox")
        tx = conn.transaction()
        await tx.start()
        try:
            claimed = await conn.fetch(CLAIM_MESSAGES, ["k"], [8], 30.0, "me", run)
            await tx.rollback()
            tx = conn.transaction()
            await tx.start()
            [(plan,)] = await conn.fetch(
                "EXPLAIN (ANALYZE, FORMAT JSON) " + CLAIM_MESSAGES, ["k"], [8], 30.0, "me", run
            )
        finally:
            await tx.rollback()
    finally:
        await conn.close()
    assert [(r["instance_id"], r["version"]) for r in claimed] == [
        ("hot", v) for v in range(2, run + 2)
    ]
    [top] = json.loads(plan) if isinstance(plan, str) else plan
    followers = _subplan(top["Plan"], "followers")
    assert followers is not None
    assert run - 1 <= _rows_read(followers) <= 2 * run, _rows_read(followers)


@pytest.mark.parametrize("held", [False, True])
async def test_a_hot_backlog_ahead_in_due_order_does_not_make_the_claim_read_it(
    pg_url: str, pg_schema: str, held: bool
) -> None:
    """A hot instance's 20,000 pending messages come first in due order (its head free, or held
    by a run in flight), 50 other instances' after: a claim of 8 takes the oldest heads (the
    hot one's and 7 others, or 8 others) and reads a few hundred rows, not the backlog: past a
    bounded walk of the due index, it finds the heads instance by instance (EXPLAIN ANALYZE,
    rolled back)."""
    backlog, others, limit = 20_000, 50, 8
    store = PostgresStore(pg_url, schema=pg_schema, pool_size=2)
    await store.open()
    await store.aclose()
    conn: asyncpg.Connection = await pg_budget.connect(pg_url)
    try:
        await conn.execute(f'SET search_path TO "{pg_schema}"')
        await conn.execute(
            "INSERT INTO flowlock_outbox (instance_id, version, n, workflow, kind, payload,"
            " due_at)"
            " SELECT 'hot', g, 0, 'w', 'k', '{}', now() - interval '1 hour' + g * interval '1 ms'"
            "   FROM generate_series(2, $1 + 1) g",
            backlog,
        )
        await conn.execute(
            "INSERT INTO flowlock_outbox (instance_id, version, n, workflow, kind, payload,"
            " due_at)"
            " SELECT 'c' || lpad(g::text, 3, '0'), 2, 0, 'w', 'k', '{}',"
            "        now() - interval '30 minutes' + g * interval '1 ms'"
            "   FROM generate_series(1, $1) g",
            others,
        )
        if held:
            await conn.execute(
                "UPDATE flowlock_outbox SET claimed_until = now() + interval '1 hour',"
                " claimed_by = 'a run in flight', attempts = 1"
                " WHERE instance_id = 'hot' AND version < 34"
            )
        await conn.execute("ANALYZE flowlock_outbox")
        tx = conn.transaction()
        await tx.start()
        try:
            claimed = await conn.fetch(CLAIM_MESSAGES, ["k"], [limit], 30.0, "me", 1)
        finally:
            await tx.rollback()
        tx = conn.transaction()
        await tx.start()
        try:
            [(plan,)] = await conn.fetch(
                "EXPLAIN (ANALYZE, FORMAT JSON) " + CLAIM_MESSAGES, ["k"], [limit], 30.0, "me", 1
            )
        finally:
            await tx.rollback()
    finally:
        await conn.close()
    cold = [f"c{g:03}" for g in range(1, others + 1)]
    wanted = cold[:limit] if held else ["hot", *cold[: limit - 1]]
    assert sorted(r["instance_id"] for r in claimed) == sorted(wanted)
    [top] = json.loads(plan) if isinstance(plan, str) else plan
    read = _rows_read(top["Plan"])
    assert read <= 1000, read
