"""``flowlock bench --http`` without any server: what the config accepts and refuses, how the
connections are shared with the service, the service's URL and workflows, how the service's
answers are recorded, and the report's HTTP rows (their aim against the in-process twin, the
JSON, the table at 80 and 120 columns). The run itself is in tests/integration/test_bench.py."""

from __future__ import annotations

import io
import time
from dataclasses import replace
from typing import Any

import pytest
from rich.console import Console

# pytest puts this directory on sys.path (rootdir-less test modules): the same hand-built results.
from test_bench_report import _floor, _report, _result
from typer.testing import CliRunner

import flowlock
from flowlock.bench import BenchConfig, BenchReport
from flowlock.bench import runner as bench_runner
from flowlock.bench.config import HTTP_SCENARIOS, HTTP_STRATEGIES, HTTP_WORKERS, service_pool
from flowlock.bench.extend import Lab
from flowlock.bench.measure import RemoteFailure, timed_call
from flowlock.bench.progress import Progress
from flowlock.bench.report import aims, render, to_json
from flowlock.bench.report.aims import (
    HTTP_AIM,
    HTTP_RATE_AIM,
    HTTP_RATE_FACTOR,
    Overhead,
    overhead,
)
from flowlock.bench.report.cells import ELLIPSIS
from flowlock.bench.results import HTTP, CallSpec, ScenarioResult, failures
from flowlock.bench.scenarios import SCENARIOS, Fired
from flowlock.bench.servers import fit_pool, with_service
from flowlock.checker import DOUBLE_APPLY, Verdict, Violation
from flowlock.cli import app
from flowlock.core.diagram import load_workflows
from flowlock.core.errors import InvalidInput
from flowlock_lab.http import SERVICE_APP, failure, service_url
from flowlock_lab.http_app import workflows

# -- the config ----------------------------------------------------------------------------------


def test_http_runs_storm_hot_and_spread_with_the_engine_strategies_by_default() -> None:
    """--http alone: the three scenarios whose calls are plain fires, with the strategies the
    service has without a lock backend, one service worker; every pair warms up, also under
    --quick (both transports are compared warm)."""
    config = BenchConfig(http=True, quick=True)
    config.validate()
    assert config.scenario_names() == HTTP_SCENARIOS == ("storm", "hot", "spread")
    assert config.strategy_names() == HTTP_STRATEGIES == ("optimistic", "pessimistic", "adaptive")
    assert config.http_workers == HTTP_WORKERS == 1
    assert config.warms_up()
    assert not BenchConfig(quick=True).warms_up()
    assert not BenchConfig().http
    assert BenchConfig(http=True, scenarios=("hot",), strategies=("pessimistic",)).scenario_names()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (BenchConfig(http=True, scenarios=("countersign",)), "not 'countersign'"),
        (BenchConfig(http=True, scenarios=("storm", "cluster")), "worker processes of its own"),
        (BenchConfig(http=True, scenarios=("singleton",)), "a scheduled job"),
        (BenchConfig(http=True, strategies=("raw",)), "no engine to put behind HTTP"),
        (BenchConfig(http=True, strategies=("distributed",)), "scratch namespace"),
        (BenchConfig(http=True, strategies=("distributed-advisory",)), "no advisory-lock"),
        (BenchConfig(http=True, batching=False), "drop --batching off"),
        (BenchConfig(http=True, http_workers=0), "must be 1 to 64, not 0"),
        (BenchConfig(http="yes"), "http must be True or False"),  # type: ignore[arg-type]
    ],
)
def test_http_refuses_what_cannot_go_through_the_service(config: BenchConfig, message: str) -> None:
    """Each pair that cannot be made HTTP calls is refused before any I/O, saying why and what
    to drop."""
    with pytest.raises(InvalidInput) as caught:
        config.validate()
    assert message in str(caught.value)


