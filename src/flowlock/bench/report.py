"""Rendering a :class:`~flowlock.bench.runner.BenchReport`: rich tables, the JSON document, the
PNG chart and the progress display. Nothing here measures; everything here only reads the
runner's dataclasses.

The JSON shape is the contract in DESIGN.md (``flowlock bench --json FILE``); its keys keep their
names and units, extra keys are added after them. The comparisons with the floor (the ``raw``
strategy of the same run) and the issue's performance aims are computed here, from the results.
"""

from __future__ import annotations

import importlib.util
import json
import platform
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from rich import box
from rich.console import Console, Group
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

from flowlock.bench.runner import BenchReport, ScenarioResult
from flowlock.checker import (
    BROKEN_CHAIN,
    DOUBLE_APPLY,
    FINAL_MISMATCH,
    LOST_UPDATE,
    OVERSELL,
    VERSION_GAP,
)
from flowlock.errors import FlowlockError

__all__ = [
    "AIM_P99",
    "AIM_THROUGHPUT",
    "FLOOR",
    "SEED_COUNTERPART",
    "SEED_MEASURED",
    "SEED_PUBLISHED",
    "Aim",
    "PlotUnavailable",
    "RichProgress",
    "SeedFigures",
    "aims",
    "aims_table",
    "check_plot_support",
    "failures",
    "floors",
    "plot",
    "render",
    "result_to_json",
    "results_table",
    "seed_table",
    "to_json",
    "vs_floor",
    "write_json",
]


@dataclass(frozen=True, slots=True)
class SeedFigures:
    """The seed article's published storm figures for one strategy (100 threads, one instance)."""

    avg_ms: float
    p99_ms: float
    success_pct: float | None


SEED_PUBLISHED: Mapping[str, SeedFigures] = {
    "optimistic": SeedFigures(12, 85, 99.2),
    "pessimistic": SeedFigures(35, 120, 99.9),
    "distributed": SeedFigures(18, 55, None),
}
"""What the seed article says its load test measured (seed/NOTES.md)."""

SEED_MEASURED: Mapping[str, str] = {
    "optimistic": "p99 174 ms",
    "pessimistic": "7/10 rounds double-advanced, 94 % failed",
    "distributed": "14 % success",
}
"""What the seed's own code does when run (PostgreSQL 18 + Redis 6.2, seed/NOTES.md)."""


SEED_COUNTERPART: Mapping[str, str] = {
    "optimistic": "optimistic",
    "pessimistic": "pessimistic",
    "distributed-redis": "distributed",
}
"""Which seed row each of our strategies is compared with (the seed's lock was one Redis)."""

FLOOR = "raw"
"""The strategy every other one is compared with."""

AIM_P99 = {"storm": 1.5}
"""Scenario -> the largest p99 latency, as a multiple of the floor's, the aims allow."""
AIM_THROUGHPUT = {"hot": 0.8, "spread": 0.8}
"""Scenario -> the smallest applied/s, as a fraction of the floor's, the aims allow."""

FLOOR_METHOD: Mapping[str, str] = {
    "statement": "one conditional UPDATE",
    "locked": "row-locked read-modify-write transaction",
    "cas": "read + compare-and-swap, retried until it lands",
    "claim": "INSERT ... ON CONFLICT DO NOTHING claim",
}
"""How the raw floor does a scenario's calls, in words (flowlock.bench.raw)."""


# -- the floor and the aims ---------------------------------------------------------------------


def floors(report: BenchReport) -> dict[str, ScenarioResult]:
    """The raw floor's result per scenario (scenarios run without it are missing)."""
    return {r.scenario: r for r in report.results if r.strategy == FLOOR}


def _ratio(mine: float, floor: float) -> float | None:
    return mine / floor if floor > 0 else None


def vs_floor(result: ScenarioResult, floor: ScenarioResult | None) -> dict[str, float | None]:
    """``result``'s p99 latency and applied/s as multiples of the floor's, measured in the same
    run (None without a floor, or for the floor itself)."""
    if floor is None or result.strategy == FLOOR:
        return {"p99": None, "applied_per_s": None}
    return {
        "p99": _ratio(result.p99_ms, floor.p99_ms),
        "applied_per_s": _ratio(result.applied_per_s, floor.applied_per_s),
    }


