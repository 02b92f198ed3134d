"""The conflict monitor: windows, thresholds, hysteresis, bounded memory, sharing."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import pytest

import flowlock
from flowlock.core.models import Escalation
from flowlock.stores.memory import MemoryBoard
from flowlock.strategies.monitor import ConflictMonitor, EscalationSync


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def monitor(clock: Clock, **kw: float) -> ConflictMonitor:
    return ConflictMonitor(clock=clock, wall=clock, **kw)  # type: ignore[arg-type]


def test_quiet_keys_are_not_tracked() -> None:
    """Attempts without a conflict on an untracked key cost nothing and track nothing."""
    m = monitor(Clock())
    for i in range(10_000):
        assert m.record(f"k{i}", conflict=False) is None
    assert m.rate("k1") == (0, 0)
    assert not m._windows


def test_one_conflict_does_not_escalate() -> None:
    """Below min_samples a single conflict (100 % of one attempt) does not flip the key."""
    m = monitor(Clock())
    assert m.record("k", conflict=True) is None
    assert m.escalated("k") is None


def test_escalates_past_the_threshold_with_enough_samples() -> None:
    """A key whose conflict rate is clearly over 5 % escalates once min_samples are seen."""
    m = monitor(Clock(), min_samples=20)
    m.record("k", conflict=True)  # makes the key hot; not counted
    for i in range(19):
        assert m.record("k", conflict=i % 2 == 0) is None
    escalation = m.record("k", conflict=False)  # 10 conflicts / 20 attempts
    assert isinstance(escalation, Escalation)
    assert escalation.strategy == "pessimistic"
    assert "50.0%" in escalation.reason and "20 attempts" in escalation.reason
    assert m.escalated("k") == escalation
    assert m.escalations == 1


def test_a_storm_escalates_within_min_samples() -> None:
    """A storm (every attempt a conflict) escalates after exactly min_samples attempts."""
    m = monitor(Clock(), min_samples=20)
    results = [m.record("k", conflict=True) for _ in range(21)]
    assert results[:20] == [None] * 20 and results[20] is not None


def test_borderline_rates_need_more_evidence() -> None:
    """2 conflicts in 20 attempts (10 %) is not yet enough evidence to escalate."""
    m = monitor(Clock(), min_samples=20)
    m.record("k", conflict=True)
    for i in range(20):
        assert m.record("k", conflict=i in (3, 11)) is None


def test_steady_three_percent_never_flaps() -> None:
    """A steady 3 % conflict rate over a long run never escalates."""
    clock = Clock()
    m = monitor(clock)
    rng = random.Random(3)
    conflicts = 0
    for _ in range(20_000):
        clock.now += 0.001
        conflict = rng.random() < 0.03
        conflicts += conflict
        assert m.record("k", conflict=conflict) is None
    assert m.escalations == 0
    assert 500 < conflicts < 700


def test_steps_down_after_calm_cooldown_and_contention_extends_it() -> None:
    """An escalated key stays escalated while contended and steps down after a calm cooldown."""
    clock = Clock()
    m = monitor(clock, cooldown=5.0, min_samples=2)
    m.record("k", conflict=True)
    m.record("k", conflict=True)
    assert m.record("k", conflict=True) is not None
    clock.now += 4.0
    m.contended("k")  # still busy: the step-down moves to now + 5
    clock.now += 4.0
    assert m.escalated("k") is not None
    clock.now += 1.5
    assert m.escalated("k") is None
    assert m.deescalations == 1
    # A fresh window afterwards: one conflict does not re-escalate at once.
    assert m.record("k", conflict=True) is None


def test_window_forgets_old_conflicts() -> None:
    """Conflicts older than window_seconds no longer count."""
    clock = Clock()
    m = monitor(clock, window_seconds=1.0, min_samples=5)
    for _ in range(5):
        m.record("k", conflict=True)
    clock.now += 2.0
    for _ in range(10):
        assert m.record("k", conflict=False) is None
    assert m.rate("k") == (0, 10)


def test_memory_is_bounded() -> None:
    """Only max_keys hot keys are tracked; the least recently used are evicted."""
    m = monitor(Clock(), max_keys=100)
    for i in range(1000):
        m.record(f"k{i}", conflict=True)
    m.record("k999", conflict=True)
    assert len(m._windows) == 100
    assert m.rate("k999") == (1, 1) and m.rate("k0") == (0, 0)


async def test_escalations_are_shared_through_a_board() -> None:
    """An escalation published by one monitor is adopted by another."""
    clock = Clock()
    a, b = monitor(clock, min_samples=2), monitor(clock, min_samples=2)
    board = MemoryBoard()
    for _ in range(3):
        a.record("k", conflict=True)
    for e in a.take_pending():
        await board.publish(e)
    b.adopt({e.key: e for e in await board.active(clock.now)})
    adopted = b.escalated("k")
    assert adopted is not None and adopted.strategy == "pessimistic"
    # Each counts the escalation once; only b took it from another engine's decision.
    assert (a.escalations, a.adopted, b.escalations, b.adopted) == (1, 0, 1, 1)
    b.adopt({e.key: e for e in await board.active(clock.now)})  # seen again: not counted again
    assert (b.escalations, b.adopted) == (1, 1)
    clock.now += 10
    assert b.escalated("k") is None


def test_a_contended_key_is_republished_only_when_the_boards_copy_runs_low() -> None:
    """The escalation goes to the board at once. Contention extends it here at every call, but
    the board hears of it again only once its copy has less than half a cool-down left: one
    statement per key every few seconds, not one per key per sync tick. Nothing is lost: the
    extension waits, and goes out with what is left of the local deadline then."""
    clock = Clock()
    m = monitor(clock, min_samples=2, cooldown=4.0)
    for _ in range(3):
        m.record("k", conflict=True)
    [first] = m.take_pending()
    assert first.until == clock.now + 4.0
    m.published(first)
    clock.now += 1.0
    m.contended("k")  # the board's copy has 3 s left, over half a cool-down
    assert m.take_pending() == []
    clock.now += 0.5
    assert m.take_pending() == []  # 2.5 s left: the extension waits, kept...
    clock.now += 0.6  # ...and goes once the board's copy has 1.9 s left
    [again] = m.take_pending()
    assert again.until == pytest.approx(1005.0)  # the local deadline the contention set
    assert m.take_pending() == []


async def test_a_failed_publish_is_queued_again_and_not_taken_for_shared() -> None:
    """A board that fails to publish leaves the escalation pending: the next tick publishes
    it. Without that, the monitor would take the board's copy for fresh and hold back the
    key's extensions for half a cool-down while the other engines see nothing."""

    class Flaky(MemoryBoard):
        fail = True

        async def publish(self, escalation: Escalation) -> None:
            if self.fail:
                raise flowlock.StoreError("board down")
            await super().publish(escalation)

    clock = Clock()
    board = Flaky()
    m = monitor(clock, min_samples=2, cooldown=4.0)
    sync = EscalationSync(board, m, interval=0.5)
    for _ in range(3):
        m.record("k", conflict=True)
    await sync.tick()  # fails, logged
    assert await board.active(clock.now) == []
    clock.now += 1.0
    m.contended("k")  # would wait for the board's copy to run low, were it thought fresh
    board.fail = False
    await sync.tick()
    [shared] = await board.active(clock.now)
    assert shared.key == "k" and shared.until == pytest.approx(clock.now + 4.0)
    clock.now += 0.5
    m.contended("k")
    await sync.tick()  # published now: this extension waits for the copy to run low
    [still] = await board.active(clock.now)
    assert still.until == shared.until


