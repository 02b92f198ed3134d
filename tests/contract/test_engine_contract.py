"""One contract for every store (memory, SQLite, PostgreSQL) and both strategies.

Each test runs once per store backend (the ``engine`` fixture is parametrised) and, where the
strategy matters, once per strategy.
"""

from __future__ import annotations

import asyncio

import pytest

import flowlock
from flowlock.checker import check
from flowlock.models import HistoryEntry

STRATEGIES = ["optimistic", "pessimistic", "distributed"]


@pytest.fixture(params=STRATEGIES)
def strategy(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


async def test_create_and_get(engine: flowlock.Engine) -> None:
    """create stores the instance in its initial state at version 1; get reads it back."""
    inst = await engine.create("approval", instance_id="req-1", data={"amount": 120})
    assert (inst.state, inst.version, dict(inst.data)) == ("pending", 1, {"amount": 120})
    got = await engine.get("req-1")
    assert (got.id, got.workflow, got.state, got.version) == ("req-1", "approval", "pending", 1)
    assert got.last_event is None
    assert got.created_at is not None


async def test_create_twice_raises_instance_exists(engine: flowlock.Engine) -> None:
    """A taken id raises InstanceExists and leaves the first instance untouched."""
    await engine.create("approval", instance_id="dup", data={"n": 1})
    with pytest.raises(flowlock.InstanceExists):
        await engine.create("approval", instance_id="dup", data={"n": 2})
    assert dict((await engine.get("dup")).data) == {"n": 1}


async def test_missing_instance(engine: flowlock.Engine, strategy: str) -> None:
    """get, fire and history on an unknown id raise InstanceNotFound."""
    with pytest.raises(flowlock.InstanceNotFound):
        await engine.get("nope")
    with pytest.raises(flowlock.InstanceNotFound):
        await engine.fire("nope", "approve", strategy=strategy)
    with pytest.raises(flowlock.InstanceNotFound):
        await engine.history("nope")


async def test_fire_applies_once_and_records_history(
    engine: flowlock.Engine, strategy: str
) -> None:
    """fire moves the state, bumps the version by one and appends one history entry."""
    await engine.create("approval", instance_id="r", data={"amount": 5})
    out = await engine.fire("r", "approve", actor="alice", strategy=strategy)
    assert out.applied and not out.idempotent
    assert (out.instance.state, out.instance.version, out.strategy) == ("approved", 2, strategy)
    assert out.attempts == 1
    assert out.elapsed > 0
    [entry] = await engine.history("r")
    assert (entry.version, entry.event, entry.from_state, entry.to_state, entry.actor) == (
        2,
        "approve",
        "pending",
        "approved",
        "alice",
    )
    assert entry.strategy == strategy
    assert check(await engine.get("r"), [entry], initial_state="pending", expected_applied=1)


async def test_two_admins_rule(engine: flowlock.Engine, strategy: str) -> None:
    """The same event fired again after it was applied answers idempotent, writes nothing."""
    await engine.create("approval", instance_id="r")
    first = await engine.fire("r", "approve", actor="alice", strategy=strategy)
    second = await engine.fire("r", "approve", actor="bob", strategy=strategy)
    assert first.applied and second.idempotent and not second.applied
    assert second.instance.version == 2
    assert len(await engine.history("r")) == 1


async def test_not_allowed_carries_state_and_allowed_events(
    engine: flowlock.Engine, strategy: str
) -> None:
    """An event not allowed from the current state raises TransitionNotAllowed with the facts."""
    await engine.create("approval", instance_id="r")
    await engine.fire("r", "approve", strategy=strategy)
    with pytest.raises(flowlock.TransitionNotAllowed) as caught:
        await engine.fire("r", "reject", strategy=strategy)
    assert (caught.value.state, caught.value.allowed, caught.value.version) == ("approved", (), 2)
    await engine.create("ticket", instance_id="t")
    with pytest.raises(flowlock.TransitionNotAllowed) as caught2:
        await engine.fire("t", "reopen", strategy=strategy)
    assert caught2.value.allowed == ("close",)
    assert (await engine.get("t")).version == 1


async def test_unknown_event(engine: flowlock.Engine, strategy: str) -> None:
    """An event the workflow does not define raises UnknownEvent listing the real ones."""
    await engine.create("approval", instance_id="r")
    with pytest.raises(flowlock.UnknownEvent) as caught:
        await engine.fire("r", "sign", strategy=strategy)
    assert caught.value.known == ("approve", "reject")


async def test_request_id_is_exactly_once_even_after_a_cycle(
    engine: flowlock.Engine, strategy: str
) -> None:
    """A repeated request id returns the first outcome, also after the workflow cycled back."""
    await engine.create("ticket", instance_id="t")
    first = await engine.fire("t", "close", request_id="req-A", strategy=strategy)
    await engine.fire("t", "reopen", request_id="req-B", strategy=strategy)
    # The ticket is open again, so "close" is allowed: only the request id stops a second close.
    again = await engine.fire("t", "close", request_id="req-A", strategy=strategy)
    assert again.idempotent and not again.applied
    assert (again.instance.state, again.instance.version) == (
        first.instance.state,
        first.instance.version,
    )
    assert dict(again.instance.data) == dict(first.instance.data)
    current = await engine.get("t")
    assert (current.state, current.version) == ("open", 3)
    history = await engine.history("t")
    assert [h.request_id for h in history] == ["req-A", "req-B"]
    assert check(current, history, initial_state="open", expected_applied=2)


async def test_cycle_without_request_id_is_applied_again(
    engine: flowlock.Engine, strategy: str
) -> None:
    """Without a request id a cycle is real work: version, not state, is compared."""
    await engine.create("ticket", instance_id="t")
    for _ in range(3):
        assert (await engine.fire("t", "close", strategy=strategy)).applied
        assert (await engine.fire("t", "reopen", strategy=strategy)).applied
    current = await engine.get("t")
    assert current.version == 7
    assert check(current, await engine.history("t"), initial_state="open", expected_applied=6)


async def test_expected_version(engine: flowlock.Engine, strategy: str) -> None:
    """A stale expected_version raises VersionMismatch with the current version; fresh applies."""
    await engine.create("ticket", instance_id="t")
    await engine.fire("t", "close", strategy=strategy)
    with pytest.raises(flowlock.VersionMismatch) as caught:
        await engine.fire("t", "reopen", expected_version=1, strategy=strategy)
    assert (caught.value.current, caught.value.expected, caught.value.state) == (2, 1, "closed")
    assert (await engine.get("t")).version == 2
    out = await engine.fire("t", "reopen", expected_version=2, strategy=strategy)
    assert out.applied and out.instance.version == 3


async def test_guard_rejection_writes_nothing(engine: flowlock.Engine, strategy: str) -> None:
    """A guard's refusal raises GuardRejected with its reason and leaves the instance as it was."""
    await engine.create("inventory", instance_id="sku", data={"stock": 1})
    assert (await engine.fire("sku", "reserve", strategy=strategy)).applied
    with pytest.raises(flowlock.GuardRejected) as caught:
        await engine.fire("sku", "reserve", strategy=strategy)
    assert "out of stock" in caught.value.reason
    assert caught.value.instance_id == "sku" and caught.value.version == 2
    inst = await engine.get("sku")
    assert (inst.version, dict(inst.data)) == (2, {"stock": 0, "reserved": 1})


async def test_countersign_quorum(engine: flowlock.Engine, strategy: str) -> None:
    """Each approver signs once; a second signature is refused; quorum moves to approved."""
    await engine.create("countersign", instance_id="doc")
    assert (await engine.fire("doc", "sign", actor="a", strategy=strategy)).instance.state == (
        "pending"
    )
    with pytest.raises(flowlock.GuardRejected):
        await engine.fire("doc", "sign", actor="a", strategy=strategy)
    await engine.fire("doc", "sign", actor="b", strategy=strategy)
    last = await engine.fire("doc", "sign", actor="c", strategy=strategy)
    assert last.instance.state == "approved"
    assert last.instance.data["signers"] == ["a", "b", "c"]
    history = await engine.history("doc")
    assert [h.to_state for h in history] == ["pending", "pending", "approved"]


async def test_concurrent_duplicates_of_one_request(engine: flowlock.Engine, strategy: str) -> None:
    """Five concurrent calls with one request id: applied once, identical outcomes."""
    await engine.create("approval", instance_id="r")
    outs = await asyncio.gather(
        *[
            engine.fire("r", "approve", request_id="once", actor=f"u{i}", strategy=strategy)
            for i in range(5)
        ]
    )
    assert sum(o.applied for o in outs) == 1
    assert {(o.instance.state, o.instance.version) for o in outs} == {("approved", 2)}
    assert len(await engine.history("r")) == 1


async def test_sql_text_is_data(engine: flowlock.Engine, strategy: str) -> None:
    """Ids, actors, request ids and data carrying SQL are stored verbatim, never executed."""
    evil = "x'); DROP TABLE flowlock_instances; --"
    await engine.create("approval", instance_id=evil, data={"note": evil})
    out = await engine.fire(evil, "approve", actor=evil, request_id=evil, strategy=strategy)
    assert out.applied
    [entry] = await engine.history(evil)
    assert (entry.instance_id, entry.actor, entry.request_id) == (evil, evil, evil)
    assert (await engine.get(evil)).data["note"] == evil


async def test_history_entries_are_values(engine: flowlock.Engine) -> None:
    """history returns frozen HistoryEntry values, oldest first."""
    await engine.create("ticket", instance_id="t")
    await engine.fire("t", "close")
    await engine.fire("t", "reopen")
    history = await engine.history("t")
    assert all(isinstance(h, HistoryEntry) for h in history)
    assert [h.version for h in history] == [2, 3]
    assert history[0].at is not None and history[0].at <= history[1].at  # type: ignore[operator]
