"""The progress display of `flowlock bench`: a bar per step and one for the whole run."""

from __future__ import annotations

from types import TracebackType
from typing import Self

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Column
from rich.text import Text

__all__ = ["OVERALL", "EtaColumn", "RichProgress"]

OVERALL = "whole run"
"""The description of the bar that counts every round of the run."""


class EtaColumn(ProgressColumn):
    """The time left as `eta 0:01:23`, from the rounds done so far.

    Blank for a step without a count, such as starting a server.
    """

    def __init__(self) -> None:
        super().__init__(table_column=Column(no_wrap=True))
        self._remaining = TimeRemainingColumn()

    def render(self, task: Task) -> Text:
        if task.total is None:
            return Text("")
        left = self._remaining.render(task)
        return Text.assemble(("eta ", "progress.remaining"), left)


class RichProgress:
    """A transient rich progress display (meant for stderr) implementing the runner's Progress.
    Shown only on a terminal: piped or redirected, it prints nothing."""

    def __init__(self, console: Console) -> None:
        # The figures never wrap; a long step ("creating flowlock's tables in the scratch
        # schema ...") wraps instead of squeezing them into an ellipsis on a narrow terminal.
        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}", table_column=Column(overflow="fold")),
            # 16, not rich's 40: with the longest pair ("cluster / distributed-advisory") and
            # the ETA, a line fits 80 columns without the bar being shrunk.
            BarColumn(bar_width=16),
            MofNCompleteColumn(table_column=Column(no_wrap=True)),
            TimeElapsedColumn(table_column=Column(no_wrap=True)),
            EtaColumn(),
            console=console,
            transient=True,
            disable=not console.is_terminal,
        )
        self._status: TaskID | None = None
        self._pair: TaskID | None = None
        self._overall: TaskID | None = None

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

    def plan(self, rounds: int) -> None:
        if self._overall is None:
            self._overall = self._progress.add_task(OVERALL, total=rounds)
        else:
            self._progress.update(self._overall, total=rounds)

    def begin(self, scenario: str, strategy: str, rounds: int) -> None:
        if self._status is not None:
            self._progress.remove_task(self._status)
            self._status = None
        self._pair = self._progress.add_task(f"{scenario} / {strategy}", total=rounds)

    def advance(self) -> None:
        if self._pair is not None:
            self._progress.advance(self._pair)
        if self._overall is not None:
            self._progress.advance(self._overall)

    def end(self) -> None:
        if self._pair is not None:
            self._progress.remove_task(self._pair)
            self._pair = None
