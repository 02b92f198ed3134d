"""Rendering a :class:`~flowlock.bench.runner.BenchReport`: rich tables, the JSON document, and the
progress display. Nothing here measures; everything here only reads the runner's dataclasses.

The JSON shape is the contract in DESIGN.md (``flowlock bench --json FILE``); its keys keep their
names and units, extra keys are added after them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

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

__all__ = [
    "SEED_MEASURED",
    "SEED_PUBLISHED",
    "RichProgress",
    "SeedFigures",
    "failures",
    "render",
    "result_to_json",
    "results_table",
    "seed_table",
    "to_json",
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


# -- JSON ---------------------------------------------------------------------------------------


def _ms(value: float) -> float:
    return round(value, 3)


def result_to_json(result: ScenarioResult) -> dict[str, Any]:
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
        "rounds": result.rounds,
        "loop": result.loop,
        "double_advanced_rounds": result.double_advanced_rounds,
        "errors": dict(result.errors),
        "applied": result.applied,
        "idempotent": result.idempotent,
        "refused": result.refused,
        "failed": result.failed,
        "applied_per_round": list(result.applied_per_round),
        "peak_active_connections": result.peak_active_connections,
        "wall_s": round(result.wall_s, 4),
    }


def to_json(report: BenchReport) -> dict[str, Any]:
    """The whole report as the JSON document ``flowlock bench --json`` writes."""
    return {
        "flowlock_version": report.flowlock_version,
        "postgres_version": report.postgres_version,
        "redis_version": report.redis_version,
        "cores": report.cores,
        "args": dict(report.args),
        "results": [result_to_json(r) for r in report.results],
        # extras
        "loop": report.loop,
        "database": report.database,
        "duration_s": round(report.duration_s, 3),
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


def results_table(report: BenchReport) -> Table:
    """One row per (scenario, strategy): latency, success, throughput, connections, verdict."""
    table = Table(
        title=f"flowlock bench: {report.args.get('workers')} callers at once, "
        f"PostgreSQL {report.postgres_version} ({report.database}), {report.loop}, "
        f"{report.cores} cores",
        title_justify="left",
    )
    table.add_column("scenario")
    table.add_column("strategy")
    for name in ("calls", "avg ms", "p50 ms", "p99 ms", "max ms", "success %", "attempts"):
        table.add_column(name, justify="right")
    for name in ("calls/s", "applied/s", "peak conns", "double adv."):
        table.add_column(name, justify="right")
    table.add_column("verdict")
    for r in report.results:
        success = Text(_num(r.success_pct), style="" if r.success_pct >= 99.0 else "yellow")
        double = Text(
            f"{r.double_advanced_rounds}/{r.rounds}",
            style="bold red" if r.double_advanced_rounds else "",
        )
        table.add_row(
            r.scenario,
            r.strategy,
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
            double,
            _verdict_cell(r),
        )
    return table


def seed_table(report: BenchReport) -> Table | None:
    """The ``storm`` results beside the seed article's published figures and what its own code
    measured; None when the run had no storm."""
    storm = {r.strategy: r for r in report.results if r.scenario == "storm"}
    if not storm:
        return None
    table = Table(
        title="storm: flowlock vs the seed article (100 threads, one instance)",
        title_justify="left",
        caption="seed avg/p99/success: the article's published table; seed code, measured: "
        "the article's own code run on PostgreSQL 18 + Redis 6.2 (seed/NOTES.md)",
        caption_justify="left",
    )
    table.add_column("strategy")
    for name in ("avg ms", "p99 ms", "success %", "double adv."):
        table.add_column(name, justify="right")
    for name in ("avg ms", "p99 ms", "success %"):
        table.add_column(f"seed {name}", justify="right")
    table.add_column("seed code, measured", no_wrap=True)
    for name in dict.fromkeys([*storm, *SEED_PUBLISHED]):
        ours = storm.get(name)
        seed = SEED_PUBLISHED.get(name)
        mine = (
            [
                _num(ours.avg_ms),
                _num(ours.p99_ms),
                _num(ours.success_pct),
                f"{ours.double_advanced_rounds}/{ours.rounds}",
            ]
            if ours is not None
            else ["not run", "", "", ""]
        )
        theirs = (
            [
                _num(seed.avg_ms, 0),
                _num(seed.p99_ms, 0),
                "—" if seed.success_pct is None else _num(seed.success_pct),
            ]
            if seed is not None
            else ["—", "—", "—"]
        )
        table.add_row(name, *mine, *theirs, SEED_MEASURED.get(name, "—"))
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


def failures(report: BenchReport, limit: int = 5) -> list[str]:
    """One line per failed verdict, with up to ``limit`` of its violations."""
    lines: list[str] = []
    for r in report.results:
        if r.verdict.ok:
            continue
        found = r.verdict.violations
        lines.append(f"{r.scenario}/{r.strategy}: {len(found)} violation(s)")
        lines.extend(f"  - {v}" for v in found[:limit])
        if len(found) > limit:
            lines.append(f"  ... and {len(found) - limit} more")
    return lines


def render(report: BenchReport, console: Console) -> None:
    """Print the results table, the seed comparison, errors and notes to ``console``."""
    parts: list[Table | Text] = [results_table(report)]
    seed = seed_table(report)
    if seed is not None:
        parts.append(seed)
    errors = _errors(report)
    if errors is not None:
        parts.append(errors)
    parts.extend(Text(f"note: {n}", style="yellow") for n in report.notes)
    console.print(Group(*parts))


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
