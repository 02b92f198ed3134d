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
    AIMS,
    FLOOR,
    FLOOR_METHOD,
    Aim,
    AimSpec,
    aims,
    floors,
    is_distributed,
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
    batching = report.args.get("batching")
    switch = "" if batching is None else f", batching {'on' if batching else 'off'}"
    return (
        f"flowlock bench: {report.args.get('workers')} callers{switch}, PostgreSQL "
        f"{report.postgres_version} ({report.database}){redis}, {report.loop}, "
        f"{report.cores} cores"
    )


def _batch_cell(result: ScenarioResult) -> Text:
    if result.mean_batch is None:
        return Text("—", style="dim")
    return Text(_num(result.mean_batch, 2))


def results_table(report: BenchReport) -> Table:
    """One row per (scenario, strategy): latency, success, attempts and mean batch size per
    call, throughput, connections, lock wait, verdict."""
    # One space between columns, not two: the 15 columns then fit 160 (a piped run's width)
    # with every header whole.
    table = Table(
        title=title(report),
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    table.add_column("scenario", no_wrap=True)
    table.add_column("strategy", no_wrap=True)
    for name in ("calls", "avg ms", "p50 ms", "p99 ms", "max ms", "success %", "att/call"):
        table.add_column(name, justify="right")
    table.add_column("batch", justify="right")
    for name in ("calls/s", "applied/s", "peak conns", "lock wait ms"):
        table.add_column(name, justify="right")
    table.add_column("verdict", no_wrap=True)
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
            _batch_cell(r),
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
    if aim is None:
        return Text("—", style="dim")  # the strategy did not run that scenario
    if aim.measured is None:
        return Text("no floor", style="dim")
    return Text(f"{aim.measured:.2f}× {aim.status}", style="green" if aim.ok else "bold red")


def _aim_label(spec: AimSpec) -> str:
    metric = "p99" if spec.metric == "p99" else "applied/s"
    return f"{spec.scenario} {metric} ×floor"


def _aim_target(spec: AimSpec, strategies: list[str]) -> str:
    """The target, with the distributed strategies' own when it differs and one of them is in
    the table."""
    sign = "≤" if spec.compare == "<=" else "≥"
    target = f"{sign} {spec.target:g}×"
    if spec.distributed != spec.target and any(is_distributed(s) for s in strategies):
        target += f" (dist. {spec.distributed:g}×)"
    return target


def aims_table(report: BenchReport) -> Table | None:
    """The aims against the floor measured in this run, one row per aim and one column per
    flowlock strategy: the scenarios below 100 % success, the violations, then each ratio aim
    of a scenario the run had, as the ratio and whether it was met; None when the run had no
    floor."""
    checked = aims(report)
    if not floors(report) or not checked:
        return None
    strategies = list(dict.fromkeys(a.strategy for a in checked))
    ran = {a.scenario for a in checked}
    table = Table(
        title="aims, against the raw floor of this run",
        title_justify="left",
        caption="each ratio is the strategy's figure over the raw floor's in the same run; "
        "dist.: the distributed strategies' target (they take a lease on every call); "
        "success: the scenarios below 100 % (failed calls: lost to contention, never wrong)",
        caption_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    table.add_column("aim")
    table.add_column("target")
    for strategy in strategies:
        # The strategy names head the columns: wrap the aims first, then shorten the names.
        table.add_column(strategy, justify="right", min_width=min(len(strategy), 12))
    mine = {s: [a for a in checked if a.strategy == s] for s in strategies}
    success: list[Text] = []
    violations: list[Text] = []
    for strategy in strategies:
        short = [
            f"{a.scenario} {_pct(a.measured or 0.0)}"
            for a in mine[strategy]
            if a.what == "success" and not a.ok
        ]
        bad = sum(int(a.measured or 0) for a in mine[strategy] if a.what == "violations")
        success.append(Text(", ".join(short) or "none", style="yellow" if short else "green"))
        violations.append(Text(str(bad), style="bold red" if bad else "green"))
    table.add_row("below 100 % success", "none", *success)
    table.add_row("violations", "0", *violations)
    table.add_section()
    for spec in AIMS:
        if spec.scenario not in ran:
            continue
        cells = [_aim_cell(_pick(mine[s], spec.scenario, spec.what)) for s in strategies]
        table.add_row(_aim_label(spec), _aim_target(spec, strategies), *cells)
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
