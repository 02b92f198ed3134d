"""The capacity scenarios as a rich table: throughput against the floor, the holders proved
from the slot log, refusals and fairness.

Read from the results; nothing here measures.
"""

from __future__ import annotations

from rich.console import RenderableType
from rich.text import Text

from flowlock.bench.capacity_results import CapacityFigures
from flowlock.bench.report.aims import floors, vs_floor
from flowlock.bench.report.cells import num
from flowlock.bench.report.sections import Col, check_cell, forms, section_table, yes_cell
from flowlock.bench.results import BenchReport, ScenarioResult

__all__ = ["capacity_layouts"]

_Row = tuple[ScenarioResult, CapacityFigures, float | None]
"""A result, its capacity figures, and its applied/s as a multiple of the floor's."""


def _none() -> Text:
    return Text("—", style="dim")


def _ratio(row: _Row) -> Text:
    return _none() if row[2] is None else Text(f"{row[2]:.2f}×")


def _jain(row: _Row) -> Text:
    fair = row[1].jain_fairness
    return _none() if fair is None else Text(f"{fair:.3f}")


_COLUMNS: tuple[Col[_Row], ...] = (
    Col("applied /s", lambda r: Text(num(r[0].applied_per_s, 0))),
    Col("vs floor", _ratio),
    Col("p99 ms", lambda r: Text(num(r[0].p99_ms))),
    Col("keys", lambda r: Text(f"{r[1].keys:,}")),
    Col("max holders", lambda r: Text(f"{r[1].max_holders} / {r[1].limit}")),
    Col("within", lambda r: yes_cell(r[1].ok)),
    Col("refusals", lambda r: Text(f"{r[1].refusals:,}")),
    Col("gave up", lambda r: Text(f"{r[1].gave_up:,}")),
    Col("waiters", lambda r: Text(f"{r[1].waiters:,}")),
    Col("Jain", _jain),
    Col("verdict", lambda r: check_cell(r[0].verdict.ok, len(r[0].verdict.violations))),
)

_CAPTION = (
    "max holders: the most any key had at once, replayed from the slot log in (key, seq) order; "
    "refusals: CapacityReached answers, each retried after a jittered sleep; gave up: enters "
    "still refused after the bound; Jain: fairness over the applied entries of the callers "
    "that waited (1 = equal shares); vs floor: applied/s over the raw floor's"
)


def capacity_layouts(report: BenchReport) -> list[list[list[RenderableType]]]:
    """The capacity table in its layouts, widest first; none without capacity results."""
    base = floors(report)
    rows: list[tuple[str, _Row]] = []
    for r in report.results:
        if r.capacity is None:
            continue
        ratio = vs_floor(r, base.get(r.scenario)).get("applied_per_s")
        rows.append((r.label, (r, r.capacity, ratio)))
    if not rows:
        return []
    title = "capacity: never more holders than the limit, proved from the slot log"
    layouts = forms(title, "pair", _COLUMNS, rows, _CAPTION)
    # Before the lines: the throughput and the proof apart, each with stacked headers.
    split: list[RenderableType] = [
        section_table(title, "pair", _COLUMNS[:6], rows, stacked=True, caption=None),
        section_table(None, "pair", _COLUMNS[6:], rows, stacked=True, caption=_CAPTION),
    ]
    return [[*layouts[:2], split, *layouts[2:]]]
