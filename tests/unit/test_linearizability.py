"""flowlock.checker's linearizability check and its recorder: valid histories pass, each kind of
breakage is caught and named, generated histories are judged right, real calls on the memory
engine are linearizable."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import pickle
import random
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flowlock
from flowlock import examples
from flowlock.checker import (
    DOUBLE_APPLY,
    INVALID_RESULT,
    LOST_UPDATE,
    NOT_LINEARIZABLE,
    STALE_READ,
    UNDECIDED,
    CallRecord,
    LinearizabilityVerdict,
    NotLinearizable,
    Recorder,
    check,
    check_linearizable,
    outcome_of,
)
from flowlock.core.definition import Step, Transition, Workflow
from flowlock.core.models import HistoryEntry, Instance
from flowlock.stores import MemoryStore

Data = Mapping[str, Any]


def ok(
    op: str,
    at: tuple[float, float],
    version: int,
    state: str = "pending",
    data: Data | None = None,
    *,
    event: str | None = None,
    iid: str = "i",
) -> CallRecord:
    """An ok call on ``iid`` over ``at`` that returned (state, version, data)."""
    return CallRecord(
        iid, op, event, at[0], at[1], "ok", state, version, dict(data or {}), workflow="approval"
    )


def fire(at: tuple[float, float], version: int, state: str, event: str = "approve") -> CallRecord:
    return ok("fire", at, version, state, event=event)


def get(at: tuple[float, float], version: int, state: str = "pending") -> CallRecord:
    return ok("get", at, version, state)


def create(at: tuple[float, float] = (0.0, 1.0)) -> CallRecord:
    return ok("create", at, 1)


def failed(at: tuple[float, float], event: str = "approve") -> CallRecord:
    return CallRecord("i", "fire", event, at[0], at[1], "fail", error="TransitionNotAllowed")


def unknown(invoked_at: float, event: str = "approve") -> CallRecord:
    return CallRecord("i", "fire", event, invoked_at, None, "unknown", error="OutcomeUnknown")


APPROVAL = examples.approval()


def verdict_of(calls: Sequence[CallRecord], *, workflow: Workflow | None = None) -> Any:
    verdict = check_linearizable(calls, workflow)
    assert isinstance(verdict, LinearizabilityVerdict)
    return verdict


# -- valid histories -------------------------------------------------------------------------


def test_a_sequential_history_is_linearizable() -> None:
    """create, get, fire, get one after another: linearizable, with or without the workflow."""
    calls = [create(), get((2, 3), 1), fire((4, 5), 2, "approved"), get((6, 7), 2, "approved")]
    for workflow in (None, APPROVAL):
        verdict = verdict_of(calls, workflow=workflow)
        assert verdict.ok, verdict.describe()
        assert (verdict.instances, verdict.calls, verdict.violations) == (1, 4, [])
        assert bool(verdict)


def test_overlapping_fires_where_one_wins() -> None:
    """Four overlapping fires: one applied, two refused, one idempotent; reads around them."""
    calls = [
        create(),
        fire((2, 6), 2, "approved"),
        failed((2, 7), "reject"),
        failed((3, 5), "reject"),
        dataclasses.replace(fire((2, 8), 2, "approved"), idempotent=True),
        get((3, 4), 1),  # overlaps the winning fire and read the old version: fine
        get((5, 9), 2, "approved"),
    ]
    assert verdict_of(calls, workflow=APPROVAL).ok


def test_overlapping_fires_may_complete_out_of_order() -> None:
    """Two overlapping applied fires: the one reporting the later version completed first."""
    calls = [
        create(),
        ok("fire", (2, 10), 2, "pending", {"n": 1}, event="bump"),
        ok("fire", (3, 5), 3, "pending", {"n": 2}, event="bump"),
        ok("get", (6, 7), 3, "pending", {"n": 2}),
    ]
    assert verdict_of(calls).ok


def test_an_unknown_call_that_did_not_apply() -> None:
    """An unknown fire nothing shows the effect of: it never took effect, and that is fine."""
    calls = [create(), unknown(2.0), get((3, 4), 1), get((5, 6), 1)]
    assert verdict_of(calls, workflow=APPROVAL).ok


def test_an_unknown_call_that_must_be_assumed_applied() -> None:
    """A later read sees a version only the unknown fire can have made: it is taken as applied,
    even long after the caller gave up on it."""
    calls = [create(), unknown(2.0), get((3, 4), 1), get((10, 11), 2, "approved")]
    assert verdict_of(calls, workflow=APPROVAL).ok
    assert verdict_of(calls).ok


def test_an_unknown_fire_without_the_workflow_is_pinned_by_the_next_read() -> None:
    """Without the workflow an unknown fire's state is whatever the next observation says."""
    calls = [create(), unknown(2.0, "reject"), get((3, 4), 2, "approved")]
    assert verdict_of(calls).ok


