"""What the report's tables share: number formats, verdict cells, frames and layout choice."""

from __future__ import annotations

import io
from collections.abc import Sequence

from rich import box
from rich.console import Console, RenderableType
from rich.table import Table
from rich.text import Text

from flowlock.bench.results import ScenarioResult

__all__ = [
    "ELLIPSIS",
    "figures_table",
    "fitting",
    "num",
    "pct",
    "success_cell",
    "verdict_cell",
]

ELLIPSIS = "…"
"""What rich puts where it cuts a cell too wide for its column."""


def num(value: float, digits: int = 1) -> str:
    return f"{value:,.{digits}f}"


def pct(value: float) -> str:
    """A success rate that never reads 100.0 unless it is 100."""
    return f"{value:.2f}" if 99.9 < value < 100 else f"{value:.1f}"


def verdict_cell(result: ScenarioResult) -> Text:
    if result.verdict.ok:
        return Text("ok", style="green")
    return Text(f"FAIL ({len(result.verdict.violations)})", style="bold red")


def success_cell(r: ScenarioResult) -> Text:
    return Text(pct(r.success_pct), style="" if r.success_pct >= 100 else "yellow")


def figures_table(
    title: str | None,
    headers: Sequence[str],
    *,
    scenario: bool,
    stacked: bool,
    caption: str | None = None,
) -> Table:
    """A table of (scenario,) strategy, then one right-aligned column per figure."""
    # One space between columns, not two: the 15 columns then fit 160 (a piped run's width)
    # with every header whole.
    table = Table(
        title=title,
        title_justify="left",
        caption=caption,
        caption_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    if scenario:
        table.add_column("scenario", no_wrap=True)
    table.add_column("strategy", no_wrap=True)
    # no_wrap: rich narrows the wrapping columns first, past their longest word, so a
    # figure in one would be cut before any text is wrapped. render picks a form that fits.
    # stacked: each header's words one under the other ("p99" over "ms"), the narrowest
    # header a no_wrap column can have.
    for header in headers:
        table.add_column(
            header.replace(" ", "\n") if stacked else header, justify="right", no_wrap=True
        )
    return table


def _fits(console: Console, parts: Sequence[RenderableType]) -> bool:
    """Whether every table of `parts` prints whole at the console's width.

    Rich cuts a number or a header word only with an ellipsis; text wraps and always fits.
    We print the tables unseen instead of asking rich to measure.
    Rich's measure is clamped to the width and counts collapsed padding twice.
    """
    probe = Console(
        width=console.options.max_width, file=io.StringIO(), record=True, color_system=None
    )
    for part in parts:
        if isinstance(part, Table):
            probe.print(part)
    return ELLIPSIS not in probe.export_text()


def fitting(console: Console, layouts: Sequence[Sequence[RenderableType]]) -> list[RenderableType]:
    """The first of `layouts` (widest first) that fits `console`; the last when none does."""
    for parts in layouts:
        if _fits(console, parts):
            return list(parts)
    return list(layouts[-1])
