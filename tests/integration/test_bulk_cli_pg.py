"""`flowlock admin force --yes` killed midway (SIGKILL, as a crash) and the same command run
again: it finishes the rest, and no instance gets a second forced row (PostgreSQL, a real
subprocess of the CLI)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

import flowlock
import pg_budget
from bulk_kit import METER, meter
from flowlock.checker import check_many
from flowlock.stores.postgres import PostgresStore

pytestmark = pytest.mark.postgres

TESTS = Path(__file__).resolve().parents[1]
N = 1500


async def _bulk_rows(pg_url: str, schema: str) -> Counter[str]:
    """Each instance's forced rows written by a bulk run, counted with SQL."""
    conn = await pg_budget.connect(pg_url)
    try:
        await conn.execute(f'SET search_path TO "{schema}"')
        rows = await conn.fetch(
            "SELECT instance_id, count(*) AS n FROM flowlock_history"
            " WHERE request_id LIKE 'bulk:%' AND event = 'flowlock:force' GROUP BY instance_id"
        )
    finally:
        await conn.close()
    return Counter({r["instance_id"]: r["n"] for r in rows})


def _command(pg_url: str, schema: str) -> list[str]:
    return [
        sys.executable, "-m", "flowlock", "admin", "force", "--to", "held",
        "--reason", "stuck after the outage", "--actor", "ops", "--workflow", METER,
        "--app", "bulk_kit:workflows", "--database-url", pg_url, "--schema", schema,
        "--batch", "100", "--concurrency", "4", "--yes", "--json",
    ]  # fmt: skip


async def test_a_killed_cli_run_run_again_forces_the_rest_once(pg_url: str, pg_schema: str) -> None:
    store = PostgresStore(pg_url, schema=pg_schema, pool_size=8)
    async with flowlock.Engine(store) as engine:
        await engine.register(meter())
        gate = asyncio.Semaphore(16)

        async def make(i: int) -> None:
            async with gate:
                await engine.create(METER, instance_id=f"k-{i:05d}", data={"n": 0})

        await asyncio.gather(*(make(i) for i in range(N)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path])}
        command = _command(pg_url, pg_schema)
        first = await asyncio.create_subprocess_exec(
            *command, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        deadline = time.monotonic() + 60
        while sum((await _bulk_rows(pg_url, pg_schema)).values()) < N // 4:
            assert first.returncode is None, (await first.communicate())[1].decode()[-2000:]
            assert time.monotonic() < deadline, "the first run forced too few in 60 s"
            await asyncio.sleep(0.02)
        first.send_signal(signal.SIGKILL)
        await first.wait()
        done_before = sum((await _bulk_rows(pg_url, pg_schema)).values())
        assert N // 4 <= done_before < N, done_before

        again = await asyncio.create_subprocess_exec(
            *command, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, err = await asyncio.wait_for(again.communicate(), 120)
        assert again.returncode == 0, err.decode()[-2000:]
        report = json.loads(out)
        assert report["failed"] == {} and report["stopped"] is None
        # Every instance is selected again (no state filter): what the killed run forced is
        # replayed under the same request id, the rest forced now.
        assert (report["matched"], report["applied"]) == (N, N - done_before)
        assert (report["skipped"], report["replayed"]) == (0, done_before)
        assert report["note"].startswith(f"{done_before} were done earlier by operation ")
        rows = await _bulk_rows(pg_url, pg_schema)
        ids = [f"k-{i:05d}" for i in range(N)]
        assert rows == Counter(dict.fromkeys(ids, 1))
        pairs = [(await engine.get(i), await engine.history(i)) for i in ids]
        verdict = check_many(pairs, initial_state="open", expected_applied=1)
        assert verdict.ok, verdict.violations[:10]
        assert {i.state for i, _ in pairs} == {"held"}
        (entry,) = pairs[0][1]
        assert entry.request_id == f"bulk:{report['operation_id']}:{ids[0]}"
