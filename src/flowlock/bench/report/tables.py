"""The run as rich tables: one row per (scenario, strategy), the storm beside the seed article's
figures, the aims against the floor, then the floors used, failed calls, notes, what flowlock
logged and the total time (:func:`render`). Nothing here measures; it only reads results."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from rich import box
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from flowlock.bench.report.aims import (
    AIM_P99,
    AIM_THROUGHPUT,
    FLOOR,
    FLOOR_METHOD,
    Aim,
    aims,
    floors,
)
from flowlock.bench.results import BenchReport, ScenarioResult

__all__ = [
    "SEED_COUNTERPART",
    "SEED_MEASURED",
    "SEED_PUBLISHED",
    "SeedFigures",
    "aims_table",
    "render",
    "results_table",
    "seed_table",
    "title",
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
"""What the seed article says its load test measured (its published table)."""

SEED_MEASURED: Mapping[str, str] = {
    "optimistic": "p99 174 ms",
    "pessimistic": "7/10 rounds double-advanced, 94 % failed",
    "distributed": "14 % success",
}
"""What the seed's own code did when the flowlock developers ran it (PostgreSQL 18 + Redis 6.2)."""


SEED_COUNTERPART: Mapping[str, str] = {
    "optimistic": "optimistic",
    "pessimistic": "pessimistic",
    "distributed-redis": "distributed",
}
"""Which seed row each of our strategies is compared with (the seed's lock was one Redis)."""


def _num(value: float, digits: int = 1) -> str:
    return f"{value:,.{digits}f}"


def _verdict_cell(result: ScenarioResult) -> Text:
    if result.verdict.ok:
        return Text("ok", style="green")
    return Text(f"FAIL ({len(result.verdict.violations)})", style="bold red")


def title(report: BenchReport) -> str:
    redis = f", Redis {report.redis_version}" if report.redis_version else ""
    return (
        f"flowlock bench: {report.args.get('workers')} callers, PostgreSQL "
        f"{report.postgres_version} ({report.database}){redis}, {report.loop}, "
        f"{report.cores} cores"
    )


def results_table(report: BenchReport) -> Table:
    """One row per (scenario, strategy): latency, success, throughput, connections, lock wait,
    verdict."""
    table = Table(title=title(report), title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
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
        "the article's own code, run by the flowlock developers on PostgreSQL 18 + Redis 6.2",
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
