"""Engine behaviour on the in-memory store: input validation, lifecycle, strategies, retries."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest

import flowlock
from flowlock import examples
from flowlock.checker import check
from flowlock.stores import MemoryStore


@pytest.fixture
async def mem() -> AsyncIterator[flowlock.Engine]:
    async with flowlock.Engine(MemoryStore(), max_payload_bytes=1024) as eng:
        await eng.register(examples.approval())
        await eng.register(examples.inventory())
        await eng.create("approval", instance_id="r", data={"amount": 1})
        yield eng


async def _unchanged(eng: flowlock.Engine) -> None:
    inst = await eng.get("r")
    assert (inst.state, inst.version, dict(inst.data)) == ("pending", 1, {"amount": 1})
    assert await eng.history("r") == []


@pytest.mark.parametrize(
    "bad_id",
    ["", "x" * 201, "nul\x00byte", "tab\there", "newline\n", "bell\x07", "del\x7f", 42, None],
)
async def test_bad_instance_ids(mem: flowlock.Engine, bad_id: Any) -> None:
    """Empty, too long, control-character and non-string ids raise InvalidInput, change nothing."""
    with pytest.raises(flowlock.InvalidInput):
        await mem.fire(bad_id, "approve")
    with pytest.raises(flowlock.InvalidInput):
        await mem.create("approval", instance_id=bad_id)
    with pytest.raises(flowlock.InvalidInput):
        await mem.get(bad_id)
    await _unchanged(mem)


async def test_id_of_200_characters_is_fine(mem: flowlock.Engine) -> None:
    """The limit is inclusive: a 200-character id works."""
    long_id = "é" * 200
    await mem.create("approval", instance_id=long_id)
    assert (await mem.fire(long_id, "approve")).applied


@pytest.mark.parametrize("event", ["", "no such", "a;drop", "x" * 101, 7])
async def test_bad_event_names(mem: flowlock.Engine, event: Any) -> None:
    """A malformed event name is InvalidInput before anything is read."""
    with pytest.raises(flowlock.InvalidInput):
        await mem.fire("r", event)
    await _unchanged(mem)


async def test_unknown_event_and_workflow(mem: flowlock.Engine) -> None:
    """Unknown events and workflows raise typed errors (both InvalidInput) and change nothing."""
    with pytest.raises(flowlock.UnknownEvent):
        await mem.fire("r", "ship")
    with pytest.raises(flowlock.UnknownWorkflow, match="register"):
        await mem.create("nope", instance_id="n")
    assert issubclass(flowlock.UnknownEvent, flowlock.InvalidInput)
    await _unchanged(mem)


@pytest.mark.parametrize("payload", [[1, 2], "text", 3, {"bad": object()}, {"s": {1, 2}}])
async def test_payload_must_be_a_json_object(mem: flowlock.Engine, payload: Any) -> None:
    """Payloads that are not JSON objects raise InvalidInput and change nothing."""
    with pytest.raises(flowlock.InvalidInput):
        await mem.fire("r", "approve", payload=payload)
    await _unchanged(mem)


async def test_payload_size_limit(mem: flowlock.Engine) -> None:
    """A payload over max_payload_bytes raises PayloadTooLarge with both sizes."""
    with pytest.raises(flowlock.PayloadTooLarge) as caught:
        await mem.fire("r", "approve", payload={"blob": "x" * 2000})
    assert caught.value.limit == 1024 and caught.value.size > 1024
    with pytest.raises(flowlock.PayloadTooLarge):
        await mem.create("approval", instance_id="big", data={"blob": "x" * 2000})
    await _unchanged(mem)


@pytest.mark.parametrize("field", ["actor", "request_id"])
async def test_bad_actor_and_request_id(mem: flowlock.Engine, field: str) -> None:
    """actor and request_id follow the id rules."""
    with pytest.raises(flowlock.InvalidInput):
        await mem.fire("r", "approve", **{field: "a\x00b"})  # type: ignore[arg-type]
    with pytest.raises(flowlock.InvalidInput):
        await mem.fire("r", "approve", **{field: ""})  # type: ignore[arg-type]
    await _unchanged(mem)


@pytest.mark.parametrize("version", [0, -1, True, "1", 1.0])
async def test_bad_expected_version(mem: flowlock.Engine, version: Any) -> None:
    """expected_version must be a positive int."""
    with pytest.raises(flowlock.InvalidInput):
        await mem.fire("r", "approve", expected_version=version)
    await _unchanged(mem)


async def test_unknown_strategy(mem: flowlock.Engine) -> None:
    """An unknown strategy name is InvalidInput listing the known ones."""
    with pytest.raises(flowlock.InvalidInput, match="optimistic"):
        await mem.fire("r", "approve", strategy="yolo")
    await _unchanged(mem)


async def test_closed_engine_refuses_everything() -> None:
    """Every call on a closed engine raises EngineClosed; close is idempotent."""
    eng = flowlock.Engine(MemoryStore())
    with pytest.raises(flowlock.EngineClosed):
        await eng.create("approval", instance_id="x")
    await eng.open()
    await eng.register(examples.approval())
    await eng.create("approval", instance_id="x")
    await eng.aclose()
    await eng.aclose()
    assert eng.closed
    for call in (eng.fire("x", "approve"), eng.get("x"), eng.history("x")):
        with pytest.raises(flowlock.EngineClosed, match="async with"):
            await call


async def test_register_refuses_non_workflows() -> None:
    """register takes only Workflow objects."""
    async with flowlock.Engine(MemoryStore()) as eng:
        with pytest.raises(flowlock.InvalidInput):
            await eng.register("approval")  # type: ignore[arg-type]


async def test_per_transition_and_per_workflow_strategy() -> None:
    """Without strategy=, a transition's strategy wins over the workflow's, then the default."""
    wf = flowlock.Workflow(
        "stock",
        states=["open"],
        initial="open",
        strategy="pessimistic",
        transitions=[
            flowlock.Transition("take", source="open", target="open"),
            flowlock.Transition("peek", source="open", target="open", strategy="optimistic"),
        ],
    )
    async with flowlock.Engine(MemoryStore()) as eng:
        await eng.register(wf)
        await eng.register(examples.approval())
        await eng.create("stock", instance_id="s")
        await eng.create("approval", instance_id="a")
        assert (await eng.fire("s", "take")).strategy == "pessimistic"
        assert (await eng.fire("s", "peek")).strategy == "optimistic"
        assert (await eng.fire("s", "take", strategy="optimistic")).strategy == "optimistic"
        assert (await eng.fire("a", "approve")).strategy == "optimistic"


async def test_optimistic_exhausts_after_max_attempts() -> None:
    """A CAS that always loses raises ConflictRetriesExhausted after max_attempts, jittered."""
    store = MemoryStore()
    slept: list[float] = []

    async def fake_sleep(delay: float) -> None:
        slept.append(delay)

    async def always_lose(entries: Any) -> None:
        return None

    strategy = flowlock.Optimistic(
        max_attempts=4, backoff_base=0.01, backoff_cap=0.025, rng=random.Random(7), sleep=fake_sleep
    )
    async with flowlock.Engine(store, strategies=[strategy]) as eng:
        await eng.register(examples.approval())
        await eng.create("approval", instance_id="r")
        store.commit = always_lose  # type: ignore[method-assign]
        with pytest.raises(flowlock.ConflictRetriesExhausted) as caught:
            await eng.fire("r", "approve")
    assert caught.value.attempts == 4
    assert len(slept) == 3
    # Full jitter: each delay in [0, min(cap, base * 2**(n-1))].
    for n, delay in enumerate(slept, start=1):
        assert 0 <= delay <= min(0.025, 0.01 * 2 ** (n - 1))
    assert len(set(slept)) == 3


def test_backoff_is_deterministic_with_a_seeded_rng() -> None:
    """Two strategies with equally seeded RNGs back off identically."""
    a = flowlock.Optimistic(rng=random.Random(1))
    b = flowlock.Optimistic(rng=random.Random(1))
    assert [a.backoff(n) for n in range(1, 6)] == [b.backoff(n) for n in range(1, 6)]


def test_strategy_options_are_validated() -> None:
    """Nonsense retry and lock options are refused at construction."""
    with pytest.raises(flowlock.InvalidInput):
        flowlock.Optimistic(max_attempts=0)
    with pytest.raises(flowlock.InvalidInput):
        flowlock.Pessimistic(lock_timeout=0)


async def test_memory_storm_is_exactly_once() -> None:
    """100 concurrent approvals on the memory store: one applied, 99 idempotent, history clean."""
    async with flowlock.Engine(MemoryStore()) as eng:
        await eng.register(examples.approval())
        for strategy in ("optimistic", "pessimistic"):
            iid = f"storm-{strategy}"
            await eng.create("approval", instance_id=iid)
            outs = await asyncio.gather(
                *[eng.fire(iid, "approve", actor=f"a{i}", strategy=strategy) for i in range(100)]
            )
            assert sum(o.applied for o in outs) == 1
            assert sum(o.idempotent for o in outs) == 99
            verdict = check(await eng.get(iid), await eng.history(iid), expected_applied=1)
            assert verdict.ok, verdict.violations


async def test_pessimistic_memory_lock_timeout() -> None:
    """On the memory store a held row lock also ends in LockTimeout / LockBusy."""
    store = MemoryStore()
    async with flowlock.Engine(store) as eng:
        await eng.register(examples.approval())
        await eng.create("approval", instance_id="r")
        lock = store._locks.setdefault("r", asyncio.Lock())
        await lock.acquire()
        try:
            with pytest.raises(flowlock.LockTimeout):
                await eng.fire("r", "approve", strategy=flowlock.Pessimistic(lock_timeout=0.05))
            with pytest.raises(flowlock.LockBusy):
                await eng.fire("r", "approve", strategy=flowlock.Pessimistic(nowait=True))
        finally:
            lock.release()
        assert (await eng.get("r")).version == 1


def _faulty() -> flowlock.Workflow:
    """A workflow whose transitions exercise the step's error branches."""

    def falsy(value: Any) -> Any:
        def guard(inst: Any, payload: Any, actor: Any) -> Any:
            return value

        return guard

    def elsewhere(inst: Any, payload: Any, actor: Any) -> flowlock.Step:
        return flowlock.Step(data={"moved": True}, target="archived")  # not a target of "go"

    def not_a_mapping(inst: Any, payload: Any, actor: Any) -> Any:
        return [("moved", True)]

    def not_a_mapping_in_a_step(inst: Any, payload: Any, actor: Any) -> flowlock.Step:
        return flowlock.Step(data="moved", target="done")  # type: ignore[arg-type]

    return flowlock.Workflow(
        "faulty",
        states=["start", "done", "archived"],
        initial="start",
        transitions=[
            flowlock.Transition("refuse_false", source="start", target="done", guard=falsy(False)),
            flowlock.Transition("refuse_none", source="start", target="done", guard=falsy(None)),
            flowlock.Transition("refuse_zero", source="start", target="done", guard=falsy(0)),
            flowlock.Transition("refuse_empty", source="start", target="done", guard=falsy("")),
            flowlock.Transition("go", source="start", target="done", effect=elsewhere),
            flowlock.Transition("listed", source="start", target="done", effect=not_a_mapping),
            flowlock.Transition(
                "stepped", source="start", target="done", effect=not_a_mapping_in_a_step
            ),
            flowlock.Transition("archive", source="done", target="archived"),
        ],
    )


