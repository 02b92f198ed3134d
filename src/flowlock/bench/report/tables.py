"""The run as rich tables, read from the results; nothing here measures.

`render` prints them all, each in the widest layout that fits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from rich import box
from rich.console import Console, Group, RenderableType
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
from flowlock.bench.report.capacity_table import capacity_layouts
from flowlock.bench.report.cells import (
    figures_table,
    fitting,
    num,
    pct,
    success_cell,
    verdict_cell,
)
from flowlock.bench.report.http_table import http_layouts, in_process_only
from flowlock.bench.report.outbox_table import outbox_layouts
from flowlock.bench.report.timers_table import timers_layouts
from flowlock.bench.results import BenchReport, ScenarioResult

__all__ = [
    "SEED_COUNTERPART",
    "SEED_MEASURED",
    "SEED_PUBLISHED",
    "SeedFigures",
    "aims_layouts",
    "aims_table",
    "render",
    "results_layouts",
    "results_table",
    "seed_layouts",
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


def title(report: BenchReport) -> str:
    redis = f", Redis {report.redis_version}" if report.redis_version else ""
    batching = report.args.get("batching")
    switch = "" if batching is None else f", batching {'on' if batching else 'off'}"
    if report.args.get("http"):
        switch += ", in-process"
    return (
        f"flowlock bench: {report.args.get('workers')} callers{switch}{_hosts_title(report)}, "
        f"PostgreSQL {report.postgres_version} ({report.database}){redis}, {report.loop}, "
        f"{report.cores} cores"
    )


def _hosts_title(report: BenchReport) -> str:
    hosts = report.args.get("hosts")
    if not hosts:
        return ""
    delay = hosts.get("netem_delay_ms") or 0
    link = f"netem {delay:g} ms each way" if delay else "no netem delay"
    return f", {hosts.get('count')} namespaced hosts ({link})"


def _batch_cell(result: ScenarioResult) -> Text:
    if result.mean_batch is None:
        return Text("—", style="dim")
    return Text(num(result.mean_batch, 2))


def _cpu_cell(result: ScenarioResult) -> Text:
    if result.cpu_us is None:
        return Text("—", style="dim")
    return Text(num(result.cpu_us, 0))


@dataclass(frozen=True, slots=True)
class _Column:
    """One figure of the results table: header, cell, and whether narrow terminals may drop it.

    The figures a reader checks a run by always stay.
    """

    header: str
    cell: Callable[[ScenarioResult], Text]
    essential: bool = True


_COLUMNS: tuple[_Column, ...] = (
    _Column("calls", lambda r: Text(str(r.calls))),
    _Column("avg ms", lambda r: Text(num(r.avg_ms))),
    _Column("p50 ms", lambda r: Text(num(r.p50_ms))),
    _Column("p99 ms", lambda r: Text(num(r.p99_ms))),
    _Column("max ms", lambda r: Text(num(r.max_ms)), essential=False),
    _Column("success %", success_cell),
    _Column("att/call", lambda r: Text(num(r.attempts_per_call, 2)), essential=False),
    _Column("batch", _batch_cell),
    _Column("calls/s", lambda r: Text(num(r.calls_per_s, 0))),
    _Column("applied/s", lambda r: Text(num(r.applied_per_s, 0))),
    _Column("peak conns", lambda r: Text(str(r.peak_connections)), essential=False),
    _Column("lock wait ms", lambda r: Text(num(r.lock_wait_ms)), essential=False),
    _Column("cpu µs", _cpu_cell, essential=False),
)
"""The figures in the order of the wide table; the verdict follows them."""

_LATENCY = ("calls", "avg ms", "p50 ms", "p99 ms", "max ms")
"""Under 80 columns each scenario's figures split in two tables: these, then the rest."""


def _table(
    title: str | None,
    results: Sequence[ScenarioResult],
    columns: Sequence[_Column],
    *,
    scenario: bool,
    verdict: bool = True,
    stacked: bool = False,
) -> Table:
    table = figures_table(title, [c.header for c in columns], scenario=scenario, stacked=stacked)
    if verdict:
        # In one table per scenario "FAIL (12)" may take two lines: that is what fits 80.
        table.add_column("verdict", no_wrap=scenario)
    last = None
    for r in results:
        if scenario and last is not None and r.scenario != last:
            table.add_section()
        last = r.scenario
        row: list[Text | str] = [r.scenario] if scenario else []
        row.append(Text(r.strategy, style="dim" if r.strategy == FLOOR else ""))
        row.extend(column.cell(r) for column in columns)
        if verdict:
            row.append(verdict_cell(r))
        table.add_row(*row)
    return table


def results_table(report: BenchReport) -> Table:
    """One row per (scenario, strategy), with every figure: the 160-column form."""
    return _table(title(report), report.results, _COLUMNS, scenario=True)


def _by_scenario(report: BenchReport) -> dict[str, list[ScenarioResult]]:
    grouped: dict[str, list[ScenarioResult]] = {}
    for r in report.results:
        grouped.setdefault(r.scenario, []).append(r)
    return grouped