def test_the_service_shares_the_pool_and_both_fit_the_server() -> None:
    """The service gets as many connections as the in-process pool, shared out over its
    workers; they stay open all run, beside each in-process pair and each HTTP pair's admin
    session, and the pool is lowered until both fit."""
    assert service_pool(100, 1) == 100
    assert service_pool(100, 2) == 50
    assert service_pool(41, 2) == 21
    assert service_pool(1, 4) == 1
    assert with_service(100, 100, 1) == 200
    assert with_service(41, 41, 2) == 42 + 41
    assert with_service(3, 3, 1) == 3 + 10  # the admin session of an HTTP pair is larger
    # A server with max_connections=100 and ~85 free: a pool of 42, the service's 42 beside it.
    assert fit_pool(100, 85, lambda pool: with_service(pool, pool, 1)) == 42


def test_the_service_url_puts_the_scratch_schema_on_the_search_path() -> None:
    """The service's connections find the run's tables: the schema rides in the URL as a
    server setting, any other query parameter (and the password) kept, a given search_path
    replaced."""
    assert service_url("postgresql://u:pw@h:5432/db", "flowlock_bench_ab") == (
        "postgresql://u:pw@h:5432/db?search_path=flowlock_bench_ab"
    )
    assert service_url("postgresql://u@h/db?sslmode=disable&search_path=public", "s") == (
        "postgresql://u@h/db?sslmode=disable&search_path=s"
    )


def test_the_service_serves_the_workflows_of_the_scenarios() -> None:
    """``--app flowlock_lab.http_app:workflows`` loads (as flowlock serve loads it) exactly
    the definitions the in-process sessions of storm, hot and spread register."""
    served = load_workflows(SERVICE_APP)
    assert [wf.name for wf in served] == [wf.name for wf in workflows()] == ["approval", "counter"]
    for name in HTTP_SCENARIOS:
        for wf in SCENARIOS[name].workflows(BenchConfig().params_for(SCENARIOS[name])):
            mine = next(w for w in served if w.name == wf.name)
            assert mine.states == wf.states
            assert set(mine.transitions) == set(wf.transitions)


# -- the service's answers -----------------------------------------------------------------------


def test_a_problem_is_recorded_as_the_flowlock_error_it_names() -> None:
    """A problem document names its flowlock error; the report counts it under that name, as
    the in-process rows do, a workflow's refusal as refused, with the attempts it reports."""
    lost = failure(
        503,
        {
            "type": "urn:flowlock:problem:conflict-retries-exhausted",
            "status": 503,
            "detail": "lost the race 3 times",
            "attempts": 3,
        },
    )
    assert (lost.error, lost.refused, lost.attempts) == ("ConflictRetriesExhausted", False, 3)
    assert "HTTP 503: lost the race 3 times" in str(lost)
    rule = failure(422, {"type": "urn:flowlock:problem:guard-rejected", "detail": "no stock"})
    assert (rule.error, rule.refused, rule.attempts) == ("GuardRejected", True, 1)
    moved = failure(409, {"type": "urn:flowlock:problem:transition-not-allowed"})
    assert (moved.error, moved.refused) == ("TransitionNotAllowed", True)
    busy = failure(503, {"type": "urn:flowlock:problem:lock-timeout", "attempts": "x"})
    assert (busy.error, busy.refused, busy.attempts) == ("LockTimeout", False, 1)
    proxy = failure(502, "<html>bad gateway</html>")
    assert (proxy.error, proxy.refused) == ("HTTP 502", False)


class _Answers:
    """A session whose calls end as the service's answers would make them (the HTTP path is
    run for real by tests/integration/test_bench.py)."""

    strategy = "optimistic"

    def __init__(self, raised: Exception) -> None:
        self.raised = raised

    async def fire(self, call: CallSpec) -> Fired:
        raise self.raised


@pytest.mark.parametrize(
    ("raised", "kind", "error", "attempts"),
    [
        (RemoteFailure("ConflictRetriesExhausted", "lost", attempts=3), "failed", "CRE", 3),
        (RemoteFailure("GuardRejected", "no stock", refused=True), "refused", "GuardRejected", 1),
        (RemoteFailure("HTTP 502", "bad gateway", attempts=0), "failed", "HTTP 502", 1),
    ],
)
async def test_timed_call_records_a_remote_failure_like_a_local_one(
    raised: RemoteFailure, kind: str, error: str, attempts: int
) -> None:
    """A call the service answered with a problem is a measurement: refused or failed, under
    the error's own name, never a crash of the bench."""
    call = CallSpec("i", "approve", actor="a")
    got = await timed_call(SCENARIOS["storm"], _Answers(raised), call, time.perf_counter())  # type: ignore[arg-type]
    expected = "ConflictRetriesExhausted" if error == "CRE" else error
    assert (got.kind, got.error, got.attempts) == (kind, expected, attempts)
    assert got.latency >= 0


