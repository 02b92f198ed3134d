"""The benchmark's pure arithmetic, without any server: percentiles, latency summaries, one pair's
summary from hand-made rounds, verdict aggregation, and the failed-verdict lines the CLI prints.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest

from flowlock.bench.results import (
    HTTP,
    BenchReport,
    CallResult,
    CallSpec,
    ConnectionStats,
    Judgement,
    Kind,
    Latencies,
    Params,
    RoundPlan,
    RoundRecord,
    ScenarioResult,
    Timed,
    failures,
    mean_batch,
    percentile,
    summarise,
    verdict_of,
)
from flowlock.bench.scenarios import SCENARIOS, Scenario
from flowlock.checker import BROKEN_CHAIN, DOUBLE_APPLY, LOST_UPDATE, Verdict, Violation
from flowlock.core.models import HistoryEntry, Instance

STORM = SCENARIOS["storm"]


def _call(
    actor: str,
    kind: Kind,
    ms: float,
    attempts: int = 1,
    error: str | None = None,
    batch: int | None = None,
) -> CallResult:
    spec = CallSpec("s-1", "approve", actor=actor)
    return CallResult(spec, kind, ms / 1000, attempts, error, batch_size=batch)


def _approved(version: int) -> Instance:
    return Instance("s-1", "approval", "approved", version, {"amount": 120}, "approve")


def _row(version: int, actor: str, from_state: str = "pending") -> HistoryEntry:
    return HistoryEntry(
        "s-1",
        version,
        "approve",
        from_state,
        "approved",
        actor,
        None,
        "optimistic",
        {"amount": 120},
    )


def _storm_round(results: Sequence[CallResult], history: Sequence[HistoryEntry]) -> RoundRecord:
    """One storm round on instance s-1, created pending, with these calls and this history."""
    final = _approved(1 + len(history))
    return RoundRecord(
        RoundPlan({"s-1": "pending"}, tuple(r.call for r in results)),
        tuple(results),
        {"s-1": final},
        {"s-1": list(history)},
    )


def _good_round() -> RoundRecord:
    return _storm_round(
        [
            _call("admin-0", "applied", 10.0),
            _call("admin-1", "idempotent", 20.0, attempts=2),
            _call("admin-2", "failed", 30.0, attempts=3, error="LockTimeout"),
            _call("admin-3", "idempotent", 40.0),
        ],
        [_row(2, "admin-0")],
    )


def _double_round() -> RoundRecord:
    return _storm_round(
        [_call("admin-0", "applied", 5.0), _call("admin-1", "applied", 6.0)],
        [_row(2, "admin-0"), _row(3, "admin-1")],
    )


# -- percentiles and latency -------------------------------------------------------------------


def test_percentile_of_nothing_is_zero() -> None:
    """An empty sample has every percentile at 0 rather than raising."""
    assert percentile([], 50) == 0.0
    assert percentile([], 99) == 0.0


@pytest.mark.parametrize(
    ("pct", "expected"), [(0, 1.0), (1, 1.0), (50, 50.0), (99, 99.0), (99.5, 100.0), (100, 100.0)]
)
def test_percentile_is_nearest_rank(pct: float, expected: float) -> None:
    """Nearest rank on 1..100: the p-th percentile is the ceil(p)-th value, at least the first."""
    ordered = [float(n) for n in range(1, 101)]
    assert percentile(ordered, pct) == expected


def test_percentile_of_a_small_sample_rounds_the_rank_up() -> None:
    """With 3 values, p50 is the 2nd (rank ceil(1.5)) and p99 the 3rd: never interpolated."""
    assert percentile([10.0, 20.0, 30.0], 50) == 20.0
    assert percentile([10.0, 20.0, 30.0], 99) == 30.0
    assert percentile([7.0], 99) == 7.0


def test_latencies_are_milliseconds_of_the_sorted_sample() -> None:
    """Seconds in, milliseconds out: mean, p50, p99 and max, whatever order the calls ended in."""
    summary = Latencies.of([0.030, 0.010, 0.020, 0.040])
    assert summary.avg_ms == pytest.approx(25.0)
    assert summary.p50_ms == pytest.approx(20.0)
    assert summary.p99_ms == pytest.approx(40.0)
    assert summary.max_ms == pytest.approx(40.0)


def test_latencies_of_no_calls_are_zero() -> None:
    """No calls: every latency figure is 0."""
    assert Latencies.of([]) == Latencies(0.0, 0.0, 0.0, 0.0)


# -- one pair's summary ------------------------------------------------------------------------


def test_summarise_counts_outcomes_and_rates() -> None:
    """Outcome counts, success % (failures excluded), attempts per call, and rates per second
    of round wall time come from the recorded calls."""
    timed = Timed([_good_round()], wall=0.5, lease_wait=0.002)
    result = summarise(
        STORM, "optimistic", Params(workers=4), timed, ConnectionStats(), loop="asyncio"
    )
    assert (result.scenario, result.strategy, result.workers) == ("storm", "optimistic", 4)
    assert (result.applied, result.idempotent, result.refused, result.failed) == (1, 2, 0, 1)
    assert result.calls == 4
    assert result.rounds == 1
    assert result.success_pct == pytest.approx(75.0)
    assert result.attempts_per_call == pytest.approx(7 / 4)
    assert result.calls_per_s == pytest.approx(8.0)
    assert result.applied_per_s == pytest.approx(2.0)
    assert result.avg_ms == pytest.approx(25.0)
    assert result.p50_ms == pytest.approx(20.0)
    assert result.max_ms == pytest.approx(40.0)
    assert result.errors == {"LockTimeout": 1}
    assert result.applied_per_round == (1,)
    assert result.wall_s == 0.5
    assert result.loop == "asyncio"


def test_summarise_reports_cpu_microseconds_per_call() -> None:
    """The calling processes' CPU seconds over the rounds, per call, in microseconds; None
    over HTTP (the engine's CPU is then the service's) and for a pair without calls."""
    timed = Timed([_good_round()], wall=0.5, cpu=0.002)
    mine = summarise(STORM, "optimistic", Params(workers=4), timed, ConnectionStats(), loop="a")
    assert mine.cpu_us == pytest.approx(500.0)  # 2 ms over 4 calls
    http = summarise(
        STORM, "optimistic", Params(workers=4), timed, ConnectionStats(), loop="a", transport=HTTP
    )
    assert http.cpu_us is None
    assert summarise(STORM, "raw", Params(), Timed(), ConnectionStats(), loop="a").cpu_us is None


def test_summarise_takes_connections_and_lock_wait_from_the_sampler() -> None:
    """Peak connections come from the sampler; lock wait per call adds the sampled row-lock
    wait and the client-timed lease wait."""
    timed = Timed([_good_round()], wall=0.5, lease_wait=0.002)
    conns = ConnectionStats(peak=7, peak_active=5, peak_open=9, lock_wait=0.006)
    result = summarise(STORM, "pessimistic", Params(workers=4), timed, conns, loop="uvloop")
    assert (result.peak_connections, result.peak_active_connections) == (7, 5)
    assert result.open_connections == 9
    assert result.row_lock_wait_s == pytest.approx(0.006)
    assert result.lease_wait_s == pytest.approx(0.002)
    assert result.lock_wait_ms == pytest.approx(1000 * 0.008 / 4)


def test_summarise_names_the_floor_only_for_the_floor() -> None:
    """The raw floor's result says how it did the calls; a strategy's says nothing."""
    timed = Timed([_good_round()], wall=0.5)
    raw = summarise(STORM, "raw", Params(workers=4), timed, ConnectionStats(), loop="a", floor=True)
    mine = summarise(STORM, "optimistic", Params(workers=4), timed, ConnectionStats(), loop="a")
    assert raw.floor == "statement"
    assert mine.floor is None


def test_summarise_of_no_rounds_is_all_zero_and_ok() -> None:
    """A pair with no timed calls divides by nothing: zero figures, a true verdict."""
    result = summarise(STORM, "raw", Params(), Timed(), ConnectionStats(), loop="asyncio")
    assert (result.calls, result.avg_ms, result.success_pct, result.calls_per_s) == (0, 0, 0, 0)
    assert result.lock_wait_ms == 0.0
    assert result.verdict == Verdict(ok=True)


def test_mean_batch_averages_the_outcomes_only() -> None:
    """The mean batch size counts the calls that got an Outcome (applied or idempotent, with a
    batch size), whatever their kind; failed calls and calls no engine answered do not count."""
    calls = [
        _call("a", "applied", 1.0, batch=40),
        _call("b", "idempotent", 1.0, batch=40),
        _call("c", "idempotent", 1.0, batch=1),
        _call("d", "failed", 1.0, error="LockTimeout"),
        _call("e", "applied", 1.0),  # the raw floor or RunOnce: no Outcome
    ]
    assert mean_batch(calls) == pytest.approx(27.0)
    assert mean_batch([_call("a", "applied", 1.0, batch=1)] * 5) == 1.0
    assert mean_batch([_call("a", "applied", 1.0), _call("b", "failed", 1.0)]) is None
    assert mean_batch([]) is None


def test_summarise_reports_the_mean_batch_over_every_round() -> None:
    """A pair's mean batch size spans all its timed rounds; a pair whose calls carried no
    batch size (the raw floor) has none."""
    first = _storm_round(
        [_call("a", "applied", 1.0, batch=3), _call("b", "idempotent", 1.0, batch=3)],
        [_row(2, "a")],
    )
    second = _storm_round(
        [_call("a", "applied", 1.0, batch=1), _call("b", "idempotent", 1.0, batch=1)],
        [_row(2, "a")],
    )
    timed = Timed([first, second], wall=0.5)
    mine = summarise(STORM, "optimistic", Params(workers=2), timed, ConnectionStats(), loop="a")
    assert mine.mean_batch == pytest.approx(2.0)
    raw = summarise(
        STORM, "raw", Params(workers=4), Timed([_good_round()], 0.5), ConnectionStats(), loop="a"
    )
    assert raw.mean_batch is None


def test_call_results_keep_their_batch_size_through_json() -> None:
    """A worker's call result travels as JSON: its batch size (or None) comes back as is."""
    for call in (_call("a", "applied", 2.0, batch=12), _call("b", "failed", 2.0, error="X")):
        assert CallResult.from_json(call.to_json()) == call


