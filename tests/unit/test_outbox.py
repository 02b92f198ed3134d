"""Emitting on the memory store, and registering handlers: what a transition writes to the
outbox, under which key, and what `on_emit` and the outbox options accept."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import pytest

import flowlock
from flowlock.core.outbox import message_key, parse_key
from outbox_kit import status_is


def _orders() -> flowlock.Workflow:
    """An order whose `reserve` effect emits through a Step, and whose `ship` transition
    emits through `emit=`; `note` emits two messages and stays."""

    def reserve(inst: flowlock.Instance, payload: Mapping[str, Any], actor: str | None) -> Any:
        return flowlock.Step(
            {**inst.data, "reserved": True}, emit=[flowlock.Emit("charge", {"sku": "x"})]
        )

    def shipped(inst: flowlock.Instance, payload: Mapping[str, Any], actor: str | None) -> Any:
        return [flowlock.Emit("mail", {"to": actor, "state": inst.state})]

    def note(inst: flowlock.Instance, payload: Mapping[str, Any], actor: str | None) -> Any:
        return flowlock.Step(
            {**inst.data, "notes": inst.data.get("notes", 0) + 1},
            emit=[flowlock.Emit("audit", {"n": 0}), flowlock.Emit("audit", {"n": 1})],
        )

    return flowlock.Workflow(
        "order",
        states=["new", "reserved", "shipped"],
        initial="new",
        transitions=[
            flowlock.Transition("reserve", source="new", target="reserved", effect=reserve),
            flowlock.Transition("ship", source="reserved", target="shipped", emit=shipped),
            flowlock.Transition("note", source="reserved", target="reserved", effect=note),
        ],
    )


@pytest.fixture
async def engine() -> Any:
    async with flowlock.connect("memory://") as eng:
        await eng.register(_orders())
        await eng.create("order", instance_id="o1")
        yield eng


async def test_step_and_transition_emit_are_written_with_their_keys(
    engine: flowlock.Engine,
) -> None:
    """Step(emit=) and Transition(emit=) write pending messages keyed id:version:n."""
    await engine.fire("o1", "reserve", actor="ann")
    await engine.fire("o1", "note", actor="ann")
    await engine.fire("o1", "ship", actor="bob")
    found = await engine.messages("o1")
    assert [m.key for m in found] == ["o1:2:0", "o1:3:0", "o1:3:1", "o1:4:0"]
    assert [m.kind for m in found] == ["charge", "audit", "audit", "mail"]
    assert [dict(m.payload) for m in found] == [
        {"sku": "x"},
        {"n": 0},
        {"n": 1},
        {"to": "bob", "state": "shipped"},
    ]
    assert all(m.status == "pending" and m.attempts == 0 for m in found)
    assert all(m.workflow == "order" and m.fencing_token is None for m in found)
    for m in found:
        assert parse_key(m.key) == (m.instance_id, m.version, m.n)
        assert message_key(m.instance_id, m.version, m.n) == m.key
    assert (await engine.message("o1:4:0")).kind == "mail"


async def test_an_idempotent_call_emits_nothing(engine: flowlock.Engine) -> None:
    """A request repeated under its request id answers the first outcome, writes no message."""
    first = await engine.fire("o1", "reserve", request_id="r1")
    again = await engine.fire("o1", "reserve", request_id="r1")
    assert first.applied and again.idempotent
    assert [m.key for m in await engine.messages("o1")] == ["o1:2:0"]


async def test_a_refused_call_emits_nothing(engine: flowlock.Engine) -> None:
    """An event not allowed from the state, or a failing emit function, writes nothing."""
    with pytest.raises(flowlock.TransitionNotAllowed):
        await engine.fire("o1", "ship")
    assert await engine.messages("o1") == []

    def broken(inst: flowlock.Instance, payload: Mapping[str, Any], actor: str | None) -> Any:
        raise RuntimeError("no")

    wf = flowlock.Workflow(
        "broken",
        states=["a", "b"],
        initial="a",
        transitions=[flowlock.Transition("go", source="a", target="b", emit=broken)],
    )
    await engine.register(wf)
    await engine.create("broken", instance_id="b1")
    with pytest.raises(flowlock.StepFailed):
        await engine.fire("b1", "go")
    assert await engine.messages("b1") == []
    assert (await engine.get("b1")).version == 1


async def test_calls_that_lose_the_race_emit_nothing() -> None:
    """Of 50 racing calls with one attempt each, only the applied ones wrote a message: one per
    history entry, none for a lost compare-and-swap."""

    def bump(inst: flowlock.Instance, payload: Mapping[str, Any], actor: str | None) -> Any:
        return flowlock.Step({"n": inst.data.get("n", 0) + 1}, emit=[flowlock.Emit("k")])

    wf = flowlock.Workflow(
        "counter",
        states=["on"],
        initial="on",
        policy="approval",
        transitions=[flowlock.Transition("bump", source="on", target="on", effect=bump)],
    )
    one_try = [flowlock.Optimistic(max_attempts=1)]
    async with flowlock.connect("memory://", batching=False, strategies=one_try) as eng:
        await eng.register(wf)
        await eng.create("counter", instance_id="c")
        got = await asyncio.gather(
            *(eng.fire("c", "bump") for _ in range(50)), return_exceptions=True
        )
        lost = [r for r in got if isinstance(r, flowlock.ConflictRetriesExhausted)]
        applied = [r for r in got if isinstance(r, flowlock.Outcome) and r.applied]
        assert lost, "the race was not run: no call lost"
        assert len(applied) + len(lost) == 50
        history = await eng.history("c")
        found = await eng.messages("c")
        assert len(found) == len(applied) == len(history)
        assert [m.version for m in found] == [h.version for h in history]


# -- on_emit and the options ---------------------------------------------------------------


async def _ok(message: flowlock.Message) -> None:
    return None


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        (("bad kind", _ok), {}),
        (("", _ok), {}),
        ((7, _ok), {}),
        (("k", "not callable"), {}),
        (("k", _ok), {"concurrency": 0}),
        (("k", _ok), {"concurrency": True}),
        (("k", _ok), {"concurrency": 1.5}),
        (("k", _ok), {"max_attempts": 0}),
        (("k", _ok), {"max_attempts": 10_000}),
        (("k", _ok), {"timeout": 0}),
        (("k", _ok), {"timeout": float("nan")}),
        (("k", _ok), {"timeout": 60.0}),  # not below the default outbox_lease (60)
    ],
)
async def test_on_emit_refuses_bad_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A bad kind, handler, concurrency, max_attempts or timeout is InvalidInput; nothing is
    registered."""
    eng = flowlock.connect("memory://")
    with pytest.raises(flowlock.InvalidInput):
        eng.on_emit(*args, **kwargs)
    assert eng.dispatcher is not None
    assert dict(eng._handlers) == {}


