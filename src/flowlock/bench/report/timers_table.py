"""The timers section as rich tables: the race, the firing lag and the idle cost.

Read from the results; nothing here measures. Each table has a wide form, one with stacked
headers, and last a list of lines, which always fits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from rich import box
from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from flowlock.bench.report.cells import num
from flowlock.bench.results import BenchReport
from flowlock.bench.timer_results import (
    IDLE_TARGET,
    LAG_P99_TARGET_MS,
    RACE_TARGET,
    IdleFigures,
    LagFigures,
    RaceFigures,
)

__all__ = ["races", "timers_layouts"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class _Col(Generic[T]):
    header: str
    cell: Callable[[T], Text]


def _met(ok: bool) -> Text:
    return Text("met", style="green") if ok else Text("not met", style="bold red")


def _check(ok: bool, violations: int) -> Text:
    return Text("ok", style="green") if ok else Text(f"FAIL ({violations})", style="bold red")


def _yes(ok: bool) -> Text:
    return Text("yes", style="green") if ok else Text("NO", style="bold red")


def _scans_cell(f: IdleFigures) -> Text:
    if f.scans_per_s is None:
        return Text("—", style="dim")  # not counted (--quick)
    return Text(num(f.scans_per_s.get("flowlock_timers", 0.0), 2))


def races(report: BenchReport) -> list[tuple[str, RaceFigures]]:
    """The `deadline` pairs' race figures, by strategy, in the order they ran."""
    return [(r.strategy, r.race) for r in report.results if r.race is not None]


_RACE: tuple[_Col[tuple[str, RaceFigures]], ...] = (
    _Col("engines", lambda s: Text(str(s[1].engines))),
    _Col("instances", lambda s: Text(f"{s[1].instances:,}")),
    _Col("approved", lambda s: Text(f"{s[1].approved:,}")),
    _Col("rejected", lambda s: Text(f"{s[1].rejected:,}")),
    _Col("exactly one", lambda s: _yes(s[1].exactly_one)),
    _Col("resolved/s", lambda s: Text(num(s[1].resolved_per_s, 0))),
    _Col("expiry p50 ms", lambda s: Text(num(s[1].expiry_lag.p50_ms))),
    _Col("expiry p99 ms", lambda s: Text(num(s[1].expiry_lag.p99_ms))),
    _Col("left armed", lambda s: Text(str(s[1].left_armed))),
    _Col("checker", lambda s: _check(s[1].checker_ok, s[1].violations)),
    _Col(f"≥ {RACE_TARGET:,.0f}/s", lambda s: _met(s[1].met)),
)
_LAG: tuple[_Col[LagFigures], ...] = (
    _Col("armed", lambda f: Text(f"{f.armed:,}")),
    _Col("due/s", lambda f: Text(num(f.due_per_s, 0))),
    _Col("fired", lambda f: Text(f"{f.lag.count:,}")),
    _Col("p50 ms", lambda f: Text(num(f.lag.p50_ms))),
    _Col("p99 ms", lambda f: Text(num(f.lag.p99_ms))),
    _Col("max ms", lambda f: Text(num(f.lag.max_ms))),
    _Col("missed", lambda f: Text(str(f.missed))),
    _Col("by engine", lambda f: Text(" ".join(str(n) for n in f.firings_by_engine))),
    _Col("checker", lambda f: _check(f.checker_ok, f.violations)),
    _Col(f"p99 < {LAG_P99_TARGET_MS:g} ms", lambda f: _met(f.met)),
)
_IDLE: tuple[_Col[IdleFigures], ...] = (
    _Col("armed", lambda f: Text(f"{f.armed:,}")),
    _Col("window s", lambda f: Text(num(f.window_s))),
    _Col("stmts/s", lambda f: Text(num(f.total_per_s, 2))),
    _Col("timers", lambda f: Text(num(f.statements_per_s.get("timers", 0.0), 2))),
    _Col("listen", lambda f: Text(num(f.statements_per_s.get("listen", 0.0), 2))),
    _Col("escalations", lambda f: Text(num(f.statements_per_s.get("escalations", 0.0), 2))),
    _Col("other", lambda f: Text(num(f.statements_per_s.get("other", 0.0), 2))),
    _Col("timer scans/s", lambda f: _scans_cell(f)),
    _Col(f"timers = {IDLE_TARGET:g}", lambda f: _met(f.met)),
)


def _table(
    title: str,
    first: str,
    columns: Sequence[_Col[T]],
    rows: Sequence[tuple[str, T]],
    *,
    stacked: bool,
    caption: str,
) -> Table:
    table = Table(
        title=title,
        title_justify="left",
        caption=caption,
        caption_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    table.add_column(first, no_wrap=True)
    for column in columns:
        header = column.header.replace(" ", "\n") if stacked else column.header
        table.add_column(header, justify="right", no_wrap=True)
    for label, row in rows:
        table.add_row(label, *(column.cell(row) for column in columns))
    return table


def _lines(
    title: str, columns: Sequence[_Col[T]], rows: Sequence[tuple[str, T]], caption: str
) -> Text:
    """The narrowest form: one line per figure, which wraps rather than being cut."""
    out = Text(title + "\n", style="italic")
    for label, row in rows:
        out.append(f"  {label}:\n")
        for column in columns:
            out.append(f"    {column.header}: ")
            out.append(column.cell(row))
            out.append("\n")
    out.append(caption, style="dim")
    return out


_RACE_CAPTION = (
    "approvals by callers and expiries by the engines' timer services, due at the same instant; "
    "resolved/s: instances from the first due time to the last resolved (server clock); "
    "expiry ms: due time to the expiry's history row"
)
_LAG_CAPTION = (
    "lag: the history row's `at` minus the due time, both on the server; timers armed with "
    "one SQL statement (as the store's create writes them); by engine: firings each made"
)
_IDLE_CAPTION = (
    "one engine, none due, in a database of its own; statements seen in pg_stat_activity "
    "(a lower bound) by kind; timer scans/s: the server's own count of reads of flowlock_timers "
    "(— under --quick)"
)


def _forms(
    title: str,
    first: str,
    columns: Sequence[_Col[T]],
    rows: Sequence[tuple[str, T]],
    caption: str,
) -> list[list[RenderableType]]:
    return [
        [_table(title, first, columns, rows, stacked=False, caption=caption)],
        [_table(title, first, columns, rows, stacked=True, caption=caption)],
        [_lines(title, columns, rows, caption)],
    ]


def timers_layouts(report: BenchReport) -> list[list[list[RenderableType]]]:
    """Each table of the timers section in its layouts, widest first; none without them."""
    found: list[list[list[RenderableType]]] = []
    raced = races(report)
    if raced:
        rows = [(strategy, (strategy, race)) for strategy, race in raced]
        found.append(_forms("timers: the race (deadline)", "strategy", _RACE, rows, _RACE_CAPTION))
    section = report.timers
    if section is not None and section.lag:
        lags = [(f"{f.engines} engine(s)", f) for f in section.lag]
        title = f"timers: firing lag ({section.lag[0].strategy}, {section.lag[0].window_s:.1f} s)"
        found.append(_forms(title, "engines", _LAG, lags, _LAG_CAPTION))
    if section is not None and section.idle is not None:
        idle = [("1 engine", section.idle)]
        found.append(_forms("timers: idle cost", "engines", _IDLE, idle, _IDLE_CAPTION))
    return found
