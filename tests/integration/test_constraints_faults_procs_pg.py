"""Capacities across OS processes when one of them dies (kill -9 in the middle of its takes)
and when callers wait for a slot another process frees (Capacity(wait=)).

See test_constraints_procs_pg.py for how the workers run and what the proofs read.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sqlite3
import time
from collections import Counter
from pathlib import Path
from typing import Any

import constraint_procs as cp
import pytest
from proc_worker import Gate

import flowlock
from constraint_kit import (
    DESK_KIND,
    LIMIT,
    REVIEW_KIND,
    Rows,
    read_pg,
    read_sqlite,
    slot_proof,
    workflows,
)
from flowlock.stores.sqlite import SqliteStore

# -- kill -9 in the middle of a take ---------------------------------------------------------

VICTIM = "procs-victim"
STALL = 3.0  # seconds the victim's takes sleep inside their transaction

_STALL_SQL = f"""
CREATE FUNCTION procs_stall() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('application_name') = '{VICTIM}' THEN
        PERFORM pg_sleep({STALL});
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER procs_stall AFTER INSERT ON flowlock_slot_log
    FOR EACH ROW EXECUTE FUNCTION procs_stall();
"""


async def _victim_sessions(pg_url: str, pg_schema: str, where: str = "true") -> int:
    rows = await cp.sql(
        pg_url,
        pg_schema,
        f"SELECT count(*) AS n FROM pg_stat_activity WHERE application_name = $1 AND {where}",
        VICTIM,
    )
    return int(rows[0]["n"])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["optimistic", "pessimistic", "distributed"])
async def test_kill_9_in_the_middle_of_a_take_leaks_no_slot(
    request: pytest.FixtureRequest,
    pg_url: str,
    pg_schema: str,
    tmp_path: Path,
    sql_history: cp.SqlHistory,
    strategy: str,
) -> None:
    """A process is killed with SIGKILL while 3 others storm the same keys and it is in the
    middle of transitions that took a slot: storm takes held inside their statement by a
    trigger, and two starts (of two other reviewers) inside transactions of its own, not yet
    committed. Afterwards the two held reviews are still queued with no history and no slot,
    the slot rows equal the instances in review and the counters, the log replays clean, and
    every reviewer's 5 slots can be taken again, no more (no slot leaked). Under the
    distributed strategy the leases it held run out (their ttl) and the others go on."""
    keys = ["ann", "bob", "cid"]
    engine = await cp.pg_engine(pg_url, pg_schema)
    locks = cp.redis_locks(request, strategy)
    try:
        ids = await cp.make_reviews(engine, 48, keys)
        # Two more reviewers, 6 reviews each, out of the storm: the victim starts the first of
        # each inside a transaction of its own and never commits; then their 5 slots must be
        # free (no slot leaked): 5 of the 6 get in, the sixth is refused.
        spare = {"dan": [f"dan-{n}" for n in range(6)], "eve": [f"eve-{n}" for n in range(6)]}
        for reviewer, names in spare.items():
            for iid in names:
                await engine.create("review", instance_id=iid, data={"reviewer": reviewer})
        hold = [names[0] for names in spare.values()]
        await cp.sql(pg_url, pg_schema, _STALL_SQL)
        gate = Gate(tmp_path / "gate", cp.PROCESSES)
        base = {
            "mode": "storm", "url": pg_url, "schema": pg_schema, "strategy": strategy,
            "gate": str(gate), "ids": ids, "keys": keys, "callers": 6, "warm": ids, **locks,
        }  # fmt: skip
        confs = [{**base, "proc": p, "seconds": 6.0} for p in range(cp.PROCESSES - 1)]
        victim_conf = {"proc": cp.PROCESSES - 1, "seconds": cp.BOUND, "hold": hold}
        confs.append({**base, **victim_conf, "application_name": VICTIM})
        procs = await cp.spawn(confs)
        victim = procs[-1]
        try:
            await gate.open_when_ready(procs)

            async def in_the_middle() -> bool:
                held = sum((gate.path / f"held-{n}").exists() for n in range(len(hold)))
                if victim.returncode is not None:
                    _, err = await victim.communicate()
                    raise AssertionError(f"the victim exited: {err.decode()[-3000:]}")
                stalled = await _victim_sessions(pg_url, pg_schema, "wait_event = 'PgSleep'")
                return held == len(hold) and stalled >= 1

            await cp.until(in_the_middle, 30.0, "the victim's takes in the middle of their commit")
            killed_at = time.monotonic()
            victim.send_signal(signal.SIGKILL)
            assert await asyncio.wait_for(victim.wait(), timeout=cp.BOUND) == -signal.SIGKILL
            reports = await cp.read_reports(procs[:-1])
        finally:
            await cp.stop(procs)

        async def gone() -> bool:
            return await _victim_sessions(pg_url, pg_schema) == 0

        await cp.until(gone, STALL + 30.0, "the killed process's sessions ended")
        # The kill fell inside every other process's storm.
        phases = [cp.phase_of(gate, p) for p in range(cp.PROCESSES - 1)]
        assert max(p.start for p in phases) < killed_at < min(p.end for p in phases), phases
        errors = cp.total(reports, "errors")
        assert set(errors) <= cp.EXPECTED, [r["samples"] for r in reports]

        rows = await read_pg(pg_url, pg_schema)
        for iid in hold:  # rolled back whole: no transition, no slot
            assert [(i[2], i[3]) for i in rows.instances if i[0] == iid] == [("queued", 1)]
            assert [h for h in rows.history if h[0] == iid] == []
            assert [s for s in rows.slots if s[2] == iid] == []
        slot_proof(rows, REVIEW_KIND, LIMIT, key_of=cp.reviewer).assert_ok()
        await cp.checked(engine, pg_url, pg_schema, rows)
        everyone = [*ids, *(i for names in spare.values() for i in names)]
        (await sql_history()).assert_matches({i: await engine.history(i) for i in everyone})

        # No slot leaked: each reviewer's queued reviews fill its free slots exactly.
        for key in [*keys, *spare]:
            mine = [i for i in everyone if (await engine.get(i)).data["reviewer"] == key]
            for iid in mine:
                if (await engine.get(iid)).state == "queued":
                    with contextlib.suppress(flowlock.CapacityReached):
                        await engine.fire(iid, "start")
            in_review = [i for i in mine if (await engine.get(i)).state == "in_review"]
            assert len(in_review) == min(LIMIT, len(mine)), (key, in_review)
            assert (await engine.capacity(REVIEW_KIND, key)).used == len(in_review)
        refilled = await read_pg(pg_url, pg_schema)
        slot_proof(refilled, REVIEW_KIND, LIMIT, key_of=cp.reviewer).assert_ok()
        assert Counter(s[1] for s in refilled.slots) == dict.fromkeys([*keys, *spare], LIMIT)
    finally:
        await engine.aclose()
        await cp.forget_locks(locks)


# -- waiting for a slot, woken by another process's release ---------------------------------


async def _desks(
    engine: flowlock.Engine, gate: Gate, processes: int, where: dict[str, Any]
) -> list[dict[str, Any]]:
    """`engine` takes all 5 seats of desk d1; `processes` workers x 4 callers ask for seats
    (waiting), and once every worker is in its phase (and a second more), `engine` gives its
    seats back. The workers' reports, once their phases overlapped."""
    holders = [f"hold-{n}" for n in range(LIMIT)]
    for iid in holders:
        await engine.create("desk", instance_id=iid, data={"desk": "d1"})
        await engine.fire(iid, "take")
    confs = []
    for p in range(processes):
        ids = [f"w{p}-{n}" for n in range(4)]
        for iid in ids:
            await engine.create("desk", instance_id=iid, data={"desk": "d1"})
        confs.append({**where, "mode": "desks", "proc": p, "gate": str(gate), "ids": ids,
                      "rounds": 5, "warm": ids})  # fmt: skip
    procs = await cp.spawn(confs)
    try:
        await gate.open_when_ready(procs)

        async def all_started() -> bool:
            return all((gate.path / f"started-{p}").exists() for p in range(processes))

        await cp.until(all_started, cp.BOUND, "every worker in its phase")
        await asyncio.sleep(1.0)  # their first takes are refused and wait
        assert (await engine.capacity(DESK_KIND, "d1")).holders == tuple(holders)
        for iid in holders:
            await engine.fire(iid, "leave")
        reports = await cp.read_reports(procs)
    finally:
        await cp.stop(procs)
    gate.assert_overlapped()
    applied, errors = cp.total(reports, "applied"), cp.total(reports, "errors")
    waited = max(r["waited"] for r in reports)
    run = f"{where.get('backend', 'postgres')} {where['strategy']}"
    print(f"desks {run}: applied {dict(applied)}, errors {dict(errors)}, {waited=:.2f}")
    assert errors == {}, [r["samples"] for r in reports]
    assert applied == {"take": processes * 4 * 5, "leave": processes * 4 * 5}, applied
    return reports


