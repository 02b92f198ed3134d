"""What the engine's services do with a paused instance, on the memory and SQLite stores: a
timer due while it is paused waits (not fired, not lost) and fires after the resume; an outbox
handler's Then into it is a failed delivery, retried by the backoff until the resume."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

import flowlock
from flowlock.core.admin import PAUSE_EVENT, RESUME_EVENT
from flowlock.metrics import Metrics
from flowlock.stores import MemoryStore, Store
from flowlock.stores.sqlite import SqliteStore
from lock_probes import wait_until
from outbox_kit import shop, status_is
from timer_kit import deadline


@pytest.fixture(params=["memory", "sqlite"])
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], Store]:
    if request.param == "memory":
        shared = MemoryStore()
        return lambda: shared
    return lambda: SqliteStore(tmp_path / "repairs.db")


@pytest.fixture
async def engine(stores: Callable[[], Store]) -> AsyncIterator[flowlock.Engine]:
    options = {"timer_lease": 0.3, "outbox_backoff": (0.05, 0.1), "metrics": Metrics()}
    async with flowlock.Engine(stores(), **options) as eng:  # type: ignore[arg-type]
        await eng.register(deadline(after=0.2))
        await eng.register(shop())
        yield eng


async def test_a_timer_due_while_paused_fires_after_the_resume(engine: flowlock.Engine) -> None:
    await engine.create("deadline", instance_id="t")
    await engine.pause("t", reason="hold", actor="ops")
    service = engine.timer_service
    assert service is not None and engine.metrics is not None
    waits = engine.metrics.timer_firings.labels("paused")

    await wait_until(lambda: waits._value.get() >= 2, within=10.0, what="two paused firings")
    assert service.fired == 0 and (await engine.get("t")).state == "pending"
    assert [t.event for t in await engine.timers("t")] == ["expire"]
    await engine.resume("t")

    async def expired() -> bool:
        return (await engine.get("t")).state == "rejected"

    await wait_until(expired, within=10.0, what="the deadline after the resume")
    rows = await engine.history("t")
    assert [r.event for r in rows] == [PAUSE_EVENT, RESUME_EVENT, "expire"]
    assert service.fired == 1 and await engine.timers("t") == []


async def test_a_then_into_a_paused_instance_is_retried_until_the_resume(
    engine: flowlock.Engine,
) -> None:
    attempts: list[int] = []

    def charge(message: flowlock.Message) -> flowlock.Then:
        attempts.append(message.attempts)
        return flowlock.Then("charged")

    await engine.create("shop", instance_id="s")
    await engine.fire("s", "reserve")
    await engine.pause("s", reason="fraud check", actor="ops")
    engine.on_emit("charge", charge, max_attempts=1000)

    await wait_until(lambda: len(attempts) >= 3, within=10.0, what="three deliveries")
    message = await engine.message("s:2:0")
    assert message.status in ("pending", "running") and "paused" in (message.last_error or "")
    assert (await engine.get("s")).state == "reserved"
    await engine.resume("s")
    done = await status_is(engine, "s:2:0", "done")
    # A delivery refused by the pause is not counted: the message never nears max_attempts.
    assert len(attempts) >= 3 and done.attempts == 1
    rows = await engine.history("s")
    assert [r.event for r in rows] == ["reserve", PAUSE_EVENT, RESUME_EVENT, "charged"]
    assert rows[-1].request_id == "s:2:0"
