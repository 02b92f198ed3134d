"""The timer service's loop: bounded when due timers cannot be claimed, alive after any error."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

import pytest

from flowlock.core.models import Outcome, Timer
from flowlock.stores.base import ArmedSignal
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
