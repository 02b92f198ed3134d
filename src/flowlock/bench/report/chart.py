"""The `--plot` chart: latency, success and throughput per scenario and strategy.

matplotlib is imported only when drawing.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

from flowlock.bench.report.tables import title
from flowlock.bench.results import IN_PROCESS, BenchReport, ScenarioResult
from flowlock.core.errors import FlowlockError
from flowlock.core.install import pip_install

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["PlotUnavailable", "chart_title", "check_plot_support", "figure", "plot"]

_COLORS = {
    "raw": "#8c8c8c",
    "optimistic": "#1f77b4",
    "pessimistic": "#ff7f0e",
    "distributed-redis": "#d62728",
    "distributed-advisory": "#9467bd",
    "adaptive": "#2ca02c",
}
_SPARE_COLORS = ("#17becf", "#bcbd22", "#e377c2", "#7f7f7f", "#8c564b")


def _series(result: ScenarioResult) -> str:
    """A result's bar: its strategy, `(http)` after it when measured through the service."""
    return result.strategy if result.transport == IN_PROCESS else f"{result.strategy} (http)"


class PlotUnavailable(FlowlockError):
    """--plot needs matplotlib, which comes with the bench extra (or pip install matplotlib)."""

    def __init__(self) -> None:
        super().__init__(
            f"--plot needs matplotlib: {pip_install('bench')} (or pip install matplotlib)"
        )


def check_plot_support() -> None:
    """Raise PlotUnavailable unless matplotlib can be imported (checked before a run)."""
    if importlib.util.find_spec("matplotlib") is None:
        raise PlotUnavailable()


def chart_title(report: BenchReport) -> str:
    """The run's title; a `--quick` run says so, since its figures are not comparable."""
    quick = " (--quick: fewer rounds and calls)" if report.args.get("quick") else ""
    return title(report) + quick


def plot(report: BenchReport, path: Path) -> None:
    """Draw the run as a PNG at `path` (matplotlib, Agg): see `figure`."""
    fig = figure(report)  # checks for matplotlib first, and picks the Agg backend
    import matplotlib.pyplot as plt

    try:
        fig.savefig(path, dpi=80, pil_kwargs={"optimize": True})
    finally:
        plt.close(fig)


def figure(report: BenchReport) -> Figure:
    """The run drawn with matplotlib (Agg); the caller closes the figure.

    Per scenario, one bar per strategy in three panels: latency, success % and throughput.
    Latency shows p50 solid, p99 light and max as a tick, on a log scale.
    Throughput shows applied transitions and answered calls per second, on a log scale.
    """
    check_plot_support()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    scenarios = list(dict.fromkeys(r.scenario for r in report.results))
    strategies = list(dict.fromkeys(_series(r) for r in report.results))
    spare = iter(_SPARE_COLORS * 4)
    colors = {s: _COLORS.get(s) or next(spare) for s in strategies}
    by_pair = {(r.scenario, _series(r)): r for r in report.results}
    width = 0.84 / max(1, len(strategies))

    fig, (lat, ok, thr) = plt.subplots(
        3, 1, figsize=(13, 10.5), sharex=True, height_ratios=(1.25, 0.8, 1.05)
    )
    for k, strategy in enumerate(strategies):
        offset = (k - (len(strategies) - 1) / 2) * width
        for i, scenario in enumerate(scenarios):
            r = by_pair.get((scenario, strategy))
            if r is None:
                continue
            x, color = i + offset, colors[strategy]
            lat.bar(x, r.p99_ms, width * 0.92, color=color, alpha=0.35, linewidth=0)
            lat.bar(x, r.p50_ms, width * 0.55, color=color, linewidth=0)
            lat.plot([x - width * 0.4, x + width * 0.4], [r.max_ms] * 2, color=color, lw=1.2)
            ok.bar(x, r.success_pct, width * 0.92, color=color, linewidth=0)
            if r.success_pct < 99.95:
                label = f"{r.success_pct:.1f}".removesuffix(".0")
                ok.text(
                    x, r.success_pct + 2, label, ha="center", va="bottom", fontsize=7, rotation=90
                )
            if not r.verdict.ok:
                ok.text(x, 103, "✗", ha="center", va="bottom", color="red", fontsize=11)
            if r.calls_per_s > 0:
                thr.bar(x, r.calls_per_s, width * 0.92, color=color, alpha=0.35, linewidth=0)
            if r.applied_per_s > 0:
                thr.bar(x, r.applied_per_s, width * 0.55, color=color, linewidth=0)
                label = f"{r.applied_per_s:,.0f}"
                thr.text(
                    x,
                    r.applied_per_s * 1.1,
                    label,
                    ha="center",
                    va="bottom",
                    fontsize=6.5,
                    rotation=90,
                )

    lat.set_yscale("log")
    lat.set_ylabel("latency per call, ms (log)")
    lat.set_title("latency: p50 (solid), p99 (light bar), max (line)", fontsize=10, loc="left")
    ok.set_ylim(0, 112)
    ok.set_yticks([0, 25, 50, 75, 100])
    ok.set_ylabel("success %")
    ok.set_title(
        "success: applied, already done, or refused by the business rule (✗: checker verdict "
        "failed)",
        fontsize=10,
        loc="left",
    )
    thr.set_yscale("log")
    top = max((r.calls_per_s for r in report.results), default=1.0)
    thr.set_ylim(top=top * 2)
    thr.set_ylabel("per second (log)")
    thr.set_title(
        "throughput: applied transitions per second (solid, labelled), calls answered per "
        "second (light bar)",
        fontsize=10,
        loc="left",
    )
    thr.set_xticks(range(len(scenarios)), scenarios, fontsize=10)
    for ax in (lat, ok, thr):
        ax.grid(axis="y", alpha=0.3, which="both", linewidth=0.5)
        ax.set_axisbelow(True)
        ax.spines[["top", "right"]].set_visible(False)
        for i in range(1, len(scenarios)):
            ax.axvline(i - 0.5, color="#dddddd", linewidth=0.8)
    handles = [Patch(color=colors[s], label=s) for s in strategies]
    fig.legend(
        handles=handles,
        loc="upper center",
        ncol=len(strategies),
        frameon=False,
        bbox_to_anchor=(0.5, 0.955),
        fontsize=10,
    )
    fig.suptitle(chart_title(report), fontsize=11, y=0.99)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    return fig
