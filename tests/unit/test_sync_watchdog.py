"""The sync engine when its event loop thread ends without ``close()``: a call waiting on it
raises ``EngineClosed`` promptly, saying so, instead of waiting forever or raising an untyped
``CancelledError``; every later call raises ``EngineClosed`` too, and ``close()`` still works.

The loop is stopped for real, from inside it, the two ways a step can do it: by stopping the
running loop, and by raising ``SystemExit`` (which ends ``run_forever`` and the thread). A
second test holds the watchdog itself (``settle``) to a thread that ends while the call it
waits for is left unanswered.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import pytest

import flowlock
import flowlock.sync
from flowlock._sync_loop import LoopThread, settle
from flowlock.core.models import Instance
from flowlock.stores import MemoryStore

BOUND = 10.0
"""Seconds a call may take to answer once the loop has stopped: generous, it answers at once."""
ENDED = "the flowlock.sync.Engine's event loop thread ended while a call was running"
GONE = "event loop thread has ended without close()"


class HeldStore(MemoryStore):
    """Holds every ``get`` on the engine's loop until the loop ends, saying when one waits."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()

    async def get(self, instance_id: str) -> Instance:
        self.waiting.set()
        await asyncio.Event().wait()  # never set: the call is still running when the loop ends
        raise AssertionError("unreachable")  # pragma: no cover


def stop_loop(inst: Instance, payload: Mapping[str, Any], actor: str | None) -> bool:
    asyncio.get_running_loop().stop()
    return True


def exit_loop(inst: Instance, payload: Mapping[str, Any], actor: str | None) -> bool:
    raise SystemExit("a step called sys.exit() on the engine's thread")


def stopper(guard: Callable[[Instance, Mapping[str, Any], str | None], bool]) -> flowlock.Workflow:
    return flowlock.Workflow(
        "stopper",
        states=["on", "off"],
        initial="on",
        transitions=[flowlock.Transition("stop", source="on", target="off", guard=guard)],
    )


def in_thread(call: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    """``call()`` in a thread of its own; what it returned or raised lands in the list."""
    answer: list[object] = []

    def run() -> None:
        try:
            answer.append(call())
        except BaseException as exc:
            answer.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, answer


@pytest.mark.parametrize("guard", [stop_loop, exit_loop], ids=["loop-stopped", "system-exit"])
def test_a_call_waiting_when_the_loop_thread_ends_raises_engine_closed(
    guard: Callable[[Instance, Mapping[str, Any], str | None], bool],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A call in flight when a step ends the engine's loop raises EngineClosed within the bound,
    with the message the watchdog promises; later calls raise EngineClosed, closed is true, and
    close() joins the thread."""
    store = HeldStore()
    engine = flowlock.sync.Engine(store)
    engine.register(stopper(guard))
    engine.create("stopper", instance_id="s")
    waiting, answer = in_thread(lambda: engine.get("s"))
    assert store.waiting.wait(BOUND), "the get never reached the store"
    started = time.monotonic()
    stopping, stopped = in_thread(lambda: engine.fire("s", "stop"))
    waiting.join(BOUND)
    assert not waiting.is_alive(), f"the waiting call did not answer within {BOUND:.0f} s"
    took = time.monotonic() - started
    [error] = answer
    assert isinstance(error, flowlock.EngineClosed), repr(error)
    assert str(error).startswith(ENDED), error
    assert "build a new engine" in str(error)
    stopping.join(BOUND)
    assert not stopping.is_alive()
    # The stopping call itself: done before the loop stopped, cut short, or its SystemExit.
    [own] = stopped
    assert isinstance(own, flowlock.Outcome | flowlock.EngineClosed | SystemExit), repr(own)
    if guard is exit_loop:
        assert isinstance(own, SystemExit)
        assert "a step raised SystemExit on it" in caplog.text
    with pytest.raises(flowlock.EngineClosed, match=GONE):
        engine.get("s")
    assert engine.closed
    engine.close()
    engine.close()
    assert not any(t.name == "flowlock-sync" and t.is_alive() for t in threading.enumerate())
    print(f"the waiting call answered {took:.3f} s after the stop was fired")


def test_the_watchdog_ends_a_wait_whose_thread_ended_with_the_call_unanswered() -> None:
    """A wait on a call the loop will never answer ends, when the loop's thread ends, in
    EngineClosed saying the thread ended while a call was running (checked every second)."""
    runner = LoopThread()
    unanswered: concurrent.futures.Future[None] = concurrent.futures.Future()
    ender = threading.Thread(target=runner.stop)
    started = time.monotonic()
    waiting, answer = in_thread(lambda: settle(unanswered, runner))
    ender.start()
    waiting.join(BOUND)
    assert not waiting.is_alive(), f"the wait did not end within {BOUND:.0f} s"
    ender.join(BOUND)
    [error] = answer
    assert isinstance(error, flowlock.EngineClosed), repr(error)
    assert str(error).startswith(ENDED), error
    assert not unanswered.done() and not runner.thread.is_alive()
    print(f"the wait ended {time.monotonic() - started:.3f} s after the thread was told to stop")
