"""Retention on PostgreSQL under live traffic, and how long a purge batch holds its row locks.

- A purge of final states while callers fire at every instance (the final ones refuse, some
  pending ones move into a final state): only instances final and older than the bound at their
  delete go, held ones stay, nothing else is lost, and the checker passes on what remains.
- A purge of a non-final state while callers move those very instances: each delete is a
  compare-and-swap, so an instance a caller moved is kept, and every transition a caller was
  told was applied is still in the history afterwards; the archive holds exactly what went.
- 10,000 instances with 5 history rows each, purged in batches of 500 with an archive: the
  longest batch transaction (from its first statement to its commit, as the engine measures it
  around the store call) is reported and bounded.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import random
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import flowlock
import pg_budget
from age_kit import backdate
from flowlock._inspect import check_instances

BOUND = timedelta(minutes=10)


async def _make(engine: flowlock.Engine, ids: list[str], event: str | None) -> None:
    sem = asyncio.Semaphore(16)

    async def one(iid: str) -> None:
        async with sem:
            await engine.create("approval", instance_id=iid, request_id=f"mk-{iid}")
            if event is not None:
                await engine.fire(iid, event, actor="setup", request_id=f"{event}-{iid}")

    await asyncio.gather(*(one(iid) for iid in ids))


async def _exists(engine: flowlock.Engine, iid: str) -> bool:
    try:
        await engine.get(iid)
    except flowlock.InstanceNotFound:
        return False
    return True


async def test_a_purge_of_final_states_under_live_traffic(
    pg_engine_factory: Callable[..., Any],
) -> None:
    engine: flowlock.Engine = await pg_engine_factory(pool_size=12)
    final = [f"f-{i:04d}" for i in range(600)]
    pending = [f"p-{i:04d}" for i in range(300)]
    await _make(engine, final[:300], "approve")
    await _make(engine, final[300:], "reject")
    await _make(engine, pending, None)
    held = final[::50]
    for iid in held:
        await engine.hold(iid, reason="audit")
    await backdate(engine.store, [*final, *pending])  # an hour old: past the bound
    young = [f"y-{i:03d}" for i in range(50)]
    await _make(engine, young, "approve")  # final, but newer than the bound

    moved: dict[str, str] = {}  # pending instances a caller moved into a final state
    refused = 0
    purging = False
    during = 0  # calls that ended while the purge ran
    stop = asyncio.Event()
    flowing = asyncio.Event()  # callers have moved some instances and been refused some

    async def caller(seed: int) -> None:
        nonlocal refused, during
        rng = random.Random(seed)
        while not stop.is_set():
            if rng.random() < 0.5:
                iid, event = rng.choice(final), "approve"
            else:
                iid, event = rng.choice(pending), rng.choice(["approve", "reject"])
            try:
                out = await engine.fire(iid, event, actor=f"caller-{seed}")
            except (flowlock.TransitionNotAllowed, flowlock.InstanceNotFound):
                refused += 1
                continue
            finally:
                during += purging
                if len(moved) >= 5 and refused >= 5:
                    flowing.set()
            if out.applied:
                moved[iid] = event

    callers = [asyncio.create_task(caller(s)) for s in range(12)]
    await asyncio.wait_for(flowing.wait(), 20)  # traffic flows before the purge begins
    purging = True
    report = await engine.purge("approval", older_than=BOUND, batch=50)
    purging = False
    stop.set()
    await asyncio.gather(*callers)

    assert moved and refused and during, "the callers ran during the purge"
    assert all(iid.startswith("p-") for iid in moved)
    assert report.matched == len(final) - len(held) and report.held == len(held)
    assert (report.purged, report.kept) == (len(final) - len(held), 0)
    assert report.batches >= 11
    for iid in final:
        assert await _exists(engine, iid) == (iid in held), iid
    for iid in [*pending, *young]:
        assert await _exists(engine, iid), iid  # nothing else lost
    for iid, event in moved.items():
        history = await engine.history(iid)
        assert [(h.event, h.actor is not None) for h in history] == [(event, True)]
    checked = await check_instances(engine, None)
    assert checked.verdict.ok, checked.verdict.violations
    assert checked.instances == len(held) + len(pending) + len(young)


async def test_a_purge_keeps_what_callers_move_under_it(
    pg_engine_factory: Callable[..., Any], tmp_path: Path
) -> None:
    """final=False over "pending": callers approve the very instances being purged."""
    engine: flowlock.Engine = await pg_engine_factory(pool_size=12)
    ids = [f"q-{i:04d}" for i in range(1500)]
    await _make(engine, ids, None)
    await backdate(engine.store, ids)  # an hour old: past the bound
    applied: set[str] = set()
    stop = asyncio.Event()

    async def caller(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            iid = rng.choice(ids)
            try:
                out = await engine.fire(iid, "approve", actor="caller")
            except flowlock.InstanceNotFound:
                continue
            if out.applied:
                applied.add(iid)

    callers = [asyncio.create_task(caller(s)) for s in range(16)]
    await asyncio.sleep(0.1)
    archive = tmp_path / "pending.jsonl.gz"
    report = await engine.purge(
        "approval", older_than=BOUND, final=False, states=["pending"], batch=100, archive=archive
    )
    stop.set()
    await asyncio.gather(*callers)

    left = {iid for iid in ids if await _exists(engine, iid)}
    gone = set(ids) - left
    assert applied and gone, "callers and the purge both did something"
    assert applied <= left, "an applied transition was purged"
    assert report.purged == len(gone)
    # Every instance still here either moved (a caller approved it) or was never reached.
    for iid in left:
        inst = await engine.get(iid)
        assert inst.state == "approved" and iid in applied
    with gzip.open(archive, "rb") as f:
        lines = [json.loads(line) for line in f]
    assert {line["instance"]["id"] for line in lines} == gone
    assert all(line["instance"]["state"] == "pending" for line in lines)
    assert all(line["history"] == [] for line in lines)
    checked = await check_instances(engine, None)
    assert checked.verdict.ok, checked.verdict.violations


LEDGER = flowlock.Workflow(
    "ledger",
    states=["open", "closed"],
    initial="open",
    transitions=[
        flowlock.Transition("note", source="open", target="open"),
        flowlock.Transition("close", source="open", target="closed"),
    ],
)
ROWS = 5  # history rows per instance: 4 notes and a close


async def _fill_ledger(pg_url: str, schema: str, count: int) -> None:
    """`count` closed ledgers at version 6 with their 5 history rows, an hour old, written with
    the test's own SQL (the engine would take minutes to make 50,000 rows here)."""
    conn = await pg_budget.connect(pg_url)
    try:
        await conn.execute(f'SET search_path TO "{schema}"')
        await conn.execute(
            """
            INSERT INTO flowlock_instances (id, workflow, state, version, data, last_event,
                                            created_at, updated_at, stay_version)
            SELECT 'l-' || lpad(g::text, 6, '0'), 'ledger', 'closed', 6,
                   jsonb_build_object('n', g), 'close', now() - interval '2 hours',
                   now() - interval '1 hour', 6
              FROM generate_series(1, $1) g
            """,
            count,
        )
        await conn.execute(
            """
            INSERT INTO flowlock_history (instance_id, version, event, from_state, to_state,
                                          actor, request_id, strategy, data, at, payload)
            SELECT 'l-' || lpad(g::text, 6, '0'), v,
                   CASE WHEN v = 6 THEN 'close' ELSE 'note' END, 'open',
                   CASE WHEN v = 6 THEN 'closed' ELSE 'open' END, 'clerk',
                   'r-' || g || '-' || v, 'optimistic', jsonb_build_object('n', g),
                   now() - interval '2 hours' + v * interval '1 minute',
                   jsonb_build_object('line', v)
              FROM generate_series(1, $1) g, generate_series(2, 6) v
            """,
            count,
        )
    finally:
        await conn.close()