def test_an_instance_created_before_the_history_starts_unknown() -> None:
    """No create recorded: the first observation pins the instance; ``initial`` can instead."""
    calls = [get((0, 1), 5, "pending"), fire((2, 3), 6, "approved")]
    assert verdict_of(calls).ok
    before = Instance(id="i", workflow="approval", state="pending", version=4, data={})
    verdict = check_linearizable(calls, initial={"i": before})
    assert verdict.kinds() == {NOT_LINEARIZABLE}, verdict.describe()
    assert "version 5 where version 4 was due" in verdict.violations[0].message


def test_failed_and_idempotent_calls_are_not_checked() -> None:
    """Fails have no effect; an idempotent answer may be older than the instance."""
    old = dataclasses.replace(fire((6, 7), 2, "approved"), idempotent=True)
    calls = [create(), fire((2, 3), 2, "approved"), failed((4, 5)), old]
    assert verdict_of(calls, workflow=APPROVAL).ok


def test_instances_are_checked_apart() -> None:
    """Calls on two instances never constrain each other."""
    a = [create(), fire((2, 3), 2, "approved")]
    b = [dataclasses.replace(r, instance_id="j") for r in a]
    verdict = verdict_of([*a, *b])
    assert verdict.ok
    assert verdict.instances == 2


# -- invalid histories -----------------------------------------------------------------------


def test_double_apply() -> None:
    """Two fires both applied from version 1: named, both of them."""
    calls = [create(), fire((2, 4), 2, "approved"), fire((2, 5), 2, "approved")]
    verdict = verdict_of(calls)
    assert not verdict.ok
    assert verdict.kinds() == {DOUBLE_APPLY}
    assert verdict.violations[0].calls == (1, 2)
    assert "#1 fire 'approve'" in verdict.violations[0].message


def test_created_twice() -> None:
    """Two creates that both succeeded are a double apply."""
    calls = [create(), create((0.5, 2.0))]
    assert verdict_of(calls).kinds() == {DOUBLE_APPLY}


def test_lost_update() -> None:
    """A fire reported approved at version 2, a later read sees version 2 rejected: one of the
    two writes at version 2 replaced the other."""
    calls = [create(), fire((2, 3), 2, "approved"), get((4, 5), 2, "rejected")]
    verdict = verdict_of(calls)
    assert verdict.kinds() == {LOST_UPDATE}
    assert verdict.violations[0].calls == (1, 2)


def test_stale_read() -> None:
    """A read that starts after a fire completed and sees the version before it."""
    calls = [create(), fire((2, 3), 2, "approved"), get((4, 5), 1)]
    verdict = verdict_of(calls)
    assert verdict.kinds() == {STALE_READ}
    assert "read version 1 after version 2 had been seen" in verdict.violations[0].message


def test_a_fire_applied_from_a_version_already_replaced() -> None:
    """A fire that began after version 3 was read reports version 3 as its own result."""
    calls = [
        create(),
        ok("fire", (2, 3), 2, "pending", event="bump"),
        ok("fire", (3, 4), 3, "pending", event="bump"),
        get((5, 6), 3),
        ok("fire", (7, 8), 3, "pending", event="bump"),
    ]
    kinds = verdict_of(calls).kinds()
    assert STALE_READ in kinds
    assert DOUBLE_APPLY in kinds


def test_an_unknown_call_whose_effect_is_needed_but_conflicts() -> None:
    """Version 2 can only be the unknown approve, but the read sees it rejected: with the
    workflow, no order explains it (without it, the read pins the unknown fire's state)."""
    calls = [create(), unknown(2.0, "approve"), get((3, 4), 2, "rejected")]
    assert verdict_of(calls).ok
    verdict = verdict_of(calls, workflow=APPROVAL)
    assert verdict.kinds() == {NOT_LINEARIZABLE}
    message = verdict.violations[0].message
    assert "#2 get ok -> v2 'rejected'" in message
    assert 2 in verdict.violations[0].calls


def test_an_unknown_call_cannot_take_effect_before_it_was_made() -> None:
    """A read sees version 2 before the only call that could make it was invoked."""
    calls = [create(), get((3, 4), 2, "approved"), unknown(5.0)]
    verdict = verdict_of(calls)
    assert verdict.kinds() == {NOT_LINEARIZABLE}
    assert "it reports version 2 where version 1 was due" in verdict.violations[0].message


