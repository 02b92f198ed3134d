"""request_id is an idempotency key in the Stripe sense: a retry must repeat the request exactly.

The bugs new users hit: the same request_id sent with a *different* event answered `idempotent`
(for the other event), and a call's payload was not kept in history (an approver's comment was
lost unless an effect copied it into the data). Now the payload is kept in the history row, a key
reused with another event or payload raises IdempotencyKeyReused (nothing written), and a refused
call is not remembered. Every store, every strategy.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest

import flowlock
from conftest import BOTH_WAYS, ON_AND_OFF
from flowlock.checker import check
from flowlock.core.models import HistoryEntry


@pytest.fixture(params=["optimistic", "pessimistic", "distributed", "adaptive"])
def strategy(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture(params=BOTH_WAYS)
def batching(request: pytest.FixtureRequest) -> bool:
    """Each test runs with batching on and off (see BOTH_WAYS)."""
    on: bool = request.param
    return on


async def unchanged(engine: flowlock.Engine, instance_id: str) -> tuple[str, int, int]:
    inst = await engine.get(instance_id)
    return inst.state, inst.version, len(await engine.history(instance_id))


async def test_the_payload_is_kept_in_history(engine: flowlock.Engine, strategy: str) -> None:
    """The approver's comment is in the history row, though no effect copied it into data."""
    await engine.create("approval", instance_id="r", data={"amount": 5})
    comment = {"comment": "looks good", "checked": ["budget", "vendor"], "score": 0.5}
    out = await engine.fire("r", "approve", actor="alice", payload=comment, strategy=strategy)
    assert out.applied
    [entry] = await engine.history("r")
    assert dict(entry.payload) == comment
    assert dict(entry.data) == {"amount": 5}
    assert check(await engine.get("r"), [entry], initial_state="pending", expected_applied=1)


async def test_without_a_payload_the_history_payload_is_empty(engine: flowlock.Engine) -> None:
    await engine.create("ticket", instance_id="t")
    await engine.fire("t", "close")
    [entry] = await engine.history("t")
    assert entry.payload == {}


async def test_a_key_reused_for_another_event_is_refused(
    engine: flowlock.Engine, strategy: str
) -> None:
    """The key of an `approve` sent again with `reject` raises IdempotencyKeyReused carrying
    the original event; it used to answer idempotent (as if the reject had been done)."""
    await engine.create("approval", instance_id="r")
    first = await engine.fire("r", "approve", request_id="k1", strategy=strategy)
    assert first.applied
    before = await unchanged(engine, "r")
    with pytest.raises(flowlock.IdempotencyKeyReused) as caught:
        await engine.fire("r", "reject", request_id="k1", strategy=strategy)
    reused = caught.value
    assert (reused.request_id, reused.original_event, reused.event) == ("k1", "approve", "reject")
    assert (reused.instance_id, reused.mismatch, reused.version) == ("r", "event", 2)
    assert isinstance(reused, flowlock.InvalidInput)
    assert "'k1'" in str(reused) and "'approve'" in str(reused) and "new request_id" in str(reused)
    assert await unchanged(engine, "r") == before


async def test_a_key_reused_with_another_payload_is_refused(
    engine: flowlock.Engine, strategy: str
) -> None:
    """Same event, other payload (another quantity): refused, not answered idempotent."""
    await engine.create("inventory", instance_id="sku", data={"stock": 10})
    await engine.fire("sku", "reserve", request_id="order-1", payload={"qty": 2}, strategy=strategy)
    before = await unchanged(engine, "sku")
    with pytest.raises(flowlock.IdempotencyKeyReused) as caught:
        await engine.fire(
            "sku", "reserve", request_id="order-1", payload={"qty": 3}, strategy=strategy
        )
    reused = caught.value
    assert (reused.mismatch, reused.original_event, reused.event) == (
        "payload",
        "reserve",
        "reserve",
    )
    assert (dict(reused.original_payload), dict(reused.payload)) == ({"qty": 2}, {"qty": 3})
    with pytest.raises(flowlock.IdempotencyKeyReused):
        await engine.fire("sku", "reserve", request_id="order-1", strategy=strategy)  # no payload
    assert await unchanged(engine, "sku") == before
    assert dict((await engine.get("sku")).data) == {"stock": 8, "reserved": 2}


async def test_an_exact_retry_is_idempotent(engine: flowlock.Engine, strategy: str) -> None:
    """The same event and the same JSON payload (keys in another order, 2 as 2.0) is a retry:
    the first outcome, idempotent, nothing written."""
    await engine.create("inventory", instance_id="sku", data={"stock": 10})
    payload: dict[str, Any] = {"qty": 2, "note": {"by": "web", "tags": ["a", "b"]}}
    first = await engine.fire(
        "sku", "reserve", request_id="order-1", payload=payload, strategy=strategy
    )
    again = await engine.fire(
        "sku",
        "reserve",
        request_id="order-1",
        payload={"note": {"tags": ["a", "b"], "by": "web"}, "qty": 2.0},
        strategy=strategy,
    )
    assert first.applied and again.idempotent and not again.applied
    assert (again.instance.version, dict(again.instance.data)) == (2, {"stock": 8, "reserved": 2})
    [entry] = await engine.history("sku")
    assert dict(entry.payload) == payload


