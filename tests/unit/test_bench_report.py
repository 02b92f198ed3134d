"""The benchmark's report, without any server: the JSON document's shape, keys and units
(docs/benchmarks.md), the comparisons with the floor and the aims, and the rich tables at several
console widths.
"""

from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from flowlock.bench.report import (
    AIMS,
    aims,
    aims_table,
    floors,
    render,
    result_to_json,
    seed_table,
    to_json,
    vs_floor,
    write_json,
)
from flowlock.bench.results import BenchReport, ScenarioResult
from flowlock.checker import DOUBLE_APPLY, Verdict, Violation

# The documented contract (docs/benchmarks.md): these keys first, in this order.
TOP_KEYS = ["flowlock_version", "postgres_version", "redis_version", "cores", "args", "results"]
RESULT_KEYS = [
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
]


def _result(strategy: str, **changes: object) -> ScenarioResult:
    base = ScenarioResult(
        scenario="storm",
        strategy=strategy,
        workers=100,
        rounds=10,
        calls=1000,
        avg_ms=12.34567,
        p50_ms=10.0,
        p99_ms=30.0,
        max_ms=31.23456,
        success_pct=99.98765,
        attempts_per_call=1.234567,
        calls_per_s=1234.5678,
        applied_per_s=12.3456,
        peak_connections=42,
        peak_active_connections=40,
        double_advanced_rounds=0,
        applied=10,
        idempotent=989,
        refused=0,
        failed=1,
        applied_per_round=(1,) * 10,
        errors={"LockTimeout": 1},
        wall_s=0.81,
        loop="uvloop",
        verdict=Verdict(ok=True),
        lock_wait_ms=3.45678,
        row_lock_wait_s=1.23456,
        lease_wait_s=0.5,
        open_connections=100,
        cpu_us=853.2,
    )
    return replace(base, **changes)  # type: ignore[arg-type]


def _floor(scenario: str = "storm", **changes: object) -> ScenarioResult:
    figures: dict[str, object] = {
        "scenario": scenario,
        "p99_ms": 10.0,
        "applied_per_s": 20.0,
        "success_pct": 100.0,
        "floor": "statement",
        "errors": {},
        "failed": 0,
    }
    return _result("raw", **{**figures, **changes})


def _report(*results: ScenarioResult, redis_version: str | None = "7.0.15") -> BenchReport:
    return BenchReport(
        flowlock_version="0.1.0",
        postgres_version="18.6",
        redis_version=redis_version,
        cores=2,
        args={"workers": 100, "seed": 7, "quick": True},
        results=results,
        loop="uvloop",
        database="embedded",
        pool_size=100,
        duration_s=12.3456,
        notes=("pool lowered from 100 to 90 connections",),
        redis="embedded",
        log=("2 × flowlock: escalating 'x' to pessimistic (and similar)",),
    )


def _full_report() -> BenchReport:
    bad = Verdict.of([Violation(DOUBLE_APPLY, "instance 'x': twice")])
    return _report(
        _floor(),
        _result("optimistic", mean_batch=4.5),
        _result("pessimistic", verdict=bad, double_advanced_rounds=2, mean_batch=1.0),
        _floor("hot", floor="locked"),
        _result("optimistic", scenario="hot", applied_per_s=4.0, success_pct=6.5),
    )


# -- JSON ----------------------------------------------------------------------------------------


def test_json_starts_with_the_documented_keys_in_order() -> None:
    """The document and each result begin with the contract's keys, in the contract's order;
    extras only follow them."""
    doc = to_json(_full_report())
    assert list(doc)[: len(TOP_KEYS)] == TOP_KEYS
    for result in doc["results"]:
        assert list(result)[: len(RESULT_KEYS)] == RESULT_KEYS
    assert doc["results"][0]["scenario"] == "storm"
    assert [r["strategy"] for r in doc["results"]] == [
        "raw",
        "optimistic",
        "pessimistic",
        "raw",
        "optimistic",
    ]


