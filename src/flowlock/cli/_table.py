"""Rows for people at any width: a table when it fits, else one block of lines per row.

Ids, keys, names and timestamps are tokens: an operator copies and greps them, so they are
never broken across lines. A table is printed only when every token fits whole in its column
at the console's width. Otherwise each row becomes a block of `name  value` lines, where a
token stays on one line (past the edge if it is longer than the line) and free text wraps at
spaces. Why and how wide: docs/operations.md ("Reading at 80 columns").
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

from rich.cells import cell_len
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

__all__ = ["Column", "print_record", "print_rows", "print_wrapped"]

_GAP = 2
"""Spaces between a block's names and its values."""
_UNBOUNDED = 1 << 20


@dataclass(frozen=True, slots=True)
class Column:
    """A column's header, and whether its cells are tokens (printed whole) or free text."""

    header: str
    text: bool = False


def wrapped(text: Text, width: int) -> list[Text]:
    """`text` as lines of at most `width` cells, broken at spaces only: a word longer than a
    line is a line of its own, whole. The text's own style carries over to each line."""
    lines: list[Text] = []
    for paragraph in text.plain.split("\n"):
        pieces = textwrap.wrap(
            paragraph, max(width, 1), break_long_words=False, break_on_hyphens=False
        )
        lines += [Text(piece, style=text.style) for piece in pieces or [""]]
    return lines


def print_wrapped(console: Console, line: Text) -> None:
    """`line` wrapped at spaces to the console's width, a word longer than a line kept whole."""
    for piece in wrapped(line, console.width):
        console.print(piece, soft_wrap=True)


def _fits(console: Console, table: Table) -> bool:
    need = Measurement.get(console, console.options.update_width(_UNBOUNDED), table).minimum
    return need <= console.width


def print_rows(
    console: Console,
    title: str,
    columns: Sequence[Column],
    rows: Sequence[Sequence[Text]],
) -> None:
    """`title`, then `rows` as a table if it fits the console's width, else as blocks."""
    table = Table()
    for i, column in enumerate(columns):
        if column.text:
            table.add_column(column.header, overflow="fold")
            continue
        # As wide as its widest cell: a token column is never narrowed below it.
        widest = max([cell_len(column.header), *(row[i].cell_len for row in rows)])
        table.add_column(column.header, no_wrap=True, overflow="ellipsis", min_width=widest)
    for row in rows:
        table.add_row(*row)
    print_wrapped(console, Text(title, style="bold"))
    if _fits(console, table):
        console.print(table)
        return
    for row in rows:
        console.print()
        print_record(console, list(zip(columns, row, strict=True)))


def print_record(console: Console, fields: Sequence[tuple[Column, Text]]) -> None:
    """One row as `name  value` lines: a token on its name's line, free text wrapped at
    spaces under its first line's indent."""
    indent = max((cell_len(column.header) for column, _ in fields), default=0) + _GAP
    for column, value in fields:
        name = Text(column.header.ljust(indent), style="bold")
        if not column.text:
            console.print(name + value, soft_wrap=True)
            continue
        lines = wrapped(value, max(console.width - indent, 20))
        console.print(name + lines[0], soft_wrap=True)
        for more in lines[1:]:
            console.print(Text(" " * indent) + more, soft_wrap=True)
