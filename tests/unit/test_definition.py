"""Workflow definitions are validated at construction and describe the seed's cases."""

from __future__ import annotations

import pytest

from flowlock import DefinitionError, Transition, Workflow, examples


def test_valid_workflow_exposes_allowed_events() -> None:
    """A valid workflow knows which events each state allows and which states are final."""
    wf = examples.approval()
    assert wf.allowed("pending") == ("approve", "reject")
    assert wf.allowed("approved") == ()
    assert wf.is_final("rejected") and not wf.is_final("pending")


def test_unknown_states_are_reported() -> None:
    """A transition naming a state the workflow lacks is a DefinitionError naming it."""
    with pytest.raises(DefinitionError) as caught:
        Workflow(
            "w",
            states=["a", "b"],
            initial="a",
            transitions=[Transition("go", source="a", target="c")],
        )
    assert any("'c'" in p for p in caught.value.problems)


def test_duplicate_names_are_reported() -> None:
    """Two transitions of one name, or a state listed twice, are DefinitionErrors."""
    with pytest.raises(DefinitionError, match="duplicate transition name 'go'"):
        Workflow(
            "w",
            states=["a", "b"],
            initial="a",
            transitions=[
                Transition("go", source="a", target="b"),
                Transition("go", source="b", target="a"),
            ],
        )
    with pytest.raises(DefinitionError, match="duplicate states: a"):
        Workflow("w", states=["a", "a"], initial="a", transitions=[])


def test_initial_state_is_required_and_must_exist() -> None:
    """No initial state, or one that is not a state, is a DefinitionError."""
    with pytest.raises(DefinitionError, match="no initial state"):
        Workflow("w", states=["a"], initial="", transitions=[])
    with pytest.raises(DefinitionError, match="initial state 'z'"):
        Workflow("w", states=["a"], initial="z", transitions=[])


def test_unreachable_states_are_reported() -> None:
    """Every state must be reachable from the initial one; the unreachable ones are named."""
    with pytest.raises(DefinitionError, match="unreachable from 'a': c, d"):
        Workflow(
            "w",
            states=["a", "b", "c", "d"],
            initial="a",
            transitions=[
                Transition("go", source="a", target="b"),
                Transition("jump", source="c", target="d"),
            ],
        )


def test_every_problem_is_reported_at_once() -> None:
    """A definition with several problems lists all of them."""
    with pytest.raises(DefinitionError) as caught:
        Workflow(
            "w",
            states=["a", "a"],
            initial="z",
            transitions=[Transition("go", source="q", target="a")],
        )
    assert len(caught.value.problems) >= 3


@pytest.mark.parametrize("name", ["", "1abc", "has space", "x" * 101, "semi;colon", "nul\x00"])
def test_bad_names_are_refused(name: str) -> None:
    """Names must be short identifiers: no spaces, SQL punctuation or control characters."""
    with pytest.raises(DefinitionError):
        Transition(name, source="a", target="b")
    with pytest.raises(DefinitionError):
        Workflow(name, states=["a"], initial="a", transitions=[])


def test_transition_sources_and_targets() -> None:
    """A transition may have several sources and several targets; the first target is default."""
    t = Transition("sign", source=["a", "b"], target=("b", "c"))
    assert t.sources == ("a", "b") and t.targets == ("b", "c") and t.target == "b"
    with pytest.raises(DefinitionError, match="at least one source"):
        Transition("x", source=[], target="a")


def test_guard_and_effect_must_be_callable() -> None:
    """A non-callable guard or effect is refused at construction."""
    with pytest.raises(DefinitionError, match="guard must be callable"):
        Transition("x", source="a", target="a", guard=True)  # type: ignore[arg-type]
    with pytest.raises(DefinitionError, match="effect must be callable"):
        Transition("x", source="a", target="a", effect={})  # type: ignore[arg-type]


def test_unknown_strategy_is_refused() -> None:
    """Only known strategy names are accepted on a transition or workflow."""
    with pytest.raises(DefinitionError, match="unknown strategy"):
        Transition("x", source="a", target="a", strategy="yolo")  # type: ignore[arg-type]
    with pytest.raises(DefinitionError, match="unknown strategy"):
        Workflow("w", states=["a"], initial="a", transitions=[], strategy="yolo")  # type: ignore[arg-type]


def test_policy_presets_follow_the_seed_decision_guide() -> None:
    """policy= picks the strategy: approval/ticket optimistic, inventory/allocation
    pessimistic, cross-service/scheduled-job distributed, adaptive adaptive."""
    expected = {
        "approval": "optimistic",
        "ticket": "optimistic",
        "inventory": "pessimistic",
        "allocation": "pessimistic",
        "cross-service": "distributed",
        "scheduled-job": "distributed",
        "adaptive": "adaptive",
    }
    for policy, strategy in expected.items():
        assert Transition("x", source="a", target="a", policy=policy).strategy == strategy
        wf = Workflow("w", states=["a"], initial="a", transitions=[], policy=policy)
        assert (wf.strategy, wf.policy) == (strategy, policy)


def test_unknown_or_contradictory_policy_is_refused() -> None:
    """An unknown policy, or a policy and a different strategy together, is a DefinitionError."""
    with pytest.raises(DefinitionError, match="unknown policy"):
        Transition("x", source="a", target="a", policy="yolo")
    with pytest.raises(DefinitionError, match="give one of them"):
        Workflow(
            "w",
            states=["a"],
            initial="a",
            transitions=[],
            policy="inventory",
            strategy="optimistic",
        )


def test_must_apply_transitions_under_plain_optimistic_are_flagged() -> None:
    """A data-changing self-loop left to plain optimistic is flagged; a preset clears it (the
    examples carry one, so only with ``strategy=None`` are they left to the default)."""
    assert examples.inventory(strategy=None).safety_warnings("optimistic")
    assert (
        "policy='inventory'"
        in examples.countersign(3, strategy=None).safety_warnings("optimistic")[0]
    )
    assert examples.inventory(strategy=None).safety_warnings("pessimistic") == []
    assert examples.inventory().safety_warnings("optimistic") == []
    assert examples.approval().safety_warnings("optimistic") == []
    safe = Workflow(
        "stock",
        states=["open"],
        initial="open",
        policy="inventory",
        transitions=[Transition("take", source="open", target="open", effect=lambda i, p, a: {})],
    )
    assert safe.safety_warnings("optimistic") == []


async def test_register_logs_the_safety_warning(caplog: pytest.LogCaptureFixture) -> None:
    """The engine logs the startup check's warning when a risky workflow is registered."""
    import logging

    import flowlock
    from flowlock.stores import MemoryStore

    async with flowlock.Engine(MemoryStore()) as engine:
        with caplog.at_level(logging.WARNING, logger="flowlock"):
            await engine.register(examples.inventory(strategy=None))
    assert any("run out of retries" in r.message for r in caplog.records)