def _desk_proof(rows: Rows) -> None:
    """Never more than 5 seated, all free at the end, shared by processes, and no worker
    seated before the first seat the test's engine gave back."""
    proof = slot_proof(
        rows, DESK_KIND, LIMIT, workflow="desk", key_of=lambda d: d["desk"],
        states=("busy",), takes=("take",), releases=("leave",), must_take=("take",),
        must_release=("leave",),
    )  # fmt: skip
    proof.assert_ok()
    assert proof.peak == {"d1": LIMIT} and proof.holders == {}, proof
    assert proof.mixed_full > 0, proof
    log = [e for e in rows.log if e[0] == DESK_KIND]
    first_release = next(e[2] for e in log if e[3].startswith("hold-") and e[5] == -1)
    assert all(e[2] > first_release for e in log if e[3].startswith("w")), log[:12]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["optimistic", "pessimistic"])
async def test_waiters_in_four_processes_are_woken_by_another_process(
    pg_url: str, pg_schema: str, tmp_path: Path, strategy: str
) -> None:
    """The test's own engine holds all 5 seats of a desk while 4 processes x 4 callers ask for
    one with Capacity(wait=30): they wait, and once it gives its seats back (a release they can
    only hear from the database) every take gets in, none before the first release, 5 rounds
    each, never more than 5 seated."""
    engine = await cp.pg_engine(pg_url, pg_schema)
    try:
        where = {"url": pg_url, "schema": pg_schema, "strategy": strategy}
        await _desks(engine, Gate(tmp_path / "gate", cp.PROCESSES), cp.PROCESSES, where)
        rows = await read_pg(pg_url, pg_schema)
        _desk_proof(rows)
        await cp.checked(engine, pg_url, pg_schema, rows)
    finally:
        await engine.aclose()


