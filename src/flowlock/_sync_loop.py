"""The sync engine's private event loop thread, and how a blocking call waits for what it
handed to that loop (bounded checks that the thread lives; an interrupt waits for the call).

Used by [`flowlock.sync`][flowlock.sync] only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from flowlock.core.errors import EngineClosed, SyncCallInEventLoop
from flowlock.core.models import Outcome

__all__ = [
    "ENDED",
    "GONE",
    "JOIN_TIMEOUT",
    "LoopThread",
    "refuse_in_event_loop",
    "settle",
]

T = TypeVar("T")
log = logging.getLogger("flowlock")

_ALIVE_CHECK = 1.0
"""Seconds between two checks, while a call waits, that the engine's thread is still running."""
JOIN_TIMEOUT = 30.0
"""Seconds `close()` waits for the thread to end once its loop has stopped."""
ENDED = (
    "the flowlock.sync.Engine's event loop thread ended while a call was running; build a new "
    "engine, and read the instance to see what the call did"
)
GONE = (
    "the flowlock.sync.Engine's event loop thread has ended without close() (its loop was "
    "stopped, or a step raised SystemExit on it); build a new engine to go on"
)


class LoopThread:
    """One private event loop, run forever by a daemon thread, until `stop`."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.pid = os.getpid()
        # Set on the thread once its loop has stopped: from then on nothing submitted runs.
        self.ended = False
        self.thread = threading.Thread(target=self._serve, name="flowlock-sync", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        except BaseException as exc:  # SystemExit, KeyboardInterrupt: raised by a step on the loop
            log.error(
                "flowlock: the sync engine's event loop thread ends: a step raised %s on it (%s); "
                "calls in flight and after raise EngineClosed",
                type(exc).__name__,
                exc,
            )
        finally:
            self.ended = True
            self._finish()

    def _finish(self) -> None:
        """What `asyncio.run` does on its way out: cancel the tasks left (background ones, such
        as a lease's renewal), let them end, then close the loop."""
        loop = self.loop
        try:
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            # At interpreter exit no thread may start; the pool's threads end with the process.
            with contextlib.suppress(RuntimeError):
                loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            asyncio.set_event_loop(None)
            loop.close()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """`coro` handed to the loop; EngineClosed (`coro` closed) once the loop has stopped."""
        try:
            if self.ended:
                raise EngineClosed(GONE)
            try:
                return asyncio.run_coroutine_threadsafe(coro, self.loop)
            except RuntimeError:  # "Event loop is closed": it ended since the check above
                if not self.loop.is_closed():
                    raise
                raise EngineClosed(GONE) from None
        except BaseException:
            coro.close()
            raise

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(JOIN_TIMEOUT)
        if self.thread.is_alive():
            log.warning(
                "flowlock: the sync engine's thread did not end within %.0f s of its loop "
                "stopping; it is a daemon thread and ends with the process",
                JOIN_TIMEOUT,
            )


# -- waiting -----------------------------------------------------------------------------------


def refuse_in_event_loop(method: str) -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise SyncCallInEventLoop(method)


def _wait_done(future: concurrent.futures.Future[Any], runner: LoopThread) -> None:
    """Until `future` is done, or the loop thread that should finish it has ended."""
    while not future.done() and runner.thread.is_alive():
        concurrent.futures.wait([future], timeout=_ALIVE_CHECK)


def settle(future: concurrent.futures.Future[T], runner: LoopThread) -> T:
    """The result of `future`; an interrupt in the meantime waits for it, then is raised."""
    try:
        _wait_done(future, runner)
    except BaseException as interrupt:
        _after_interrupt(future, runner, interrupt)
        raise
    # The thread ended with the call unanswered, or its loop stopped and cancelled the call on
    # the way out (a sync engine cancels no call of its own: close() waits for them).
    if not future.done() or (future.cancelled() and runner.ended):
        raise EngineClosed(ENDED)
    return future.result()


def _after_interrupt(
    future: concurrent.futures.Future[Any], runner: LoopThread, interrupt: BaseException
) -> None:
    """Let the interrupted call finish before `interrupt` is raised, and say what it did."""
    if not future.done():
        try:
            log.warning(
                "flowlock: %s while a call is running: waiting for the call to finish (it is "
                "bounded) before raising it; interrupt again to stop waiting",
                type(interrupt).__name__,
            )
            _wait_done(future, runner)
        except BaseException as again:
            again.add_note(
                "flowlock: the interrupted call was still running; it runs to its end on the "
                "engine's thread, whole or not at all. Read the instance to see what it did"
            )
            raise
    interrupt.add_note(f"flowlock: the interrupted call ran to its end first: {_did(future)}")


def _did(future: concurrent.futures.Future[Any]) -> str:
    if not future.done():
        return "its thread ended before it did; read the instance to see what it did"
    error = future.exception()
    if error is not None:
        return f"it raised {type(error).__name__}: {error}"
    result = future.result()
    if isinstance(result, Outcome):
        return (
            f"{result.event!r} {'applied' if result.applied else 'idempotent'}, instance "
            f"{result.instance.id!r} now in state {result.instance.state!r} at version "
            f"{result.instance.version}"
        )
    text = repr(result)
    return f"it returned {text[:200]}{'...' if len(text) > 200 else ''}"
