"""`async with` for anything with `open()` and `aclose()`.

And `with` plus `async with` for anything with blocking `start()` and `stop()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from types import TracebackType
from typing import Self

__all__ = ["AsyncResource", "BlockingResource"]


class AsyncResource:
    """Mixin: `async with x:` opens `x` and closes it on the way out, error or not."""

    async def open(self) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


class BlockingResource(AsyncResource):
    """Mixin for things brought up and down by blocking `start()` and `stop()`.

    `with` calls them. `async with` calls them in a worker thread, so the event loop keeps
    running. Both must be idempotent.
    """

    _thread_name = "flowlock-stop"

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    async def open(self) -> None:
        """`start()` in a worker thread."""
        starting = asyncio.ensure_future(asyncio.to_thread(self.start))
        try:
            await asyncio.shield(starting)
        except asyncio.CancelledError:
            # The worker thread cannot be interrupted, so start() may still bring things up
            # after our caller gave up; take them down as soon as start() is done.
            starting.add_done_callback(self._stop_after_cancelled_start)
            raise

    async def aclose(self) -> None:
        """`stop()` in a worker thread."""
        await asyncio.to_thread(self.stop)

    def _stop_after_cancelled_start(self, task: asyncio.Future[None]) -> None:
        if not task.cancelled():
            task.exception()  # retrieved so asyncio does not log it as never retrieved
        # A plain non-daemon thread, not the loop's executor: the loop may already be shutting
        # down, and the interpreter still waits for non-daemon threads before it exits.
        threading.Thread(target=self._stop_quietly, name=self._thread_name).start()

    def _stop_quietly(self) -> None:
        with contextlib.suppress(Exception):
            self.stop()
