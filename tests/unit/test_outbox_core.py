"""What a transition emits, decided by the pure step: `Step(emit=)`, `Transition(emit=)`, the
checks on what they return, and the message keys."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

import flowlock
from flowlock import Emit, Step, Transition, Workflow
from flowlock.core.models import Instance, Snapshot
from flowlock.core.outbox import Message, message_key, parse_key
from flowlock.core.step import Call, decide, decide_batch
from flowlock.stores import MemoryStore


def _call(event: str, payload: Mapping[str, Any] | None = None, rid: str | None = None) -> Call:
    return Call("i", event, payload or {}, "ann", rid, None, "optimistic", trace="00-trace")


def _inst(state: str = "open", version: int = 3) -> Instance:
    return Instance("i", "doc", state, version, {"n": 1}, stay_version=1)


def _doc(**transition: Any) -> Workflow:
    return Workflow(
        "doc",
        states=["open", "closed"],
        initial="open",
        transitions=[
            Transition("close", source="open", target="closed", **transition),
            Transition("touch", source=["open", "closed"], target=["open", "closed"]),
        ],
    )


def _decide(wf: Workflow, call: Call, inst: Instance | None = None) -> Any:
    return decide({wf.name: wf}, Snapshot(inst or _inst()), call)


def test_an_effect_s_step_and_the_emit_function_both_emit_in_that_order() -> None:
    """The Step's messages come first, then the function's; the function sees the instance as
    the transition leaves it (new state, data and version)."""
    seen: list[Instance] = []

    def emit(inst: Instance, payload: Mapping[str, Any], actor: str | None) -> list[Emit]:
        seen.append(inst)
        return [Emit("audit", {"by": actor, "state": inst.state, "why": payload["why"]})]

    wf = _doc(effect=lambda i, p, a: Step({"n": 2}, emit=[Emit("notify", {"to": "x"})]), emit=emit)
    entry = _decide(wf, _call("close", {"why": "done"}))
    assert entry.emits == (
        Emit("notify", {"to": "x"}),
        Emit("audit", {"by": "ann", "state": "closed", "why": "done"}),
    )
    assert entry.trace == "00-trace"
    [after] = seen
    assert (after.state, after.version, after.data, after.stay_version) == (
        "closed",
        4,
        {"n": 2},
        4,
    )


def test_no_emit_means_no_messages_and_no_trace() -> None:
    entry = _decide(_doc(), _call("close"))
    assert entry.emits == () and entry.trace is None


def test_an_idempotent_answer_emits_nothing() -> None:
    """The two-admins rule answers without an entry: nothing is written, no message either."""
    wf = _doc(emit=lambda i, p, a: [Emit("n")])
    done = _inst("closed").evolve(last_event="close")
    answer = _decide(wf, _call("close"), done)
    assert not isinstance(answer, flowlock.HistoryEntry)


def test_a_refused_call_runs_no_emit_function() -> None:
    calls: list[str] = []

    def emit(inst: Instance, payload: Mapping[str, Any], actor: str | None) -> list[Emit]:
        calls.append(inst.id)
        return []

    wf = _doc(guard=lambda i, p, a: False, emit=emit)
    with pytest.raises(flowlock.GuardRejected):
        _decide(wf, _call("close"))
    assert calls == []


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        ({"kind": "x"}, "give a list of flowlock.Emit"),
        ("notify", "give a list of flowlock.Emit"),
        ([{"kind": "x"}], r"emit flowlock\.Emit\(kind, payload\) values"),
    ],
)
def test_an_emit_function_returning_something_else_is_a_definition_error(
    returned: object, message: str
) -> None:
    wf = _doc(emit=lambda i, p, a: returned)
    with pytest.raises(flowlock.DefinitionError, match=message):
        _decide(wf, _call("close"))


def test_an_emit_function_may_return_none_or_one_emit() -> None:
    assert _decide(_doc(emit=lambda i, p, a: None), _call("close")).emits == ()
    one = _decide(_doc(emit=lambda i, p, a: Emit("n")), _call("close"))
    assert one.emits == (Emit("n", {}),)


def test_an_emit_function_that_raises_is_a_step_failure() -> None:
    def boom(inst: Instance, payload: Mapping[str, Any], actor: str | None) -> list[Emit]:
        raise RuntimeError("no")

    with pytest.raises(flowlock.StepFailed) as info:
        _decide(_doc(emit=boom), _call("close"))
    assert info.value.step == "emit"


def test_an_async_emit_function_is_refused_when_defined() -> None:
    async def emit(inst: Instance, payload: Mapping[str, Any], actor: str | None) -> list[Emit]:
        return []

    with pytest.raises(flowlock.DefinitionError, match="emit"):
        _doc(emit=emit)
    with pytest.raises(flowlock.DefinitionError, match="callable"):
        _doc(emit="notify")


def test_message_payloads_pass_the_data_checks() -> None:
    """Not JSON, or too large: InvalidInput before anything is written."""
    wf = _doc(emit=lambda i, p, a: [Emit("n", {"at": object()})])
    with pytest.raises(flowlock.InvalidInput, match="payload of message 0"):
        _decide(wf, _call("close"))
    big = _doc(emit=lambda i, p, a: [Emit("n", {"x": "y" * 100})])
    with pytest.raises(flowlock.PayloadTooLarge):
        decide({"doc": big}, Snapshot(_inst()), _call("close"), max_payload_bytes=50)


@pytest.mark.parametrize("kind", ["", "1x", "a b", "x" * 101, None, 3])
def test_a_bad_kind_is_refused(kind: object) -> None:
    with pytest.raises(flowlock.InvalidInput, match="message kind"):
        Emit(kind)  # type: ignore[arg-type]


def test_a_batch_gives_each_entry_its_own_messages() -> None:
    wf = _doc(emit=lambda i, p, a: [Emit("n", {"v": i.version})])
    wf2 = Workflow(
        "doc",
        states=["open"],
        initial="open",
        transitions=[
            Transition("bump", source="open", target="open", emit=wf.transitions["close"].emit)
        ],
    )
    batched = decide_batch(
        {"doc": wf2}, Snapshot(_inst()), (_call("bump", rid="a"), _call("bump", rid="b"))
    )
    assert [e.emits for e in batched.entries] == [(Emit("n", {"v": 4}),), (Emit("n", {"v": 5}),)]


def test_keys_name_the_instance_the_version_and_the_place() -> None:
    assert message_key("order:7", 4, 1) == "order:7:4:1"
    assert parse_key("order:7:4:1") == ("order:7", 4, 1)
    for bad in ("x", "x:1", "x:a:1", ":1:2", 5):
        with pytest.raises(flowlock.InvalidInput):
            parse_key(bad)  # type: ignore[arg-type]


async def test_the_memory_store_writes_messages_with_the_commit_only() -> None:
    """Applied calls write their messages (keyed by version and place); an idempotent repeat,
    a refusal and a lost compare-and-swap write none."""
    wf = Workflow(
        "doc",
        states=["open", "closed"],
        initial="open",
        transitions=[
            Transition(
                "close",
                source="open",
                target="closed",
                emit=lambda i, p, a: [Emit("a", {"n": 1}), Emit("b")],
            ),
        ],
    )
    async with flowlock.Engine(MemoryStore()) as engine:
        await engine.register(wf)
        await engine.create("doc", instance_id="d")
        await engine.fire("d", "close", request_id="r1")
        await engine.fire("d", "close", request_id="r1")  # replayed
        await engine.fire("d", "close")  # the same event again: idempotent
        with pytest.raises(flowlock.VersionMismatch):
            await engine.fire("d", "close", expected_version=1)
        messages = await engine.messages("d")
        assert [(m.key, m.kind, m.payload, m.status, m.attempts) for m in messages] == [
            ("d:2:0", "a", {"n": 1}, "pending", 0),
            ("d:2:1", "b", {}, "pending", 0),
        ]
        assert all(isinstance(m, Message) and m.version == 2 for m in messages)
        assert await engine.messages("nobody") == []


async def test_a_caller_may_not_use_a_message_key_of_the_instance_as_request_id() -> None:
    """That id is the Then's of the message's handler: refused, nothing read or written. The
    same form for another instance, or a longer key of a long instance id, is fine."""
    wf = _doc()
    async with flowlock.Engine(MemoryStore()) as engine:
        await engine.register(wf)
        await engine.create("doc", instance_id="d:1")
        for rid in ("d:1:2:0", "d:1:12:345"):
            with pytest.raises(flowlock.InvalidInput, match="outbox message key"):
                await engine.fire("d:1", "close", request_id=rid)
        assert (await engine.get("d:1")).version == 1
        assert (await engine.fire("d:1", "close", request_id="d:2:0")).applied
        with pytest.raises(flowlock.InvalidInput, match="request_id"):
            await engine.fire("d:1", "touch", request_id="r" * 201)


@pytest.mark.parametrize(("event", "payload"), [(123, {}), ("", {}), ("ok", ["x"])])
def test_a_bad_then_is_refused_when_made(event: object, payload: object) -> None:
    with pytest.raises(flowlock.InvalidInput, match="Then"):
        flowlock.Then(event, payload)  # type: ignore[arg-type]


def test_a_message_can_be_made_by_hand_to_call_a_handler() -> None:
    """As the issue names its fields: version and n come from the key, `attempt` is
    `attempts`; dataclasses.replace keeps working."""
    import dataclasses

    m = Message(key="o-1:2:1", instance_id="o-1", kind="notify", payload={"to": "x"}, attempt=1)
    assert (m.version, m.n, m.attempt, m.attempts, m.status) == (2, 1, 1, 1, "pending")
    assert (m.fencing_token, m.workflow, dict(m.payload)) == (None, "", {"to": "x"})
    later = dataclasses.replace(m, attempts=3, status="dead")
    assert (later.attempt, later.status, later.key) == (3, "dead", "o-1:2:1")