def test_json_environment_figures() -> None:
    """Versions, cores and the arguments are reported as given; the run's ok is every verdict."""
    doc = to_json(_full_report())
    assert doc["flowlock_version"] == "0.1.0"
    assert doc["postgres_version"] == "18.6"
    assert doc["redis_version"] == "7.0.15"
    assert doc["cores"] == 2
    assert doc["args"] == {"workers": 100, "seed": 7, "quick": True}
    assert doc["duration_s"] == 12.346
    assert doc["ok"] is False
    assert doc["notes"] == ["pool lowered from 100 to 90 connections"]
    assert doc["log"] == ["2 × flowlock: escalating 'x' to pessimistic (and similar)"]


def test_json_units_and_rounding() -> None:
    """Latencies in ms to the microsecond, success in % to 3 places, attempts to 4, rates per
    second to 1, seconds to 4: the documented units, rounded."""
    doc = result_to_json(_result("optimistic"), _floor())
    assert doc["workers"] == 100
    assert doc["calls"] == 1000
    assert doc["avg_ms"] == 12.346
    assert doc["p50_ms"] == 10.0
    assert doc["p99_ms"] == 30.0
    assert doc["max_ms"] == 31.235
    assert doc["success_pct"] == 99.988
    assert doc["attempts_per_call"] == 1.2346
    assert doc["calls_per_s"] == 1234.6
    assert doc["applied_per_s"] == 12.3
    assert doc["peak_connections"] == 42
    assert doc["lock_wait_ms"] == 3.457
    assert doc["row_lock_wait_s"] == 1.2346
    assert doc["lease_wait_s"] == 0.5
    assert doc["wall_s"] == 0.81
    assert doc["errors"] == {"LockTimeout": 1}
    assert doc["applied_per_round"] == [1] * 10
    assert doc["open_connections"] == 100
    assert doc["mean_batch"] is None  # no Outcome carried a batch size
    assert doc["cpu_us"] == 853.2
    assert result_to_json(_result("optimistic", cpu_us=None))["cpu_us"] is None
    assert result_to_json(_result("optimistic", mean_batch=12.34567))["mean_batch"] == 12.346


def test_json_verdict_is_ok_and_its_violations() -> None:
    """The verdict is ``{ok, violations}``, each violation with kind, message and version."""
    bad = Verdict.of([Violation(DOUBLE_APPLY, "instance 'x': twice", 3)])
    assert result_to_json(_result("a"))["verdict"] == {"ok": True, "violations": []}
    assert result_to_json(_result("a", verdict=bad))["verdict"] == {
        "ok": False,
        "violations": [{"kind": "double-apply", "message": "instance 'x': twice", "version": 3}],
    }


def test_json_compares_each_result_with_the_floor_of_its_scenario() -> None:
    """``vs_floor`` holds p99 and applied/s as multiples of the same scenario's raw result; the
    floor itself, and a scenario without one, have None."""
    doc = to_json(_full_report())
    by_pair = {(r["scenario"], r["strategy"]): r for r in doc["results"]}
    assert by_pair["storm", "optimistic"]["vs_floor"] == {"p99": 3.0, "applied_per_s": 0.617}
    assert by_pair["hot", "optimistic"]["vs_floor"] == {"p99": 3.0, "applied_per_s": 0.2}
    assert by_pair["storm", "raw"]["vs_floor"] == {"p99": None, "applied_per_s": None}
    assert by_pair["storm", "raw"]["floor"] == "statement"
    assert by_pair["storm", "optimistic"]["floor"] is None
    alone = to_json(_report(_result("optimistic")))
    assert alone["results"][0]["vs_floor"] == {"p99": None, "applied_per_s": None}
    assert alone["floors"] == {}


def test_json_names_each_floor() -> None:
    """``floors`` says, per scenario, how the raw floor did its calls."""
    doc = to_json(_full_report())
    assert doc["floors"] == {
        "storm": {
            "strategy": "raw",
            "method": "statement",
            "description": "one conditional UPDATE",
        },
        "hot": {
            "strategy": "raw",
            "method": "locked",
            "description": "row-locked read-modify-write transaction",
        },
    }


