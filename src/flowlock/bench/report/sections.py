"""What the sections' tables share (timers, outbox): a column, the three forms of a table
(wide, stacked headers, lines), and the met / ok cells."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from rich import box
from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

__all__ = ["Col", "check_cell", "forms", "met_cell", "section_table", "yes_cell"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Col(Generic[T]):
    header: str
    cell: Callable[[T], Text]


def met_cell(ok: bool) -> Text:
    return Text("met", style="green") if ok else Text("not met", style="bold red")


def check_cell(ok: bool, violations: int) -> Text:
    return Text("ok", style="green") if ok else Text(f"FAIL ({violations})", style="bold red")


def yes_cell(ok: bool) -> Text:
    return Text("yes", style="green") if ok else Text("NO", style="bold red")


def section_table(
    title: str | None,
    first: str,
    columns: Sequence[Col[T]],
    rows: Sequence[tuple[str, T]],
    *,
    stacked: bool,
    caption: str | None,
) -> Table:
    """One section's table: a label column, then a right-aligned column per figure.

    `stacked` puts each word of a header on a line of its own.
    """
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
    title: str, columns: Sequence[Col[T]], rows: Sequence[tuple[str, T]], caption: str
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


def forms(
    title: str,
    first: str,
    columns: Sequence[Col[T]],
    rows: Sequence[tuple[str, T]],
    caption: str,
) -> list[list[RenderableType]]:
    return [
        [section_table(title, first, columns, rows, stacked=False, caption=caption)],
        [section_table(title, first, columns, rows, stacked=True, caption=caption)],
        [_lines(title, columns, rows, caption)],
    ]
