"""The sync API's timers: `flowlock.sync.Engine.timers` lists what the async engine lists, and the
timer service runs on the sync engine's own loop thread, firing while the caller's thread does
other things."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest

import flowlock
import flowlock.sync
from flowlock.core.models import TIMER_ACTOR

BOUND = 20.0


def _workflow() -> flowlock.Workflow:
    return flowlock.Workflow(
        "quick",
        states=["pending", "approved", "rejected"],
        initial="pending",
        transitions=[
            flowlock.Transition("approve", source="pending", target="approved"),
            flowlock.Transition(
                "expire", source="pending", target="rejected", after=timedelta(milliseconds=300)
            ),
            flowlock.Transition(
                "remind", source="pending", target="pending", every=timedelta(hours=1)
            ),
        ],
    )


@pytest.fixture(params=["memory", "sqlite"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A database URL on each store that runs without a server."""
    return "memory://" if request.param == "memory" else f"sqlite:///{tmp_path / 'timers.db'}"


def test_timers_lists_the_armed_timers_and_the_expiry_fires(url: str) -> None:
    """timers() lists both armed timers of the stay, earliest first; the expiry then fires on
    the engine's thread (as the timer), and the stay's timers are gone."""
    with flowlock.sync.Engine.connect(url) as engine:
        engine.register(_workflow())
        inst = engine.create("quick", instance_id="q")
        armed = engine.timers("q")
        assert [(t.event, t.stay, t.n) for t in armed] == [("expire", 1, 0), ("remind", 1, 0)]
        assert all(isinstance(t, flowlock.Timer) for t in armed)
        assert engine.get("q").next_timer == armed[0]
        assert inst.stay_version == 1
        deadline = time.monotonic() + BOUND
        while engine.get("q").state != "rejected":
            assert time.monotonic() < deadline, "the expiry did not fire"
            time.sleep(0.02)
        [row] = engine.history("q")
        assert (row.actor, row.request_id) == (TIMER_ACTOR, "timer:1:expire:0")
        assert engine.timers("q") == []


def test_timers_off_arms_without_firing(url: str) -> None:
    """timers=False: the timers are armed (listed), and no service runs to fire them."""
    with flowlock.sync.Engine.connect(url, timers=False) as engine:
        engine.register(_workflow())
        engine.create("quick", instance_id="q")
        assert [t.event for t in engine.timers("q")] == ["expire", "remind"]
        engine.fire("q", "approve")
        assert engine.timers("q") == []