async def test_a_timeout_must_be_below_the_lease() -> None:
    """The handler's timeout must be below outbox_lease, which can be raised."""
    eng = flowlock.connect("memory://", outbox_lease=5.0)
    with pytest.raises(flowlock.InvalidInput, match="outbox_lease"):
        eng.on_emit("k", _ok)  # the default 30 s timeout
    eng.on_emit("k", _ok, timeout=4.0)
    flowlock.connect("memory://", outbox_lease=120.0).on_emit("k", _ok, timeout=100.0)


@pytest.mark.parametrize(
    "options",
    [
        {"outbox": 1},
        {"outbox_lease": 0},
        {"outbox_lease": -1.0},
        {"outbox_lease": 7200.0},
        {"outbox_retention": 3600},
        {"outbox_retention": timedelta(0)},
        {"outbox_retention": timedelta(seconds=-1)},
        {"outbox_backoff": 1.0},
        {"outbox_backoff": (1.0,)},
        {"outbox_backoff": (0.0, 1.0)},
        {"outbox_backoff": (2.0, 1.0)},
        {"outbox_backoff": (1.0, 7200.0)},
    ],
)
def test_bad_outbox_options_are_refused(options: dict[str, Any]) -> None:
    """Each outbox option is checked when the engine is built."""
    with pytest.raises(flowlock.InvalidInput):
        flowlock.connect("memory://", **options)


def test_good_outbox_options() -> None:
    """The defaults: a 60 s lease, 7 days of retention, backoff from 1 s to 5 min."""
    eng = flowlock.connect("memory://")
    dispatcher = eng.dispatcher
    assert dispatcher is not None
    assert dispatcher.lease == 60.0
    assert dispatcher.retention == timedelta(days=7).total_seconds()
    assert dispatcher.backoff == (1.0, 300.0)
    kept = flowlock.connect(
        "memory://", outbox_retention=None, outbox_lease=5, outbox_backoff=(0.01, 0.5)
    ).dispatcher
    assert kept is not None
    assert (kept.retention, kept.lease, kept.backoff) == (None, 5.0, (0.01, 0.5))
    assert flowlock.connect("memory://", outbox=False).dispatcher is None


async def test_registering_a_kind_again_replaces_its_handler() -> None:
    """The second on_emit for a kind replaces the first; later messages go to it."""
    first: list[str] = []
    second: list[str] = []

    async def one(message: flowlock.Message) -> None:
        first.append(message.key)

    async def two(message: flowlock.Message) -> None:
        second.append(message.key)

    async with flowlock.connect("memory://") as eng:
        await eng.register(_orders())
        eng.on_emit("charge", one)
        eng.on_emit("charge", two)
        await eng.create("order", instance_id="o1")
        await eng.fire("o1", "reserve")
        await status_is(eng, "o1:2:0", "done")
    assert (first, second) == ([], ["o1:2:0"])


async def test_an_engine_with_outbox_false_never_delivers() -> None:
    """outbox=False keeps the handler, writes the messages, and delivers none."""
    seen: list[str] = []

    async def record(message: flowlock.Message) -> None:
        seen.append(message.key)

    async with flowlock.connect("memory://", outbox=False) as eng:
        await eng.register(_orders())
        eng.on_emit("charge", record)
        await eng.create("order", instance_id="o1")
        await eng.fire("o1", "reserve")
        await asyncio.sleep(0.2)
        assert [m.status for m in await eng.messages("o1")] == ["pending"]
    assert seen == []
