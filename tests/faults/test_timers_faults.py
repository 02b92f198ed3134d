"""Timers under faults: a claimer killed with SIGKILL in the middle of its firings, and
PostgreSQL restarted while timers are due and while a timer service sleeps.

The claimer is a process of its own (tests/faults/timer_claimer.py) whose first deadline effect
blocks it: every deadline it claimed is read and not written when it is killed. The restarts
are of a PostgreSQL of the module's own (``EmbeddedPostgres.restart()``, as
test_error_sweep does): restarting the session's shared server would break every other test's
connections. Waits are for conditions, with generous bounds.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

import flowlock
import pg_budget
from flowlock.checker import check_many
from flowlock.embedded import EmbeddedPostgres, available
from flowlock.metrics import Metrics
from flowlock.stores.postgres import PostgresStore
from lock_probes import wait_until
from timer_kit import deadline, fired, firings, stay_violations

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

CLAIMER = Path(__file__).with_name("timer_claimer.py")
BOUND = 60.0  # the most a test waits for a condition (a restart, a lease, a loaded machine)
LEASE = 1.0  # the killed claimer's lease: its claims run out this long after it took them
INSTANCES = 20
RESTART_LEASE = 3.0  # the lease of the service that lives through a restart


async def _fetch(url: str, sql: str) -> list[tuple[object, ...]]:
    conn = await pg_budget.connect(url)
    try:
        return [tuple(r) for r in await conn.fetch(sql)]
    finally:
        await conn.close()


async def _all_rejected(engine: flowlock.Engine, ids: list[str]) -> None:
    async def done() -> bool:
        return await engine.count("deadline", state="rejected") == len(ids)

    await wait_until(done, within=BOUND, what="every deadline to fire")


async def _fired_once(engine: flowlock.Engine, ids: list[str]) -> None:
    """Each instance was rejected by its deadline, once, inside its stay: the checker and the
    stay check agree."""
    pairs = [(await engine.get(i), await engine.history(i)) for i in ids]
    for _, history in pairs:
        assert [h.request_id for h in history] == ["timer:1:expire:0"]
    verdict = check_many(pairs, initial_state="pending", expected_applied=1)
    assert verdict.ok, verdict.violations
    assert [v for _, h in pairs for v in stay_violations(h)] == []


# -- a claimer killed mid-firing -------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["optimistic", "pessimistic"])
async def test_a_claimer_killed_mid_firing_loses_nothing(
    pg_url: str, pg_schema: str, tmp_path: Path, strategy: str
) -> None:
    """A process claims every due deadline and is killed with SIGKILL in the middle of firing
    them (pessimistic: holding the instance's row lock): nothing of it is written, and once its
    lease ran out another engine fires each deadline exactly once."""
    ids = [f"d{n:02}" for n in range(INSTANCES)]
    app = f"claimer-{uuid.uuid4().hex[:8]}"
    store = PostgresStore(pg_url, schema=pg_schema, pool_size=4)
    async with flowlock.Engine(store, timers=False) as caller:
        await caller.register(deadline(after=0.2))
        for iid in ids:
            await caller.create("deadline", instance_id=iid)
        await asyncio.sleep(0.3)  # every deadline is due before the claimer starts
        conf = {
            "url": pg_url,
            "schema": pg_schema,
            "dir": str(tmp_path),
            "strategy": strategy,
            "lease": LEASE,
            "after": 0.2,
            "app": app,
        }
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(CLAIMER),
            json.dumps(conf),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:

            def mid_firing() -> bool:
                if proc.returncode is not None:
                    raise AssertionError(f"the claimer exited ({proc.returncode}) before firing")
                return (tmp_path / "firing").exists()

            await wait_until(mid_firing, within=BOUND, what="the claimer to be mid-firing")
            owner = (tmp_path / "owner").read_text()
            claims = await _fetch(pg_url, f'SELECT claimed_by FROM "{pg_schema}".flowlock_timers')
            assert claims == [(owner,)] * INSTANCES  # it holds every deadline
            if strategy == "pessimistic":  # and the row of the one it is firing
                [(locked,)] = await _fetch(
                    pg_url,
                    "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
                    f" WHERE a.application_name = '{app}' AND l.locktype = 'transactionid'",
                )
                assert locked == 1
            proc.send_signal(signal.SIGKILL)
            assert await asyncio.wait_for(proc.wait(), timeout=BOUND) == -signal.SIGKILL
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        assert await caller.count("deadline", state="pending") == INSTANCES  # nothing written
        metrics = Metrics()
        rescuer = flowlock.Engine(
            PostgresStore(pg_url, schema=pg_schema, pool_size=4),
            strategy=strategy,
            metrics=metrics,
        )
        async with rescuer:
            await rescuer.register(deadline(after=0.2))
            await _all_rejected(caller, ids)
        assert firings(metrics)["applied"] == INSTANCES
        await _fired_once(caller, ids)
        assert await _fetch(pg_url, f'SELECT * FROM "{pg_schema}".flowlock_timers') == []


# -- PostgreSQL restarted ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedPostgres]:
    """A PostgreSQL of this module's own, to restart at will."""
    if not available():
        pytest.skip('needs pip install "flowlock[embedded]"')
    pg = EmbeddedPostgres(max_connections=50)
    pg.start()
    try:
        yield pg
    finally:
        pg.stop()


@pytest.fixture
async def schema(server: EmbeddedPostgres) -> AsyncIterator[str]:
    name = f"timers_{uuid.uuid4().hex[:10]}"
    yield name
    conn = await pg_budget.connect(server.url)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
    finally:
        await conn.close()


async def _engine(url: str, schema: str, **options: Any) -> flowlock.Engine:
    store = PostgresStore(url, schema=schema, pool_size=4)
    engine = await flowlock.Engine(store, metrics=Metrics(), **options).open()
    await engine.register(deadline(after=0.5))
    return engine


async def test_deadlines_due_while_postgresql_restarts_fire_once_after(
    server: EmbeddedPostgres, schema: str
) -> None:
    """PostgreSQL is down while the deadlines fall due and comes back: the timer service
    recovers by itself and fires each once; its LISTEN connection is back too (a deadline armed
    afterwards by another engine wakes it)."""
    engine = await _engine(server.url, schema, timer_lease=RESTART_LEASE)
    caller = None
    try:
        ids = [f"d{n:02}" for n in range(INSTANCES)]
        for iid in ids:
            await engine.create("deadline", instance_id=iid)
        began = time.monotonic()

        def down() -> None:
            time.sleep(max(0.0, 1.0 - (time.monotonic() - began)))  # past every due time

        await asyncio.to_thread(server.restart, while_down=down)
        await _all_rejected(engine, ids)
        await _fired_once(engine, ids)
        await fired(INSTANCES, engine.metrics)
        # The service also wakes when the claims it took would run out (a firing may have been
        # cut by the restart). Once past that, it sleeps with nothing due, for minutes: only
        # the NOTIFY of a deadline armed elsewhere wakes it in time.
        await asyncio.sleep(RESTART_LEASE + 1)
        caller = await _engine(server.url, schema, timers=False)
        await caller.create("deadline", instance_id="after")
        await _all_rejected(caller, [*ids, "after"])
        await fired(INSTANCES + 1, engine.metrics)
    finally:
        await engine.aclose()
        if caller is not None:
            await caller.aclose()


async def test_a_service_asleep_through_a_restart_still_hears_new_timers(
    server: EmbeddedPostgres, schema: str
) -> None:
    """The timer service sleeps (nothing due, no statement sent) while PostgreSQL restarts: a
    deadline armed after the restart by another engine still wakes it, and fires once."""
    engine = await _engine(server.url, schema)
    caller = None
    try:
        await asyncio.sleep(0.2)  # the service found nothing due and sleeps
        await asyncio.to_thread(server.restart)
        caller = await _engine(server.url, schema, timers=False)
        await caller.create("deadline", instance_id="a")
        await _all_rejected(caller, ["a"])
        await fired(1, engine.metrics)
        await _fired_once(caller, ["a"])
    finally:
        await engine.aclose()
        if caller is not None:
            await caller.aclose()
