"""Repairs as transitions on every store (memory, SQLite, PostgreSQL): force, pause and resume of
one instance, and the pause of a whole workflow. Each is a history row written by the same
compare-and-swap as a transition (a workflow's pause is one row of its own); bad input is
refused with a typed error and writes nothing."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

import flowlock
from conftest import StoreFactory, cyclic
from flowlock.checker import check
from flowlock.core.admin import FORCE_EVENT, PAUSE_EVENT, RESUME_EVENT
from flowlock.locks import MemoryLocks

Open = Callable[..., Any]


@pytest.fixture
async def second(store_factory: StoreFactory) -> AsyncIterator[flowlock.Engine]:
    """Another engine on the same database: what one engine pauses, the other sees."""
    from flowlock import examples

    async with flowlock.Engine(store_factory(), locks=MemoryLocks()) as eng:
        for wf in (examples.approval(), examples.inventory(), cyclic()):
            await eng.register(wf)
        yield eng


async def _unchanged(engine: flowlock.Engine, iid: str, before: flowlock.Instance) -> None:
    """Nothing was written: the same version and one history row per version step."""
    now = await engine.get(iid)
    assert (now.state, now.version, now.paused) == (before.state, before.version, before.paused)
    assert len(await engine.history(iid)) == before.version - 1


async def test_force_moves_to_any_state_with_a_forced_row(engine: flowlock.Engine) -> None:
    await engine.create("approval", instance_id="f1", data={"n": 1})
    out = await engine.force("f1", "rejected", reason="stuck since the outage", actor="ops")
    assert out.applied and out.event == FORCE_EVENT
    assert (out.instance.state, out.instance.version) == ("rejected", 2)
    assert out.instance.data == {"n": 1}
    # A final state is no obstacle for an operator: back to pending, with new data.
    back = await engine.force("f1", "pending", data={"n": 2}, reason="reopen", actor="ops")
    assert (back.instance.state, back.instance.data) == ("pending", {"n": 2})
    rows = await engine.history("f1")
    assert [(r.kind, r.forced, r.from_state, r.to_state) for r in rows] == [
        ("forced", True, "pending", "rejected"),
        ("forced", True, "rejected", "pending"),
    ]
    assert rows[0].payload == {"reason": "stuck since the outage", "state": "rejected"}
    assert rows[1].payload == {"reason": "reopen", "state": "pending", "data": {"n": 2}}
    assert (rows[0].reason, rows[0].actor) == ("stuck since the outage", "ops")
    assert rows[1].data == {"n": 2}
    # The instance takes events again from where it was put.
    assert (await engine.fire("f1", "approve")).instance.state == "approved"
    assert check(await engine.get("f1"), await engine.history("f1")).ok


async def test_force_is_exactly_once_by_request_id(engine: flowlock.Engine) -> None:
    await engine.create("approval", instance_id="f2")
    first = await engine.force("f2", "approved", reason="r", actor="ops", request_id="fix-1")
    again = await engine.force("f2", "approved", reason="r", actor="ops", request_id="fix-1")
    assert first.applied and not again.applied and again.replayed
    assert again.instance.version == first.instance.version == 2
    with pytest.raises(flowlock.IdempotencyKeyReused):
        await engine.force("f2", "rejected", reason="r", actor="ops", request_id="fix-1")
    assert [r.request_id for r in await engine.history("f2")] == ["fix-1"]


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ({"state": "nowhere"}, flowlock.UnknownState),
        ({"reason": ""}, flowlock.InvalidInput),
        ({"reason": "   "}, flowlock.InvalidInput),
        ({"reason": None}, flowlock.InvalidInput),
        ({"actor": ""}, flowlock.InvalidInput),
        ({"actor": None}, flowlock.InvalidInput),
        ({"data": [1, 2]}, flowlock.InvalidInput),
        ({"expected_version": 7}, flowlock.VersionMismatch),
        ({"request_id": "timer:1:x:0"}, flowlock.InvalidInput),
    ],
)
async def test_a_bad_force_writes_nothing(
    engine: flowlock.Engine, args: dict[str, Any], error: type[Exception]
) -> None:
    before = await engine.create("approval", instance_id="f3")
    given: dict[str, Any] = {"state": "approved", "reason": "r", "actor": "ops", **args}
    state = given.pop("state")
    with pytest.raises(error) as caught:
        await engine.force("f3", state, **given)
    if isinstance(caught.value, flowlock.UnknownState):
        assert caught.value.state == "nowhere" and "approved" in str(caught.value)
        assert isinstance(caught.value, flowlock.InvalidInput)
    await _unchanged(engine, "f3", before)


async def test_force_of_a_missing_instance(engine: flowlock.Engine) -> None:
    with pytest.raises(flowlock.InstanceNotFound):
        await engine.force("nobody", "approved", reason="r", actor="ops")


async def test_pause_refuses_fire_and_force_still_works(
    engine: flowlock.Engine, second: flowlock.Engine
) -> None:
    before = await engine.create("approval", instance_id="p1")
    paused = await engine.pause("p1", reason="fraud check", actor="ops")
    assert isinstance(paused, flowlock.Outcome) and paused.applied and paused.instance.paused
    assert (paused.instance.state, paused.instance.version) == ("pending", 2)
    for eng in (engine, second):  # the other engine sees the pause: it is stored
        assert (await eng.get("p1")).paused
        with pytest.raises(flowlock.InstancePaused) as caught:
            await eng.fire("p1", "approve", request_id=f"a-{id(eng)}")
        assert (caught.value.scope, caught.value.instance_id, caught.value.version) == (
            "instance",
            "p1",
            2,
        )
    # Pausing again writes nothing; a force applies and leaves it paused.
    again = await engine.pause("p1", reason="again")
    assert isinstance(again, flowlock.Outcome) and again.idempotent and not again.applied
    forced = await engine.force("p1", "rejected", reason="known fraud", actor="ops")
    assert forced.applied and forced.instance.paused and forced.instance.state == "rejected"
    resumed = await engine.resume("p1", reason="cleared", actor="ops")
    assert isinstance(resumed, flowlock.Outcome) and resumed.applied
    assert not resumed.instance.paused and not (await second.get("p1")).paused
    unpaused = await engine.resume("p1")
    assert isinstance(unpaused, flowlock.Outcome) and unpaused.idempotent
    rows = await engine.history("p1")
    assert [(r.event, r.from_state, r.to_state, r.version) for r in rows] == [
        (PAUSE_EVENT, "pending", "pending", 2),
        (FORCE_EVENT, "pending", "rejected", 3),
        (RESUME_EVENT, "rejected", "rejected", 4),
    ]
    assert [r.reason for r in rows] == ["fraud check", "known fraud", "cleared"]
    assert all(r.data == before.data for r in rows)
    await engine.force("p1", "pending", reason="retry", actor="ops")
    assert (await second.fire("p1", "approve")).applied
    assert check(await engine.get("p1"), await engine.history("p1")).ok


@pytest.fixture
async def bare(store_factory: StoreFactory) -> AsyncIterator[flowlock.Engine]:
    """An engine on the same database with no workflow registered (an operator's CLI
    without --app)."""
    async with flowlock.Engine(store_factory(), locks=MemoryLocks()) as eng:
        yield eng


async def test_pause_and_resume_need_no_registered_workflow(
    engine: flowlock.Engine, bare: flowlock.Engine
) -> None:
    """Pause and resume keep the state and data, so an engine without the definition does
    them; force (the definition's states) and fire (its transitions) still need it."""
    before = await engine.create("approval", instance_id="b1", data={"n": 1})
    with pytest.raises(flowlock.UnknownWorkflow):
        await bare.force("b1", "approved", reason="r", actor="ops")
    with pytest.raises(flowlock.UnknownWorkflow):
        await bare.fire("b1", "approve")
    await _unchanged(bare, "b1", before)
    paused = await bare.pause("b1", reason="incident", actor="ops", request_id="bp-1")
    assert isinstance(paused, flowlock.Outcome) and paused.applied and paused.instance.paused
    again = await bare.pause("b1", reason="incident", actor="ops", request_id="bp-1")
    assert isinstance(again, flowlock.Outcome) and again.replayed
    with pytest.raises(flowlock.InstancePaused):
        await engine.fire("b1", "approve")
    resumed = await bare.resume("b1", reason="cleared", actor="ops")
    assert isinstance(resumed, flowlock.Outcome) and resumed.applied
    assert not resumed.instance.paused
    idle = await bare.resume("b1")
    assert isinstance(idle, flowlock.Outcome) and idle.idempotent and not idle.applied
    assert (await engine.fire("b1", "approve")).instance.state == "approved"
    rows = await engine.history("b1")
    assert [(r.kind, r.from_state, r.to_state, r.data) for r in rows] == [
        ("pause", "pending", "pending", {"n": 1}),
        ("resume", "pending", "pending", {"n": 1}),
        ("transition", "pending", "approved", {"n": 1}),
    ]
    assert check(await engine.get("b1"), rows).ok


async def test_a_replay_answers_its_first_outcome_while_paused(engine: flowlock.Engine) -> None:
    await engine.create("approval", instance_id="p2")
    first = await engine.fire("p2", "approve", request_id="once")
    await engine.pause("p2", reason="audit")
    again = await engine.fire("p2", "approve", request_id="once")
    assert again.replayed and again.instance.version == first.instance.version
    with pytest.raises(flowlock.InstancePaused):
        await engine.fire("p2", "reject", request_id="new")
    pause_again = await engine.pause("p2", reason="audit", request_id="pz")
    assert isinstance(pause_again, flowlock.Outcome) and not pause_again.applied


async def test_pause_and_resume_are_exactly_once_by_request_id(engine: flowlock.Engine) -> None:
    await engine.create("approval", instance_id="p3")
    one = await engine.pause("p3", reason="a", request_id="pause-1")
    await engine.resume("p3", request_id="resume-1")
    two = await engine.pause("p3", reason="a", request_id="pause-1")  # a late retry: replayed
    assert isinstance(one, flowlock.Outcome) and isinstance(two, flowlock.Outcome)
    assert two.replayed and two.instance.version == one.instance.version == 2
    assert two.instance.paused and not (await engine.get("p3")).paused
    assert len(await engine.history("p3")) == 2


@pytest.mark.parametrize("method", ["pause", "resume"])
@pytest.mark.parametrize(
    "target", [{}, {"instance_id": "x1", "workflow": "approval"}], ids=["neither", "both"]
)
async def test_pause_and_resume_take_one_target(
    engine: flowlock.Engine, method: str, target: dict[str, str]
) -> None:
    before = await engine.create("approval", instance_id="x1")
    call = getattr(engine, method)
    with pytest.raises(flowlock.InvalidInput, match="exactly one of instance_id"):
        await call(**target, reason="r")
    await _unchanged(engine, "x1", before)
    assert await engine.workflow_pauses() == []


async def test_pause_refuses_a_blank_reason(engine: flowlock.Engine) -> None:
    before = await engine.create("approval", instance_id="x2")
    for reason in ("", "  \t"):
        with pytest.raises(flowlock.InvalidInput):
            await engine.pause("x2", reason=reason)
        with pytest.raises(flowlock.InvalidInput):
            await engine.pause(workflow="approval", reason=reason)
    await _unchanged(engine, "x2", before)
    assert await engine.workflow_pauses() == []


async def test_a_workflow_pause_is_one_row(
    engine: flowlock.Engine, second: flowlock.Engine
) -> None:
    made = [await engine.create("approval", instance_id=f"w{i}") for i in range(5)]
    await engine.create("ticket", instance_id="other")
    pause = await engine.pause(workflow="approval", reason="bad deploy", actor="ops")
    assert isinstance(pause, flowlock.WorkflowPause)
    assert (pause.workflow, pause.reason, pause.actor) == ("approval", "bad deploy", "ops")
    assert await second.workflow_pauses() == [pause]
    again = await second.pause(workflow="approval", reason="another reason")
    assert again == pause  # the pause in place, unchanged
    for inst in made:  # no instance row was written
        got = await second.get(inst.id)
        assert (got.version, got.paused, got.workflow_paused) == (1, False, True)
        assert await second.history(inst.id) == []
        with pytest.raises(flowlock.InstancePaused) as caught:
            await second.fire(inst.id, "approve")
        assert (caught.value.scope, caught.value.workflow) == ("workflow", "approval")
    page = await second.list(workflow="approval")
    assert len(page) == 5 and all(i.workflow_paused for i in page)
    assert (await second.fire("other", "close")).applied  # another workflow is not paused
    # A force still works through the workflow's pause.
    assert (await second.force("w0", "rejected", reason="r", actor="ops")).applied
    lifted = await engine.resume(workflow="approval")
    assert lifted == pause and await engine.resume(workflow="approval") is None
    assert await second.workflow_pauses() == []
    assert (await second.fire("w1", "approve")).applied
    assert not (await second.get("w1")).workflow_paused


async def test_a_workflow_pause_and_an_instance_pause_both_hold(engine: flowlock.Engine) -> None:
    await engine.create("approval", instance_id="b1")
    await engine.pause("b1", reason="own")
    await engine.pause(workflow="approval", reason="all")
    await engine.resume(workflow="approval")
    with pytest.raises(flowlock.InstancePaused) as caught:
        await engine.fire("b1", "approve")
    assert caught.value.scope == "instance"
    await engine.pause(workflow="approval", reason="all")
    await engine.resume("b1")
    with pytest.raises(flowlock.InstancePaused) as caught:
        await engine.fire("b1", "approve")
    assert caught.value.scope == "workflow"
    await engine.resume(workflow="approval")
    assert (await engine.fire("b1", "approve")).applied


async def test_pausing_an_unknown_workflow_is_refused(engine: flowlock.Engine) -> None:
    with pytest.raises(flowlock.UnknownWorkflow):
        await engine.pause(workflow="approvall", reason="typo")
    assert await engine.workflow_pauses() == []


async def test_no_fire_applies_between_pause_and_resume(engine: flowlock.Engine) -> None:
    """Callers fire while an operator pauses and resumes: no fired row lands between the pause
    row and the resume row (the checker says so too)."""
    await engine.create("inventory", instance_id="c1", data={"stock": 0})
    stop = asyncio.Event()

    async def caller(n: int) -> None:
        while not stop.is_set():
            with contextlib.suppress(flowlock.InstancePaused):
                await engine.fire("c1", "restock", payload={"qty": 1})
            await asyncio.sleep(0)

    callers = [asyncio.create_task(caller(n)) for n in range(8)]
    try:
        await asyncio.sleep(0.05)
        await engine.pause("c1", reason="count the stock")
        paused_at = (await engine.get("c1")).version
        await asyncio.sleep(0.1)
        assert (await engine.get("c1")).version == paused_at  # nothing applied meanwhile
        await engine.resume("c1")
        await asyncio.sleep(0.05)
    finally:
        stop.set()
        await asyncio.gather(*callers)
    rows = await engine.history("c1")
    kinds = [r.kind for r in rows]
    start, end = kinds.index("pause"), kinds.index("resume")
    assert end == start + 1 and kinds.count("transition") > end - 1
    assert check(await engine.get("c1"), rows).ok


def test_a_batch_with_a_pause_not_last_is_refused() -> None:
    from flowlock.core.models import HistoryEntry
    from flowlock.stores.base import entries_of

    def row(version: int, event: str) -> HistoryEntry:
        return HistoryEntry("i", version, event, "a", "a", None, None, "optimistic", {})

    assert len(entries_of([row(2, "go"), row(3, PAUSE_EVENT)])) == 2
    with pytest.raises(flowlock.InvalidInput, match="must be its batch's last"):
        entries_of([row(2, PAUSE_EVENT), row(3, "go")])
