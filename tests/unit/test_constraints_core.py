"""The pure core of constraints: definitions, the claims a move makes, canonical forms."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

import flowlock
from flowlock.core.constraints import Claim, constraint_claims
from flowlock.core.models import Instance, Snapshot
from flowlock.core.step import Call, decide
from flowlock.core.versions import canonical, content_hash


def reviewer(inst: Instance) -> Any:
    return inst.data.get("reviewer")


def customer(inst: Instance) -> Any:
    return inst.data["customer"]


def _review(**extra: Any) -> flowlock.Workflow:
    cap = flowlock.Capacity(key=reviewer, limit=5)
    return flowlock.Workflow(
        "review",
        states=["draft", flowlock.State("in_review", capacity=cap), "done"],
        initial="draft",
        transitions=[
            flowlock.Transition("submit", source="draft", target="in_review"),
            flowlock.Transition("reassign", source="in_review", target="in_review", effect=_move),
            flowlock.Transition("finish", source="in_review", target="done"),
        ],
        **extra,
    )


def _move(inst: Instance, payload: Any, actor: str | None) -> dict[str, Any]:
    return {**inst.data, "reviewer": payload["to"]}


def _inst(state: str, **data: Any) -> Instance:
    return Instance(id="r1", workflow="review", state=state, version=3, data=data)


def _call(event: str, payload: Any = None) -> Call:
    return Call("r1", event, payload or {}, None, None, None, "optimistic")


def test_a_state_with_a_capacity_is_its_name_everywhere() -> None:
    """State("x", capacity=...) is the text "x" in states, sources and targets."""
    wf = _review()
    assert wf.states == ("draft", "in_review", "done")
    assert all(type(s) is str for s in wf.states)
    (rule,) = wf.constraints.slots
    assert (rule.kind, rule.limit, rule.states, rule.unique) == (
        "review.in_review",
        5,
        frozenset({"in_review"}),
        False,
    )


def test_a_capacity_given_on_a_transition_target_counts_too() -> None:
    """A State(capacity=) named as a transition's target gives that state the capacity."""
    held = flowlock.State("held", capacity=flowlock.Capacity(key=reviewer, limit=1, kind="desk"))
    wf = flowlock.Workflow(
        "desk",
        states=["idle", "held"],
        initial="idle",
        transitions=[
            flowlock.Transition("take", source="idle", target=held),
            flowlock.Transition("give", source="held", target="idle"),
        ],
    )
    assert [r.kind for r in wf.constraints.slots] == ["desk"]
    assert wf.transitions["take"].targets == ("held",)


def test_entering_takes_leaving_releases_staying_keeps() -> None:
    """Claims: a take on entering, a release on leaving, nothing on a move that keeps the key."""
    rules = _review().constraints
    draft, held = _inst("draft", reviewer="ann"), _inst("in_review", reviewer="ann")
    done = _inst("done", reviewer="ann")
    assert constraint_claims(rules, draft, held, "submit") == (
        Claim("take", "review.in_review", "ann", 5),
    )
    assert constraint_claims(rules, held, done, "finish") == (Claim("release", "review.in_review"),)
    assert constraint_claims(rules, held, held, "noop") == ()
    assert constraint_claims(rules, draft, draft, "noop") == ()


def test_a_changed_key_releases_then_takes() -> None:
    """Staying in the state under another key gives the old slot back before taking one."""
    rules = _review().constraints
    before, after = _inst("in_review", reviewer="ann"), _inst("in_review", reviewer="bob")
    assert constraint_claims(rules, before, after, "reassign") == (
        Claim("release", "review.in_review"),
        Claim("take", "review.in_review", "bob", 5),
    )


def test_a_key_of_none_is_exempt() -> None:
    """An instance whose key is None takes no slot."""
    rules = _review().constraints
    assert constraint_claims(rules, _inst("draft"), _inst("in_review"), "submit") == ()


def test_unique_defaults_to_every_state_but_the_final_ones() -> None:
    """Unique(states=None) covers every state an event leaves; a create takes its slot."""
    wf = _review(unique=flowlock.Unique(key=customer))
    rule = wf.constraints.kind("review.unique")
    assert rule is not None and getattr(rule, "states", None) == {"draft", "in_review"}
    new = Instance(id="r1", workflow="review", state="draft", version=1, data={"customer": 7})
    claims = constraint_claims(wf.constraints, None, new, None)
    assert Claim("take", "review.unique", "7", 1, unique=True) in claims