@pytest.mark.slow  # a measurement for the docs; the purges above prove batches under traffic
async def test_ten_thousand_instances_purge_in_short_batches(
    pg_engine_factory: Callable[..., Any], pg_url: str, pg_schema: str, tmp_path: Path
) -> None:
    """The figure docs/operations.md quotes: 10,000 instances x 5 history rows, batches of
    500, archived. Each batch transaction locks its rows in id order, deletes, writes and
    fsyncs its archive member, commits."""
    engine: flowlock.Engine = await pg_engine_factory(pool_size=4)
    await engine.register(LEDGER)
    count = 10_000
    await _fill_ledger(pg_url, pg_schema, count)
    sample = await engine.history("l-000042")
    assert len(sample) == ROWS
    seen: list[float] = []
    last = time.monotonic()

    def tick(_: int) -> None:
        nonlocal last
        now = time.monotonic()
        seen.append(now - last)
        last = now

    archive = tmp_path / "ledger.jsonl.gz"
    started = time.monotonic()
    report = await engine.purge(
        "ledger", older_than=timedelta(minutes=30), archive=archive, progress=tick
    )
    elapsed = time.monotonic() - started
    assert (report.purged, report.batches) == (count, count // 500)
    print(  # the figure the docs quote (pytest -s shows it)
        f"\npurge of {count} x {ROWS} rows in {elapsed:.2f} s, {report.batches} batches of 500: "
        f"longest batch transaction {report.longest_batch * 1000:.1f} ms, "
        f"longest batch with its read {max(seen) * 1000:.1f} ms"
    )
    assert report.longest_batch < 2.0, "a batch held its row locks for seconds"
    restored = await engine.restore(archive)
    assert restored.restored == count
    assert await engine.history("l-000042") == sample