def test_a_read_needs_more_unknown_calls_than_there_are() -> None:
    """Two unknown fires can explain version 3, not version 4."""
    calls = [create(), unknown(2.0, "bump"), unknown(2.5, "bump")]
    assert verdict_of([*calls, get((5, 6), 3, "x")]).ok
    assert verdict_of([*calls, get((5, 6), 4, "x")]).kinds() == {NOT_LINEARIZABLE}


def test_an_effectless_event_keeps_the_data() -> None:
    """With the workflow, approve (no effect) cannot change the data."""
    calls = [
        ok("create", (0, 1), 1, "pending", {"amount": 1}),
        ok("fire", (2, 3), 2, "approved", {"amount": 2}, event="approve"),
    ]
    assert verdict_of(calls).ok
    verdict = verdict_of(calls, workflow=APPROVAL)
    assert verdict.kinds() == {NOT_LINEARIZABLE}
    assert 'data {"amount": 2}' in verdict.violations[0].message


def test_results_no_workflow_can_give() -> None:
    """A fire reaching a state its event does not lead to, an unknown event, a create at version
    2 or a fire at version 1 are invalid whatever the order."""
    calls = [
        ok("create", (0, 1), 2),
        fire((2, 3), 2, "rejected", "approve"),
        fire((4, 5), 3, "approved", "ship"),
        ok("fire", (6, 7), 1, "approved", event="approve", iid="j"),
    ]
    verdict = verdict_of(calls, workflow=APPROVAL)
    invalid = [v for v in verdict.violations if v.kind == INVALID_RESULT]
    assert [v.calls for v in invalid] == [(0,), (1,), (2,), (3,)]
    text = verdict.describe()
    assert "not 'rejected'" in text
    assert "no event 'ship'" in text
    assert "version 1, not 2" in text


def test_the_message_says_why_the_call_due_next_does_not_fit() -> None:
    """A read of an instance known not to exist yet; an event not allowed from the state found."""
    absent = check_linearizable([get((0, 1), 1)], initial={"i": None})
    assert "the instance does not exist yet" in absent.violations[0].message
    calls = [create(), fire((2, 3), 2, "approved"), fire((4, 5), 3, "rejected", "reject")]
    refused = verdict_of(calls, workflow=APPROVAL)
    assert refused.kinds() == {NOT_LINEARIZABLE}
    assert "its event is not allowed from state 'approved'" in refused.violations[0].message


def test_each_instance_gets_the_workflow_its_calls_name() -> None:
    """Given several workflows, an instance is checked against the one its results name: an
    unknown create puts it in that workflow's initial state."""
    maybe = CallRecord("i", "create", None, 0.0, None, "unknown")
    both = [TOGGLE, APPROVAL]
    absent: dict[str, Instance | None] = {"i": None}
    assert check_linearizable([maybe, get((1, 2), 1)], both, initial=absent).ok
    wrong = [maybe, get((1, 2), 1, "approved")]
    # Not known to be absent, the instance may have existed (approved) all along.
    assert check_linearizable(wrong, both).ok
    verdict = check_linearizable(wrong, both, initial=absent)
    assert "it reads state 'approved' where the instance is in 'pending'" in verdict.describe()


def test_running_out_of_steps_is_undecided_never_ok() -> None:
    """A budget too small for the history: an undecided violation that says what to do."""
    calls = [create(), *(get((1 + i, 30), 1) for i in range(10)), fire((2, 31), 2, "approved")]
    assert check_linearizable(calls).ok
    verdict = check_linearizable(calls, max_steps=3)
    assert not verdict.ok
    assert verdict.kinds() == {UNDECIDED}
    assert verdict.undecided == ["i"]
    assert "Raise max_steps" in verdict.violations[0].message


def test_the_verdict_reports_and_raises() -> None:
    """to_dict is JSON, describe names each violation, raise_for_violations raises a
    FlowlockError carrying the verdict."""
    good = verdict_of([create()])
    good.raise_for_violations()
    assert "linearizable" in good.describe()
    bad = verdict_of([create(), fire((2, 4), 2, "approved"), fire((2, 5), 2, "approved")])
    as_json = json.loads(json.dumps(bad.to_dict()))
    assert as_json["ok"] is False
    assert as_json["violations"][0]["kind"] == DOUBLE_APPLY
    assert as_json["violations"][0]["instance_id"] == "i"
    assert "[double-apply] instance 'i'" in bad.describe()
    with pytest.raises(NotLinearizable) as raised:
        bad.raise_for_violations()
    assert isinstance(raised.value, flowlock.FlowlockError)
    assert raised.value.verdict is bad


