"""The replay check on every store (memory, SQLite, PostgreSQL): `engine.check_definition` replays
the recorded histories through a new definition and finds each kind of change that would alter
live instances, and none for a compatible change."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import pytest

import flowlock
from flowlock import Transition, Workflow
from flowlock.stores.replaying import ReplayStore

Payload = Mapping[str, Any]


def _count(inst: flowlock.Instance, payload: Payload, actor: str | None) -> dict[str, Any]:
    return {**inst.data, "edits": int(inst.data.get("edits", 0)) + 1}


def _count_twice(inst: flowlock.Instance, payload: Payload, actor: str | None) -> dict[str, Any]:
    return {**inst.data, "edits": int(inst.data.get("edits", 0)) + 2}


def _small(inst: flowlock.Instance, payload: Payload, actor: str | None) -> bool:
    return int(payload.get("amount", 0)) <= 100


def _tiny(inst: flowlock.Instance, payload: Payload, actor: str | None) -> bool:
    return int(payload.get("amount", 0)) <= 10


def _broken(inst: flowlock.Instance, payload: Payload, actor: str | None) -> bool:
    raise KeyError("limit")


def doc(
    *,
    review: str = "review",
    guard: Any = _small,
    effect: Any = _count,
    reject: bool = True,
    extra: Sequence[Transition] = (),
    states: Sequence[str] = (),
) -> Workflow:
    """The recorded definition (every default), or a changed one."""
    transitions = [
        Transition("submit", source="draft", target=review, effect=effect),
        Transition("approve", source=review, target="approved", guard=guard),
        *([Transition("reject", source=review, target="draft")] if reject else []),
        *extra,
    ]
    return Workflow(
        "doc",
        states=["draft", review, "approved", *states],
        initial="draft",
        transitions=transitions,
    )


async def _record(engine: flowlock.Engine) -> None:
    """Histories under the first definition: d1 approved, d2 rejected and resubmitted, d3 under
    review, d4 just created."""
    await engine.register(doc())
    for n in range(1, 5):
        await engine.create("doc", instance_id=f"d{n}", data={"title": f"t{n}"})
    await engine.fire("d1", "submit")
    await engine.fire("d1", "approve", payload={"amount": 50})
    await engine.fire("d2", "submit")
    await engine.fire("d2", "reject")
    await engine.fire("d2", "submit")
    await engine.fire("d3", "submit")


def _kinds(report: flowlock.ReplayReport) -> set[tuple[str, int, str | None, str]]:
    return {(d.instance_id, d.version, d.event, d.kind) for d in report.divergences}


async def test_the_recorded_definition_replays_clean(engine: flowlock.Engine) -> None:
    """The definition the histories were written with replays every row, with no divergence."""
    await _record(engine)
    report = await engine.check_definition(doc())
    assert report.ok and report.divergences == ()
    assert (report.workflow, report.checked_instances, report.checked_transitions) == ("doc", 4, 6)
    assert (report.unreplayed_first, report.operator_rows) == (0, 0)
    assert report.seconds >= 0


async def test_a_compatible_change_has_no_divergence(engine: flowlock.Engine) -> None:
    """A new state and a new transition change nothing recorded: no divergence."""
    await _record(engine)
    wider = doc(
        states=["archived"],
        extra=[Transition("archive", source=["approved", "draft"], target="archived")],
    )
    report = await engine.check_definition(wider)
    assert report.ok, report.divergences
    assert report.checked_transitions == 6


async def test_a_renamed_state_is_found(engine: flowlock.Engine) -> None:
    """Renaming review: each submit now targets another state, the rows that left review and the
    instances sitting in it name a state the new definition lacks."""
    await _record(engine)
    report = await engine.check_definition(doc(review="in_review"))
    assert not report.ok
    found = _kinds(report)
    assert ("d1", 2, "submit", "target") in found
    assert ("d1", 3, "approve", "state") in found
    assert ("d3", 2, None, "state") in found  # d3 sits in review now
    target = next(d for d in report.divergences if d.kind == "target")
    assert (target.expected, target.found) == ("review", "in_review")
    assert report.counts()["state"] == 4  # d1 and d2 left review once each; d2, d3 sit in it


async def test_a_removed_transition_is_found(engine: flowlock.Engine) -> None:
    """Dropping reject: the recorded reject row names an event the new definition lacks."""
    await _record(engine)
    report = await engine.check_definition(doc(reject=False))
    assert _kinds(report) == {("d2", 3, "reject", "event")}
    assert report.divergences[0].expected == "draft" and report.divergences[0].found is None


async def test_a_changed_guard_is_found(engine: flowlock.Engine) -> None:
    """A stricter guard rejects the recorded approval of 50."""
    await _record(engine)
    report = await engine.check_definition(doc(guard=_tiny))
    assert _kinds(report) == {("d1", 3, "approve", "guard")}


async def test_a_changed_effect_is_found(engine: flowlock.Engine) -> None:
    """An effect that now counts twice gives other data on every submit, with both values."""
    await _record(engine)
    report = await engine.check_definition(doc(effect=_count_twice))
    assert {(d.instance_id, d.version, d.kind) for d in report.divergences} == {
        ("d1", 2, "data"),
        ("d2", 2, "data"),
        ("d2", 4, "data"),
        ("d3", 2, "data"),
    }
    first = report.divergences[0]
    assert first.expected == {"title": "t1", "edits": 1}
    assert first.found == {"title": "t1", "edits": 2}


async def test_a_raising_guard_is_a_divergence_not_a_crash(engine: flowlock.Engine) -> None:
    """A guard that raises during replay is reported with its error's text."""
    await _record(engine)
    report = await engine.check_definition(doc(guard=_broken))
    [found] = report.divergences
    assert (found.instance_id, found.kind) == ("d1", "guard")
    assert "KeyError" in found.detail and "limit" in found.detail