def test_write_json_round_trips(tmp_path: Path) -> None:
    """The file holds exactly the document, indented, with a trailing newline."""
    report = _full_report()
    path = tmp_path / "bench.json"
    write_json(report, path)
    text = path.read_text(encoding="utf-8")
    assert text.endswith("}\n")
    written = json.loads(text)
    expected = to_json(report)
    assert written == json.loads(json.dumps(expected))


# -- the floor and the aims ----------------------------------------------------------------------


def test_floors_and_ratios() -> None:
    """The floor per scenario is its raw result; ratios are mine / floor's, None on a 0 floor."""
    report = _full_report()
    assert {s: r.strategy for s, r in floors(report).items()} == {"storm": "raw", "hot": "raw"}
    ratios = vs_floor(_result("optimistic"), _floor())
    assert ratios["p99"] == pytest.approx(3.0)
    assert ratios["applied_per_s"] == pytest.approx(12.3456 / 20.0)
    assert vs_floor(_result("x"), _floor(p99_ms=0.0))["p99"] is None
    assert vs_floor(_result("x"), None) == {"p99": None, "applied_per_s": None}


def test_aims_check_success_violations_and_ratios() -> None:
    """Each flowlock strategy: 100 % success, no violations, and every ratio aim of the
    scenarios it ran (storm p99 at most 0.2x the floor's; hot applied/s at least 12x and p99 at
    most 0.25x); the floor itself is not judged."""
    found = {(a.strategy, a.scenario, a.what): a for a in aims(_full_report())}
    assert not any(strategy == "raw" for strategy, _, _ in found)
    success = found["optimistic", "storm", "success"]
    assert (success.target, success.measured, success.ok) == (100.0, 99.98765, False)
    assert found["pessimistic", "storm", "violations"].measured == 1
    assert not found["pessimistic", "storm", "violations"].ok
    p99 = found["optimistic", "storm", "p99_vs_floor"]
    assert (p99.target, p99.measured, p99.ok, p99.status) == (0.2, 3.0, False, "not met")
    hot = found["optimistic", "hot", "applied_per_s_vs_floor"]
    assert (hot.target, hot.measured, hot.ok) == (12.0, 0.2, False)
    assert found["optimistic", "hot", "p99_vs_floor"].target == 0.25
    assert found["optimistic", "hot", "applied_per_s_vs_floor"].to_dict() == {
        "strategy": "optimistic",
        "scenario": "hot",
        "what": "applied_per_s_vs_floor",
        "target": 12.0,
        "measured": 0.2,
        "ok": False,
        "compare": ">=",
        "status": "not met",
        "transport": "in-process",
    }


def _ratio_aims(report: BenchReport) -> dict[tuple[str, str, str], tuple[float, float, str]]:
    """(strategy, scenario, what) -> (target, measured, status) for every ratio aim."""
    return {
        (a.strategy, a.scenario, a.what): (a.target, a.measured or 0.0, a.status)
        for a in aims(report)
        if a.what.endswith("_vs_floor")
    }