def test_bad_arguments_are_invalid_input() -> None:
    """Not records, a bad budget, a bad initial instance or a malformed record: InvalidInput."""
    with pytest.raises(flowlock.InvalidInput):
        check_linearizable([{"op": "get"}])  # type: ignore[list-item]
    with pytest.raises(flowlock.InvalidInput):
        check_linearizable([create()], max_steps=0)
    with pytest.raises(flowlock.InvalidInput):
        check_linearizable([create()], initial={"i": "pending"})  # type: ignore[dict-item]
    with pytest.raises(flowlock.InvalidInput):
        check_linearizable([create()], [APPROVAL, "approval"])  # type: ignore[list-item]
    for bad in (
        {"op": "delete"},
        {"outcome": "maybe"},
        {"version": 0},
        {"state": None},
        {"completed_at": -1.0},
        {"data": [1]},
        {"event": None, "op": "fire"},
    ):
        with pytest.raises(flowlock.InvalidInput, match="bad call record"):
            dataclasses.replace(create(), **bad)


# -- the recorder ----------------------------------------------------------------------------


class Clock:
    """A clock that moves one second per reading."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def _instance(version: int = 1, state: str = "pending", iid: str = "i") -> Instance:
    return Instance(id=iid, workflow="approval", state=state, version=version, data={"a": 1})


def _outcome(applied: bool, instance: Instance) -> flowlock.Outcome:
    return flowlock.Outcome(
        applied=applied,
        instance=instance,
        attempts=1,
        strategy="optimistic",
        elapsed=0.0,
        event="approve",
    )


def test_the_recorder_records_invoke_and_completion_times() -> None:
    """invoke then ok/fail/unknown: times from the clock, results from what was returned, a
    call still running reported unknown with no completion."""
    rec = Recorder(clock=Clock())
    c = rec.invoke("i", "create")
    f = rec.invoke("i", "fire", event="approve")
    g = rec.invoke("i", "get")
    r = rec.invoke("i", "fire", event="reject")
    pending = rec.invoke("i", "fire", event="approve")
    c.ok(_instance())
    f.ok(_outcome(True, _instance(2, "approved")))
    g.fail(flowlock.InstanceNotFound("i"))
    r.unknown(flowlock.OutcomeUnknown("i", "socket closed"))
    calls = rec.calls
    assert len(calls) == len(rec) == 5
    assert [(x.op, x.outcome, x.invoked_at, x.completed_at) for x in calls] == [
        ("create", "ok", 1.0, 6.0),
        ("fire", "ok", 2.0, 7.0),
        ("get", "fail", 3.0, 8.0),
        ("fire", "unknown", 4.0, None),
        ("fire", "unknown", 5.0, None),
    ]
    assert (calls[1].state, calls[1].version, calls[1].data) == ("approved", 2, {"a": 1})
    assert calls[1].workflow == "approval"
    assert calls[2].error is not None
    assert calls[2].error.startswith("InstanceNotFound: no instance with id 'i'")
    assert not pending.done
    assert pending.record.outcome == "unknown"
    assert check_linearizable(calls).ok


def test_an_idempotent_outcome_is_recorded_as_such() -> None:
    """ok(outcome) keeps Outcome.idempotent; ok(instance) of a fire means applied."""
    rec = Recorder()
    rec.invoke("i", "fire", event="approve").ok(_outcome(False, _instance(2, "approved")))
    rec.invoke("i", "fire", event="approve").ok(_instance(2, "approved"))
    assert [c.idempotent for c in rec.calls] == [True, False]


def test_a_call_is_completed_once_with_what_its_op_returns() -> None:
    """A second completion, an Outcome for a get, another instance or a non-result: InvalidInput."""
    rec = Recorder()
    call = rec.invoke("i", "get")
    with pytest.raises(flowlock.InvalidInput, match="Instance, not an Outcome"):
        call.ok(_outcome(True, _instance()))
    with pytest.raises(flowlock.InvalidInput, match="returned instance 'j'"):
        call.ok(_instance(iid="j"))
    with pytest.raises(flowlock.InvalidInput):
        call.ok({"state": "pending"})  # type: ignore[arg-type]
    call.ok(_instance())
    with pytest.raises(flowlock.InvalidInput, match="already completed"):
        call.fail()
    with pytest.raises(flowlock.InvalidInput):
        rec.invoke("i", "delete")  # type: ignore[arg-type]
    with pytest.raises(flowlock.InvalidInput, match="with its event"):
        rec.invoke("i", "fire")
    with pytest.raises(flowlock.InvalidInput):
        rec.invoke(7, "get")  # type: ignore[arg-type]
    with pytest.raises(flowlock.InvalidInput):
        rec.extend([{"op": "get"}])  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("error", "outcome"),
    [
        (flowlock.TransitionNotAllowed("i", "approve", "approved", (), 2), "fail"),
        (flowlock.GuardRejected("no"), "fail"),
        (flowlock.ConflictRetriesExhausted("i", "approve", 5), "fail"),
        (flowlock.LockTimeout("i", 1.0), "fail"),
        (flowlock.InvalidInput("bad"), "fail"),
        (flowlock.InstanceNotFound("i"), "fail"),
        (flowlock.VersionMismatch("i", 1, 2, "pending"), "fail"),
        (flowlock.StoreBusy(1.0, 5), "fail"),
        (flowlock.OutcomeUnknown("i", "lost"), "unknown"),
        (flowlock.ConnectionLost("i", "lost"), "fail"),
        (flowlock.StoreError("odd"), "fail"),
        (TimeoutError(), "unknown"),
        (asyncio.CancelledError(), "unknown"),
        (KeyError("x"), "unknown"),
    ],
)
def test_the_context_manager_records_an_exception_by_its_meaning(
    error: BaseException, outcome: str
) -> None:
    """A refusal made before any write is a fail; anything else may have written: unknown. The
    exception is not swallowed."""
    assert outcome_of(error) == outcome
    rec = Recorder()
    with pytest.raises(type(error)), rec.invoke("i", "fire", event="approve"):
        raise error
    (record,) = rec.calls
    assert record.outcome == outcome
    assert record.error is not None
    assert record.error.startswith(type(error).__name__)


def test_the_context_manager_keeps_a_completion_and_marks_a_forgotten_one_unknown() -> None:
    """A block that completed its call keeps that; one that did not is unknown."""
    rec = Recorder()
    with rec.invoke("i", "get") as call:
        call.ok(_instance())
    with rec.invoke("i", "get"):
        pass
    assert [c.outcome for c in rec.calls] == ["ok", "unknown"]


def test_records_travel_between_processes() -> None:
    """Records pickle and round-trip through JSON; merge and extend combine histories."""
    rec = Recorder(clock=Clock())
    rec.invoke("i", "create").ok(_instance())
    rec.invoke("i", "fire", event="approve").unknown("killed")
    records = rec.calls
    assert pickle.loads(pickle.dumps(records)) == records
    through_json = [CallRecord.from_dict(json.loads(json.dumps(r.to_dict()))) for r in records]
    assert through_json == records
    with pytest.raises(flowlock.InvalidInput, match="missing 'op'"):
        CallRecord.from_dict({"instance_id": "i"})
    other = Recorder(clock=lambda: 1.5)
    other.invoke("j", "get").ok(_instance(iid="j"))
    merged = Recorder.merge(records, other.calls)
    assert [r.invoked_at for r in merged] == [1.0, 1.5, 3.0]
    rec.extend(other.calls)
    assert len(rec) == 3
    assert rec.calls[-1].instance_id == "j"


# -- generated histories ---------------------------------------------------------------------


def _bump(inst: Instance, payload: Mapping[str, Any], actor: str | None) -> Step:
    return Step(data={"n": int(inst.data["n"]) + 1}, target=inst.state)


TOGGLE = Workflow(
    "toggle",
    states=["open", "closed"],
    initial="open",
    transitions=[
        Transition("close", source="open", target="closed"),
        Transition("reopen", source="closed", target="open"),
        Transition("bump", source=("open", "closed"), target=("open", "closed"), effect=_bump),
    ],
)

KINDS = ("fire", "get", "fail", "unknown-applied", "unknown-lost", "idempotent")


@dataclasses.dataclass
class Sim:
    """A sequential run of TOGGLE: the instance after each step."""

    state: str = "open"
    version: int = 1
    data: dict[str, Any] = dataclasses.field(default_factory=lambda: {"n": 0})

    def fire(self, pick: int) -> str:
        allowed = TOGGLE.allowed(self.state)
        event = allowed[pick % len(allowed)]
        transition = TOGGLE.transitions[event]
        if transition.effect is not None:
            self.data = {"n": self.data["n"] + 1}
        else:
            self.state = transition.target
        self.version += 1
        return event

    def record(self, iid: str, op: str, at: tuple[float, float], event: str | None) -> CallRecord:
        return CallRecord(
            iid, op, event, at[0], at[1], "ok", self.state, self.version, dict(self.data)
        )


Step_ = tuple[str, int, float, float]
steps_st = st.lists(
    st.tuples(
        st.sampled_from(KINDS),
        st.integers(0, 5),
        st.floats(0, 4, allow_nan=False),
        st.floats(0, 4, allow_nan=False),
    ),
    max_size=25,
)


def history(steps: Sequence[Step_], iid: str = "g", *, unknowns: bool = True) -> list[CallRecord]:
    """Calls whose effects happen one per time unit (step n at time n), each invoked up to 4
    units before and completed up to 4 after its own instant: overlapping, and linearizable by
    construction. Fails are spread anywhere, unknown calls take effect at their instant or
    never, and an idempotent answer reports the instance as created."""
    sim = Sim()
    calls = [sim.record(iid, "create", (-1.0, 0.5), None)]
    first = calls[0]
    for n, (kind, pick, before, after) in enumerate(steps, start=1):
        at = (n - before, n + after)
        if kind == "get":
            calls.append(sim.record(iid, "get", at, None))
        elif kind == "fire" or (kind == "unknown-applied" and not unknowns):
            event = sim.fire(pick)
            calls.append(sim.record(iid, "fire", at, event))
        elif kind == "unknown-applied":
            event = sim.fire(pick)
            calls.append(CallRecord(iid, "fire", event, at[0], None, "unknown"))
        elif kind == "unknown-lost" and unknowns:
            calls.append(CallRecord(iid, "fire", "bump", at[0], None, "unknown"))
        elif kind == "idempotent":
            calls.append(
                dataclasses.replace(
                    first,
                    op="fire",
                    event="close",
                    idempotent=True,
                    invoked_at=at[0],
                    completed_at=at[1],
                )
            )
        else:
            calls.append(CallRecord(iid, "fire", "close", at[0], at[1], "fail"))
    return calls


# Appended to the generated steps of the mutation tests: an applied fire, then a read that
# begins after it completed, so there is always something to mutate.
TAIL: list[Step_] = [("fire", 0, 0.0, 0.0), ("get", 0, 0.0, 0.0)]


def _replace_at(calls: list[CallRecord], n: int, record: CallRecord) -> list[CallRecord]:
    return [*calls[:n], record, *calls[n + 1 :]]


@settings(max_examples=300, deadline=None)
@given(steps=steps_st, seed=st.integers(0, 2**32))
def test_generated_linearizable_histories_pass(steps: list[Step_], seed: int) -> None:
    """Any overlapping history built from a sequential run is judged linearizable, with the
    workflow and without, with and without the creates, in any order of records and mixed with
    another instance's."""
    calls = history(steps) + history(list(reversed(steps)), "h")
    random.Random(seed).shuffle(calls)
    for workflow in (None, TOGGLE):
        verdict = check_linearizable(calls, workflow)
        assert verdict.ok, verdict.describe()
    # Without the creates, each instance starts unknown: still linearizable.
    verdict = check_linearizable([c for c in calls if c.op != "create"], TOGGLE)
    assert verdict.ok, verdict.describe()


