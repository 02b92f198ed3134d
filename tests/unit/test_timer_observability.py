"""What an operator sees of timer firings: the metrics and the `flowlock.timer` span."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import timedelta

from prometheus_client import CollectorRegistry

import flowlock
from span_probes import attrs, recording


def _deadline() -> flowlock.Workflow:
    return flowlock.Workflow(
        "deadline",
        states=["pending", "approved", "rejected"],
        initial="pending",
        transitions=[
            flowlock.Transition("approve", source="pending", target="approved"),
            flowlock.Transition(
                "expire", source="pending", target="rejected", after=timedelta(milliseconds=50)
            ),
        ],
    )


async def _rejected(engine: flowlock.Engine, ids: list[str]) -> None:
    async with asyncio.timeout(10):
        while True:
            states = [(await engine.get(i)).state for i in ids]
            if all(s == "rejected" for s in states):
                return
            await asyncio.sleep(0.02)


async def _until(check: Callable[[], bool]) -> None:
    async with asyncio.timeout(10):
        while True:
            if check():
                return
            await asyncio.sleep(0.02)


async def test_firings_are_counted_with_their_lag_and_the_armed_timers() -> None:
    """flowlock_timer_firings_total, flowlock_timer_lag_seconds and flowlock_timers_armed move."""
    registry = CollectorRegistry()
    metrics = flowlock.Metrics(registry=registry)
    async with flowlock.connect("memory://", metrics=metrics) as engine:
        await engine.register(_deadline())
        for i in range(3):
            await engine.create("deadline", instance_id=f"d{i}")
        await _rejected(engine, [f"d{i}" for i in range(3)])
        sample = registry.get_sample_value
        await _until(lambda: sample("flowlock_timer_firings_total", {"outcome": "applied"}) == 3)
        assert sample("flowlock_timer_lag_seconds_count") == 3
        assert sample("flowlock_timer_lag_seconds_sum") is not None
        assert sample("flowlock_timers_armed") is not None


async def test_each_firing_has_a_timer_span_around_its_fire_span() -> None:
    """One `flowlock.timer` span per firing, with the timer's stay and outcome, parent of the
    `flowlock.fire` span of the call it made."""
    with recording() as spans:
        async with flowlock.connect("memory://") as engine:
            await engine.register(_deadline())
            await engine.create("deadline", instance_id="d")
            await _rejected(engine, ["d"])
            await _until(lambda: bool(spans.named("flowlock.timer")))
        timer = spans.one("flowlock.timer")
        seen = attrs(timer)
        assert seen["flowlock.instance_id"] == "d"
        assert seen["flowlock.event"] == "expire"
        assert seen["flowlock.timer.stay"] == 1
        assert seen["flowlock.timer.outcome"] == "applied"
        fire = spans.children(timer, "flowlock.fire")
        assert len(fire) == 1
