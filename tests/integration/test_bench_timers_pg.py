"""The benchmark's deadline scenario and timers section on PostgreSQL, at --quick size.

Four worker processes' engines fire the expiries while their callers approve the same
instances; then the firing lag with one and with four engines, and the idle cost in a database
of the bench's own. Only the shape and the correctness figures are asserted (one outcome per
instance, the checker clean, nothing left behind), never a speed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

import pg_budget
from flowlock.bench import BenchConfig, run_bench
from flowlock.bench.report import to_json
from flowlock.bench.scenarios.deadline import LAG_AFTER, LAG_WORKFLOW, deadline_workflow
from flowlock.bench.servers import DatabaseServer, probe
from flowlock.bench.timer_load import arm
from flowlock.core.errors import InvalidInput

pytestmark = pytest.mark.postgres

INSTANCES = 200  # --quick: 100 callers x 2 ops
ENGINES = 4


async def _left(url: str, schema: str) -> list[str]:
    """The run's schemas and databases still on the server."""
    conn = await pg_budget.connect(url)
    try:
        schemas = await conn.fetch(
            "SELECT nspname FROM pg_namespace WHERE nspname LIKE $1", f"{schema}%"
        )
        bases = await conn.fetch(
            "SELECT datname FROM pg_database WHERE datname LIKE $1", f"{schema}%"
        )
    finally:
        await conn.close()
    return [r[0] for r in schemas] + [r[0] for r in bases]


def _check_race(race: dict[str, Any], result: dict[str, Any]) -> None:
    """Every instance ended in exactly one outcome, written by the one who was told so."""
    assert race["engines"] == ENGINES
    assert race["instances"] == INSTANCES
    assert race["unresolved"] == 0
    assert race["approved"] + race["rejected"] == INSTANCES
    assert race["exactly_one"] is True
    assert race["checker"] == {"ok": True, "violations": 0}
    assert race["left_armed"] == 0
    assert len(race["firings_by_engine"]) == ENGINES
    # Every approval answered applied is an approved instance; the rest lost to the expiry.
    assert result["applied"] == race["approved"]
    assert result["refused"] + result["failed"] == race["rejected"]
    assert result["calls"] == INSTANCES
    assert result["verdict"] == {"ok": True, "violations": []}
    assert race["expiry_lag"]["count"] == race["rejected"]
    assert race["span_s"] > 0 and race["resolved_per_s"] > 0


@pytest.mark.slow
async def test_quick_deadline_race_lag_and_idle_cost(pg_url: str) -> None:
    """A --quick deadline run with the floor and two strategies: the floor is left out (no timer
    service), each race ends every instance approved or rejected exactly once with the checker
    clean, the lag runs apply every firing once with one and with four engines, the idle cost
    is counted by kind in a database of its own, and no schema or database is left."""
    config = BenchConfig(
        database_url=pg_url,
        scenarios=("deadline",),
        strategies=("raw", "optimistic", "pessimistic"),
        quick=True,
        seed=11,
        pool_size=8,
    )
    try:
        await probe(DatabaseServer(pg_url, "external"), config)
    except InvalidInput as exc:
        pytest.skip(f"a quick deadline run does not fit the server's free connections: {exc}")
    report = await run_bench(config)
    doc = to_json(report)
    assert report.ok, doc["timers"]
    assert doc["ok"] is True
    pairs = [(r["scenario"], r["strategy"]) for r in doc["results"]]
    assert pairs == [("deadline", "optimistic"), ("deadline", "pessimistic")]
    timers = doc["timers"]
    assert [r["strategy"] for r in timers["race"]] == ["optimistic", "pessimistic"]
    for race, result in zip(timers["race"], doc["results"], strict=True):
        _check_race(race, result)

    assert [lag["engines"] for lag in timers["lag"]] == [1, ENGINES]
    for lag in timers["lag"]:
        assert lag["armed"] == 2000 and lag["armed_by"] == "sql"
        assert lag["checker"] == {"ok": True, "violations": 0}
        assert len(lag["firings_by_engine"]) == lag["engines"]
        # 0.5 s at 1,000 a second fell due in the window: each fired, or missed if late.
        assert abs(lag["fired"] + lag["missed"] - 500) <= 1
        assert lag["fired_total"] >= lag["fired"]
        assert 0 <= lag["p50_ms"] <= lag["p99_ms"] <= lag["max_ms"]

    idle = timers["idle"]
    assert idle is not None, timers["notes"]
    assert idle["database"] == "dedicated" and idle["armed"] == 2000
    assert idle["window_s"] > 0
    assert set(idle["statements_by_kind"]) == {"timers", "outbox", "listen", "escalations", "other"}
    assert idle["scans_per_s"] is None  # --quick settles too briefly to count them
    assert timers["targets"]["lag_p99_ms"] == 100.0

    assert await _left(pg_url, doc["args"]["schema"]) == []


async def test_bulk_arming_writes_what_the_store_writes(
    pg_url: str, pg_schema: str, pg_engine_factory: Callable[..., Any]
) -> None:
    """The lag measurement's one-statement arming writes the rows the store's own create writes
    (instance and timer, column for column), but for the creation time, set `after` before the
    due time; the engine sees the bulk-armed instance and its timer as it sees its own."""
    engine = await pg_engine_factory(pool_size=2, timers=False)
    await engine.register(deadline_workflow(LAG_AFTER, LAG_WORKFLOW))
    await engine.create(LAG_WORKFLOW, instance_id="made-0")
    conn = await pg_budget.connect(pg_url)
    try:
        await conn.execute(f'SET search_path TO "{pg_schema}"')
        before = time.time()
        first, committed = await arm(conn, "bulk-", 3, 5.0, 10.0)
        assert before - 1 < first - 5.0 <= committed + 1
        instances = await conn.fetch(
            "SELECT * FROM flowlock_instances WHERE id IN ('made-0', 'bulk-0', 'bulk-2')"
            " ORDER BY id"
        )
        timers = await conn.fetch(
            "SELECT *, extract(epoch FROM due_at)::float8 AS due, extract(epoch FROM due_at -"
            " (SELECT created_at FROM flowlock_instances i WHERE i.id = t.instance_id))::float8"
            " AS after FROM flowlock_timers t WHERE instance_id IN ('made-0', 'bulk-0', 'bulk-2')"
            " ORDER BY instance_id"
        )
    finally:
        await conn.close()
    by_id = {r["id"]: dict(r) for r in instances}
    made = by_id.pop("made-0")
    for row in by_id.values():
        assert row["created_at"] == row["updated_at"]
        for column in set(made) - {"id", "created_at", "updated_at"}:
            assert row[column] == made[column], column
    armed = {r["instance_id"]: dict(r) for r in timers}
    own = armed.pop("made-0")
    for row in armed.values():
        for column in set(own) - {"instance_id", "due_at", "due"}:
            assert row[column] == own[column], column
    assert own["after"] == pytest.approx(LAG_AFTER)
    # Due from `first`, ten a second.
    assert armed["bulk-0"]["due"] == pytest.approx(first, abs=1e-3)
    assert armed["bulk-2"]["due"] == pytest.approx(first + 0.2, abs=1e-3)
    for iid in ("bulk-0", "bulk-2"):
        got = await engine.get(iid)
        assert (got.state, got.version, got.stay_version) == ("pending", 1, 1)
        (timer,) = await engine.timers(iid)
        assert (timer.event, timer.stay, timer.n, timer.workflow) == ("expire", 1, 0, LAG_WORKFLOW)