@settings(max_examples=200, deadline=None)
@given(steps=steps_st, pick=st.integers(0, 1000))
def test_a_bumped_version_is_caught(steps: list[Step_], pick: int) -> None:
    """One applied fire reporting a version one too high (no unknown call to explain it)."""
    calls = history([*steps, *TAIL], unknowns=False)
    fires = [n for n, c in enumerate(calls) if c.op == "fire" and c.outcome == "ok"]
    fires = [n for n in fires if not calls[n].idempotent]
    n = fires[pick % len(fires)]
    bumped = dataclasses.replace(calls[n], version=(calls[n].version or 0) + 1)
    verdict = check_linearizable(_replace_at(calls, n, bumped))
    assert not verdict.ok


@settings(max_examples=200, deadline=None)
@given(steps=steps_st, pick=st.integers(0, 1000))
def test_a_stale_read_is_caught(steps: list[Step_], pick: int) -> None:
    """A read that began after an applied fire completed, turned into a read of the created
    instance: caught with or without unknown calls around."""
    calls = history([*steps, *TAIL])
    applied = [c for c in calls if c.op == "fire" and c.outcome == "ok" and not c.idempotent]
    done = [c.completed_at for c in applied if c.completed_at is not None]
    late = [n for n, c in enumerate(calls) if c.op == "get" and any(t < c.invoked_at for t in done)]
    n = late[pick % len(late)]
    stale = dataclasses.replace(
        calls[0], op="get", invoked_at=calls[n].invoked_at, completed_at=calls[n].completed_at
    )
    verdict = check_linearizable(_replace_at(calls, n, stale), TOGGLE)
    assert verdict.kinds() == {STALE_READ}