async def test_a_refused_call_is_not_remembered(engine: flowlock.Engine, strategy: str) -> None:
    """Only applied calls are remembered under their key: a reservation refused for lack of
    stock, retried with the same key once stock arrived, applies."""
    await engine.create("inventory", instance_id="sku", data={"stock": 0})
    with pytest.raises(flowlock.GuardRejected):
        await engine.fire("sku", "reserve", request_id="order-9", strategy=strategy)
    assert await unchanged(engine, "sku") == ("open", 1, 0)
    await engine.fire("sku", "restock", payload={"qty": 1}, strategy=strategy)
    retried = await engine.fire("sku", "reserve", request_id="order-9", strategy=strategy)
    assert retried.applied
    assert [h.request_id for h in await engine.history("sku")] == [None, "order-9"]


@ON_AND_OFF
async def test_concurrent_calls_reusing_one_key_apply_once(
    engine: flowlock.Engine, strategy: str
) -> None:
    """Five callers send one key at once, two with the first payload and three with others:
    exactly one applies, the other exact copy is idempotent, and each differing call is
    refused (never applied, never answered idempotent)."""
    await engine.create("inventory", instance_id="sku", data={"stock": 100})
    payloads = [{"qty": 1}, {"qty": 1}, {"qty": 2}, {"qty": 3}, {"qty": 4}]
    outs = await asyncio.gather(
        *[
            engine.fire("sku", "reserve", request_id="once", payload=p, strategy=strategy)
            for p in payloads
        ],
        return_exceptions=True,
    )
    applied = [o for o in outs if isinstance(o, flowlock.Outcome) and o.applied]
    assert len(applied) == 1
    [entry] = await engine.history("sku")
    winner = dict(entry.payload)
    for payload, out in zip(payloads, outs, strict=True):
        if payload == winner:
            assert isinstance(out, flowlock.Outcome), out
        else:
            assert isinstance(out, flowlock.IdempotencyKeyReused), out
    kinds = Counter(type(o).__name__ for o in outs)
    assert kinds["IdempotencyKeyReused"] == sum(p != winner for p in payloads)
    final = await engine.get("sku")
    assert dict(final.data) == {"stock": 100 - winner["qty"], "reserved": winner["qty"]}
    assert check(final, [entry], initial_state="open", expected_applied=1)


def test_history_entry_keeps_its_positional_form() -> None:
    """Code that builds HistoryEntry positionally keeps working; payload defaults to {}."""
    entry = HistoryEntry("i", 2, "approve", "pending", "approved", None, None, "optimistic", {})
    assert entry.payload == {} and entry.fencing_token is None and entry.at is None
    assert HistoryEntry("i", 2, "e", "a", "b", None, None, "s", {}, payload={"x": 1}).payload == {
        "x": 1
    }


async def test_a_replay_is_marked_and_answers_the_first_outcome(
    engine: flowlock.Engine, strategy: str
) -> None:
    """`Outcome.replayed` tells a retry of an applied request id (its instance is exactly the
    first answer's, which an HTTP service sends again) from the two-admins rule's idempotent
    answer (a new request that found its event already applied), and from a first call."""
    await engine.create("approval", instance_id="r")
    first = await engine.fire("r", "approve", request_id="k1", strategy=strategy)
    again = await engine.fire("r", "approve", request_id="k1", strategy=strategy)
    other = await engine.fire("r", "approve", request_id="k2", strategy=strategy)
    bare = await engine.fire("r", "approve", strategy=strategy)
    assert (first.applied, first.replayed) == (True, False)
    assert (again.idempotent, again.replayed) == (True, True)
    assert again.instance == first.instance
    assert (other.idempotent, other.replayed) == (True, False)
    assert (bare.idempotent, bare.replayed) == (True, False)


async def test_concurrent_replays_are_marked(engine: flowlock.Engine, strategy: str) -> None:
    """Twenty callers sharing one request id, batched or not: one applies, every other one is a
    replay whose instance equals the applied one's."""
    await engine.create("approval", instance_id="r")
    outs = await asyncio.gather(
        *(engine.fire("r", "approve", request_id="k", strategy=strategy) for _ in range(20))
    )
    [applied] = [o for o in outs if o.applied]
    replays = [o for o in outs if not o.applied]
    assert all(o.replayed for o in replays)
    assert {o.instance.version for o in replays} == {applied.instance.version}
    assert {(o.instance.state, o.instance.last_event) for o in replays} == {("approved", "approve")}
