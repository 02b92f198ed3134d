"""Timed transitions in a definition, and what the pure step makes of a timer's firing."""

from __future__ import annotations

from datetime import timedelta

import pytest

import flowlock
from flowlock.core.errors import StaleTimer
from flowlock.core.models import HistoryEntry, Instance, Snapshot, TimerFiring, Timing
from flowlock.core.step import Call, decide


def _approval(**remind: object) -> flowlock.Workflow:
    return flowlock.Workflow(
        "approval",
        states=["pending", "approved", "rejected"],
        initial="pending",
        transitions=[
            flowlock.Transition("approve", source="pending", target="approved"),
            flowlock.Transition(
                "expire", source="pending", target="rejected", after=timedelta(hours=48)
            ),
            flowlock.Transition("remind", source="pending", target="pending", **remind),  # type: ignore[arg-type]
            flowlock.Transition("reopen", source="rejected", target="pending"),
        ],
    )


def test_a_stay_in_a_state_arms_each_timed_transition_leaving_it() -> None:
    """`Workflow.timers(state)` lists every timed transition from that state, in seconds."""
    wf = _approval(every=timedelta(hours=1), limit=3)
    assert wf.timers("pending") == (
        Timing("expire", 172_800.0),
        Timing("remind", 3_600.0, 3_600.0, 3),
    )
    assert wf.timers("approved") == ()
    assert wf.has_timers


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"after": timedelta(0)}, "must be positive"),
        ({"after": timedelta(seconds=-1)}, "must be positive"),
        ({"after": timedelta(days=40_000)}, "at most 36500 days"),
        ({"after": 3600}, "takes a datetime.timedelta"),
        ({"every": timedelta(0)}, "must be positive"),
        ({"after": timedelta(hours=1), "limit": 3}, "give every= too"),
        ({"every": timedelta(hours=1), "limit": 0}, "a whole number of firings from 1"),
        ({"every": timedelta(hours=1), "limit": True}, "a whole number of firings from 1"),
        ({"every": timedelta(hours=1), "limit": 2**63}, "to 1,000,000,000,000,000"),
    ],
)
def test_a_bad_timing_is_refused_when_the_transition_is_built(
    kwargs: dict[str, object], says: str
) -> None:
    """A timed transition's after, every and limit are checked before it can register."""
    with pytest.raises(flowlock.DefinitionError, match=says):
        flowlock.Transition("remind", source="pending", target="pending", **kwargs)  # type: ignore[arg-type]


def test_every_needs_a_transition_that_can_stay() -> None:
    """A repeating timer on a transition that always leaves its state could fire only once."""
    with pytest.raises(flowlock.DefinitionError, match="never keep it in a source"):
        flowlock.Transition("expire", source="pending", target="rejected", every=timedelta(1))


def test_a_bare_every_first_fires_one_period_into_the_stay() -> None:
    """`every=` alone means `after=every`."""
    t = flowlock.Transition("remind", source="p", target="p", every=timedelta(minutes=5))
    assert t.after == timedelta(minutes=5)
    assert t.timing() == Timing("remind", 300.0, 300.0, None)


def test_the_diagram_labels_timed_edges() -> None:
    """Mermaid shows when a timed transition fires."""
    text = _approval(every=timedelta(hours=1)).to_mermaid()
    assert "pending --> rejected: expire after 2d" in text
    assert "pending --> pending: remind after 1h every 1h" in text


def _snap(state: str, version: int, stay: int) -> Snapshot:
    inst = Instance("a", "approval", state, version, {}, stay_version=stay)
    return Snapshot(inst)


def _call(event: str, timer: TimerFiring | None = None) -> Call:
    rid = None if timer is None else timer.request_id
    return Call("a", event, {}, None, rid, None, "optimistic", timer)


def test_an_entry_that_enters_a_state_arms_it_and_voids_the_old_stay() -> None:
    """Leaving a state voids its timers; entering a timed one arms the new stay's."""
    wf = {"approval": _approval()}
    left = decide(wf, _snap("pending", 3, 1), _call("approve"))
    assert isinstance(left, HistoryEntry)
    assert left.voids and left.arm == () and left.enters
    back = decide(wf, _snap("rejected", 4, 4), _call("reopen"))
    assert isinstance(back, HistoryEntry)
    assert back.voids  # every state change of a timed workflow ends the stay's timers
    assert [t.event for t in back.arm] == ["expire"]


def test_a_timer_of_an_ended_stay_is_refused() -> None:
    """The instance left and re-entered `pending`: the first stay's timer is stale."""
    wf = {"approval": _approval()}
    with pytest.raises(StaleTimer, match="began at version 1") as caught:
        decide(wf, _snap("pending", 5, 5), _call("expire", TimerFiring(1, "expire")))
    assert isinstance(caught.value, flowlock.TransitionNotAllowed)
    entry = decide(wf, _snap("pending", 5, 5), _call("expire", TimerFiring(5, "expire")))
    assert isinstance(entry, HistoryEntry)
    assert entry.request_id == "timer:5:expire:0"
    assert entry.timer == TimerFiring(5, "expire")