@dataclass(frozen=True, slots=True)
class Aim:
    """One performance aim of the issue, checked for one strategy on one scenario."""

    strategy: str
    scenario: str
    what: str
    """``success``, ``violations``, ``p99_vs_floor`` or ``applied_per_s_vs_floor``."""
    target: float
    measured: float | None
    ok: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "scenario": self.scenario,
            "what": self.what,
            "target": self.target,
            "measured": None if self.measured is None else round(self.measured, 4),
            "ok": self.ok,
        }


def aims(report: BenchReport) -> list[Aim]:
    """Every flowlock strategy at 100 % success with zero violations; storm p99 within 1.5x the
    floor's; hot and spread applied/s at least 0.8x the floor's (all measured in this run)."""
    found: list[Aim] = []
    base = floors(report)
    for r in report.results:
        if r.strategy == FLOOR:
            continue
        found.append(
            Aim(r.strategy, r.scenario, "success", 100.0, r.success_pct, r.success_pct >= 100.0)
        )
        n = len(r.verdict.violations)
        found.append(Aim(r.strategy, r.scenario, "violations", 0, n, n == 0))
        ratios = vs_floor(r, base.get(r.scenario))
        if r.scenario in AIM_P99 and ratios["p99"] is not None:
            limit = AIM_P99[r.scenario]
            got = ratios["p99"]
            found.append(Aim(r.strategy, r.scenario, "p99_vs_floor", limit, got, got <= limit))
        if r.scenario in AIM_THROUGHPUT and ratios["applied_per_s"] is not None:
            limit = AIM_THROUGHPUT[r.scenario]
            got = ratios["applied_per_s"]
            found.append(
                Aim(r.strategy, r.scenario, "applied_per_s_vs_floor", limit, got, got >= limit)
            )
    return found


# -- JSON ---------------------------------------------------------------------------------------


def _ms(value: float) -> float:
    return round(value, 3)


def _rounded(ratios: Mapping[str, float | None]) -> dict[str, float | None]:
    return {k: None if v is None else round(v, 3) for k, v in ratios.items()}


def result_to_json(result: ScenarioResult, floor: ScenarioResult | None = None) -> dict[str, Any]:
    """One result in DESIGN.md's shape, then the extra fields."""
    return {
        "scenario": result.scenario,
        "strategy": result.strategy,
        "workers": result.workers,
        "calls": result.calls,
        "avg_ms": _ms(result.avg_ms),
        "p50_ms": _ms(result.p50_ms),
        "p99_ms": _ms(result.p99_ms),
        "max_ms": _ms(result.max_ms),
        "success_pct": round(result.success_pct, 3),
        "attempts_per_call": round(result.attempts_per_call, 4),
        "calls_per_s": round(result.calls_per_s, 1),
        "applied_per_s": round(result.applied_per_s, 1),
        "peak_connections": result.peak_connections,
        "verdict": result.verdict.to_dict(),
        # extras
        "lock_wait_ms": _ms(result.lock_wait_ms),
        "row_lock_wait_s": round(result.row_lock_wait_s, 4),
        "lease_wait_s": round(result.lease_wait_s, 4),
        "rounds": result.rounds,
        "ops": result.ops,
        "processes": result.processes,
        "loop": result.loop,
        "double_advanced_rounds": result.double_advanced_rounds,
        "errors": dict(result.errors),
        "applied": result.applied,
        "idempotent": result.idempotent,
        "refused": result.refused,
        "failed": result.failed,
        "applied_per_round": list(result.applied_per_round),
        "peak_active_connections": result.peak_active_connections,
        "open_connections": result.open_connections,
        "wall_s": round(result.wall_s, 4),
        "floor": result.floor,
        "vs_floor": _rounded(vs_floor(result, floor)),
    }


