"""The same guarantees across 4 OS processes sharing one PostgreSQL database.

The processes start together through a gate (each says it is ready, then waits for one go signal)
and every test asserts that their contended phases overlapped, then runs the checker over the
history and counts the history rows with its own SQL."""

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
from flowlock import examples
from flowlock.checker import check
from flowlock.stores.postgres import PostgresStore

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

WORKER = Path(__file__).with_name("proc_worker.py")
PROCESSES = 4
CALLERS = 25  # per process: 100 concurrent callers in all, as in the seed's experiment


SqlHistory = Callable[..., Awaitable[Any]]


async def _run(pg_url: str, schema: str, gate_dir: Path, **cfg: Any) -> list[dict[str, Any]]:
    """Runs the 4 workers through one gate; their results, once their phases are shown to have
    overlapped."""
    gate = Gate(gate_dir, PROCESSES)
    procs = []
    for p in range(PROCESSES):
        conf = {
            "url": pg_url,
            "schema": schema,
            "callers": CALLERS,
            "proc": p,
            "gate": str(gate),
            "quorum": PROCESSES * CALLERS,
            **cfg,
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
        await gate.open_when_ready(procs)
        results: list[dict[str, Any]] = []
        for proc in procs:
            out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
            assert proc.returncode == 0, err.decode()[-2000:]
            results += [json.loads(line) for line in out.decode().splitlines()]
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert len(results) == PROCESSES * CALLERS
    gate.assert_overlapped()
    return results


async def _engine(pg_url: str, schema: str) -> flowlock.Engine:
    engine = await flowlock.Engine(PostgresStore(pg_url, schema=schema, pool_size=2)).open()
    for wf in (
        examples.approval(),
        examples.countersign(PROCESSES * CALLERS),
        examples.inventory(),
    ):
        await engine.register(wf)
    return engine


@pytest.mark.parametrize("strategy", ["optimistic", "pessimistic"])
async def test_storm_across_processes(
    pg_url: str, pg_schema: str, tmp_path: Path, sql_history: SqlHistory, strategy: str
) -> None:
    """4 processes x 25 callers approve one instance at once: exactly one applied overall."""
    engine = await _engine(pg_url, pg_schema)
    try:
        await engine.create("approval", instance_id="req")
        results = await _run(
            pg_url, pg_schema, tmp_path, instance="req", event="approve", strategy=strategy
        )
        assert [r for r in results if "error" in r] == []
        assert sum(r["applied"] for r in results) == 1
        assert sum(r["idempotent"] for r in results) == 99
        history = await engine.history("req")
        verdict = check(
            await engine.get("req"), history, initial_state="pending", expected_applied=1
        )
        assert verdict.ok, verdict.violations
        (await sql_history()).assert_matches({"req": history})
    finally:
        await engine.aclose()


async def test_countersign_across_processes(
    pg_url: str, pg_schema: str, tmp_path: Path, sql_history: SqlHistory
) -> None:
    """100 signers in 4 processes, pessimistic: every signature once, approved once."""
    engine = await _engine(pg_url, pg_schema)
    try:
        await engine.create("countersign", instance_id="doc")
        results = await _run(
            pg_url, pg_schema, tmp_path, instance="doc", event="sign", strategy="pessimistic"
        )
        assert [r for r in results if "error" in r] == []
        assert sum(r["applied"] for r in results) == 100
        final = await engine.get("doc")
        history = await engine.history("doc")
        assert final.state == "approved"
        assert [h.to_state for h in history].count("approved") == 1
        assert sorted(final.data["signers"]) == sorted(r["actor"] for r in results)
        verdict = check(final, history, initial_state="pending", expected_applied=100)
        assert verdict.ok, verdict.violations
        (await sql_history()).assert_matches({"doc": history})
    finally:
        await engine.aclose()


@pytest.mark.parametrize("strategy", ["optimistic", "pessimistic"])
async def test_inventory_across_processes(
    pg_url: str, pg_schema: str, tmp_path: Path, sql_history: SqlHistory, strategy: str
) -> None:
    """100 reserves from 4 processes on stock 50: exactly 50 applied, never below zero."""
    engine = await _engine(pg_url, pg_schema)
    try:
        await engine.create("inventory", instance_id="sku", data={"stock": 50})
        results = await _run(
            pg_url, pg_schema, tmp_path, instance="sku", event="reserve", strategy=strategy,
            max_attempts=300,
        )  # fmt: skip
        applied = [r for r in results if r.get("applied")]
        refused = [r for r in results if r.get("error") == "GuardRejected"]
        assert (len(applied), len(refused)) == (50, 50), results
        final = await engine.get("sku")
        history = await engine.history("sku")
        assert final.data["stock"] == 0
        verdict = check(
            final,
            history,
            expected_applied=50,
            invariant=lambda d: None if d["stock"] >= 0 else "stock below zero",
        )
        assert verdict.ok, verdict.violations
        (await sql_history()).assert_matches({"sku": history})
    finally:
        await engine.aclose()


async def test_duplicate_request_across_processes(
    pg_url: str, pg_schema: str, tmp_path: Path, sql_history: SqlHistory
) -> None:
    """One request id sent by 100 callers in 4 processes is applied once."""
    engine = await _engine(pg_url, pg_schema)
    try:
        await engine.create("inventory", instance_id="sku", data={"stock": 500})
        results = await _run(
            pg_url,
            pg_schema,
            tmp_path,
            instance="sku",
            event="reserve",
            strategy="optimistic",
            request_id="order-42",
            max_attempts=300,
        )
        assert [r for r in results if "error" in r] == []
        assert sum(r["applied"] for r in results) == 1
        assert {(r["version"]) for r in results} == {2}
        final = await engine.get("sku")
        history = await engine.history("sku")
        assert final.data["stock"] == 499
        assert [h.request_id for h in history] == ["order-42"]
        verdict = check(final, history, expected_applied=1)
        assert verdict.ok, verdict.violations
        (await sql_history()).assert_matches({"sku": history})
    finally:
        await engine.aclose()
