"""The benchmark's capacity scenarios on PostgreSQL, small: `-s capacity` with the raw floor and
two engine strategies. Only the correctness figures and the shape are asserted (never above the
limit, proved from the slot log; the history clean; the raw floor's row there), never a speed.
"""

from __future__ import annotations

from typing import Any

import pytest

from flowlock.bench import SCENARIO_ALIASES, BenchConfig, register_scenario, run_bench
from flowlock.bench.capacity_results import OVER_CAPACITY
from flowlock.bench.report import to_json
from flowlock.bench.scenarios import SCENARIOS, CapacityStorm
from flowlock.bench.scenarios.capacity import LIMIT
from flowlock.bench.servers import DatabaseServer, probe
from flowlock.core.errors import InvalidInput

pytestmark = pytest.mark.postgres

WORKERS = 40
CALLERS = 20  # --quick runs one caller per two workers, one instance (or cycle) each
STRATEGIES = ("raw", "optimistic", "pessimistic")
FIELDS = {"limit", "keys", "max_holders", "refusals", "gave_up", "waiters", "jain_fairness"}


async def _run(pg_url: str, scenarios: tuple[str, ...], strategies: tuple[str, ...]) -> Any:
    config = BenchConfig(
        database_url=pg_url,
        scenarios=scenarios,
        strategies=strategies,
        workers=WORKERS,
        quick=True,
        seed=28,
        pool_size=8,
    )
    try:
        await probe(DatabaseServer(pg_url, "external"), config)
    except InvalidInput as exc:
        pytest.skip(f"a small capacity bench does not fit the server's free connections: {exc}")
    return await run_bench(config)


@pytest.mark.slow
async def test_small_capacity_bench_never_exceeds_the_limit(pg_url: str) -> None:
    """`-s capacity` with the raw floor, optimistic and pessimistic: every verdict ok, every
    row's holders proved from its slot log at most the limit, every move applied (none gave
    up), the storm's callers refused and retried, and the raw floor's rows there."""
    report = await _run(pg_url, ("capacity",), STRATEGIES)
    doc = to_json(report)
    rows = {(r["scenario"], r["strategy"]): r for r in doc["results"]}
    assert set(rows) == {(s, t) for s in SCENARIO_ALIASES["capacity"] for t in STRATEGIES}
    for (scenario, strategy), r in rows.items():
        assert r["verdict"] == {"ok": True, "violations": []}, (scenario, strategy)
        assert r.keys() >= FIELDS | {"calls", "p50_ms", "p99_ms", "applied_per_s", "success_pct"}
        assert r["limit"] == LIMIT
        assert 1 <= r["max_holders"] <= LIMIT, (scenario, strategy)
        assert r["workers"] == CALLERS and r["calls"] == 2 * CALLERS
        assert r["applied"] == r["calls"] and r["gave_up"] == 0, (scenario, strategy, r["errors"])
        assert r["log_events"] == r["applied"]  # one slot event per move, in or out
        assert r["applied_per_s"] > 0 and r["success_pct"] == 100.0
    storms = [rows["capacity-storm", strategy] for strategy in STRATEGIES]
    # 20 callers on 5 slots at once: some are refused and retry (how many depends on timing).
    assert sum(storm["refusals"] for storm in storms) > 0
    for storm in storms:
        assert storm["keys"] == 1
        assert storm["waiters"] == 0 or 0 < storm["jain_fairness"] <= 1
    for strategy in STRATEGIES:
        # With Capacity(wait=) the engine holds the enters until a release wakes them: no
        # caller polls, none is refused (the raw floor, without such a wait, still polls).
        waited = rows["capacity-wait", strategy]
        assert waited["keys"] == 1 and waited["waiters"] == CALLERS
        assert waited["jain_fairness"] == 1.0
        if strategy != "raw":
            assert waited["refusals"] == 0, waited
        assert rows["capacity-spread", strategy]["keys"] == 1  # 20 callers: one key per 20
    raw = rows["capacity-storm", "raw"]
    assert raw["floor"] == "counter" and raw["mean_batch"] is None
    assert rows["capacity-storm", "optimistic"]["vs_floor"]["applied_per_s"] > 0
    assert doc["ok"] is True


class _LooseFloor(CapacityStorm):
    """The storm with a raw floor whose counter UPDATE lets a sixth holder in."""

    name = "capacity-storm-loose"
    floor_limit = LIMIT + 1
    hold = 0.2  # long enough that six callers surely hold at once


async def test_a_floor_above_the_limit_fails_the_verdict(pg_url: str) -> None:
    """A raw floor that lets 6 callers hold a key of capacity 5 is caught from its slot log:
    the verdict fails with over-capacity, and max_holders says 6."""
    register_scenario(_LooseFloor())
    try:
        report = await _run(pg_url, ("capacity-storm-loose",), ("raw",))
    finally:
        SCENARIOS.pop("capacity-storm-loose", None)
    (result,) = report.results
    assert result.capacity is not None and result.capacity.max_holders == LIMIT + 1
    assert not result.verdict.ok
    assert {v.kind for v in result.verdict.violations} == {OVER_CAPACITY}
    assert not report.ok
