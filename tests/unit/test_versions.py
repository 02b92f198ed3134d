"""The pure core of versioned definitions: canonical form, content hash, DefinitionVersion and
the Registry's pinning."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import flowlock
import flowlock.sync
from flowlock.core.errors import DefinitionMismatch
from flowlock.core.versions import (
    DefinitionVersion,
    Registry,
    callable_name,
    canonical,
    content_hash,
)


def approve_guard(inst: flowlock.Instance, payload: Any, actor: str | None) -> bool:
    return True


def _wf(*, guard: Any = None, extra: bool = False, after: float | None = None) -> flowlock.Workflow:
    transitions = [
        flowlock.Transition("submit", source="draft", target="review"),
        flowlock.Transition(
            "approve",
            source="review",
            target="done",
            guard=guard,
            after=None if after is None else timedelta(seconds=after),
        ),
    ]
    if extra:
        transitions.append(flowlock.Transition("reopen", source="done", target="draft"))
    return flowlock.Workflow(
        "doc", states=["draft", "review", "done"], initial="draft", transitions=transitions
    )


def test_canonical_form_is_plain_json_with_steps_by_name() -> None:
    """The canonical form round-trips through JSON and names a guard "module:qualname"."""
    form = canonical(_wf(guard=approve_guard, after=60))
    assert json.loads(json.dumps(form)) == form
    assert form["finals"] == ["done"]
    approve = next(t for t in form["transitions"] if t["name"] == "approve")
    assert approve["guard"] == f"{__name__}:approve_guard"
    assert approve["after"] == 60.0 and approve["effect"] is None


def test_the_same_definition_built_twice_has_the_same_hash() -> None:
    """Two Workflow objects of the same code hash alike; a changed one does not."""
    assert content_hash(_wf(guard=approve_guard)) == content_hash(_wf(guard=approve_guard))
    assert content_hash(_wf()) != content_hash(_wf(extra=True))
    assert content_hash(_wf()) != content_hash(_wf(after=5))
    assert content_hash(_wf()) != content_hash(_wf(guard=approve_guard))


def _typed(payload: Any = None, data: Any = None) -> flowlock.Workflow:
    go = flowlock.Transition("go", source="a", target="b", payload=payload)
    return flowlock.Workflow("t", states=["a", "b"], initial="a", transitions=[go], data=data)


def _needs(field: str) -> dict[str, Any]:
    return {"type": "object", "properties": {field: {"type": "integer"}}, "required": [field]}


def test_a_changed_payload_or_data_schema_is_a_new_definition() -> None:
    """The payload and data schemas are in the form: changing one changes the hash (and the
    version register gives); an untyped form has both members, as None."""
    plain = canonical(_typed())
    assert plain["data"] is None and plain["transitions"][0]["payload"] is None
    form = canonical(_typed(payload=_needs("n"), data=_needs("d")))
    assert form["transitions"][0]["payload"] == _needs("n") and form["data"] == _needs("d")
    assert json.loads(json.dumps(form)) == form
    hashes = {
        content_hash(wf)
        for wf in (
            _typed(),
            _typed(payload=_needs("n")),
            _typed(payload=_needs("m")),
            _typed(data=_needs("n")),
            _typed(data=_needs("m")),
        )
    }
    assert len(hashes) == 5
    assert content_hash(_typed(payload=_needs("n"))) == content_hash(_typed(payload=_needs("n")))
    with flowlock.sync.Engine.connect("memory://") as engine:
        assert engine.register(_typed(payload=_needs("n"))) == 1
        assert engine.register(_typed(payload=_needs("m"))) == 2
        assert engine.register(_typed(payload=_needs("m"), data=_needs("d"))) == 3


def test_two_different_lambdas_differ_and_the_same_one_does_not() -> None:
    """A lambda is named with a hash of its source, so a changed lambda is a new definition."""
    one = lambda inst, payload, actor: True  # noqa: E731
    two = lambda inst, payload, actor: bool(payload)  # noqa: E731
    assert callable_name(one) != callable_name(two)
    assert "<lambda>#" in (callable_name(one) or "")
    assert content_hash(_wf(guard=one)) == content_hash(_wf(guard=one))
    assert content_hash(_wf(guard=one)) != content_hash(_wf(guard=two))


@given(st.permutations(["a", "b", "c", "d"]))
def test_the_order_transitions_are_listed_in_does_not_change_the_hash(order: list[str]) -> None:
    """Transitions are sorted in the canonical form."""

    def build(names: list[str]) -> flowlock.Workflow:
        return flowlock.Workflow(
            "w",
            states=["s", "t"],
            initial="s",
            transitions=[flowlock.Transition(n, source="s", target="t") for n in names],
        )

    assert content_hash(build(order)) == content_hash(build(sorted(order)))


def test_a_definition_version_compares_with_its_number() -> None:
    """register()'s answer equals its version number, hashes like it and converts to it."""
    v = DefinitionVersion("doc", 2, "ab", None, {}, new=True)
    assert v == 2 and v != 3 and int(v) == 2 and [10, 20, 30][v] == 30
    assert v == DefinitionVersion("doc", 2, "ab", None, {"other": 1})
    assert v != DefinitionVersion("doc", 2, "cd", None, {})
    assert v != True  # noqa: E712 - a bool is not a version number
    assert len({v, DefinitionVersion("doc", 2, "ab", None, {})}) == 1


def test_the_registry_keeps_every_version_and_answers_the_pinned_one() -> None:
    """As a Mapping it gives the newest; pinned() gives an instance's own version, None for an
    unknown workflow, and DefinitionMismatch for a version it lacks."""
    reg = Registry()
    old, new = _wf(), _wf(extra=True)
    reg.add(new, 2)
    reg.add(old, 1)  # registered last, but older: the newest stays version 2
    assert reg["doc"] is new and dict(reg) == {"doc": new} and len(reg) == 1
    assert reg.versions("doc") == (1, 2) and reg.newest_version("doc") == 2
    assert reg.pinned("doc", 1) is old and reg.pinned("doc", None) is new
    assert reg.pinned("nope", 1) is None
    with pytest.raises(DefinitionMismatch) as caught:
        reg.pinned("doc", 3, instance_id="i-1")
    assert (caught.value.instance_id, caught.value.version) == ("i-1", 3)
    assert caught.value.registered == (1, 2)
    assert "migrate" in str(caught.value) and "Register" in str(caught.value)


def test_an_unversioned_registry_replaces_the_newest() -> None:
    """A store without definitions adds with no version: the last registered is the newest, and
    an instance pinned to a version is refused."""
    reg = Registry()
    reg.add(_wf(), None)
    newer = _wf(extra=True)
    reg.add(newer, None)
    assert reg["doc"] is newer and reg.newest_version("doc") is None
    with pytest.raises(DefinitionMismatch):
        reg.pinned("doc", 1)