# -- the report ----------------------------------------------------------------------------------


def _http(strategy: str, **changes: object) -> ScenarioResult:
    """An HTTP result: no sampler figures (the service's connections are its own)."""
    figures: dict[str, object] = {
        "transport": HTTP,
        "peak_connections": 0,
        "peak_active_connections": 0,
        "open_connections": 0,
        "lock_wait_ms": 0.0,
        "row_lock_wait_s": 0.0,
        "lease_wait_s": 0.0,
    }
    return _result(strategy, **{**figures, **changes})


def _http_report() -> BenchReport:
    report = _report(
        _floor(),
        _result("optimistic", p99_ms=20.0),
        _http("optimistic", p99_ms=35.0, p50_ms=17.25, calls_per_s=4321.0),
        _result("pessimistic", p99_ms=10.0, errors={}),
        _http("pessimistic", p99_ms=90.0, errors={"LockTimeout": 2}),
    )
    return replace(report, args={**report.args, "http": True, "http_service": {"workers": 1}})


def test_overhead_is_the_http_p99_against_its_twin() -> None:
    """The ratio and the difference of the p99s, and the aim: HTTP p99 <= 1.5 x in-process p99
    + 5 ms, met at the bound itself."""
    found = Overhead(in_process_p99_ms=20.0, http_p99_ms=35.0)
    assert (found.ratio, found.diff_ms, found.limit_ms, found.met) == (1.75, 15.0, 35.0, True)
    assert not Overhead(20.0, 35.001).met
    assert Overhead(0.0, 3.0).ratio is None
    assert Overhead(0.0, 3.0).met  # 3 ms <= 0 x 1.5 + 5 ms
    assert Overhead(10.0, 8.0).diff_ms == -2.0
    twin = _result("optimistic", p99_ms=20.0, calls_per_s=1000.0)
    got = overhead(_http("optimistic", p99_ms=35.0, calls_per_s=500.0), twin)
    assert got == Overhead(20.0, 35.0, 1000.0, 500.0)
    assert overhead(twin, twin) is None  # an in-process result has no overhead
    assert overhead(_http("optimistic"), None) is None


def test_the_rate_aim_is_half_the_in_process_calls_per_s() -> None:
    """HTTP calls/s >= 0.5 x in-process calls/s, met at the bound itself."""
    found = Overhead(20.0, 35.0, in_process_calls_per_s=1000.0, http_calls_per_s=500.0)
    assert (found.rate_ratio, found.rate_floor, found.rate_met) == (0.5, 500.0, True)
    assert not Overhead(20.0, 35.0, 1000.0, 499.9).rate_met
    assert Overhead(20.0, 35.0, 0.0, 10.0).rate_ratio is None
    report = _http_report()
    rate = {(a.strategy, a.what): a for a in aims(report)}["optimistic", HTTP_RATE_AIM]
    twin_rate = next(
        r.calls_per_s for r in report.results if r.strategy == "optimistic" and r.transport != HTTP
    )
    assert (rate.measured, rate.compare, rate.transport) == (4321.0, ">=", HTTP)
    assert rate.target == round(HTTP_RATE_FACTOR * twin_rate, 3)
    assert rate.ok == (rate.target <= 4321.0)