@settings(max_examples=200, deadline=None)
@given(steps=steps_st, pick=st.integers(0, 1000), shift=st.floats(-3, 3, allow_nan=False))
def test_a_repeated_fire_is_a_double_apply(steps: list[Step_], pick: int, shift: float) -> None:
    """An applied fire recorded twice (as if a retry applied again): a double apply."""
    calls = history([*steps, *TAIL])
    fires = [c for c in calls if c.op == "fire" and c.outcome == "ok" and not c.idempotent]
    twin = fires[pick % len(fires)]
    again = dataclasses.replace(
        twin, invoked_at=twin.invoked_at + shift, completed_at=(twin.completed_at or 0) + shift
    )
    verdict = check_linearizable([*calls, again])
    assert DOUBLE_APPLY in verdict.kinds()


def _exhaustive(calls: Sequence[CallRecord]) -> bool:
    """Linearizability by brute force, written apart from the checker: every subset of the
    unknown calls taken as applied, every order of the calls that respects real time, run on the
    model (None: not known yet)."""
    definite = [c for c in calls if c.outcome == "ok" and not c.idempotent]
    maybes = [c for c in calls if c.outcome == "unknown" and c.op != "get"]
    for chosen in itertools.chain.from_iterable(
        itertools.combinations(maybes, k) for k in range(len(maybes) + 1)
    ):
        for order in itertools.permutations([*definite, *chosen]):
            if _respects_real_time(order) and _runs(order):
                return True
    return False