def results_layouts(report: BenchReport) -> list[list[RenderableType]]:
    """The results in ever narrower layouts, widest first.

    Narrower layouts drop figures the JSON still has, then split by scenario.
    The narrowest shows each scenario's latencies and outcomes in two tables.
    """
    essential = [c for c in _COLUMNS if c.essential]
    latency = [c for c in essential if c.header in _LATENCY]
    outcome = [c for c in essential if c.header not in _LATENCY]
    unbatched = [c for c in essential if c.header != "batch"]
    heading = Text(title(report), style="italic")

    def per_scenario(columns: Sequence[_Column], stacked: bool) -> list[RenderableType]:
        tables = [
            _table(name, results, columns, scenario=False, stacked=stacked)
            for name, results in _by_scenario(report).items()
        ]
        return [heading, *tables]

    split: list[RenderableType] = [heading]
    for name, results in _by_scenario(report).items():
        split.append(_table(f"{name}: latency", results, latency, scenario=False, verdict=False))
        split.append(_table(f"{name}: outcome", results, outcome, scenario=False))
    return [
        [results_table(report)],
        [_table(title(report), report.results, essential, scenario=True)],
        per_scenario(essential, stacked=False),
        per_scenario(essential, stacked=True),
        per_scenario(unbatched, stacked=True),
        split,
    ]


