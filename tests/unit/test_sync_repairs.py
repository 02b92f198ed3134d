"""The sync engine's repairs: force, pause and resume one instance or a workflow, as the async
engine does them, from plain threaded code."""

from __future__ import annotations

from pathlib import Path

import pytest

import flowlock
import flowlock.sync


@pytest.fixture(params=["memory", "sqlite"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return "memory://" if request.param == "memory" else f"sqlite:///{tmp_path / 'sync.db'}"


def test_force_pause_resume_from_threaded_code(url: str) -> None:
    with flowlock.sync.Engine.connect(url) as engine:
        engine.register(flowlock.examples.approval())
        engine.create("approval", instance_id="s1")
        forced = engine.force("s1", "rejected", reason="stuck", actor="ops", request_id="f")
        assert forced.applied and forced.instance.state == "rejected"
        assert engine.force("s1", "rejected", reason="stuck", actor="ops", request_id="f").replayed
        paused = engine.pause("s1", reason="audit")
        assert isinstance(paused, flowlock.Outcome) and paused.instance.paused
        engine.force("s1", "pending", reason="reopen", actor="ops")
        with pytest.raises(flowlock.InstancePaused):
            engine.fire("s1", "approve")
        resumed = engine.resume("s1")
        assert isinstance(resumed, flowlock.Outcome) and not resumed.instance.paused
        pause = engine.pause(workflow="approval", reason="deploy", actor="ops")
        assert isinstance(pause, flowlock.WorkflowPause) and engine.workflow_pauses() == [pause]
        with pytest.raises(flowlock.InstancePaused):
            engine.fire("s1", "approve")
        assert engine.resume(workflow="approval") == pause
        assert engine.fire("s1", "approve").applied
        assert [r.kind for r in engine.history("s1")] == [
            "forced", "pause", "forced", "resume", "transition"
        ]  # fmt: skip


def test_bad_input_is_refused_before_anything_is_written(url: str) -> None:
    with flowlock.sync.Engine.connect(url) as engine:
        engine.register(flowlock.examples.approval())
        engine.create("approval", instance_id="s2")
        with pytest.raises(flowlock.UnknownState):
            engine.force("s2", "elsewhere", reason="r", actor="ops")
        with pytest.raises(flowlock.InvalidInput):
            engine.pause(reason="nothing named")
        with pytest.raises(flowlock.InvalidInput):
            engine.pause("s2", workflow="approval", reason="both")
        assert engine.history("s2") == [] and engine.get("s2").version == 1