def test_the_aims_are_the_targets_against_the_floor() -> None:
    """Every scenario's targets (issue 26): storm p99 <= 0.2x and hot applied/s >= 12x for every
    strategy; hot p99 <= 0.25x; countersign and inventory applied/s >= 3x; spread and cluster
    applied/s >= 1x for every strategy, leases included; singleton applied/s >= 1x (distributed
    0.5x). A p99 at or under its target is met, an applied/s at or over it."""
    assert [(s.scenario, s.metric, s.target, s.distributed) for s in AIMS] == [
        ("storm", "p99", 0.2, 0.2),
        ("hot", "applied_per_s", 12.0, 12.0),
        ("hot", "p99", 0.25, 0.25),
        ("countersign", "applied_per_s", 3.0, 3.0),
        ("inventory", "applied_per_s", 3.0, 3.0),
        ("spread", "applied_per_s", 1.0, 1.0),
        ("cluster", "applied_per_s", 1.0, 1.0),
        ("singleton", "applied_per_s", 1.0, 0.5),
    ]
    # Floors: p99 10 ms, 20 applied/s.
    report = _report(
        _floor(),
        _result("optimistic", p99_ms=2.0),
        _result("distributed-redis", p99_ms=1.9),
        _result("distributed-advisory", p99_ms=2.1),
        _floor("hot", floor="locked"),
        _result("pessimistic", scenario="hot", applied_per_s=240.0, p99_ms=2.5),
        _result("adaptive", scenario="hot", applied_per_s=239.0, p99_ms=2.6),
        _floor("countersign", floor="locked"),
        _result("pessimistic", scenario="countersign", applied_per_s=60.0),
        _floor("inventory", floor="locked"),
        _result("pessimistic", scenario="inventory", applied_per_s=59.0),
        _floor("spread", floor="cas"),
        _result("optimistic", scenario="spread", applied_per_s=20.0),
        _result("distributed-redis", scenario="spread", applied_per_s=19.0),
        _floor("cluster", floor="cas"),
        _result("adaptive", scenario="cluster", applied_per_s=19.0),
        _result("distributed-advisory", scenario="cluster", applied_per_s=20.0),
        _floor("singleton", floor="claim"),
        _result("optimistic", scenario="singleton", applied_per_s=20.0),
        _result("distributed-redis", scenario="singleton", applied_per_s=9.0),
    )
    found = _ratio_aims(report)
    assert found == {
        ("optimistic", "storm", "p99_vs_floor"): (0.2, 0.2, "met"),
        ("distributed-redis", "storm", "p99_vs_floor"): (0.2, pytest.approx(0.19), "met"),
        ("distributed-advisory", "storm", "p99_vs_floor"): (0.2, pytest.approx(0.21), "not met"),
        ("pessimistic", "hot", "applied_per_s_vs_floor"): (12.0, 12.0, "met"),
        ("pessimistic", "hot", "p99_vs_floor"): (0.25, 0.25, "met"),
        ("adaptive", "hot", "applied_per_s_vs_floor"): (12.0, 11.95, "not met"),
        ("adaptive", "hot", "p99_vs_floor"): (0.25, pytest.approx(0.26), "not met"),
        ("pessimistic", "countersign", "applied_per_s_vs_floor"): (3.0, 3.0, "met"),
        ("pessimistic", "inventory", "applied_per_s_vs_floor"): (3.0, 2.95, "not met"),
        ("optimistic", "spread", "applied_per_s_vs_floor"): (1.0, 1.0, "met"),
        ("distributed-redis", "spread", "applied_per_s_vs_floor"): (1.0, 0.95, "not met"),
        ("adaptive", "cluster", "applied_per_s_vs_floor"): (1.0, 0.95, "not met"),
        ("distributed-advisory", "cluster", "applied_per_s_vs_floor"): (1.0, 1.0, "met"),
        ("optimistic", "singleton", "applied_per_s_vs_floor"): (1.0, 1.0, "met"),
        ("distributed-redis", "singleton", "applied_per_s_vs_floor"): (0.5, 0.45, "not met"),
    }
    ok = {(a.strategy, a.scenario, a.what): a.ok for a in aims(report)}
    assert ok["optimistic", "storm", "p99_vs_floor"] is True
    assert ok["adaptive", "hot", "p99_vs_floor"] is False


def test_an_aim_without_a_floor_is_reported_not_judged() -> None:
    """A scenario run without the raw floor (or whose floor measured 0) has its aims listed
    with no ratio, status "no floor" and not ok; scenarios without ratio aims add none."""
    report = _report(
        _floor(applied_per_s=0.0, p99_ms=0.0),
        _result("optimistic"),
        _result("pessimistic", scenario="hot"),
        _result("pessimistic", scenario="singleton"),
        _result("pessimistic", scenario="deadline"),
    )
    found = {(a.strategy, a.scenario, a.what): a for a in aims(report)}
    for key in (
        ("optimistic", "storm", "p99_vs_floor"),
        ("pessimistic", "hot", "p99_vs_floor"),
        ("pessimistic", "hot", "applied_per_s_vs_floor"),
        ("pessimistic", "singleton", "applied_per_s_vs_floor"),
    ):
        aim = found[key]
        assert (aim.measured, aim.ok, aim.status) == (None, False, "no floor"), key
        assert aim.to_dict()["measured"] is None
    assert {w for s, sc, w in found if sc == "deadline"} == {"success", "violations"}
    assert to_json(report)["aims"][2]["status"] == "no floor"