def _respects_real_time(order: Sequence[CallRecord]) -> bool:
    for i, later in enumerate(order):
        for earlier in order[i + 1 :]:
            end = earlier.completed_at
            if earlier.outcome == "ok" and end is not None and end < later.invoked_at:
                return False  # ``earlier`` completed before ``later`` began, yet comes after it
    return True


def _runs(order: Sequence[CallRecord]) -> bool:
    exists: bool | None = None
    state: str | None = None
    version: int | None = None
    data: Data | None = None
    for c in order:
        if c.op == "create":
            if exists is True or (c.outcome == "ok" and c.version != 1):
                return False
            exists, version = True, 1
            state, data = (c.state, c.data) if c.outcome == "ok" else (None, None)
            continue
        if exists is False:
            return False
        if c.outcome == "unknown":
            exists, state, data = True, None, None
            version = None if version is None else version + 1
            continue
        assert c.version is not None
        want = version if c.op == "get" or version is None else version + 1
        if c.op == "fire" and c.version < 2:
            return False
        if c.version != want and want is not None:
            return False
        if c.op == "get" and (state not in (None, c.state) or data not in (None, c.data)):
            return False
        exists, state, version, data = True, c.state, c.version, c.data
    return True


small_call = st.builds(
    lambda kind, at, width, version, state, n: (kind, at, width, version, state, n),
    st.sampled_from(("create", "fire", "fire", "get", "get", "fire?", "create?", "fail")),
    st.integers(0, 6),
    st.integers(0, 3),
    st.integers(1, 4),
    st.sampled_from(("a", "b")),
    st.integers(0, 1),
)


def _small(spec: tuple[str, int, int, int, str, int]) -> CallRecord:
    kind, at, width, version, state, n = spec
    op = kind.rstrip("?")
    if kind.endswith("?"):
        return CallRecord("s", op, "go" if op == "fire" else None, float(at), None, "unknown")
    if kind == "fail":
        return CallRecord("s", "fire", "go", float(at), float(at + width), "fail")
    event = "go" if op == "fire" else None
    return CallRecord("s", op, event, float(at), float(at + width), "ok", state, version, {"n": n})


@settings(max_examples=400, deadline=None)
@given(specs=st.lists(small_call, max_size=6))
def test_the_verdict_agrees_with_an_exhaustive_search(
    specs: list[tuple[str, int, int, int, str, int]],
) -> None:
    """On small random histories, valid or not, the checker says ok exactly when some order
    exists (found by trying them all)."""
    calls = [_small(spec) for spec in specs]
    verdict = check_linearizable(calls)
    assert verdict.ok == _exhaustive(calls), verdict.describe()


