"""The outbox section as rich tables: each pair with and without messages, and the idle cost.

Read from the results; nothing here measures. Each table has a wide form, one with stacked
headers, and last a list of lines, which always fits.
"""

from __future__ import annotations

from rich.console import RenderableType
from rich.text import Text

from flowlock.bench.outbox_results import (
    IDLE_TARGET,
    RATIO_TARGET,
    OutboxIdle,
    OutboxPair,
    outbox_pairs,
)
from flowlock.bench.report.cells import num
from flowlock.bench.report.sections import (
    Col,
    check_cell,
    forms,
    met_cell,
    section_table,
    yes_cell,
)
from flowlock.bench.results import BenchReport

__all__ = ["outbox_layouts"]


def _none() -> Text:
    return Text("—", style="dim")


def _baseline(p: OutboxPair) -> Text:
    return _none() if p.without_per_s is None else Text(num(p.without_per_s, 0))


def _ratio(p: OutboxPair) -> Text:
    ratio = p.ratio
    return _none() if ratio is None else Text(f"{ratio:.2f}×")


def _aim(p: OutboxPair) -> Text:
    met = p.met
    return _none() if met is None else met_cell(met)


def _scans(f: OutboxIdle) -> Text:
    if f.scans_per_s is None:
        return _none()  # not counted (--quick)
    return Text(num(f.scans_per_s.get(f.table, 0.0), 2))


def _kind(kind: str) -> Col[OutboxIdle]:
    return Col(kind, lambda f: Text(num(f.statements_per_s.get(kind, 0.0), 2)))


_PAIRS: tuple[Col[OutboxPair], ...] = (
    Col("without /s", _baseline),
    Col("with /s", lambda p: Text(num(p.with_per_s, 0))),
    Col("ratio", _ratio),
    Col(f"aim ≥{RATIO_TARGET:g}×", _aim),
    Col("messages", lambda p: Text(f"{p.delivery.emitted:,}")),
    Col("all delivered", lambda p: yes_cell(p.delivery.ok)),
    Col("dup", lambda p: Text(str(p.delivery.duplicates))),
    Col("lag p50 ms", lambda p: Text(num(p.delivery.lag.p50_ms))),
    Col("lag p99 ms", lambda p: Text(num(p.delivery.lag.p99_ms))),
    Col("claim p99 ms", lambda p: Text(num(p.delivery.claim_lag.p99_ms))),
    Col("verdict", lambda p: check_cell(p.verdict_ok, p.violations)),
)
_IDLE: tuple[Col[OutboxIdle], ...] = (
    Col("done", lambda f: Text(f"{f.done:,}")),
    Col("window s", lambda f: Text(num(f.window_s))),
    Col("stmts/s", lambda f: Text(num(f.total_per_s, 2))),
    _kind("outbox"),
    _kind("listen"),
    _kind("timers"),
    _kind("escalations"),
    _kind("other"),
    Col("outbox scans/s", _scans),
    Col(f"outbox = {IDLE_TARGET:g}", lambda f: met_cell(f.met)),
)

_PAIRS_CAPTION = (
    "applied/s of the same calls without messages and with one per transition, in alternate "
    "rounds on one session; lag: the message's commit to its handler's start, on the server's "
    "clock; claim: commit to claim (Message.lag); dup: deliveries beyond the first"
)
_IDLE_CAPTION = (
    "one engine with a handler, its dispatcher running, nothing pending, in a database of its "
    "own; statements seen in pg_stat_activity (a lower bound) by kind; outbox scans/s: the "
    "server's own count of reads of the outbox's table (— under --quick)"
)


def outbox_layouts(report: BenchReport) -> list[list[list[RenderableType]]]:
    """Each table of the outbox section in its layouts, widest first; none without them."""
    found: list[list[list[RenderableType]]] = []
    pairs = outbox_pairs(report)
    if pairs:
        rows = [(f"{p.baseline} / {p.strategy}", p) for p in pairs]
        title = "outbox: one message per transition, delivered to a local sink"
        layouts = forms(title, "pair", _PAIRS, rows, _PAIRS_CAPTION)
        # Before the lines: the throughput and the delivery apart, each with stacked headers.
        split = [
            section_table(title, "pair", _PAIRS[:4], rows, stacked=True, caption=None),
            section_table(None, "pair", _PAIRS[4:], rows, stacked=True, caption=_PAIRS_CAPTION),
        ]
        found.append([*layouts[:2], list(split), *layouts[2:]])
    section = report.outbox
    if section is not None and section.idle is not None:
        idle = [("1 engine", section.idle)]
        found.append(forms("outbox: idle cost", "engines", _IDLE, idle, _IDLE_CAPTION))
    return found