# -- tables --------------------------------------------------------------------------------------


def _rendered(report: BenchReport, width: int) -> str:
    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    render(report, console)
    return console.export_text()


def _rows(text: str) -> dict[tuple[str, str], list[str]]:
    """Each results row's words by (scenario, strategy), in any of the table's forms: one table
    with a scenario column, or one table per scenario titled with its name (the latency table
    of a split pair is left out: its rows are read from the outcome table)."""
    rows: dict[tuple[str, str], list[str]] = {}
    scenario = None
    for line in text.splitlines():
        words = line.split()
        if not words:
            continue
        if line[0] != " " and words[0] in ("storm", "hot", "storm:", "hot:"):
            scenario = None if words[-1] == "latency" else words[0].rstrip(":")
        elif words[0] in ("storm", "hot") and len(words) > 2 and words[2][0].isdigit():
            rows[words[0], words[1]] = words[2:]
        elif scenario and words[0] in ("raw", "optimistic", "pessimistic"):
            rows.setdefault((scenario, words[0]), words[1:])
    return rows


@pytest.mark.parametrize("width", [60, 80, 100, 120, 160, 220])
def test_render_fits_the_console_width(width: int) -> None:
    """At any width every line fits the console, no cell is cut (rich's ellipsis), every pair
    has its row, and the plain lines below the tables are whole."""
    text = _rendered(_full_report(), width)
    assert max(len(line) for line in text.splitlines()) <= width
    assert "…" not in text
    assert list(_rows(text)) == [
        ("storm", "raw"),
        ("storm", "optimistic"),
        ("storm", "pessimistic"),
        ("hot", "raw"),
        ("hot", "optimistic"),
    ]
    assert "storm: one conditional UPDATE" in text
    assert "storm/optimistic: LockTimeout × 1" in text
    assert "note: pool lowered from 100 to 90 connections" in text
    assert text.rstrip().endswith("total 12.3 s")


@pytest.mark.parametrize("width", [60, 80, 100, 160, 220])
def test_render_keeps_the_verdict_column(width: int) -> None:
    """At every width each pair shows its verdict: ok, or FAIL (count)."""
    rows = _rows(_rendered(_full_report(), width))
    assert rows["storm", "optimistic"][-1] == "ok"
    assert "FAIL" in rows["storm", "pessimistic"][-2:]


def test_render_wide_shows_one_row_per_pair_with_its_figures() -> None:
    """At 160 columns each pair is one row: calls, latencies to 0.1 ms, success to 2 places
    when just under 100, attempts, the mean batch size (— for the floor, which has no engine),
    rates with thousands separators, connections, lock wait, CPU µs per call, verdict."""
    lines = _rendered(_full_report(), 160).splitlines()
    row = next(line for line in lines if line.split()[:2] == ["storm", "optimistic"])
    assert row.split()[2:] == [
        "1000",
        "12.3",
        "10.0",
        "30.0",
        "31.2",
        "99.99",
        "1.23",
        "4.50",
        "1,235",
        "12",
        "42",
        "3.5",
        "853",
        "ok",
    ]
    floor = next(line for line in lines if line.split()[:2] == ["storm", "raw"])
    assert floor.split()[9] == "—"
    failed = next(line for line in lines if line.split()[:2] == ["storm", "pessimistic"])
    assert failed.split()[-2:] == ["FAIL", "(1)"]
    header = next(line for line in lines if "scenario" in line and "verdict" in line)
    assert header.split()[:4] == ["scenario", "strategy", "calls", "avg"]
    assert "batch" in header.split()


def test_render_lists_failed_calls_floors_and_the_log() -> None:
    """Below the tables: the floor per scenario, failed calls by error, and what flowlock
    logged."""
    text = _rendered(_full_report(), 160)
    assert "storm: one conditional UPDATE" in text
    assert "hot: row-locked read-modify-write transaction" in text
    assert "storm/optimistic: LockTimeout × 1" in text
    assert "2 × flowlock: escalating 'x' to pessimistic (and similar)" in text