@pytest.fixture(params=["optimistic", "pessimistic", "distributed", "adaptive"])
async def faulty(request: pytest.FixtureRequest) -> AsyncIterator[tuple[flowlock.Engine, str]]:
    """An engine with the faulty workflow and one instance "f" of it, and a strategy to fire
    with (distributed on the memory lock backend)."""
    from flowlock.locks import MemoryLocks

    async with flowlock.Engine(MemoryStore(), locks=MemoryLocks()) as eng:
        await eng.register(_faulty())
        await eng.create("faulty", instance_id="f", data={"n": 1})
        yield eng, request.param


async def _untouched(eng: flowlock.Engine) -> None:
    inst = await eng.get("f")
    assert (inst.state, inst.version, dict(inst.data), inst.last_event) == (
        "start",
        1,
        {"n": 1},
        None,
    )
    assert await eng.history("f") == []


@pytest.mark.parametrize(
    ("event", "value"),
    [("refuse_false", False), ("refuse_none", None), ("refuse_zero", 0), ("refuse_empty", "")],
)
async def test_a_falsy_guard_refuses(
    faulty: tuple[flowlock.Engine, str], event: str, value: object
) -> None:
    """A guard returning a falsy value (not only False) raises GuardRejected naming the event
    and the value, with the instance's facts, and nothing is written."""
    eng, strategy = faulty
    with pytest.raises(flowlock.GuardRejected) as refused:
        await eng.fire("f", event, strategy=strategy)
    assert refused.value.reason == f"guard of {event!r} returned {value!r}"
    assert (refused.value.instance_id, refused.value.event) == ("f", event)
    assert (refused.value.state, refused.value.version) == ("start", 1)
    await _untouched(eng)


async def test_an_effect_choosing_a_target_outside_the_transition_is_refused(
    faulty: tuple[flowlock.Engine, str],
) -> None:
    """An effect whose Step names a state that is not one of the transition's targets raises
    DefinitionError naming it and the real targets, and nothing is written."""
    eng, strategy = faulty
    with pytest.raises(flowlock.DefinitionError) as refused:
        await eng.fire("f", "go", strategy=strategy)
    message = str(refused.value)
    assert "'archived'" in message and "('done',)" in message
    await _untouched(eng)


@pytest.mark.parametrize(("event", "kind"), [("listed", "list"), ("stepped", "str")])
async def test_an_effect_returning_a_non_mapping_is_refused(
    faulty: tuple[flowlock.Engine, str], event: str, kind: str
) -> None:
    """An effect returning something other than a mapping (directly, or as a Step's data)
    raises DefinitionError saying what it returned, and nothing is written."""
    eng, strategy = faulty
    with pytest.raises(flowlock.DefinitionError, match=f"returned {kind};"):
        await eng.fire("f", event, strategy=strategy)
    await _untouched(eng)