def test_http_results_have_their_own_aims() -> None:
    """An HTTP result is judged on success, violations and the overhead aim against its twin
    (measured: its p99; target: the bound in ms), never against the raw floor; in-process
    results keep the floor's aims."""
    found = {(a.strategy, a.scenario, a.what, a.transport): a for a in aims(_http_report())}
    http_aim = found["optimistic", "storm", HTTP_AIM, HTTP]
    assert (http_aim.measured, http_aim.target, http_aim.ok, http_aim.status) == (
        35.0,
        35.0,
        True,
        "met",
    )
    assert http_aim.compare == "<="
    slow = found["pessimistic", "storm", HTTP_AIM, HTTP]
    assert (slow.measured, slow.target, slow.ok, slow.status) == (90.0, 20.0, False, "not met")
    assert ("optimistic", "storm", "success", HTTP) in found
    assert ("optimistic", "storm", "violations", HTTP) in found
    assert not [k for k in found if k[3] == HTTP and k[2].endswith("_vs_floor")]
    assert ("optimistic", "storm", "p99_vs_floor", "in-process") in found
    assert not [k for k in found if k[3] == "in-process" and k[2] == HTTP_AIM]
    # Without its in-process twin an HTTP result has no overhead aim.
    alone = [a.what for a in aims(_report(_http("optimistic")))]
    assert alone == ["success", "violations"]


def test_json_says_each_results_transport_and_the_overhead() -> None:
    """Each result names its transport; an HTTP result has ``vs_in_process`` (its twin's p99,
    the ratio, the difference, the bound and whether it held) and null for what the sampler
    did not measure, and no ratio to the floor; each aim names its transport."""
    doc = to_json(_http_report())
    by_pair = {(r["strategy"], r["transport"]): r for r in doc["results"]}
    local = by_pair["optimistic", "in-process"]
    assert local["vs_in_process"] is None
    assert local["peak_connections"] == 42
    assert local["vs_floor"]["p99"] == 2.0
    remote = by_pair["optimistic", "http"]
    assert remote["vs_in_process"] == {
        "in_process_p99_ms": 20.0,
        "p99_ratio": 1.75,
        "p99_diff_ms": 15.0,
        "aim_limit_ms": 35.0,
        "aim_met": True,
        "in_process_calls_per_s": 1234.568,
        "calls_per_s_ratio": 3.5,
        "rate_aim_floor": 617.284,
        "rate_aim_met": True,
    }
    assert remote["vs_floor"] == {"p99": None, "applied_per_s": None}
    for key in (
        "peak_connections",
        "peak_active_connections",
        "open_connections",
        "lock_wait_ms",
        "row_lock_wait_s",
        "lease_wait_s",
    ):
        assert remote[key] is None, key
    assert remote["calls_per_s"] == 4321.0
    assert by_pair["pessimistic", "http"]["vs_in_process"]["aim_met"] is False
    http_aims = [a for a in doc["aims"] if a["what"] == HTTP_AIM]
    assert [(a["strategy"], a["status"], a["transport"]) for a in http_aims] == [
        ("optimistic", "met", "http"),
        ("pessimistic", "not met", "http"),
    ]
    assert {a["transport"] for a in doc["aims"] if a["what"].endswith("_vs_floor")} == {
        "in-process"
    }


def _rendered(report: BenchReport, width: int) -> str:
    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    render(report, console)
    return console.export_text()


def test_render_shows_the_http_rows_beside_their_twins() -> None:
    """The HTTP results get a table of their own (each row: calls/s, p50, p99, success,
    verdict, the twin's p99, ratio, difference, aim); the results, seed and aims tables keep
    the in-process rows; failed calls say which transport."""
    text = _rendered(_http_report(), 160)
    assert "through HTTP (flowlock serve, 1 worker(s)) against in-process" in text
    row = next(
        line.split()
        for line in text.splitlines()
        if line.split()[:2] == ["storm", "optimistic"] and "4,321" in line
    )
    assert row[2:] == [
        *("4,321", "17.2", "35.0", "99.99", "ok", "20.0", "1.75", "+15.0", "met", "3.50", "met")
    ]
    assert text.count("17.2") == 1  # the HTTP p50: not in the in-process results table
    slow = next(line for line in text.splitlines() if "+80.0" in line)
    assert slow.split()[-4:] == ["not", "met", "1.00", "met"]
    assert "aim: HTTP p99 ≤ 1.5 × in-process p99 + 5 ms" in text
    assert "flowlock bench: 100 callers, in-process, PostgreSQL" in text
    assert "storm/pessimistic (http): LockTimeout × 2" in text
    assert "aims, against the raw floor" in text  # the in-process aims are still shown