async def test_operator_rows_are_taken_as_recorded(engine: flowlock.Engine) -> None:
    """A forced move and a pause are not replayed; the rows after them replay from where they
    left the instance."""
    await _record(engine)
    await engine.force("d4", "review", reason="imported", actor="ops")
    await engine.pause("d4", reason="audit")
    await engine.resume("d4")
    await engine.fire("d4", "approve", payload={"amount": 5})
    report = await engine.check_definition(doc())
    assert report.ok, report.divergences
    assert (report.operator_rows, report.checked_transitions) == (3, 7)
    stricter = await engine.check_definition(doc(guard=lambda i, p, a: False))
    assert ("d4", 5, "approve", "guard") in _kinds(stricter)


async def test_sample_and_instance_ids(engine: flowlock.Engine) -> None:
    """`sample` replays N instances, `instance_ids` those named; bad arguments are refused."""
    await _record(engine)
    sampled = await engine.check_definition(doc(), sample=2)
    assert sampled.checked_instances == 2
    everyone = await engine.check_definition(doc(), sample=50)
    assert everyone.checked_instances == 4
    named = await engine.check_definition(doc(review="in_review"), instance_ids=["d3"])
    assert named.checked_instances == 1
    assert {d.instance_id for d in named.divergences} == {"d3"}
    with pytest.raises(flowlock.InstanceNotFound):
        await engine.check_definition(doc(), instance_ids=["d1", "nope"])
    await engine.create("approval", instance_id="other")
    with pytest.raises(flowlock.InvalidInput, match="runs workflow 'approval'"):
        await engine.check_definition(doc(), instance_ids=["other"])
    with pytest.raises(flowlock.InvalidInput, match="not both"):
        await engine.check_definition(doc(), sample=1, instance_ids=["d1"])
    with pytest.raises(flowlock.InvalidInput, match="sample"):
        await engine.check_definition(doc(), sample=0)
    with pytest.raises(flowlock.InvalidInput, match="Workflow"):
        await engine.check_definition("doc")  # type: ignore[arg-type]


async def test_every_create_path_stores_the_initial_data(engine: flowlock.Engine) -> None:
    """A create with and without a request id, with timers armed or not, keeps the data it
    started with; replay reads it with the history, in id order."""
    await engine.register(doc())
    await engine.create("doc", instance_id="a", data={"n": 1})
    await engine.create("doc", instance_id="b", data={"n": 2}, request_id="make-b")
    await engine.fire("a", "submit")
    store = engine.store
    assert isinstance(store, ReplayStore)
    rows = await store.replay_batch("doc", None, 10)
    assert [(i.id, initial, len(h)) for i, initial, h in rows] == [
        ("a", {"n": 1}, 1),
        ("b", {"n": 2}, 0),
    ]
    assert rows[0][0].data == {"n": 1, "edits": 1}
    assert [i.id for i, _, _ in await store.replay_batch("doc", "a", 10)] == ["b"]
    assert await store.replay_batch("approval", None, 10) == []
    by_id = await store.replay_instances(["b", "missing", "a"])
    assert [i.id for i, _, _ in by_id] == ["a", "b"]
    # A create that arms the initial state's timers (its own statement on PostgreSQL).
    timed = Workflow(
        "timed",
        states=["open", "late"],
        initial="open",
        transitions=[Transition("expire", source="open", target="late", after=timedelta(days=1))],
    )
    await engine.register(timed)
    await engine.create("timed", instance_id="t", data={"due": "tomorrow"})
    [(_, initial, _)] = await store.replay_batch("timed", None, 10)
    assert initial == {"due": "tomorrow"}


async def test_many_batches_are_walked_once(engine: flowlock.Engine) -> None:
    """More instances than one read takes: every one is replayed once, across batches."""
    from flowlock.admin import replay as replay_module

    await engine.register(doc())
    for n in range(7):
        await engine.create("doc", instance_id=f"m{n}")
        await engine.fire(f"m{n}", "submit")
    before = replay_module.REPLAY_BATCH
    replay_module.REPLAY_BATCH = 3  # type: ignore[misc]
    try:
        report = await engine.check_definition(doc(effect=_count_twice))
    finally:
        replay_module.REPLAY_BATCH = before  # type: ignore[misc]
    assert (report.checked_instances, report.checked_transitions) == (7, 7)
    assert [d.instance_id for d in report.divergences] == [f"m{n}" for n in range(7)]