def test_seed_table_only_with_a_storm() -> None:
    """The seed comparison has a row per storm strategy, with the article's figures beside the
    counterpart, and is absent without a storm."""
    console = Console(width=200, record=True, file=io.StringIO(), color_system=None)
    table = seed_table(_full_report())
    assert table is not None
    console.print(table)
    text = console.export_text()
    optimistic = next(line for line in text.splitlines() if line.startswith(" optimistic"))
    seed = ["12", "85", "99.2", "p99", "174", "ms"]
    # The seed table rounds success to one place, like the seed article's own table.
    assert optimistic.split() == ["optimistic", "12.3", "30.0", "100.0", "0/10", *seed]
    pessimistic = next(line for line in text.splitlines() if line.startswith(" pessimistic"))
    assert "2/10" in pessimistic.split()
    assert seed_table(_report(_floor("hot", floor="locked"))) is None


def _aims_rows(report: BenchReport) -> tuple[list[str], dict[str, str]]:
    """The aims table at 200 columns: its header line's words, and each row's line by its aim."""
    console = Console(width=200, record=True, file=io.StringIO(), color_system=None)
    table = aims_table(report)
    assert table is not None
    console.print(table)
    lines = console.export_text().splitlines()
    header = next(line for line in lines if line.startswith(" aim "))
    labels = [
        "below 100 % success",
        "violations",
        "storm p99",
        "hot applied/s",
        "hot p99",
        "spread applied/s",
        "singleton applied/s",
    ]
    rows = {label: line for line in lines for label in labels if line.startswith(f" {label}")}
    return header.split(), rows


def test_aims_table_needs_a_floor() -> None:
    """The aims table has a row per aim (its target beside it) and a column per strategy, each
    cell the ratio to the floor and whether it was met; it is absent without any floor."""
    header, rows = _aims_rows(_full_report())
    assert header == ["aim", "target", "optimistic", "pessimistic"]
    assert rows["storm p99"].split() == [
        "storm", "p99", "×floor", "≤", "0.2×", "3.00×", "not", "met", "3.00×", "not", "met"
    ]  # fmt: skip
    assert "≥ 12×" in rows["hot applied/s"] and "0.20× not met" in rows["hot applied/s"]
    assert "≤ 0.25×" in rows["hot p99"]
    assert "storm 99.99, hot 6.5" in rows["below 100 % success"]
    assert rows["violations"].split()[-2:] == ["0", "1"]
    assert aims_table(_report(_result("optimistic"))) is None


def test_aims_table_says_met_no_floor_and_the_distributed_target() -> None:
    """A met aim reads "met"; a scenario without a floor reads "no floor"; a scenario a
    strategy did not run reads —; the distributed target shows beside the others' only when a
    distributed strategy is in the table."""
    report = _report(
        _floor(),
        _result("optimistic", p99_ms=2.0),
        _result("distributed-redis", p99_ms=12.0),
        _result("optimistic", scenario="spread", applied_per_s=30.0),
        _floor("singleton", floor="claim"),
        _result("distributed-redis", scenario="singleton", applied_per_s=11.0),
    )
    header, rows = _aims_rows(report)
    assert header == ["aim", "target", "optimistic", "distributed-redis"]
    storm = ["≤", "0.2×", "0.20×", "met", "1.20×", "not", "met"]
    assert rows["storm p99"].split()[3:] == storm
    spread = ["≥", "1×", "no", "floor", "—"]
    assert rows["spread applied/s"].split()[3:] == spread
    singleton = ["≥", "1×", "(dist.", "0.5×)", "—", "0.55×", "met"]
    assert rows["singleton applied/s"].split()[3:] == singleton
    lone = _report(_floor("singleton", floor="claim"), _result("optimistic", scenario="singleton"))
    _, alone = _aims_rows(lone)
    assert "dist." not in alone["singleton applied/s"]


def test_the_aims_know_which_bench_strategies_take_a_lease() -> None:
    from flowlock.bench.registry import STRATEGIES
    from flowlock.bench.report.aims import is_distributed

    for name, spec in STRATEGIES.items():
        assert is_distributed(name) == (spec.locks is not None), name