@pytest.mark.parametrize("width", [80, 120])
def test_the_http_table_at_80_and_120_columns_has_no_number_cut(width: int) -> None:
    """A full --http matrix (3 scenarios x 3 strategies x 2 transports, figures as long as a
    slow run's, one failed verdict) at 80 and 120 columns: every line fits, nothing is cut,
    and every HTTP figure appears whole, as a word of its own."""
    results: list[ScenarioResult] = []
    bad = Verdict.of([Violation(DOUBLE_APPLY, "instance 'x': twice")] * 12)
    for i, scenario in enumerate(HTTP_SCENARIOS):
        for j, strategy in enumerate(HTTP_STRATEGIES):
            k = i * 10 + j
            results.append(_result(strategy, scenario=scenario, p99_ms=1_000.0 + k))
            results.append(
                _http(
                    strategy,
                    scenario=scenario,
                    calls_per_s=10_000.0 + k,
                    p50_ms=2_000.0 + k,
                    p99_ms=3_000.0 + k,
                    success_pct=50.0 + k,
                    verdict=bad if k == 11 else Verdict(ok=True),
                )
            )
    report = _report(*results)
    report = replace(report, args={**report.args, "http": True, "http_service": {"workers": 1}})
    text = _rendered(report, width)
    assert ELLIPSIS not in text
    assert max(len(line) for line in text.splitlines()) <= width
    words = text.split()
    for r in results:
        if r.transport != HTTP:
            continue
        twin = 1_000.0 + (r.p99_ms - 3_000.0)
        shown = [
            f"{r.calls_per_s:,.0f}",
            f"{r.p50_ms:,.1f}",
            f"{r.p99_ms:,.1f}",
            f"{r.success_pct:.1f}",
            f"{twin:,.1f}",
            f"{r.p99_ms / twin:.2f}",
            f"{r.p99_ms - twin:+,.1f}",
        ]
        for figure in shown:
            assert figure in words, (r.scenario, r.strategy, figure)
    assert words.count("FAIL") == 1
    assert text.count("aim: HTTP p99") == 1


def test_failures_name_the_transport() -> None:
    """A failed HTTP verdict's line says it went through HTTP."""
    bad = Verdict.of([Violation(DOUBLE_APPLY, "instance 'x': twice")])
    lines = failures(_report(_result("optimistic"), _http("optimistic", verdict=bad)))
    assert lines[0] == "storm/optimistic (http): 1 violation(s): 1 double-apply"


# -- the command line ----------------------------------------------------------------------------


def _empty_report(config: BenchConfig) -> BenchReport:
    return BenchReport(
        flowlock_version=flowlock.__version__,
        postgres_version="18.0",
        redis_version=None,
        cores=2,
        args={"workers": config.workers, "http": config.http},
        results=(),
        loop="asyncio",
        database="embedded",
        pool_size=1,
        duration_s=0.1,
    )


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    """A runner whose environment names no server, and whose runs record their config."""
    monkeypatch.delenv("FLOWLOCK_DATABASE_URL", raising=False)
    monkeypatch.delenv("FLOWLOCK_REDIS_URL", raising=False)
    return CliRunner()


def test_the_command_line_passes_http_to_the_run(
    cli: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--http` reaches the config; a scenario it cannot run is one error line, exit 1,
    before anything starts; it means nothing to --soak (usage error); --help explains it."""
    seen: list[BenchConfig] = []

    def run(
        config: BenchConfig, progress: Progress | None = None, lab: Lab | None = None
    ) -> BenchReport:
        seen.append(config)
        return _empty_report(config)

    monkeypatch.setattr(bench_runner, "run", run)
    result = cli.invoke(app, ["bench", "--quick", "--http"])
    assert result.exit_code == 0, result.output
    assert [c.http for c in seen] == [True]
    refused = cli.invoke(app, ["bench", "--http", "-s", "singleton"])
    assert refused.exit_code == 1
    assert "--http runs storm, hot, spread" in refused.output
    assert len(seen) == 1
    soaked = cli.invoke(app, ["bench", "--soak", "5", "--http"])
    assert soaked.exit_code == 2
    assert "--http" in soaked.output
    shown: Any = cli.invoke(app, ["bench", "--help"]).stdout
    assert "--http" in shown
