"""The race of an approval and its deadline across 4 OS processes sharing one PostgreSQL
database, each an engine with its timer service plus callers (tests/integration/timer_worker.py).

The parent arms the deadlines once every worker is ready, so the workers' services are woken by
NOTIFY; the callers aim their approvals at each deadline's due time. The test shows that the
processes raced (their callers' phases overlapped, more than one process's service fired
deadlines, and the firings of two processes overlapped in time), then runs the checker, the stay
check and its own SQL over the history.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from proc_worker import Gate

import flowlock
from flowlock.checker import check_many
from flowlock.core.models import TIMER_ACTOR
from flowlock.stores.postgres import PostgresStore
from timer_kit import deadline, due_of, stay_violations

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

WORKER = Path(__file__).with_name("timer_worker.py")
PROCESSES = 4
INSTANCES = 400
AFTER = 2.0  # the deadline: long enough for the parent to arm every instance before the first
BOUND = 120.0  # the most the test waits for its workers

SqlHistory = Callable[..., Awaitable[Any]]


def _ready(gate: Gate) -> int:
    return sum((gate.path / f"ready-{p}").exists() for p in range(PROCESSES))


def _overlapping(spans: list[tuple[float, float]]) -> bool:
    """Whether two of the (start, end) spans share a moment."""
    ordered = sorted(spans)
    return any(b[0] <= max(a[1] for a in ordered[:i]) for i, b in enumerate(ordered) if i)


async def test_the_race_of_an_approval_and_its_deadline_across_four_processes(
    pg_url: str, pg_schema: str, tmp_path: Path, sql_history: SqlHistory
) -> None:
    """400 approvals whose deadline falls due while a caller approves them, in 4 processes that
    each run a timer service: every instance ends approved or rejected with one history row;
    deadlines were fired by more than one process, at overlapping times."""
    gate = Gate(tmp_path / "gate", PROCESSES)
    plan = tmp_path / "plan.json"
    store = PostgresStore(pg_url, schema=pg_schema, pool_size=4)
    async with flowlock.Engine(store, timers=False) as engine:
        await engine.register(deadline(after=AFTER))  # migrated before the workers start
        procs = []
        for p in range(PROCESSES):
            conf = {
                "url": pg_url,
                "schema": pg_schema,
                "proc": p,
                "processes": PROCESSES,
                "gate": str(gate),
                "plan": str(plan),
                "after": AFTER,
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
        try:
            ids = [f"r{n:03}" for n in range(INSTANCES)]

            async def armed_when_ready() -> None:
                # The gate opens once every worker is ready; the deadlines are armed just before.
                while _ready(gate) < PROCESSES:
                    for proc in procs:
                        if proc.returncode is not None:
                            _, err = await proc.communicate()
                            raise AssertionError(f"a worker exited: {err.decode()[-3000:]}")
                    await asyncio.sleep(0.01)
                made = await asyncio.gather(
                    *[engine.create("deadline", instance_id=i) for i in ids]
                )
                due = {inst.id: due_of(inst, AFTER) for inst in made}
                plan.write_text(json.dumps(due))

            await asyncio.wait_for(armed_when_ready(), timeout=BOUND)
            await gate.open_when_ready(procs)
            reports = []
            for proc in procs:
                out, err = await asyncio.wait_for(proc.communicate(), timeout=BOUND)
                assert proc.returncode == 0, err.decode()[-3000:]
                reports.append(json.loads(out.decode().splitlines()[-1]))
        finally:
            for proc in procs:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
        gate.assert_overlapped()

        answers = {iid: a for r in reports for iid, a in r["answers"].items()}
        assert sorted(answers) == ids
        instances = {i: await engine.get(i) for i in ids}
        histories = {i: await engine.history(i) for i in ids}
    approved = [i for i in ids if instances[i].state == "approved"]
    rejected = [i for i in ids if instances[i].state == "rejected"]
    assert len(approved) + len(rejected) == INSTANCES
    for iid in approved:
        assert answers[iid] == "applied", iid
        assert [h.event for h in histories[iid]] == ["approve"]
    for iid in rejected:
        assert answers[iid] == "refused", iid
        [row] = histories[iid]
        assert (row.actor, row.request_id) == (TIMER_ACTOR, "timer:1:expire:0")
    applied = {r["proc"]: r["firings"]["applied"] for r in reports}
    assert sum(applied.values()) == len(rejected)
    print(f"race: {len(approved)} approved, {len(rejected)} rejected; fired by {applied}")
    # The processes raced: several services fired deadlines, two of them at the same time.
    firing = [r for r in reports if r["fired_at"]]
    assert len(firing) >= 2, applied
    assert len({r["owner"] for r in reports}) == PROCESSES
    assert _overlapping([(min(r["fired_at"]), max(r["fired_at"])) for r in firing]), [
        (r["proc"], min(r["fired_at"]), max(r["fired_at"])) for r in firing
    ]
    assert approved and rejected, (len(approved), len(rejected))
    verdict = check_many(
        [(instances[i], histories[i]) for i in ids], initial_state="pending", expected_applied=1
    )
    assert verdict.ok, verdict.violations
    assert [v for h in histories.values() for v in stay_violations(h)] == []
    (await sql_history()).assert_matches(histories)
