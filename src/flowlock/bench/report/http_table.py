"""The `--http` results as rich tables, each against its in-process twin."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from flowlock.bench.report.aims import (
    HTTP_P99_FACTOR,
    HTTP_P99_SLACK_MS,
    HTTP_RATE_FACTOR,
    Overhead,
    in_process,
    overhead,
)
from flowlock.bench.report.cells import figures_table, num, success_cell, verdict_cell
from flowlock.bench.results import HTTP, IN_PROCESS, BenchReport, ScenarioResult

__all__ = ["http_layouts", "http_table", "in_process_only"]


def in_process_only(report: BenchReport) -> BenchReport:
    """`report` with its in-process results only.

    The results, seed and aims tables show these; HTTP results have their own table.
    """
    return replace(report, results=tuple(r for r in report.results if r.transport == IN_PROCESS))


@dataclass(frozen=True, slots=True)
class _HttpColumn:
    header: str
    cell: Callable[[ScenarioResult, Overhead | None], Text]
    overhead: bool = False
    """A column of the comparison with the in-process twin (the second table of a split)."""


def _or_dash(found: Overhead | None, show: Callable[[Overhead], str]) -> Text:
    return Text("—", style="dim") if found is None else Text(show(found))


def _ratio_text(found: Overhead) -> str:
    return "—" if found.ratio is None else f"{found.ratio:.2f}"


def _met_cell(found: Overhead | None, met: Callable[[Overhead], bool]) -> Text:
    if found is None:
        return Text("no twin", style="dim")  # the in-process result of the pair is missing
    ok = met(found)
    return Text("met" if ok else "not met", style="green" if ok else "bold red")


def _rate_text(found: Overhead) -> str:
    return "—" if found.rate_ratio is None else f"{found.rate_ratio:.2f}"


_HTTP_COLUMNS: tuple[_HttpColumn, ...] = (
    _HttpColumn("calls/s", lambda r, o: Text(num(r.calls_per_s, 0))),
    _HttpColumn("p50 ms", lambda r, o: Text(num(r.p50_ms))),
    _HttpColumn("p99 ms", lambda r, o: Text(num(r.p99_ms))),
    _HttpColumn("success %", lambda r, o: success_cell(r)),
    _HttpColumn("verdict", lambda r, o: verdict_cell(r)),
    _HttpColumn(
        "in-proc p99 ms", lambda r, o: _or_dash(o, lambda f: num(f.in_process_p99_ms)), True
    ),
    _HttpColumn("p99 ×", lambda r, o: _or_dash(o, _ratio_text), True),
    _HttpColumn("+ms", lambda r, o: _or_dash(o, lambda f: f"{f.diff_ms:+,.1f}"), True),
    _HttpColumn("aim", lambda r, o: _met_cell(o, lambda f: f.met), True),
    _HttpColumn("calls/s ×", lambda r, o: _or_dash(o, _rate_text), True),
    _HttpColumn("rate aim", lambda r, o: _met_cell(o, lambda f: f.rate_met), True),
)
"""The HTTP table's figures: the result's own, then against its in-process twin."""


def _http_results(report: BenchReport) -> list[ScenarioResult]:
    return [r for r in report.results if r.transport == HTTP]


def _http_title(report: BenchReport) -> str:
    service = report.args.get("http_service")
    workers = service.get("workers") if isinstance(service, Mapping) else None
    served = f"flowlock serve, {workers} worker(s)" if workers else "flowlock serve"
    return f"through HTTP ({served}) against in-process, same run"


def _http_caption(report: BenchReport) -> str:
    return (
        f"aim: HTTP p99 ≤ {HTTP_P99_FACTOR:g} × in-process p99 + {HTTP_P99_SLACK_MS:g} ms; "
        "p99 ×: HTTP p99 over in-process p99; +ms: their difference. "
        f"rate aim: HTTP calls/s ≥ {HTTP_RATE_FACTOR:g} × in-process calls/s; calls/s ×: "
        "their ratio. "
        f"{report.args.get('workers')} callers run in a load generator process of their own, "
        f"on the same {report.cores} cores as the service and PostgreSQL: on a shared machine "
        "every figure is noisy"
    )


def http_table(
    report: BenchReport,
    results: Sequence[ScenarioResult] | None = None,
    *,
    title: str | None = None,
    scenario: bool = True,
    stacked: bool = False,
    columns: Sequence[_HttpColumn] = _HTTP_COLUMNS,
    caption: bool = True,
) -> Table | None:
    """The HTTP results, one row per (scenario, strategy); None without HTTP results.

    Columns: calls/s, p50, p99, success and verdict. Then the in-process p99 of the same pair,
    the ratio and difference of the p99s, the p99 aim, the ratio of the calls/s and the
    rate aim.
    """
    shown = list(results) if results is not None else _http_results(report)
    if not shown:
        return None
    table = figures_table(
        _http_title(report) if title is None else title or None,
        [c.header for c in columns],
        scenario=scenario,
        stacked=stacked,
        caption=_http_caption(report) if caption else None,
    )
    twins = in_process(report)
    last = None
    for r in shown:
        if scenario and last is not None and r.scenario != last:
            table.add_section()
        last = r.scenario
        found = overhead(r, twins.get((r.scenario, r.strategy)))
        row: list[Text | str] = [r.scenario] if scenario else []
        row.append(r.strategy)
        row.extend(column.cell(r, found) for column in columns)
        table.add_row(*row)
    return table


def http_layouts(report: BenchReport) -> list[list[RenderableType]]:
    """The HTTP results in ever narrower layouts; empty without HTTP results.

    The title heads the first table and the caption ends the last.
    """
    results = _http_results(report)
    if not results:
        return []
    grouped: dict[str, list[ScenarioResult]] = {}
    for r in results:
        grouped.setdefault(r.scenario, []).append(r)
    heading = Text(_http_title(report), style="italic")
    caption = Text(_http_caption(report), style="dim")
    own = [c for c in _HTTP_COLUMNS if not c.overhead]
    against = [c for c in _HTTP_COLUMNS if c.overhead]

    def form(parts: list[Table | None]) -> list[RenderableType]:
        return [heading, *[t for t in parts if t is not None], caption]

    per_scenario = form(
        [
            http_table(report, rs, title=name, scenario=False, caption=False)
            for name, rs in grouped.items()
        ]
    )

    def halves(stacked: bool) -> list[RenderableType]:
        return form(
            [
                http_table(
                    report, results, title=what, stacked=stacked, columns=columns, caption=False
                )
                for what, columns in (("the HTTP figures", own), ("against in-process", against))
            ]
        )

    split = form(
        [
            http_table(
                report,
                rs,
                title=what,
                scenario=False,
                stacked=True,
                columns=columns,
                caption=False,
            )
            for name, rs in grouped.items()
            for what, columns in ((name, own), (f"{name}: against in-process", against))
        ]
    )
    wide = http_table(report)
    return [
        [wide] if wide is not None else [],
        per_scenario,
        halves(stacked=False),
        halves(stacked=True),
        split,
    ]
