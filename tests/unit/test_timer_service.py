"""The timer service's loop: bounded when due timers cannot be claimed, alive after any error."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import timedelta

import pytest

import flowlock
from flowlock.core.models import Outcome, Timer
from flowlock.stores.base import ArmedSignal
from flowlock.stores.memory import MemoryStore
from flowlock.timers import TimerService


class LockedRows:
    """A store whose due timers are all locked by an open transaction: a claim (SKIP LOCKED)
    gets none, while the next due time says one is due now."""

    def __init__(self) -> None:
        self.claims = 0

    async def claim_timers(
        self, workflows: Sequence[str], *, limit: int, lease: float, owner: str
    ) -> list[Timer]:
        self.claims += 1
        await asyncio.sleep(0)
        return []

    async def next_due(self, workflows: Sequence[str]) -> float | None:
        await asyncio.sleep(0)
        return 0.0

    async def count_timers(self) -> int:
        return 0

    @contextlib.asynccontextmanager
    async def armed(self) -> AsyncIterator[ArmedSignal]:
        yield ArmedSignal()


class Broken(LockedRows):
    """A store whose next-due read fails with an error flowlock did not wrap (a bug)."""

    async def next_due(self, workflows: Sequence[str]) -> float | None:
        raise RuntimeError("an unwrapped driver error")


async def _never(timer: Timer) -> Outcome:
    raise AssertionError("nothing is claimed, so nothing fires")


async def test_due_timers_locked_elsewhere_are_looked_at_with_a_growing_pause() -> None:
    """Rows a transaction holds are skipped by the claim: the service pauses (growing to 2 s)
    instead of asking again at once, in a loop."""
    store = LockedRows()
    service = TimerService(store, _never, lambda: ["wf"])  # type: ignore[arg-type]
    service.start()
    await asyncio.sleep(1.0)
    await service.stop()
    assert 2 <= store.claims <= 10, store.claims


async def test_an_unexpected_error_is_logged_and_the_service_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An error that is not a flowlock error never stops the service, nor fails its stop."""
    store = Broken()
    service = TimerService(store, _never, lambda: ["wf"])  # type: ignore[arg-type]
    service.start()
    await asyncio.sleep(0.3)
    assert service.running
    assert store.claims >= 2
    await service.stop()
    assert "an unwrapped driver error" in caplog.text


def _reminding(*, with_reminder: bool) -> flowlock.Workflow:
    timed = [
        flowlock.Transition(
            "remind", source="open", target="open", every=timedelta(milliseconds=30)
        )
    ]
    return flowlock.Workflow(
        "nag",
        states=["open", "shut"],
        initial="open",
        transitions=[
            flowlock.Transition("shut", source="open", target="shut"),
            *(timed if with_reminder else []),
        ],
    )


async def _until(check: Callable[[], Awaitable[bool]]) -> None:
    async with asyncio.timeout(10):
        while True:
            if await check():
                return
            await asyncio.sleep(0.02)


async def test_a_reminder_whose_event_no_longer_fires_from_its_state_is_deleted() -> None:
    """A deploy moved the reminder's event away from its state: its firing is cancelled and the
    timer deleted, not moved on to fire (and be cancelled) every period forever. The instance
    runs the newest definition: it was created before definitions had versions (a pinned one
    keeps its own version's reminder)."""
    changed = flowlock.Workflow(
        "nag",
        states=["open", "shut"],
        initial="open",
        transitions=[
            flowlock.Transition("shut", source="open", target="shut"),
            flowlock.Transition("remind", source="shut", target="shut"),
        ],
    )
    async with flowlock.connect("memory://") as engine:
        old = _reminding(with_reminder=True)
        await engine.register(old)
        unpinned = flowlock.Instance(id="a", workflow="nag", state="open", version=1, data={})
        await engine.store.create(unpinned, arm=old.timers("open"))
        await engine.register(changed)
        await engine.register(
            flowlock.Workflow(
                "timed",
                states=["x"],
                initial="x",
                transitions=[
                    flowlock.Transition("tick", source="x", target="x", after=timedelta(hours=1))
                ],
            )
        )  # keeps the service running: "nag" itself has no timer left

        async def gone() -> bool:
            return await engine.timers("a") == []

        await _until(gone)
        assert await engine.history("a") == []


async def test_an_event_this_engine_does_not_know_is_left_for_another_engine() -> None:
    """An older engine (its definition lacks the event, and so it lacks the instance's
    definition version: DefinitionMismatch) claims a timer a newer one armed: it neither fires
    nor deletes it, and an engine that has the version fires it once the claim runs out."""
    store = MemoryStore()
    old = flowlock.Workflow(
        "nag",
        states=["open", "shut"],
        initial="open",
        transitions=[
            flowlock.Transition("shut", source="open", target="shut"),
            flowlock.Transition("ping", source="shut", target="shut", after=timedelta(hours=1)),
        ],
    )
    async with (
        flowlock.Engine(store, timers=False) as new,
        flowlock.Engine(store, timer_lease=0.3) as older,
    ):
        await new.register(_reminding(with_reminder=True))
        await new.create("nag", instance_id="a")
        await older.register(old)

        async def claimed_and_kept() -> bool:
            service = older.timer_service
            return service is not None and service.fired >= 1

        await _until(claimed_and_kept)
        assert [(t.event, t.n) for t in await new.timers("a")] == [("remind", 0)]
        assert await new.history("a") == []
        await older.aclose()
        async with flowlock.Engine(store) as newer:
            await newer.register(_reminding(with_reminder=True))

            async def fired() -> bool:
                return any(h.event == "remind" for h in await newer.history("a"))

            await _until(fired)
