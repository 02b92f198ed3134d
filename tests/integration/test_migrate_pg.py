"""Migration on PostgreSQL under live traffic: 100 callers fire at the instances while
`engine.migrate` moves every one to version 2; and a rolling deploy across 2 OS processes, an
old one (version 1 only) and a new one (versions 1 and 2), firing at the same instances while
the migration runs. After each: every instance migrated exactly once (counted with SQL), no row
decided under another version than its instance ran (nor by another version's code), and the
checker clean over every history.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from proc_worker import Gate

import flowlock
import pg_budget
from flowlock._inspect import check_instances
from flowlock.checker import check_many
from flowlock.core.bulk import bulk_request_id
from flowlock.stores.postgres import PostgresStore
from lock_probes import wait_until
from migrate_kit import MAP, TICKET, case_ids, ran_under_own_version, ticket_v1, ticket_v2

pytestmark = pytest.mark.postgres

WORKER = Path(__file__).with_name("deploy_worker.py")
CALLERS = 100
# The rolling deploy's size; the soak of the Performance section runs it longer:
# FLOWLOCK_DEPLOY_SECONDS=60 FLOWLOCK_DEPLOY_INSTANCES=20000 pytest -k test_rolling_deploy
DEPLOY_SECONDS = float(os.environ.get("FLOWLOCK_DEPLOY_SECONDS", "4"))
DEPLOY_INSTANCES = int(os.environ.get("FLOWLOCK_DEPLOY_INSTANCES", "400"))
EVENTS = ("bump", "hold", "reopen", "close")
WEIGHTS = (80, 10, 9, 1)
SqlHistory = Callable[..., Awaitable[Any]]


async def _engine(pg_url: str, schema: str, *versions: int, pool_size: int = 10) -> flowlock.Engine:
    store = PostgresStore(pg_url, schema=schema, pool_size=pool_size)
    engine = await flowlock.Engine(store).open()
    for version in versions:
        assert await engine.register(ticket_v1() if version == 1 else ticket_v2()) == version
    return engine


async def _create(engine: flowlock.Engine, n: int) -> list[str]:
    ids = case_ids(n)
    gate = asyncio.Semaphore(16)

    async def one(iid: str) -> None:
        async with gate:
            await engine.create(TICKET, instance_id=iid, data={"n": 0}, version=1)

    await asyncio.gather(*(one(i) for i in ids))
    return ids


async def _migrated_rows(pg_url: str, schema: str) -> Counter[str]:
    """Each instance's `migrated` rows, counted with the test's own SQL."""
    conn = await pg_budget.connect(pg_url)
    try:
        await conn.execute(f'SET search_path TO "{schema}"')
        rows = await conn.fetch(
            "SELECT instance_id, count(*) AS n FROM flowlock_history"
            " WHERE event = $1 AND definition_version = 2 GROUP BY instance_id",
            flowlock.MIGRATE_EVENT,
        )
    finally:
        await conn.close()
    return Counter({r["instance_id"]: r["n"] for r in rows})


async def _check_all(
    engine: flowlock.Engine,
    ids: list[str],
    pg_url: str,
    schema: str,
    sql_history: SqlHistory,
    expected: dict[str, int] | None = None,
) -> list[tuple[flowlock.Instance, list[flowlock.HistoryEntry]]]:
    """One migrated row per instance (SQL), each row's version the one its instance ran and
    its code that version's, the checker clean (definition versions included), and the
    histories as SQL counts them."""
    assert await _migrated_rows(pg_url, schema) == Counter(dict.fromkeys(ids, 1))
    gate = asyncio.Semaphore(16)

    async def read(iid: str) -> tuple[flowlock.Instance, list[flowlock.HistoryEntry]]:
        async with gate:
            return await engine.get(iid), await engine.history(iid)

    pairs = await asyncio.gather(*(read(i) for i in ids))
    for inst, rows in pairs:
        assert inst.definition_version == 2, inst
        assert ran_under_own_version(rows) == [], inst.id
        (cut,) = [k for k, r in enumerate(rows) if r.migrated]
        assert {r.definition_version for r in rows[:cut]} <= {1}, inst.id
        assert {r.definition_version for r in rows[cut:]} == {2}, inst.id
    verdict = check_many(pairs, initial_state="open", expected_applied=expected)
    assert verdict.ok, verdict.violations[:10]
    (await sql_history()).assert_matches({i.id: rows for i, rows in pairs})
    whole = await check_instances(engine, None)
    assert whole.verdict.ok, whole.verdict.violations[:10]
    return pairs


class Traffic:
    """Callers firing bump, hold, reopen and close at random instances until stopped, each
    under request ids of its own; what was applied is kept by instance."""

    def __init__(self, engine: flowlock.Engine, ids: list[str]) -> None:
        self.engine = engine
        self.ids = ids
        self.applied: list[tuple[str, str]] = []
        self.errors: Counter[str] = Counter()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, callers: int) -> None:
        self._tasks = [asyncio.create_task(self._caller(k)) for k in range(callers)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.wait_for(asyncio.gather(*self._tasks), 60)

    async def _caller(self, k: int) -> None:
        rng = random.Random(k)
        j = 0
        while not self._stop.is_set():
            # Mostly bumps; a close now and then (a closed instance takes no more events).
            iid = rng.choice(self.ids)
            (event,) = rng.choices(EVENTS, WEIGHTS)
            rid = f"task-{k}-{j}"
            j += 1
            try:
                outcome = await self.engine.fire(iid, event, request_id=rid, actor="caller")
            except flowlock.FlowlockError as exc:
                self.errors[type(exc).__name__] += 1
                continue
            if outcome.applied and not outcome.replayed:
                self.applied.append((iid, rid))


async def test_migration_under_100_callers_is_exactly_once(
    pg_url: str, pg_schema: str, sql_history: SqlHistory
) -> None:
    """300 instances migrated while 100 callers fire: one migrated row each, checker clean."""
    engine = await _engine(pg_url, pg_schema, 1, 2)
    callers = await _engine(pg_url, pg_schema, 1, 2, pool_size=20)
    try:
        ids = await _create(engine, 300)
        traffic = Traffic(callers, ids)
        traffic.start(CALLERS)
        try:
            await wait_until(lambda: len(traffic.applied) >= CALLERS // 2, what="callers' fires")
            before = len(traffic.applied)
            report = await engine.migrate(TICKET, 2, state_map=MAP, actor="ops", batch=50)
            during = len(traffic.applied) - before
        finally:
            await traffic.stop()
        print(
            f"\nmigrated {report.applied} in {report.seconds:.2f} s ({report.rate:.0f}/s) "
            f"under {CALLERS} callers ({during} fires applied meanwhile); errors {traffic.errors}"
        )
        assert (report.matched, report.applied, dict(report.failed)) == (300, 300, {})
        assert during > 0, "no fire was applied while the migration ran"
        # Refusals the workflow's rules give (hold twice, reopen before the migration): never
        # a mismatch, both versions are registered in every engine here.
        assert set(traffic.errors) <= {"TransitionNotAllowed", "UnknownEvent"}, traffic.errors
        wanted: dict[str, set[str]] = {i: {bulk_request_id(report.operation_id, i)} for i in ids}
        for iid, rid in traffic.applied:
            wanted[iid].add(rid)
        expected = {iid: len(rids) for iid, rids in wanted.items()}
        pairs = await _check_all(engine, ids, pg_url, pg_schema, sql_history, expected)
        assert {i.id: {r.request_id for r in rows} for i, rows in pairs} == wanted
    finally:
        await callers.aclose()
        await engine.aclose()


@pytest.mark.slow
async def test_rolling_deploy_across_two_processes(
    pg_url: str, pg_schema: str, tmp_path: Path, sql_history: SqlHistory
) -> None:
    """An old process (v1 only) and a new one (v1, v2) fire at the same instances while they
    are migrated to v2: no row under another version than its instance's; the old process is
    refused (DefinitionMismatch) on migrated instances; the checker clean."""
    await _rolling_deploy(pg_url, pg_schema, tmp_path, sql_history, DEPLOY_SECONDS,
                          DEPLOY_INSTANCES, head_start=1.0)  # fmt: skip


async def test_a_short_rolling_deploy_across_two_processes(
    pg_url: str, pg_schema: str, tmp_path: Path, sql_history: SqlHistory
) -> None:
    """The rolling deploy, short (2 s, 150 instances): kept in the quick suite."""
    await _rolling_deploy(pg_url, pg_schema, tmp_path, sql_history, 2.0, 150, head_start=0.5)


async def _rolling_deploy(
    pg_url: str,
    pg_schema: str,
    tmp_path: Path,
    sql_history: SqlHistory,
    seconds: float,
    instances: int,
    *,
    head_start: float,
) -> None:
    """The two processes fire for `seconds` at `instances`; the migration begins after
    `head_start` seconds of both firing under version 1."""
    engine = await _engine(pg_url, pg_schema, 1, 2)
    try:
        ids = await _create(engine, instances)
        gate = Gate(tmp_path / "gate", 2)
        procs = []
        for proc, versions in enumerate(([1], [1, 2])):
            conf = {
                "url": pg_url, "schema": pg_schema, "instances": len(ids), "versions": versions,
                "callers": 10, "seconds": seconds, "gate": str(gate), "proc": proc,
            }  # fmt: skip
            started = await asyncio.create_subprocess_exec(
                sys.executable, str(WORKER), json.dumps(conf),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            procs.append(started)
        try:
            await gate.open_when_ready(procs)
            await asyncio.sleep(head_start)  # both processes fire under version 1 first
            report = await engine.migrate(TICKET, 2, state_map=MAP, actor="deploy", batch=50)
            results = []
            for p in procs:
                out, err = await asyncio.wait_for(p.communicate(), seconds + 60)
                assert p.returncode == 0, err.decode()[-3000:]
                results.append(json.loads(out.decode().splitlines()[-1]))
        finally:
            for p in procs:
                if p.returncode is None:
                    p.kill()
                    await p.wait()
        gate.assert_overlapped()
        old, new = results
        print(f"\nmigration: {report.summary()}\nold: {old}\nnew: {new}")
        n = instances
        assert (report.matched, report.applied, dict(report.failed)) == (n, n, {})
        assert sum(old["applied"].values()) > 0 and sum(new["applied"].values()) > 0
        assert new["applied"].get("reopen", 0) > 0, "the new process applied no v2-only event"
        # The old process is refused on migrated instances, never applies v1 to them.
        assert old["errors"].get("DefinitionMismatch", 0) > 0, old
        assert set(old["errors"]) <= {"DefinitionMismatch", "TransitionNotAllowed"}, old
        assert "DefinitionMismatch" not in new["errors"], new
        assert set(new["errors"]) <= {"TransitionNotAllowed", "UnknownEvent"}, new
        await _check_all(engine, ids, pg_url, pg_schema, sql_history)
    finally:
        await engine.aclose()