@pytest.mark.slow
async def test_waiters_on_a_sqlite_file_are_woken_by_another_process(tmp_path: Path) -> None:
    """The same on one SQLite file with 3 processes (a release made by another process is
    seen by the store's periodic look, there is no notice to hear): every take gets in."""
    path = tmp_path / "flowlock.db"
    async with flowlock.Engine(SqliteStore(path, pool_size=2)) as engine:
        for wf in workflows():
            await engine.register(wf)
        where = {"backend": "sqlite", "path": str(path), "strategy": "optimistic"}
        await _desks(engine, Gate(tmp_path / "gate", 3), 3, where)
        rows = read_sqlite(str(path))
        _desk_proof(rows)
        await cp.checked(engine, f"sqlite:///{path}", None, rows)


@pytest.mark.slow
async def test_kill_9_during_a_storm_on_a_sqlite_file_leaks_no_slot(tmp_path: Path) -> None:
    """One of 3 processes storming a SQLite file is killed with SIGKILL once it has committed
    20 transitions (its calls in flight die with it): the file is sound, the slot rows equal
    the instances in review and the counters, the log replays clean, and every reviewer's 5
    slots can be taken again, no more."""
    path = tmp_path / "flowlock.db"
    keys = ["ann", "bob"]
    async with flowlock.Engine(SqliteStore(path, pool_size=2)) as engine:
        for wf in workflows():
            await engine.register(wf)
        ids = await cp.make_reviews(engine, 24, keys)
        gate = Gate(tmp_path / "gate", 3)
        base = {
            "mode": "storm", "backend": "sqlite", "path": str(path), "strategy": "optimistic",
            "gate": str(gate), "ids": ids, "keys": keys, "callers": 4, "warm": ids,
        }  # fmt: skip
        confs = [{**base, "proc": p, "seconds": 5.0} for p in range(2)]
        confs.append({**base, "proc": 2, "seconds": cp.BOUND})
        procs = await cp.spawn(confs)
        victim = procs[-1]

        def committed_by_victim() -> int:
            conn = sqlite3.connect(path, timeout=30)
            try:
                query = "SELECT count(*) FROM flowlock_history WHERE actor = 'p2'"
                return int(conn.execute(query).fetchone()[0])
            finally:
                conn.close()

        async def busy() -> bool:
            assert victim.returncode is None, "the victim exited before it was killed"
            return await asyncio.to_thread(committed_by_victim) >= 20

        try:
            await gate.open_when_ready(procs)
            await cp.until(busy, 30.0, "the victim's first 20 transitions")
            killed_at = time.monotonic()
            victim.send_signal(signal.SIGKILL)
            assert await asyncio.wait_for(victim.wait(), timeout=cp.BOUND) == -signal.SIGKILL
            reports = await cp.read_reports(procs[:-1])
        finally:
            await cp.stop(procs)
        phases = [cp.phase_of(gate, p) for p in range(2)]
        assert max(p.start for p in phases) < killed_at < min(p.end for p in phases), phases
        errors = cp.total(reports, "errors")
        assert set(errors) <= cp.EXPECTED, [r["samples"] for r in reports]

        conn = sqlite3.connect(path)
        try:
            assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        finally:
            conn.close()
        rows = read_sqlite(str(path))
        slot_proof(rows, REVIEW_KIND, LIMIT, key_of=cp.reviewer).assert_ok()
        await cp.checked(engine, f"sqlite:///{path}", None, rows)
        for key in keys:  # the free slots fill exactly: none leaked
            mine = [i for i in ids if (await engine.get(i)).data["reviewer"] == key]
            for iid in mine:
                if (await engine.get(iid)).state == "queued":
                    with contextlib.suppress(flowlock.CapacityReached):
                        await engine.fire(iid, "start")
            assert (await engine.capacity(REVIEW_KIND, key)).used == min(LIMIT, len(mine))
        refilled = read_sqlite(str(path))
        slot_proof(refilled, REVIEW_KIND, LIMIT, key_of=cp.reviewer).assert_ok()
