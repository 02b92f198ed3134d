"""The sync engine's definition versions: register's answer before and after the engine opens,
create(version=), definitions(), and DefinitionMismatch."""

from __future__ import annotations

import pytest

import flowlock
import flowlock.sync
from flowlock import examples


def approval_v2() -> flowlock.Workflow:
    """The example approval with an extra state: a changed definition."""
    return flowlock.Workflow(
        "approval",
        states=["pending", "approved", "rejected", "held"],
        initial="pending",
        transitions=[
            flowlock.Transition("approve", source="pending", target="approved"),
            flowlock.Transition("reject", source="pending", target="rejected"),
            flowlock.Transition("hold", source="pending", target="held"),
        ],
    )


def test_the_sync_engine_registers_versions_and_pins_creates() -> None:
    """Before the engine opens register answers version 0 and stores it at open; after, a
    changed definition is version 2; create(version=) pins; an unknown version is refused."""
    engine = flowlock.sync.Engine.connect("memory://")
    early = engine.register(examples.approval())  # connects nothing: safe before a fork
    assert early == 0 and not early.new
    with engine:
        first = engine.create("approval", instance_id="a")  # opens the engine: version 1 stored
        assert first.definition_version == 1
        v2 = engine.register(approval_v2())
        assert v2 == 2 and v2.new
        assert engine.create("approval", instance_id="b").definition_version == 2
        assert engine.create("approval", instance_id="c", version=1).definition_version == 1
        with pytest.raises(flowlock.DefinitionMismatch):
            engine.create("approval", instance_id="d", version=3)
        listed = engine.definitions("approval")
        assert [(v.version, v.instances) for v in listed] == [(1, 2), (2, 1)]
        engine.fire("a", "approve")
        assert [e.definition_version for e in engine.history("a")] == [1]
