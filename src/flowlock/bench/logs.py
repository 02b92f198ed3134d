"""Collect flowlock's log lines during a run, one line per kind of message.

They would otherwise scroll through the progress display.
asyncpg's notices about connections a cancelled round left mid-transaction stay quiet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import Any

__all__ = ["Logged", "collect_logs"]


class Logged(logging.Handler):
    """Collects what flowlock logs during a run, one line per kind of message."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: dict[str, tuple[int, str]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        kind = str(record.msg)
        count, first = self.seen.get(kind, (0, ""))
        self.seen[kind] = (count + 1, first or record.getMessage())

    def lines(self) -> tuple[str, ...]:
        return tuple(
            f"{count} × {first}" + (" (and similar)" if count > 1 else "")
            for count, first in self.seen.values()
        )


@contextlib.contextmanager
def collect_logs() -> Iterator[Logged]:
    """Send flowlock's WARNING records and above to the yielded handler, not the terminal.

    Enter it on the run's event loop.
    """
    logger = logging.getLogger("flowlock")
    handler = Logged()
    propagate = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()

    def quieter(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        # asyncpg reports, through the loop, each pooled connection released mid-transaction;
        # that is what cancelling a round (Ctrl-C) does to callers waiting for a row lock, and
        # the connection is rolled back. Everything else goes where it would have gone.
        if str(context.get("message", "")).startswith("Resetting connection with an active"):
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(quieter)
    try:
        yield handler
    finally:
        loop.set_exception_handler(previous)
        logger.removeHandler(handler)
        logger.propagate = propagate
