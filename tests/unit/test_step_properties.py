"""Property tests of the pure step: no I/O, so hypothesis can drive it hard."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flowlock
from flowlock import examples
from flowlock.checker import check
from flowlock.core.models import HistoryEntry, Instance, Snapshot
from flowlock.core.step import Call, Idempotent, decide

TICKET = flowlock.Workflow(
    "ticket",
    states=["open", "closed"],
    initial="open",
    transitions=[
        flowlock.Transition("close", source="open", target="closed"),
        flowlock.Transition("reopen", source="closed", target="open"),
    ],
)
WORKFLOWS = {w.name: w for w in (TICKET, examples.inventory(), examples.countersign(5))}


def _call(iid: str, event: str, actor: str | None = None, **kw: object) -> Call:
    return Call(
        instance_id=iid,
        event=event,
        payload=kw.pop("payload", {}),  # type: ignore[arg-type]
        actor=actor,
        request_id=kw.pop("request_id", None),  # type: ignore[arg-type]
        expected_version=None,
        strategy="optimistic",
    )


def _apply(inst: Instance, entry: HistoryEntry) -> Instance:
    return inst.evolve(
        state=entry.to_state, version=entry.version, data=entry.data, last_event=entry.event
    )


@settings(max_examples=200)
@given(st.lists(st.sampled_from(["close", "reopen"]), max_size=40))
def test_any_event_sequence_yields_a_valid_history(events: list[str]) -> None:
    """Whatever events arrive, applying decide's entries gives a history the checker accepts;
    each event is applied when its source is the current state, answered idempotent when the
    same event brought the instance where it is, and refused with TransitionNotAllowed only
    otherwise (a reopen before anything was closed)."""
    inst = Instance(id="t", workflow="ticket", state="open", version=1, data={})
    history: list[HistoryEntry] = []
    for event in events:
        source = "open" if event == "close" else "closed"
        if inst.state != source and inst.last_event != event:
            with pytest.raises(flowlock.TransitionNotAllowed) as refused:
                decide(WORKFLOWS, Snapshot(inst), _call("t", event))
            assert (refused.value.state, refused.value.allowed) == (inst.state, ("close",))
            assert event == "reopen" and inst.last_event is None
            continue
        result = decide(WORKFLOWS, Snapshot(inst), _call("t", event))
        if inst.state != source:
            # The two-admins case: the same event brought it here last time.
            assert isinstance(result, Idempotent) and result.instance == inst
            continue
        assert isinstance(result, HistoryEntry)
        assert result.version == inst.version + 1
        history.append(result)
        inst = _apply(inst, result)
    assert check(inst, history, initial_state="open").ok


@settings(max_examples=200)
@given(st.integers(min_value=0, max_value=30), st.lists(st.integers(1, 5), max_size=40))
def test_inventory_never_oversells(stock: int, wants: list[int]) -> None:
    """Reserving any sequence of quantities never takes stock below zero."""
    inst = Instance(id="s", workflow="inventory", state="open", version=1, data={"stock": stock})
    taken = 0
    for qty in wants:
        try:
            result = decide(WORKFLOWS, Snapshot(inst), _call("s", "reserve", payload={"qty": qty}))
        except flowlock.GuardRejected:
            assert qty > inst.data["stock"]
            continue
        assert not isinstance(result, Idempotent)
        inst = _apply(inst, result)
        taken += qty
    assert inst.data["stock"] == stock - taken >= 0


@given(st.lists(st.sampled_from([f"u{i}" for i in range(8)]), max_size=30))
def test_countersign_records_each_signer_once(signers: list[str]) -> None:
    """Each actor's signature is recorded at most once: while pending, a second signature by
    the same actor raises GuardRejected and a new one is applied (moving to approved at
    quorum); once approved, any signature is answered idempotent (the same event brought it
    there), never refused."""
    inst = Instance(id="d", workflow="countersign", state="pending", version=1, data={})
    for actor in signers:
        signed = list(inst.data.get("signers", []))
        if inst.state == "pending" and actor in signed:
            with pytest.raises(flowlock.GuardRejected) as refused:
                decide(WORKFLOWS, Snapshot(inst), _call("d", "sign", actor))
            assert refused.value.reason == f"{actor} has already signed"
            assert (refused.value.instance_id, refused.value.version) == ("d", inst.version)
            continue
        result = decide(WORKFLOWS, Snapshot(inst), _call("d", "sign", actor))
        if inst.state == "approved":
            assert isinstance(result, Idempotent) and result.instance == inst
            continue
        assert isinstance(result, HistoryEntry)
        assert result.data["signers"] == [*signed, actor]
        assert result.to_state == ("approved" if len(signed) + 1 >= 5 else "pending")
        inst = _apply(inst, result)
    recorded = list(inst.data.get("signers", []))
    assert len(recorded) == len(set(recorded))
    assert (inst.state == "approved") == (len(recorded) >= 5)


def test_decide_does_not_mutate_its_input() -> None:
    """Running the step twice on one snapshot gives the same entry (retries are safe)."""
    inst = Instance(id="d", workflow="countersign", state="pending", version=1, data={})
    snap = Snapshot(inst)
    first = decide(WORKFLOWS, snap, _call("d", "sign", "a"))
    second = decide(WORKFLOWS, snap, _call("d", "sign", "a"))
    assert first == second
    assert dict(inst.data) == {}