def to_json(report: BenchReport) -> dict[str, Any]:
    """The whole report as the JSON document ``flowlock bench --json`` writes."""
    base = floors(report)
    return {
        "flowlock_version": report.flowlock_version,
        "postgres_version": report.postgres_version,
        "redis_version": report.redis_version,
        "cores": report.cores,
        "args": dict(report.args),
        "results": [result_to_json(r, base.get(r.scenario)) for r in report.results],
        # extras
        "loop": report.loop,
        "database": report.database,
        "redis": report.redis,
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "duration_s": round(report.duration_s, 3),
        "floors": {
            s: {
                "strategy": FLOOR,
                "method": r.floor,
                "description": FLOOR_METHOD.get(r.floor or ""),
            }
            for s, r in base.items()
        },
        "aims": [a.to_dict() for a in aims(report)],
        "skipped": list(report.skipped),
        "log": list(report.log),
        "notes": list(report.notes),
        "ok": report.ok,
    }


def write_json(report: BenchReport, path: Path) -> None:
    """Write :func:`to_json` to ``path`` (UTF-8, indented, trailing newline)."""
    path.write_text(json.dumps(to_json(report), indent=2) + "\n", encoding="utf-8")


# -- tables -------------------------------------------------------------------------------------


def _num(value: float, digits: int = 1) -> str:
    return f"{value:,.{digits}f}"


def _verdict_cell(result: ScenarioResult) -> Text:
    if result.verdict.ok:
        return Text("ok", style="green")
    return Text(f"FAIL ({len(result.verdict.violations)})", style="bold red")


def _title(report: BenchReport) -> str:
    redis = f", Redis {report.redis_version}" if report.redis_version else ""
    return (
        f"flowlock bench: {report.args.get('workers')} callers, PostgreSQL "
        f"{report.postgres_version} ({report.database}){redis}, {report.loop}, "
        f"{report.cores} cores"
    )