def seed_table(
    report: BenchReport, *, measured: bool = True, ours: bool = True, theirs: bool = True
) -> Table | None:
    """The `storm` results beside the seed article's figures; None without a storm.

    Unless `measured` is False it adds what the seed's own code measured.
    `ours` or `theirs` False leaves out our figures or the article's.
    """
    storm = [r for r in report.results if r.scenario == "storm"]
    if not storm:
        return None
    # Split in two (ours, then theirs), the title heads the first and the caption ends the last.
    table = Table(
        title="storm: flowlock vs the seed article (100 threads, one instance)" if ours else None,
        title_justify="left",
        caption="seed avg/p99/success: the article's published table; seed code, measured: "
        "the article's own code, run by the flowlock developers on PostgreSQL 18 + Redis 6.2"
        if theirs
        else None,
        caption_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    table.add_column("strategy", no_wrap=True)
    # no_wrap: see _table.
    for name in ("avg ms", "p99 ms", "success %", "double adv.") if ours else ():
        table.add_column(name, justify="right", no_wrap=True)
    for name in ("avg ms", "p99 ms", "success %") if theirs else ():
        table.add_column(f"seed {name}", justify="right", no_wrap=True)
    if measured:
        # Words, not figures: wrapping them is what lets the table fit 80 columns.
        table.add_column("seed code, measured", min_width=12)
    for r in storm:
        counterpart = SEED_COUNTERPART.get(r.strategy)
        seed = SEED_PUBLISHED.get(counterpart) if counterpart else None
        published: list[Text | str] = (
            [
                num(seed.avg_ms, 0),
                num(seed.p99_ms, 0),
                "—" if seed.success_pct is None else num(seed.success_pct),
            ]
            if seed is not None
            else ["—", "—", "—"]
        )
        figures: list[Text | str] = [
            num(r.avg_ms),
            num(r.p99_ms),
            num(r.success_pct),
            Text(
                f"{r.double_advanced_rounds}/{r.rounds}",
                style="bold red" if r.double_advanced_rounds else "",
            ),
        ]
        table.add_row(
            r.strategy,
            *(figures if ours else []),
            *(published if theirs else []),
            *([SEED_MEASURED.get(counterpart or "", "—")] if measured else []),
        )
    return table


def seed_layouts(report: BenchReport) -> list[list[RenderableType]]:
    """The seed comparison, widest first; empty when the run had no storm.

    Narrower forms move the seed code's column to lines, then split ours and the article's.
    """
    wide = seed_table(report)
    narrow = seed_table(report, measured=False)
    if wide is None or narrow is None:
        return []
    strategies = [r.strategy for r in report.results if r.scenario == "storm"]
    lines = [
        f"{s}: {SEED_MEASURED[SEED_COUNTERPART[s]]}" for s in strategies if s in SEED_COUNTERPART
    ]
    text: list[RenderableType] = (
        [Text("seed code, measured:\n  " + "\n  ".join(lines), style="dim")] if lines else []
    )
    split: list[RenderableType | None] = [seed_table(report, measured=False, theirs=False)]
    split.append(seed_table(report, measured=False, ours=False))
    return [[wide], [narrow, *text], [t for t in split if t is not None] + text]


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
    """The target, plus the distributed strategies' own when it differs and they are shown."""
    sign = "≤" if spec.compare == "<=" else "≥"
    target = f"{sign} {spec.target:g}×"
    if spec.distributed != spec.target and any(is_distributed(s) for s in strategies):
        target += f" (dist. {spec.distributed:g}×)"
    return target


def aims_table(
    report: BenchReport,
    only: Sequence[str] | None = None,
    *,
    narrow: bool = False,
    heading: bool = True,
    caption: bool = True,
) -> Table | None:
    """The aims against this run's floor, one column per strategy; None without a floor.

    Rows: scenarios below 100 % success, violations, then each ratio aim and whether it was met.
    `only` limits the strategies. `narrow` wraps aims and targets, leaving room for names.
    `heading` and `caption` False drop the title and caption, when tables continue.
    """
    checked = aims(report)
    if not floors(report) or not checked:
        return None
    ran = {a.scenario for a in checked}
    strategies = list(dict.fromkeys(a.strategy for a in checked))
    if only is not None:
        strategies = [s for s in strategies if s in only]
    table = Table(
        title="aims, against the raw floor of this run" if heading else None,
        title_justify="left",
        caption="each ratio is the strategy's figure over the raw floor's in the same run; "
        "dist.: the distributed strategies' target (they take a lease on every call); "
        "success: the scenarios below 100 % (failed calls: lost to contention, never wrong)"
        if caption
        else None,
        caption_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    # Rich narrows the widest wrapping columns first (the strategies', whose success cell is
    # long) and would cut their names; capped, the aims and targets wrap instead.
    table.add_column("aim", max_width=16 if narrow else None)
    table.add_column("target", max_width=12 if narrow else None)
    for strategy in strategies:
        # A name is one word: aims_layouts gives fewer strategies per table rather than cut it.
        table.add_column(strategy, justify="right")
    mine = {s: [a for a in checked if a.strategy == s] for s in strategies}
    success: list[Text] = []
    violations: list[Text] = []
    for strategy in strategies:
        short = [
            f"{a.scenario} {pct(a.measured or 0.0)}"
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


def aims_layouts(report: BenchReport) -> list[list[RenderableType]]:
    """The aims, widest first; empty when the run had no floor.

    Narrower forms wrap the aims and spread the strategies over several tables.
    The title goes on the first table and the caption under the last.
    """
    wide = aims_table(report)
    if wide is None:
        return []
    strategies = list(dict.fromkeys(a.strategy for a in aims(report)))
    layouts: list[list[RenderableType]] = [[wide]]
    for count in range(1, len(strategies) + 1):
        size = -(-len(strategies) // count)  # ceiling: as even a share as the count allows
        starts = range(0, len(strategies), size)
        tables = [
            aims_table(
                report,
                strategies[i : i + size],
                narrow=True,
                heading=i == 0,
                caption=i == starts[-1],
            )
            for i in starts
        ]
        layouts.append([t for t in tables if t is not None])
    return layouts


def _errors(report: BenchReport) -> Text | None:
    lines = [
        f"{r.label}: " + ", ".join(f"{name} × {count}" for name, count in r.errors.items())
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


def _escalations_text(report: BenchReport) -> Text | None:
    """How many instances the engines escalated, and how many they adopted from the board.

    Shown only when several engines shared the adaptive rows (workers or hosts).
    """
    lines = [
        f"{r.scenario}: {r.escalated} escalations by {r.processes} engines"
        + (f" on {r.hosts} hosts" if r.hosts else "")
        + f", {r.adopted} adopted from another engine's decision"
        for r in report.results
        if r.strategy == "adaptive" and r.escalated is not None and r.processes > 1
    ]
    if not lines:
        return None
    text = "adaptive escalations, shared through PostgreSQL:\n  " + "\n  ".join(lines)
    return Text(text, style="dim")


def render(report: BenchReport, console: Console) -> None:
    """Print every table, the notes and the total time to `console`.

    Each table takes the widest layout that fits the console, so no number is ever cut.
    At 80 columns that is one table per scenario, with fewer figures.
    """
    local = in_process_only(report)
    parts: list[RenderableType] = fitting(console, results_layouts(local))
    for layouts in (seed_layouts(local), http_layouts(report), aims_layouts(local)):
        if layouts:
            parts.extend(fitting(console, layouts))
    for layouts in (*timers_layouts(report), *outbox_layouts(report), *capacity_layouts(report)):
        parts.extend(fitting(console, layouts))
    for extra in (_floors_text(report), _errors(report), _escalations_text(report)):
        if extra is not None:
            parts.append(extra)
    parts.extend(Text(f"note: {n}", style="yellow") for n in report.notes)
    for section in (report.timers, report.outbox):
        if section is not None:
            parts.extend(Text(f"note: {n}", style="yellow") for n in section.notes)
    if report.log:
        shown = [line if len(line) <= 200 else line[:197] + "..." for line in report.log[:10]]
        more = len(report.log) - len(shown)
        text = "flowlock logged during the run:\n  " + "\n  ".join(shown)
        parts.append(Text(text + (f"\n  ... {more} more kinds" if more > 0 else ""), style="dim"))
    parts.append(Text(f"total {report.duration_s:.1f} s", style="bold"))
    console.print(Group(*parts))