def _spread(rng: random.Random, instances: int, per_instance: int) -> Iterator[CallRecord]:
    kinds = ("fire",) * 5 + ("get",) * 3 + ("fail",) + ("unknown-applied", "unknown-lost")
    for i in range(instances):
        steps = [
            (rng.choice(kinds), rng.randrange(6), rng.random() * 4, rng.random() * 4)
            for _ in range(per_instance - 1)
        ]
        yield from history(steps, f"i{i}")


@pytest.mark.slow
def test_a_hundred_thousand_calls_over_a_thousand_instances() -> None:
    """The size the docs quote a time for (measured outside the suite): judged linearizable."""
    calls = list(_spread(random.Random(7), 1000, 100))
    assert len(calls) == 100_000
    verdict = check_linearizable(calls, TOGGLE)
    assert verdict.ok, verdict.describe()
    assert (verdict.instances, verdict.calls) == (1000, 100_000)


# -- real calls on the memory engine ---------------------------------------------------------


async def _fire(
    rec: Recorder, eng: flowlock.Engine, iid: str, event: str, payload: Data, limit: float | None
) -> None:
    with rec.invoke(iid, "fire", event=event) as call:
        call.ok(await asyncio.wait_for(eng.fire(iid, event, payload=payload), limit))


async def _get(rec: Recorder, eng: flowlock.Engine, iid: str) -> None:
    with rec.invoke(iid, "get") as call:
        call.ok(await eng.get(iid))


async def test_concurrent_calls_on_the_memory_engine_are_linearizable() -> None:
    """Eighty tasks reserve, restock and read two stock counts at once, some under a timeout so
    short their call is cancelled midway (unknown): the recorded history is linearizable, and
    the store's history exactly-once."""
    rng = random.Random(3)
    rec = Recorder()
    inventory = examples.inventory()
    async with flowlock.Engine(MemoryStore()) as eng:
        await eng.register(inventory)
        for iid in ("a", "b"):
            with rec.invoke(iid, "create") as call:
                call.ok(await eng.create("inventory", instance_id=iid, data={"stock": 20}))

        async def worker(n: int) -> None:
            for _ in range(6):
                iid = rng.choice(("a", "b"))
                roll = rng.random()
                if roll < 0.3:
                    await _get(rec, eng, iid)
                    continue
                event = "restock" if roll < 0.5 else "reserve"
                timeout = 0.0005 if rng.random() < 0.1 else None
                # Recorded: a refusal as fail, a timeout as unknown.
                with contextlib.suppress(flowlock.FlowlockError, TimeoutError):
                    await _fire(rec, eng, iid, event, {"qty": 1 + n % 2}, timeout)

        await asyncio.gather(*(worker(n) for n in range(80)))
        outcomes = {c.outcome for c in rec.calls}
        verdict = check_linearizable(rec.calls, inventory)
        assert verdict.ok, verdict.describe()
        assert verdict.calls == len(rec) > 400
        assert "ok" in outcomes
        assert "fail" in outcomes
        for iid in ("a", "b"):
            exactly_once = check(await eng.get(iid), await eng.history(iid))
            assert exactly_once.ok, exactly_once.describe()


class SkipsTheVersionCheck(MemoryStore):
    """A broken store: a write whose version is stale is applied anyway, at that version."""

    def _write(self, rows: tuple[HistoryEntry, ...]) -> Instance | None:
        current = self._instances[rows[0].instance_id]
        if current.version != rows[0].version - 1:
            self._instances[rows[0].instance_id] = current.evolve(version=rows[0].version - 1)
        return super()._write(rows)


async def test_a_store_that_skips_the_version_check_is_caught() -> None:
    """Concurrent reservations on a store without compare-and-swap: the recorded history is a
    double apply (two callers told they reached the same version)."""
    rec = Recorder()
    inventory = examples.inventory(strategy="optimistic")
    async with flowlock.Engine(SkipsTheVersionCheck(), batching=False) as eng:
        await eng.register(inventory)
        with rec.invoke("x", "create") as call:
            call.ok(await eng.create("inventory", instance_id="x", data={"stock": 100}))

        async def reserve() -> None:
            await _fire(rec, eng, "x", "reserve", {}, None)

        await asyncio.gather(*(reserve() for _ in range(20)))
    verdict = check_linearizable(rec.calls, inventory)
    assert not verdict.ok
    assert DOUBLE_APPLY in verdict.kinds()
