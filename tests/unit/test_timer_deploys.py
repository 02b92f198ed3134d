"""Timers across a deploy that changes the definition, and the request ids timers keep."""

from __future__ import annotations

from datetime import timedelta

import pytest

import flowlock


def _approval(*, timed: bool) -> flowlock.Workflow:
    after = {"after": timedelta(hours=1)} if timed else {}
    return flowlock.Workflow(
        "approval",
        states=["pending", "review", "done"],
        initial="pending",
        transitions=[
            flowlock.Transition("escalate", source="pending", target="review", **after),  # type: ignore[arg-type]
            flowlock.Transition("finish", source="review", target="done"),
            flowlock.Transition(
                "nudge", source="review", target="review", after=timedelta(hours=2)
            ),
        ],
    )


async def test_leaving_a_state_voids_timers_a_former_definition_armed_there() -> None:
    """Deploy a definition whose `pending` has no timer any more: an instance that armed one
    under the old definition, and runs the new one, still loses it when it leaves `pending`.
    (It runs the newest definition because it was created before definitions had versions; a
    pinned instance keeps its own version and its timers.)"""
    async with flowlock.connect("memory://") as engine:
        old = _approval(timed=True)
        await engine.register(old)
        unpinned = flowlock.Instance(
            id="a", workflow="approval", state="pending", version=1, data={}
        )
        await engine.store.create(unpinned, arm=old.timers("pending"))
        assert [t.event for t in await engine.timers("a")] == ["escalate"]
        assert await engine.register(_approval(timed=False)) == 2
        outcome = await engine.fire("a", "escalate")
        assert outcome.instance.definition_version == 2  # decided with the new definition
        assert [t.event for t in await engine.timers("a")] == ["nudge"]
        await engine.fire("a", "finish")
        assert await engine.timers("a") == []


async def test_a_caller_may_not_use_a_timers_request_id() -> None:
    """`timer:...` request ids belong to timer firings; a caller's is refused, nothing written."""
    async with flowlock.connect("memory://") as engine:
        await engine.register(_approval(timed=True))
        await engine.create("approval", instance_id="a")
        with pytest.raises(flowlock.InvalidInput, match="keeps for the firings of timers"):
            await engine.fire("a", "escalate", request_id="timer:1:escalate:0")
        assert (await engine.get("a")).version == 1
