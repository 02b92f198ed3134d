"""The bench report in a terminal: a full matrix's tables at 80 and 120 columns with no number cut,
the progress display's bar for the whole run with its ETA (only on a terminal), and the chart's
title naming --quick. No server: the report is built by hand, like test_bench_report's."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest
from rich.console import Console

# pytest puts this directory on sys.path (rootdir-less test modules): the same hand-built results.
from test_bench_report import _floor, _report, _result

from flowlock.bench.report import OVERALL, RichProgress, chart_title, figure, render, to_json
from flowlock.bench.report.cells import ELLIPSIS
from flowlock.bench.results import BenchReport, ScenarioResult
from flowlock.checker import DOUBLE_APPLY, Verdict, Violation

SCENARIOS = ("storm", "countersign", "inventory", "hot", "spread", "cluster", "singleton")
STRATEGIES = ("optimistic", "pessimistic", "distributed-redis", "distributed-advisory", "adaptive")


def _matrix(*, quick: bool = True) -> BenchReport:
    """Every scenario with every strategy and the floor, each figure distinct and as long as a
    slow run's (thousands separators, four-digit latencies), so a cut one cannot hide."""
    bad = Verdict.of([Violation(DOUBLE_APPLY, "instance 'x': twice")] * 12)
    results: list[ScenarioResult] = []
    for i, scenario in enumerate(SCENARIOS):
        results.append(_floor(scenario, calls=10_000 + i, p99_ms=1_000.0 + i))
        for j, strategy in enumerate(STRATEGIES):
            k = i * 10 + j
            results.append(
                _result(
                    strategy,
                    scenario=scenario,
                    calls=20_000 + k,
                    avg_ms=100.0 + k,
                    p50_ms=200.0 + k,
                    p99_ms=3_000.0 + k,
                    max_ms=40_000.0 + k,
                    success_pct=50.0 + k / 10,
                    calls_per_s=50_000.0 + k,
                    applied_per_s=60_000.0 + k,
                    mean_batch=1.0 + k / 100,
                    verdict=bad if j == 2 else Verdict(ok=True),
                )
            )
    report = _report(*results)
    return replace(report, args={**report.args, "quick": quick})


def _shown(result: ScenarioResult) -> list[str]:
    """The figures every form of the table shows, as printed."""
    return [
        f"{result.avg_ms:,.1f}",
        f"{result.p50_ms:,.1f}",
        f"{result.p99_ms:,.1f}",
        f"{result.success_pct:.1f}",
        f"{result.calls_per_s:,.0f}",
        f"{result.applied_per_s:,.0f}",
        str(result.calls),
    ]


def _rendered(report: BenchReport, width: int) -> str:
    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    render(report, console)
    return console.export_text()


@pytest.mark.parametrize("width", [80, 120])
def test_the_bench_table_at_80_and_120_columns_has_no_number_cut(width: int) -> None:
    """The bench table rendered at 80 (and 120) columns has no … in a number, nor anywhere:
    every line fits, and each pair's figures appear whole, each as a word of its own."""
    report = _matrix()
    text = _rendered(report, width)
    assert ELLIPSIS not in text
    assert max(len(line) for line in text.splitlines()) <= width
    words = text.split()
    for result in report.results:
        for figure_shown in _shown(result):
            assert figure_shown in words, (result.scenario, result.strategy, figure_shown)
    assert words.count("FAIL") == len(SCENARIOS)
    for name in STRATEGIES:
        assert name in words  # the strategy names (column heads of the aims) whole too
    # However many tables the aims take, their title and caption are said once.
    assert text.count("aims, against the raw floor") == 1
    assert text.count("each ratio is the strategy's figure") == 1


def test_the_json_keeps_every_figure_whatever_the_terminal() -> None:
    """The columns a narrow terminal leaves out are all in the JSON."""
    document = to_json(_matrix())
    first = document["results"][1]
    assert first["max_ms"] == 40_000.0
    assert "peak_connections" in first and "attempts_per_call" in first


def test_the_progress_shows_the_whole_run_with_an_eta() -> None:
    """On a terminal the display has a bar for the whole run with its time left, beside the
    current pair's, each whole at 80 columns with the longest pair's name."""
    console = Console(width=80, record=True, file=io.StringIO(), force_terminal=True)
    with RichProgress(console) as progress:
        progress.status("starting an embedded PostgreSQL")
        progress.plan(12)
        progress.begin("cluster", "distributed-advisory", 6)
        progress.advance()
        progress.advance()
    # The record holds every refresh, run together: the last one is the display's final state.
    text = console.export_text()
    overall = text[text.rindex(OVERALL) :].splitlines()[0]
    assert "2/12" in overall.split()
    assert "eta" in overall.split()
    pair = text[text.rindex("cluster / distributed-advisory") :].splitlines()[0]
    assert "2/6" in pair.split()
    assert ELLIPSIS not in overall + pair


def test_a_long_step_wraps_rather_than_cut_the_figures() -> None:
    """A long step's description beside the whole run's bar, at 80 columns: the figures and the
    ETA stay whole (the description wraps)."""
    console = Console(width=80, record=True, file=io.StringIO(), force_terminal=True)
    step = "creating flowlock's tables in the scratch schema flowlock_bench_0123456789ab"
    with RichProgress(console) as progress:
        progress.status(step)
        progress.plan(54)
    text = console.export_text()
    last = text[text.rindex("creating") :]
    assert ELLIPSIS not in last
    overall = last[last.index(OVERALL) :].splitlines()[0].split()
    assert "0/54" in overall
    assert "eta" in overall


def test_the_progress_prints_nothing_off_a_terminal() -> None:
    """Piped or redirected, the progress display stays silent."""
    out = io.StringIO()
    console = Console(width=120, file=out, force_terminal=False)
    with RichProgress(console) as progress:
        progress.plan(2)
        progress.begin("storm", "optimistic", 2)
        progress.advance()
        progress.end()
    assert out.getvalue() == ""


def test_the_chart_title_names_quick() -> None:
    """A --quick run's chart says so in its title; a full run's does not."""
    assert "--quick" in chart_title(_matrix(quick=True))
    assert "quick" not in chart_title(_matrix(quick=False))
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    fig = figure(_matrix(quick=True))
    try:
        assert "--quick" in fig.get_suptitle()
    finally:
        plt.close(fig)
