"""The engine's side of constraints on every store: waiting for a slot, a batch with one refused
call, `engine.capacity`, and the sync twin."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

import flowlock
import flowlock.sync
from conftest import StoreFactory
from flowlock.core.models import Instance
from flowlock.locks import MemoryLocks


def desk(inst: Instance) -> Any:
    return inst.data.get("desk")


def _desks(limit: int, wait: float | None = None) -> flowlock.Workflow:
    held = flowlock.State("held", capacity=flowlock.Capacity(key=desk, limit=limit, wait=wait))
    return flowlock.Workflow(
        "desks",
        states=["idle", held],
        initial="idle",
        transitions=[
            flowlock.Transition("enter", source="idle", target="held"),
            flowlock.Transition("leave", source="held", target="idle"),
            flowlock.Transition("touch", source="idle", target="idle", effect=_count),
        ],
    )


def _count(inst: Instance, payload: Any, actor: str | None) -> dict[str, Any]:
    return {**inst.data, "n": inst.data.get("n", 0) + 1}


@pytest.fixture
async def engine(store_factory: StoreFactory) -> AsyncIterator[flowlock.Engine]:
    async with flowlock.Engine(store_factory(), locks=MemoryLocks()) as eng:
        yield eng


async def _made(engine: flowlock.Engine, n: int, key: str = "d1") -> list[str]:
    ids = [f"i{k}" for k in range(n)]
    for iid in ids:
        await engine.create("desks", instance_id=iid, data={"desk": key})
    return ids


async def test_a_waiting_fire_gets_the_slot_a_leaving_instance_frees(
    engine: flowlock.Engine,
) -> None:
    """Capacity(wait=) waits for a slot, woken by the release, and then applies."""
    await engine.register(_desks(1, wait=10.0))
    a, b = await _made(engine, 2)
    await engine.fire(a, "enter")

    async def leave_soon() -> None:
        await asyncio.sleep(0.3)
        await engine.fire(a, "leave")

    started = time.monotonic()
    leaving = asyncio.create_task(leave_soon())
    out = await engine.fire(b, "enter")
    await leaving
    assert out.applied and out.instance.state == "held"
    assert 0.25 < time.monotonic() - started < 8.0  # woken by the release, not the bound
    usage = await engine.capacity("desks.held", "d1")
    assert usage.holders == (b,)


async def test_a_wait_is_bounded(engine: flowlock.Engine) -> None:
    """When nobody leaves, the wait ends at its bound with CapacityReached; nothing written."""
    await engine.register(_desks(1, wait=0.3))
    a, b = await _made(engine, 2)
    await engine.fire(a, "enter")
    started = time.monotonic()
    with pytest.raises(flowlock.CapacityReached) as caught:
        await engine.fire(b, "enter")
    assert time.monotonic() - started >= 0.29
    assert caught.value.holders == (a,)
    assert (await engine.get(b)).version == 1


async def test_a_refused_call_among_concurrent_calls_on_one_instance_is_alone_refused(
    engine: flowlock.Engine,
) -> None:
    """Calls queued on one instance with one refused by a full key: the others all apply."""
    await engine.register(_desks(1))
    holder, other = await _made(engine, 2)
    await engine.fire(holder, "enter")
    calls = [engine.fire(other, "touch") for _ in range(6)] + [engine.fire(other, "enter")]
    calls += [engine.fire(other, "touch") for _ in range(6)]
    answers = await asyncio.gather(*calls, return_exceptions=True)
    refused = [a for a in answers if isinstance(a, BaseException)]
    assert len(refused) == 1 and isinstance(refused[0], flowlock.CapacityReached)
    assert all(isinstance(a, flowlock.Outcome) and a.applied for a in answers if a not in refused)
    inst = await engine.get(other)
    assert inst.state == "idle" and inst.data["n"] == 12 and inst.version == 13
    assert [h.event for h in await engine.history(other)] == ["touch"] * 12


async def test_capacity_shows_the_holders_the_limit_and_the_rule(engine: flowlock.Engine) -> None:
    """engine.capacity names the holders oldest first, the limit, what is free and the rule."""
    await engine.register(_desks(3))
    ids = await _made(engine, 3)
    for iid in ids[:2]:
        await engine.fire(iid, "enter")
    usage = await engine.capacity("desks.held", "d1")
    assert (usage.limit, usage.holders, usage.used, usage.free, usage.rule) == (
        3,
        (ids[0], ids[1]),
        2,
        1,
        "capacity",
    )
    empty = await engine.capacity("desks.held", "nobody")
    assert (empty.holders, empty.limit) == ((), 3)
    with pytest.raises(flowlock.InvalidInput):
        await engine.capacity("", "d1")


async def test_a_refusal_leaves_no_trace_and_a_retry_applies_later(
    engine: flowlock.Engine,
) -> None:
    """A refused enter writes nothing; under the same request id it applies once a slot frees."""
    await engine.register(_desks(1))
    a, b = await _made(engine, 2)
    await engine.fire(a, "enter")
    with pytest.raises(flowlock.CapacityReached):
        await engine.fire(b, "enter", request_id="req-b")
    assert (await engine.get(b)).version == 1 and await engine.history(b) == []
    await engine.fire(a, "leave")
    out = await engine.fire(b, "enter", request_id="req-b")
    again = await engine.fire(b, "enter", request_id="req-b")
    assert out.applied and again.idempotent


def test_the_sync_engine_shows_capacity_too(tmp_path: Any) -> None:
    """flowlock.sync.Engine.capacity answers as the async engine does."""
    with flowlock.sync.Engine.connect(f"sqlite:///{tmp_path / 'f.db'}") as engine:
        engine.register(_desks(2))
        engine.create("desks", instance_id="s1", data={"desk": "x"})
        engine.fire("s1", "enter")
        assert engine.capacity("desks.held", "x").holders == ("s1",)


async def test_refusals_and_waits_are_counted_per_constraint() -> None:
    """The engine counts a refusal, a wait that got its slot and one that timed out, by kind."""
    from prometheus_client import CollectorRegistry

    from flowlock.stores.memory import MemoryStore

    registry = CollectorRegistry()
    metrics = flowlock.Metrics(registry=registry)
    async with flowlock.Engine(MemoryStore(), metrics=metrics) as engine:
        await engine.register(_desks(1, wait=0.5))
        a, b = await _made(engine, 2)
        await engine.fire(a, "enter")
        with pytest.raises(flowlock.CapacityReached):
            await engine.fire(b, "enter")
        entering = asyncio.create_task(engine.fire(b, "enter"))
        await asyncio.sleep(0.1)  # b is refused and waits
        await engine.fire(a, "leave")
        assert (await entering).applied

    def sample(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, {"kind": "desks.held", **labels}) or 0.0

    assert sample("flowlock_constraint_refusals_total", rule="capacity") == 1
    assert sample("flowlock_constraint_waits_total", outcome="timeout") == 1
    assert sample("flowlock_constraint_waits_total", outcome="slot") == 1
    assert sample("flowlock_constraint_wait_seconds_count") == 2


async def test_capacity_finds_a_rule_by_the_state_it_is_declared_on(
    engine: flowlock.Engine,
) -> None:
    """engine.capacity("held", key) answers the capacity of state "held" under its kind."""
    await engine.register(_desks(2))
    (only,) = await _made(engine, 1)
    await engine.fire(only, "enter")
    usage = await engine.capacity("held", "d1")
    assert (usage.kind, usage.holders, usage.limit) == ("desks.held", (only,), 2)


async def test_a_capacity_given_on_a_transition_counts_its_target(
    engine: flowlock.Engine,
) -> None:
    """Transition(capacity=) is the capacity of its target state, whoever enters it."""
    cap = flowlock.Capacity(key=desk, limit=1)
    wf = flowlock.Workflow(
        "booth",
        states=["out", "in"],
        initial="out",
        transitions=[
            flowlock.Transition("walk_in", source="out", target="in", capacity=cap),
            flowlock.Transition("walk_out", source="in", target="out"),
        ],
    )
    await engine.register(wf)
    for iid in ("p1", "p2"):
        await engine.create("booth", instance_id=iid, data={"desk": "b"})
    await engine.fire("p1", "walk_in")
    with pytest.raises(flowlock.CapacityReached) as caught:
        await engine.fire("p2", "walk_in")
    assert caught.value.kind == "booth.in" and caught.value.holders == ("p1",)


async def test_a_refused_key_is_a_hot_key_never_escalated(engine: flowlock.Engine) -> None:
    """Refusals of one key show in the monitor's hot keys; the key is not escalated."""
    await engine.register(_desks(1))
    ids = await _made(engine, 30)
    await engine.fire(ids[0], "enter")
    for iid in ids[1:]:
        with pytest.raises(flowlock.CapacityReached):
            await engine.fire(iid, "enter")
    hot = {key: (conflicts, attempts) for key, conflicts, attempts in engine.monitor.hot_keys()}
    assert hot["desks.held:d1"] == (28, 28)  # counted from the second refusal on
    assert engine.monitor.escalated("desks.held:d1") is None