def test_a_rate_counts_its_own_transition_only() -> None:
    """Rate on a transition: a count claim for that event, none for others."""
    rate = flowlock.Rate(key=reviewer, per=timedelta(minutes=1), limit=20)
    wf = flowlock.Workflow(
        "orders",
        states=["new", "placed"],
        initial="new",
        transitions=[
            flowlock.Transition("place", source="new", target="placed", rate=rate),
            flowlock.Transition("touch", source="new", target="new"),
        ],
    )
    inst = Instance(id="o", workflow="orders", state="new", version=1, data={"reviewer": "s"})
    after = inst.evolve(state="placed")
    assert constraint_claims(wf.constraints, inst, after, "place") == (
        Claim("count", "orders.place.rate", "s", 20, 60.0),
    )
    assert constraint_claims(wf.constraints, inst, inst, "touch") == ()


def test_the_pure_step_puts_the_claims_on_the_entry() -> None:
    """decide() hands the store the claims with the history entry it writes."""
    wf = _review()
    entry = decide({"review": wf}, Snapshot(_inst("draft", reviewer="ann"), {}), _call("submit"))
    assert isinstance(entry, flowlock.HistoryEntry)
    assert entry.claims == (Claim("take", "review.in_review", "ann", 5),)
    moved = decide(
        {"review": wf},
        Snapshot(_inst("in_review", reviewer="ann"), {}),
        _call("reassign", {"to": "bob"}),
    )
    assert isinstance(moved, flowlock.HistoryEntry)
    assert [c.op for c in moved.claims] == ["release", "take"]


def test_a_key_function_that_raises_is_step_failed() -> None:
    """A key function's own error becomes StepFailed; nothing is decided."""

    def broken(inst: Instance) -> Any:
        raise KeyError("reviewer")

    wf = flowlock.Workflow(
        "review",
        states=["draft", flowlock.State("in_review", capacity=flowlock.Capacity(broken, 2))],
        initial="draft",
        transitions=[flowlock.Transition("submit", source="draft", target="in_review")],
    )
    with pytest.raises(flowlock.StepFailed) as caught:
        decide({"review": wf}, Snapshot(_inst("draft"), {}), _call("submit"))
    assert caught.value.step == "constraint key"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: flowlock.Capacity(key=reviewer, limit=0), "limit"),
        (lambda: flowlock.Capacity(key="reviewer", limit=2), "key must be a function"),  # type: ignore[arg-type]
        (lambda: flowlock.Capacity(key=reviewer, limit=2, wait=-1), "wait"),
        (lambda: flowlock.Capacity(key=reviewer, limit=2, wait=10_000), "wait"),
        (lambda: flowlock.Rate(key=reviewer, per=timedelta(0), limit=2), "per"),
        (lambda: flowlock.Rate(key=reviewer, per=timedelta(seconds=1), limit=True), "limit"),
        (lambda: flowlock.Unique(key=reviewer, states=[]), "states"),
        (lambda: _review(unique=flowlock.Unique(key=customer, states=["nowhere"])), "lacks"),
        (
            lambda: _review(unique=flowlock.Unique(key=customer, kind="review.in_review")),
            "share the kind",
        ),
    ],
)
def test_bad_constraints_are_definition_errors(make: Any, message: str) -> None:
    """A malformed constraint is refused when the definition is built, saying what is wrong."""
    with pytest.raises(flowlock.DefinitionError, match=message):
        make()


def test_constraints_are_part_of_the_definition_version() -> None:
    """A changed limit is a new definition; a workflow without constraints keeps its form."""
    assert "constraints" in canonical(_review())
    wider = flowlock.Workflow(
        "review",
        states=[
            "draft",
            flowlock.State("in_review", capacity=flowlock.Capacity(key=reviewer, limit=6)),
            "done",
        ],
        initial="draft",
        transitions=list(_review().transitions.values()),
    )
    assert content_hash(wider) != content_hash(_review())
    plain = flowlock.Workflow("plain", states=["a"], initial="a", transitions=[])
    assert "constraints" not in canonical(plain)


def test_errors_carry_the_facts() -> None:
    """Each refusal names the key, the limit and who holds it, and is a TransitionRefused."""
    full = flowlock.CapacityReached(
        instance_id="r9", kind="review.in_review", key="ann", limit=2, holders=["r1", "r2"]
    )
    assert isinstance(full, flowlock.ConstraintRefused)
    assert isinstance(full, flowlock.TransitionRefused)
    assert full.holders == ("r1", "r2") and "r1, r2" in str(full)
    taken = flowlock.UniqueViolation(instance_id="s2", kind="sub.unique", key="c1", holder="s1")
    assert taken.holder == "s1" and "'s1'" in str(taken)
    slow = flowlock.RateLimited(
        instance_id="o1", kind="o.rate", key="sku", limit=20, per=60.0, retry_after=1.5
    )
    assert slow.retry_after == 1.5 and "1.500" in str(slow)