def test_bad_settings_are_refused() -> None:
    """Nonsense thresholds and windows are InvalidInput."""
    with pytest.raises(flowlock.InvalidInput):
        ConflictMonitor(threshold=5)
    with pytest.raises(flowlock.InvalidInput):
        ConflictMonitor(min_samples=50, window=10)


def test_a_stepped_down_key_is_not_readopted_from_the_board() -> None:
    """After stepping down, the board's copy of that same escalation does not bring it back;
    a newer escalation from another engine does."""
    clock = Clock()
    m = monitor(clock, min_samples=2, cooldown=1.0)
    for _ in range(3):
        m.record("k", conflict=True)
    [own] = m.take_pending()
    clock.now += 1.001
    assert m.escalated("k") is None
    m.adopt({"k": own})  # still listed by the board for a moment (clock skew)
    assert m.escalated("k") is None and m.escalations == 1
    newer = Escalation("k", "pessimistic", clock.now + 5, "another engine")
    m.adopt({"k": newer})
    assert m.escalated("k") == newer


class Recorder:
    def __init__(self) -> None:
        self.ticks: list[dict[str, Any]] = []

    def __call__(self, *, active: int, escalated: int, deescalated: int, to: str) -> None:
        self.ticks.append(
            {"active": active, "escalated": escalated, "deescalated": deescalated, "to": to}
        )