def test_summarise_orders_errors_most_frequent_first() -> None:
    """Failed calls are counted by error class, the most frequent first."""
    record = _storm_round(
        [
            _call("a", "failed", 1.0, error="LockTimeout"),
            _call("b", "failed", 1.0, error="ConflictRetriesExhausted"),
            _call("c", "failed", 1.0, error="ConflictRetriesExhausted"),
            _call("d", "applied", 1.0),
        ],
        [_row(2, "d")],
    )
    result = summarise(
        STORM, "x", Params(workers=4), Timed([record], 1.0), ConnectionStats(), loop="a"
    )
    assert list(result.errors.items()) == [("ConflictRetriesExhausted", 2), ("LockTimeout", 1)]


# -- verdicts ----------------------------------------------------------------------------------


def test_a_clean_storm_round_is_a_true_verdict() -> None:
    """One applied call and its one history row: no violation, no double advance."""
    timed = Timed([_good_round()], wall=0.1)
    result = summarise(STORM, "optimistic", Params(workers=4), timed, ConnectionStats(), loop="a")
    assert result.verdict.ok
    assert result.double_advanced_rounds == 0


def test_a_double_applied_round_fails_with_both_checks() -> None:
    """Two callers told applied and two history rows: the generic checker sees the broken chain
    and the storm's own judgement the double apply, and the round counts as double-advanced."""
    timed = Timed([_good_round(), _double_round()], wall=0.2)
    result = summarise(STORM, "broken", Params(workers=2), timed, ConnectionStats(), loop="a")
    assert not result.verdict.ok
    assert result.verdict.kinds() == {BROKEN_CHAIN, DOUBLE_APPLY}
    assert result.double_advanced_rounds == 1
    assert result.applied_per_round == (1, 2)