def results_table(report: BenchReport) -> Table:
    """One row per (scenario, strategy): latency, success, throughput, connections, lock wait,
    verdict."""
    table = Table(title=_title(report), title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("scenario", no_wrap=True)
    table.add_column("strategy", no_wrap=True)
    for name in ("calls", "avg ms", "p50 ms", "p99 ms", "max ms", "success %", "att/call"):
        table.add_column(name, justify="right")
    for name in ("calls/s", "applied/s", "peak conns", "lock wait ms"):
        table.add_column(name, justify="right")
    table.add_column("verdict")
    last = None
    for r in report.results:
        if last is not None and r.scenario != last:
            table.add_section()
        last = r.scenario
        success = Text(_pct(r.success_pct), style="" if r.success_pct >= 100 else "yellow")
        table.add_row(
            r.scenario,
            Text(r.strategy, style="dim" if r.strategy == FLOOR else ""),
            str(r.calls),
            _num(r.avg_ms),
            _num(r.p50_ms),
            _num(r.p99_ms),
            _num(r.max_ms),
            success,
            _num(r.attempts_per_call, 2),
            _num(r.calls_per_s, 0),
            _num(r.applied_per_s, 0),
            str(r.peak_connections),
            _num(r.lock_wait_ms),
            _verdict_cell(r),
        )
    return table


def seed_table(report: BenchReport) -> Table | None:
    """The ``storm`` results beside the seed article's published figures and what its own code
    measured; None when the run had no storm."""
    storm = [r for r in report.results if r.scenario == "storm"]
    if not storm:
        return None
    table = Table(
        title="storm: flowlock vs the seed article (100 threads, one instance)",
        title_justify="left",
        caption="seed avg/p99/success: the article's published table; seed code, measured: "
        "the article's own code run on PostgreSQL 18 + Redis 6.2 (seed/NOTES.md)",
        caption_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    table.add_column("strategy", no_wrap=True)
    for name in ("avg ms", "p99 ms", "success %", "double adv."):
        table.add_column(name, justify="right")
    for name in ("avg ms", "p99 ms", "success %"):
        table.add_column(f"seed {name}", justify="right")
    table.add_column("seed code, measured", no_wrap=True)
    for ours in storm:
        counterpart = SEED_COUNTERPART.get(ours.strategy)
        seed = SEED_PUBLISHED.get(counterpart) if counterpart else None
        theirs = (
            [
                _num(seed.avg_ms, 0),
                _num(seed.p99_ms, 0),
                "—" if seed.success_pct is None else _num(seed.success_pct),
            ]
            if seed is not None
            else ["—", "—", "—"]
        )
        table.add_row(
            ours.strategy,
            _num(ours.avg_ms),
            _num(ours.p99_ms),
            _num(ours.success_pct),
            Text(
                f"{ours.double_advanced_rounds}/{ours.rounds}",
                style="bold red" if ours.double_advanced_rounds else "",
            ),
            *theirs,
            SEED_MEASURED.get(counterpart or "", "—"),
        )
    return table


def _pct(value: float) -> str:
    """A success rate that never reads 100.0 unless it is 100."""
    return f"{value:.2f}" if 99.9 < value < 100 else f"{value:.1f}"


def _pick(found: list[Aim], scenario: str, what: str) -> Aim | None:
    return next((a for a in found if a.scenario == scenario and a.what == what), None)


def _aim_cell(aim: Aim | None) -> Text:
    if aim is None or aim.measured is None:
        return Text("—", style="dim")
    return Text(f"{aim.measured:.2f}×", style="green" if aim.ok else "bold red")


def aims_table(report: BenchReport) -> Table | None:
    """Per flowlock strategy, the issue's aims against the floor measured in this run; None when
    the run had no floor."""
    checked = aims(report)
    if not floors(report) or not checked:
        return None
    table = Table(
        title="aims, against the raw floor of this run",
        title_justify="left",
        caption="success: scenarios below 100 % (failed calls: lost to contention, never "
        "wrong); storm p99 ≤ 1.5× floor; hot and spread applied/s ≥ 0.8× floor",
        caption_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    table.add_column("strategy", no_wrap=True)
    table.add_column("below 100 % success")
    table.add_column("violations", justify="right")
    for scenario in AIM_P99:
        table.add_column(f"{scenario} p99 ×floor", justify="right")
    for scenario in AIM_THROUGHPUT:
        table.add_column(f"{scenario} applied/s ×floor", justify="right")
    for strategy in dict.fromkeys(a.strategy for a in checked):
        mine = [a for a in checked if a.strategy == strategy]
        short = [
            f"{a.scenario} {_pct(a.measured or 0.0)}"
            for a in mine
            if a.what == "success" and not a.ok
        ]
        bad = sum(int(a.measured or 0) for a in mine if a.what == "violations")
        cells = [
            Text(", ".join(short) or "none", style="yellow" if short else "green"),
            Text(str(bad), style="bold red" if bad else "green"),
        ]
        for scenario in AIM_P99:
            cells.append(_aim_cell(_pick(mine, scenario, "p99_vs_floor")))
        for scenario in AIM_THROUGHPUT:
            cells.append(_aim_cell(_pick(mine, scenario, "applied_per_s_vs_floor")))
        table.add_row(strategy, *cells)
    return table


def _errors(report: BenchReport) -> Text | None:
    lines = [
        f"{r.scenario}/{r.strategy}: "
        + ", ".join(f"{name} × {count}" for name, count in r.errors.items())
        for r in report.results
        if r.errors
    ]
    if not lines:
        return None
    return Text("failed calls by error:\n  " + "\n  ".join(lines), style="dim")


def _floors_text(report: BenchReport) -> Text | None:
    base = floors(report)
    if not base:
        return None
    lines = [f"{s}: {FLOOR_METHOD.get(r.floor or '', r.floor or '?')}" for s, r in base.items()]
    text = "raw floor (bare asyncpg, the same rows written):\n  " + "\n  ".join(lines)
    return Text(text, style="dim")


_SEVERITY = (DOUBLE_APPLY, LOST_UPDATE, OVERSELL, VERSION_GAP, BROKEN_CHAIN, FINAL_MISMATCH)


def failures(report: BenchReport, limit: int = 5) -> list[str]:
    """One line per failed verdict with its violations counted by kind (double applies first),
    then up to ``limit`` of them, the most serious kinds first."""
    lines: list[str] = []
    for r in report.results:
        if r.verdict.ok:
            continue
        found = sorted(
            r.verdict.violations,
            key=lambda v: _SEVERITY.index(v.kind) if v.kind in _SEVERITY else len(_SEVERITY),
        )
        kinds = Counter(v.kind for v in found)
        counted = ", ".join(f"{n} {kind}" for kind, n in kinds.items())
        lines.append(f"{r.scenario}/{r.strategy}: {len(found)} violation(s): {counted}")
        lines.extend(f"  - {v}" for v in found[:limit])
        if len(found) > limit:
            lines.append(f"  ... and {len(found) - limit} more")
    return lines


def render(report: BenchReport, console: Console) -> None:
    """Print the results table, the seed comparison, the aims, errors, notes and the total time
    to ``console``."""
    parts: list[Table | Text] = [results_table(report)]
    for extra in (seed_table(report), aims_table(report), _floors_text(report), _errors(report)):
        if extra is not None:
            parts.append(extra)
    parts.extend(Text(f"note: {n}", style="yellow") for n in report.notes)
    if report.log:
        shown = [line if len(line) <= 200 else line[:197] + "..." for line in report.log[:10]]
        more = len(report.log) - len(shown)
        text = "flowlock logged during the run:\n  " + "\n  ".join(shown)
        parts.append(Text(text + (f"\n  ... {more} more kinds" if more > 0 else ""), style="dim"))
    parts.append(Text(f"total {report.duration_s:.1f} s", style="bold"))
    console.print(Group(*parts))


# -- the chart ----------------------------------------------------------------------------------

_COLORS = {
    "raw": "#8c8c8c",
    "optimistic": "#1f77b4",
    "pessimistic": "#ff7f0e",
    "distributed-redis": "#d62728",
    "distributed-advisory": "#9467bd",
    "adaptive": "#2ca02c",
}
_SPARE_COLORS = ("#17becf", "#bcbd22", "#e377c2", "#7f7f7f", "#8c564b")


class PlotUnavailable(FlowlockError):
    """--plot needs matplotlib: pip install 'flowlock[embedded]' (or pip install matplotlib)."""


def check_plot_support() -> None:
    """Raise PlotUnavailable unless matplotlib can be imported (checked before a run)."""
    if importlib.util.find_spec("matplotlib") is None:
        raise PlotUnavailable()


def plot(report: BenchReport, path: Path) -> None:
    """Draw the run as a PNG at ``path`` (matplotlib, Agg): per scenario, one bar per strategy
    in three panels: latency (p50 solid, p99 light, max as a tick; log scale), success %, and
    throughput: applied transitions and calls answered per second (log scale)."""
    check_plot_support()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    scenarios = list(dict.fromkeys(r.scenario for r in report.results))
    strategies = list(dict.fromkeys(r.strategy for r in report.results))
    spare = iter(_SPARE_COLORS * 4)
    colors = {s: _COLORS.get(s) or next(spare) for s in strategies}
    by_pair = {(r.scenario, r.strategy): r for r in report.results}
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
    fig.suptitle(_title(report), fontsize=11, y=0.99)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=80, pil_kwargs={"optimize": True})
    plt.close(fig)


# -- progress -----------------------------------------------------------------------------------


class RichProgress:
    """A transient rich progress display (meant for stderr) implementing the runner's Progress."""

    def __init__(self, console: Console) -> None:
        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        )
        self._status: TaskID | None = None
        self._pair: TaskID | None = None

    def __enter__(self) -> Self:
        self._progress.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._progress.stop()

    def status(self, message: str) -> None:
        if self._status is None:
            self._status = self._progress.add_task(message, total=None)
        else:
            self._progress.update(self._status, description=message)

    def begin(self, scenario: str, strategy: str, rounds: int) -> None:
        if self._status is not None:
            self._progress.remove_task(self._status)
            self._status = None
        self._pair = self._progress.add_task(f"{scenario} / {strategy}", total=rounds)

    def advance(self) -> None:
        if self._pair is not None:
            self._progress.advance(self._pair)

    def end(self) -> None:
        if self._pair is not None:
            self._progress.remove_task(self._pair)
            self._pair = None