async def test_escalation_sync_publishes_adopts_and_records_changes() -> None:
    """One sync tick publishes this engine's escalations, the other's tick adopts them; the
    recorder is told the counts and only the changes since its previous tick."""
    board = MemoryBoard()
    a, b = ConflictMonitor(min_samples=2), ConflictMonitor(min_samples=2)
    seen_a, seen_b = Recorder(), Recorder()
    sync_a = EscalationSync(board, a, interval=0.5, record=seen_a)
    sync_b = EscalationSync(board, b, interval=0.5, record=seen_b)
    for _ in range(3):
        a.record("k", conflict=True)
    await sync_a.tick()
    await sync_b.tick()
    assert b.escalated("k") is not None
    await sync_a.tick()
    one = {"active": 1, "escalated": 1, "deescalated": 0, "to": "pessimistic"}
    assert seen_a.ticks == [one, {**one, "escalated": 0}]
    assert seen_b.ticks == [one]


@pytest.mark.parametrize(
    "error",
    [flowlock.StoreError("board down"), ConnectionResetError("board down"), KeyError("board down")],
    ids=["typed", "os-error", "untranslated"],
)
async def test_escalation_sync_keeps_going_when_the_board_fails(
    caplog: pytest.LogCaptureFixture, error: Exception
) -> None:
    """A board that fails is logged and retried on the next tick (failed ticks keep coming,
    the loop keeps running), whatever it raises, a flowlock error or one a board failed to
    translate; the monitor keeps escalating without it; stop is idempotent."""

    class Broken(MemoryBoard):
        async def active(self, now: float) -> list[Escalation]:
            raise error

    monitor = ConflictMonitor(min_samples=2)
    sync = EscalationSync(Broken(), monitor, interval=0.01)

    def failures() -> int:
        logged = (r.message for r in caplog.records)
        return sum(
            "sharing escalations failed, retrying:" in m and "board down" in m for m in logged
        )

    sync.start()
    sync.start()  # idempotent
    assert sync.running
    try:
        deadline = time.monotonic() + 30
        while failures() < 3:  # polled: a loaded machine may run the ticks late, not fewer
            assert time.monotonic() < deadline, f"{failures()} failed ticks logged in 30 s"
            await asyncio.sleep(0.01)
        assert sync._task is not None and not sync._task.done()
        for _ in range(3):
            monitor.record("k", conflict=True)
        assert monitor.escalated("k") is not None
    finally:
        await sync.stop()
    await sync.stop()  # idempotent
    assert not sync.running


def test_escalation_sync_needs_a_positive_interval() -> None:
    """A zero or negative interval would spin; it is InvalidInput naming escalation_sync."""
    with pytest.raises(flowlock.InvalidInput, match="escalation_sync"):
        EscalationSync(MemoryBoard(), ConflictMonitor(), interval=0)