def test_verdict_of_adds_judgements_round_by_round() -> None:
    """The verdict lists each round's history violations, then that round's judgement's."""
    extra = Violation(LOST_UPDATE, "told applied, not in history")
    records = [_double_round(), _good_round()]
    judgements = [Judgement(True), Judgement(False, (extra,))]
    verdict = verdict_of(STORM, records, judgements, Params())
    assert [v.kind for v in verdict.violations] == [BROKEN_CHAIN, LOST_UPDATE]


class _Unchecked(Scenario):
    """A scenario whose instances keep no history (like singleton): only its judgement counts."""

    name = "unchecked"

    def checked(self) -> bool:
        return False


def test_verdict_of_skips_the_history_check_when_the_scenario_says_so() -> None:
    """A scenario that is not history-checked is judged by its own rules alone."""
    verdict = verdict_of(_Unchecked(), [_double_round()], [Judgement(False)], Params())
    assert verdict == Verdict(ok=True)


def _result(strategy: str, verdict: Verdict) -> ScenarioResult:
    timed = Timed([_good_round()], wall=0.1)
    ok = summarise(STORM, strategy, Params(workers=4), timed, ConnectionStats(), loop="a")
    return replace(ok, verdict=verdict)


def _report(*results: ScenarioResult) -> BenchReport:
    return BenchReport(
        flowlock_version="0.1.0",
        postgres_version="18.0",
        redis_version=None,
        cores=2,
        args={"workers": 4},
        results=results,
        loop="asyncio",
        database="embedded",
        pool_size=4,
        duration_s=1.0,
    )


def test_report_is_ok_only_when_every_verdict_is() -> None:
    """One failed pair makes the whole report fail."""
    bad = Verdict.of([Violation(DOUBLE_APPLY, "twice")])
    assert _report(_result("a", Verdict(ok=True))).ok
    assert not _report(_result("a", Verdict(ok=True)), _result("b", bad)).ok


def test_failures_list_the_most_serious_violations_first() -> None:
    """Per failed pair: a count by kind (double applies first), then the violations, capped."""
    found = [Violation(BROKEN_CHAIN, f"chain {n}", n) for n in range(2, 5)]
    found += [Violation(DOUBLE_APPLY, "applied twice"), Violation(LOST_UPDATE, "lost")]
    report = _report(_result("good", Verdict(ok=True)), _result("bad", Verdict.of(found)))
    lines = failures(report, limit=3)
    assert lines == [
        "storm/bad: 5 violation(s): 1 double-apply, 1 lost-update, 3 broken-chain",
        "  - [double-apply] applied twice",
        "  - [lost-update] lost",
        "  - [broken-chain] (version 2) chain 2",
        "  ... and 2 more",
    ]


def test_failures_of_a_passing_report_are_empty() -> None:
    """Nothing to say when every verdict is true."""
    assert failures(_report(_result("a", Verdict(ok=True)))) == []
