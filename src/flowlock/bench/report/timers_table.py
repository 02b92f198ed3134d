"""The timers section as rich tables: the race, the firing lag and the idle cost.

Read from the results; nothing here measures. Each table has a wide form, one with stacked
headers, and last a list of lines, which always fits.
"""

from __future__ import annotations

from rich.console import RenderableType
from rich.text import Text

from flowlock.bench.report.cells import num
from flowlock.bench.report.sections import Col, check_cell, forms, met_cell, yes_cell
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


def _scans_cell(f: IdleFigures) -> Text:
    if f.scans_per_s is None:
        return Text("—", style="dim")  # not counted (--quick)
    return Text(num(f.scans_per_s.get("flowlock_timers", 0.0), 2))


def races(report: BenchReport) -> list[tuple[str, RaceFigures]]:
    """The `deadline` pairs' race figures, by strategy, in the order they ran."""
    return [(r.strategy, r.race) for r in report.results if r.race is not None]


_RACE: tuple[Col[tuple[str, RaceFigures]], ...] = (
    Col("engines", lambda s: Text(str(s[1].engines))),
    Col("instances", lambda s: Text(f"{s[1].instances:,}")),
    Col("approved", lambda s: Text(f"{s[1].approved:,}")),
    Col("rejected", lambda s: Text(f"{s[1].rejected:,}")),
    Col("exactly one", lambda s: yes_cell(s[1].exactly_one)),
    Col("resolved/s", lambda s: Text(num(s[1].resolved_per_s, 0))),
    Col("expiry p50 ms", lambda s: Text(num(s[1].expiry_lag.p50_ms))),
    Col("expiry p99 ms", lambda s: Text(num(s[1].expiry_lag.p99_ms))),
    Col("left armed", lambda s: Text(str(s[1].left_armed))),
    Col("checker", lambda s: check_cell(s[1].checker_ok, s[1].violations)),
    Col(f"≥ {RACE_TARGET:,.0f}/s", lambda s: met_cell(s[1].met)),
)
_LAG: tuple[Col[LagFigures], ...] = (
    Col("armed", lambda f: Text(f"{f.armed:,}")),
    Col("due/s", lambda f: Text(num(f.due_per_s, 0))),
    Col("fired", lambda f: Text(f"{f.lag.count:,}")),
    Col("p50 ms", lambda f: Text(num(f.lag.p50_ms))),
    Col("p99 ms", lambda f: Text(num(f.lag.p99_ms))),
    Col("max ms", lambda f: Text(num(f.lag.max_ms))),
    Col("missed", lambda f: Text(str(f.missed))),
    Col("by engine", lambda f: Text(" ".join(str(n) for n in f.firings_by_engine))),
    Col("checker", lambda f: check_cell(f.checker_ok, f.violations)),
    Col(f"p99 < {LAG_P99_TARGET_MS:g} ms", lambda f: met_cell(f.met)),
)
_IDLE: tuple[Col[IdleFigures], ...] = (
    Col("armed", lambda f: Text(f"{f.armed:,}")),
    Col("window s", lambda f: Text(num(f.window_s))),
    Col("stmts/s", lambda f: Text(num(f.total_per_s, 2))),
    Col("timers", lambda f: Text(num(f.statements_per_s.get("timers", 0.0), 2))),
    Col("listen", lambda f: Text(num(f.statements_per_s.get("listen", 0.0), 2))),
    Col("escalations", lambda f: Text(num(f.statements_per_s.get("escalations", 0.0), 2))),
    Col("other", lambda f: Text(num(f.statements_per_s.get("other", 0.0), 2))),
    Col("timer scans/s", lambda f: _scans_cell(f)),
    Col(f"timers = {IDLE_TARGET:g}", lambda f: met_cell(f.met)),
)


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


def timers_layouts(report: BenchReport) -> list[list[list[RenderableType]]]:
    """Each table of the timers section in its layouts, widest first; none without them."""
    found: list[list[list[RenderableType]]] = []
    raced = races(report)
    if raced:
        rows = [(strategy, (strategy, race)) for strategy, race in raced]
        found.append(forms("timers: the race (deadline)", "strategy", _RACE, rows, _RACE_CAPTION))
    section = report.timers
    if section is not None and section.lag:
        lags = [(f"{f.engines} engine(s)", f) for f in section.lag]
        title = f"timers: firing lag ({section.lag[0].strategy}, {section.lag[0].window_s:.1f} s)"
        found.append(forms(title, "engines", _LAG, lags, _LAG_CAPTION))
    if section is not None and section.idle is not None:
        idle = [("1 engine", section.idle)]
        found.append(forms("timers: idle cost", "engines", _IDLE, idle, _IDLE_CAPTION))
    return found
