"""The progress display of ``flowlock bench``: a transient rich progress bar."""

from __future__ import annotations

from types import TracebackType
from typing import Self

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

__all__ = ["RichProgress"]


class RichProgress:
    """A transient rich progress display (meant for stderr) implementing the runner's Progress."""

    def __init__(self, console: Console) -> None:
        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        )
        self._status: TaskID | None = None
        self._pair: TaskID | None = None

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

    def begin(self, scenario: str, strategy: str, rounds: int) -> None:
        if self._status is not None:
            self._progress.remove_task(self._status)
            self._status = None
        self._pair = self._progress.add_task(f"{scenario} / {strategy}", total=rounds)

    def advance(self) -> None:
        if self._pair is not None:
            self._progress.advance(self._pair)

    def end(self) -> None:
        if self._pair is not None:
            self._progress.remove_task(self._pair)
            self._pair = None
