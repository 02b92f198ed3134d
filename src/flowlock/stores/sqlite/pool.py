"""A small pool of SQLite connections, each on its own thread."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor

from flowlock.core.errors import EngineClosed, StoreBusy


class Worker:
    __slots__ = ("conn", "executor")

    def __init__(self, executor: ThreadPoolExecutor, conn: sqlite3.Connection) -> None:
        self.executor = executor
        self.conn = conn


class Pool:
    """The connections of one open/close cycle, the idle ones, and this store's writer queue."""

    def __init__(self, workers: list[Worker]) -> None:
        self.workers = workers
        self.idle: asyncio.Queue[Worker | None] = asyncio.Queue()
        for worker in workers:
            self.idle.put_nowait(worker)
        self.write_lock = asyncio.Lock()
        self.closed = False

    async def acquire_write(self, within: float) -> None:
        """Raises TimeoutError when this store's other writers held on for `within` s."""
        # asyncio.timeout, not wait_for: a free lock is taken without yielding, so a bound of 0
        # still succeeds when nobody holds it (wait_for(..., 0) would always time out).
        async with asyncio.timeout(max(within, 0.0)):
            await self.write_lock.acquire()

    async def acquire(self, within: float, path: str) -> Worker:
        started = time.monotonic()
        if not self.closed:
            try:
                async with asyncio.timeout(within):
                    worker = await self.idle.get()
            except TimeoutError:
                raise StoreBusy(time.monotonic() - started, len(self.workers)) from None
            if worker is not None and not self.closed:
                return worker
            # Hand the wake-up on, so every task queued for a connection learns of the close.
            self.idle.put_nowait(worker)
        raise EngineClosed(
            f"the SQLite store {path!r} was closed while this operation waited for a connection"
        )

    def release(self, worker: Worker, write: bool) -> None:
        self.idle.put_nowait(worker)
        if write:
            self.write_lock.release()

    def close(self) -> None:
        self.closed = True
        self.idle.put_nowait(None)


async def stop_workers(workers: list[Worker]) -> None:
    for worker in workers:
        # Queued behind any transaction still running on that thread, so it finishes first.
        try:
            with contextlib.suppress(sqlite3.Error):  # close() only fails on a misused connection
                await asyncio.wrap_future(worker.executor.submit(worker.conn.close))
        finally:
            worker.executor.shutdown(wait=True)
