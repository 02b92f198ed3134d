"""What the cross-process constraint tests share: starting the workers
(constraint_worker.py) through the start gate, reading their reports, the checker run both
ways, and SQL of the tests' own on the test's schema.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from proc_worker import Gate, Phase

import flowlock
import pg_budget
from constraint_kit import Rows, read_pg, read_sqlite, workflows
from flowlock._inspect import check_instances
from flowlock.stores.postgres import PostgresStore


@dataclass(frozen=True)
class Db:
    """Where a test's rows are: the URL `flowlock check` takes, the schema, how to read them."""

    url: str
    schema: str | None
    rows: Callable[[], Awaitable[Rows]]

    @classmethod
    def pg(cls, url: str, schema: str) -> Db:
        return cls(url, schema, lambda: read_pg(url, schema))

    @classmethod
    def lite(cls, path: Path) -> Db:
        return cls(f"sqlite:///{path}", None, lambda: asyncio.to_thread(read_sqlite, str(path)))


WORKER = Path(__file__).with_name("constraint_worker.py")
PROCESSES = 4
BOUND = 90.0  # the most a test waits for its workers
STRATEGIES = ["optimistic", "pessimistic", "distributed", "adaptive"]
# The storms run under every strategy; their variants (batched, swapped, in the application's
# transactions, rate limits) under one of each way to write: a compare-and-swap, a row lock.
TWO = ["optimistic", "pessimistic"]
# What a storm's callers may be told besides "applied": the key is full, the instance moved
# under them (another process's call got there first), or the instance's own contention.
EXPECTED = {
    "CapacityReached",
    "TransitionNotAllowed",
    "ConflictRetriesExhausted",
    "LockTimeout",
    "LockBusy",
}

SqlHistory = Callable[..., Awaitable[Any]]


async def spawn(confs: Sequence[dict[str, Any]]) -> list[asyncio.subprocess.Process]:
    """Starts a worker per configuration (each then waits at the gate)."""
    return [
        await asyncio.create_subprocess_exec(
            sys.executable,
            str(WORKER),
            json.dumps(conf),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for conf in confs
    ]


async def read_reports(procs: Sequence[asyncio.subprocess.Process]) -> list[dict[str, Any]]:
    """Each worker's report, once it exited 0 (bounded by BOUND)."""
    reports = []
    for proc in procs:
        out, err = await asyncio.wait_for(proc.communicate(), timeout=BOUND)
        assert proc.returncode == 0, err.decode()[-3000:]
        reports.append(json.loads(out.decode().splitlines()[-1]))
    return reports


async def stop(procs: Sequence[asyncio.subprocess.Process]) -> None:
    """Kills the workers still running (a failed test leaves none behind)."""
    for proc in procs:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def run_through_gate(gate: Gate, confs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Runs the workers through one gate; their reports, once their phases overlapped."""
    procs = await spawn(confs)
    try:
        await gate.open_when_ready(procs)
        reports = await read_reports(procs)
    finally:
        await stop(procs)
    gate.assert_overlapped()
    return reports


def total(reports: Sequence[dict[str, Any]], field: str) -> Counter[str]:
    total: Counter[str] = Counter()
    for report in reports:
        total.update(report[field])
    return total


async def checked(
    engine: flowlock.Engine, url: str, schema: str | None, rows: Rows | None = None
) -> dict[str, Any]:
    """The exactly-once checker over the whole database: through the engine, then as the
    command `flowlock check --json` in a process of its own; its report. With `rows` (read
    after the run), both read every slot and rate event the tests' SQL read."""
    report = await check_instances(engine, None)
    assert report.verdict.ok, report.verdict.describe()
    where = ["--database-url", url, *(["--schema", schema] if schema else [])]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "flowlock", "check", "--json", *where,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), timeout=BOUND)
    assert proc.returncode == 0, (out.decode()[-3000:], err.decode()[-3000:])
    found: dict[str, Any] = json.loads(out)
    assert found["instances"] == report.instances, found
    if rows is not None:
        events = (len(rows.log), len(rows.rates))
        assert (report.slot_events, report.rate_events) == events, (report, events)
        assert (found["slot_events"], found["rate_events"]) == events, (found, events)
    return found


def reviewer(data: dict[str, Any]) -> object:
    return data["reviewer"]


async def pg_engine(pg_url: str, pg_schema: str) -> flowlock.Engine:
    engine = await flowlock.Engine(PostgresStore(pg_url, schema=pg_schema, pool_size=2)).open()
    for wf in workflows():
        await engine.register(wf)
    return engine


async def make_reviews(engine: flowlock.Engine, count: int, keys: Sequence[str]) -> list[str]:
    ids = [f"r{n:03}" for n in range(count)]
    for n, iid in enumerate(ids):
        await engine.create("review", instance_id=iid, data={"reviewer": keys[n % len(keys)]})
    return ids


def redis_locks(request: pytest.FixtureRequest, strategy: str) -> dict[str, Any]:
    """The Redis a distributed run's workers lease on, under a namespace of the test's own."""
    if strategy != "distributed":
        return {}
    return {
        "redis_url": request.getfixturevalue("redis_url"),
        "namespace": f"t_{uuid.uuid4().hex[:12]}",
    }


async def forget_locks(locks: dict[str, Any]) -> None:
    """Deletes the Redis keys of a distributed run's namespace."""
    if not locks:
        return
    import redis.asyncio

    client = redis.asyncio.from_url(locks["redis_url"])
    try:
        pattern = f"flowlock:{locks['namespace']}:*"
        keys = [key async for key in client.scan_iter(match=pattern, count=500)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


async def sql(pg_url: str, pg_schema: str, statement: str, *args: Any) -> Any:
    conn = await pg_budget.connect(pg_url)
    try:
        await conn.execute(f'SET search_path TO "{pg_schema}"')
        if statement.lstrip().upper().startswith("SELECT") or "RETURNING" in statement:
            return await conn.fetch(statement, *args)
        return await conn.execute(statement, *args)
    finally:
        await conn.close()


def phase_of(gate: Gate, proc: int) -> Phase:
    raw = json.loads((gate.path / f"phase-{proc}.json").read_text())
    return Phase(raw["proc"], raw["start"], raw["end"])


async def until(probe: Callable[[], Awaitable[bool]], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not await probe():
        assert time.monotonic() < deadline, f"{what}: not within {within} s"
        await asyncio.sleep(0.05)
