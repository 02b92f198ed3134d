"""Typed payloads on every store (memory, SQLite, PostgreSQL): a payload its transition's schema
refuses is InvalidPayload naming each bad field, and nothing is written; checked before any read
when every workflow with the event declares the same schema, else in the step before the guard.
A good payload reaches the guard and effect as the parsed model; the history keeps the JSON the
caller sent. A create's data is checked against the workflow's `data=` schema."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import flowlock
from db_reads import stored
from payload_kit import (
    BAD_ORDER,
    BAD_ORDER_PATHS,
    GOOD_ORDER,
    SEEN,
    Order,
    desk,
    shop,
)


@pytest.fixture(params=["optimistic", "pessimistic"])
def strategy(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture
async def typed(engine: flowlock.Engine) -> flowlock.Engine:
    """The engine with the shop and the desk registered, a shop "s" and a desk "d" created."""
    await engine.register(shop())
    await engine.register(desk())
    await engine.create("shop", instance_id="s", data={"customer": "ann"})
    await engine.create("desk", instance_id="d", data={"owner": "bob"})
    SEEN.clear()
    return engine


async def test_a_bad_payload_is_refused_before_anything_is_read(typed: flowlock.Engine) -> None:
    """An event whose schema every workflow shares is checked before the read: a bad payload for
    an instance that does not exist is InvalidPayload, not InstanceNotFound."""
    with pytest.raises(flowlock.InvalidPayload) as caught:
        await typed.fire("nobody", "pay", payload=BAD_ORDER)
    assert caught.value.paths == BAD_ORDER_PATHS
    with pytest.raises(flowlock.InvalidPayload) as shipped:
        await typed.fire("nobody", "ship", payload={"carrier": "pigeon"})
    assert shipped.value.paths == ("carrier",)
    assert shipped.value.workflow == "shop, desk"
    assert "(workflows 'shop', 'desk')" in str(shipped.value)
    assert await stored(typed, "nobody") is None


async def test_a_bad_payload_writes_nothing(typed: flowlock.Engine, strategy: str) -> None:
    """InvalidPayload lists each bad field (loc, msg, type; dotted paths), its message names the
    workflow, the event and the fields; version, data and history are unchanged."""
    before = await stored(typed, "s")
    with pytest.raises(flowlock.InvalidPayload) as caught:
        await typed.fire("s", "pay", payload=BAD_ORDER, strategy=strategy, request_id="r-1")
    error = caught.value
    assert isinstance(error, flowlock.InvalidInput)
    assert error.paths == BAD_ORDER_PATHS
    assert [e["loc"] for e in error.errors] == [["items", 0, "sku"], ["items", 0, "qty"]]
    assert [e["type"] for e in error.errors] == ["missing", "greater_than_equal"]
    assert all(isinstance(e["msg"], str) and e["msg"] for e in error.errors)
    message = str(error)
    assert "'pay'" in message and "'shop'" in message
    assert all(path in message for path in BAD_ORDER_PATHS)
    assert SEEN == []
    assert await stored(typed, "s") == before
    # The refused request id is not remembered: the same key applies a good payload.
    applied = await typed.fire("s", "pay", payload=GOOD_ORDER, request_id="r-1")
    assert applied.applied


async def test_an_event_whose_schema_differs_per_workflow_is_checked_in_the_step(
    typed: flowlock.Engine, strategy: str
) -> None:
    """ "note" has one schema in the shop and another in the desk: the instance's workflow
    decides, so it is checked after the read, before the guard, and nothing is written."""
    with pytest.raises(flowlock.InstanceNotFound):
        await typed.fire("nobody", "note", payload={"text": 5})
    before = await stored(typed, "s")
    with pytest.raises(flowlock.InvalidPayload) as caught:
        await typed.fire("s", "note", payload={"text": "far too long"}, strategy=strategy)
    assert caught.value.paths == ("text",)
    assert caught.value.errors[0]["type"] == "maxLength"
    assert caught.value.workflow == "shop" and caught.value.event == "note"
    assert await stored(typed, "s") == before
    # The desk's schema takes it.
    assert (await typed.fire("d", "note", payload={"text": "far too long"})).applied


async def test_a_missing_property_of_a_json_schema_is_named_in_its_path(
    typed: flowlock.Engine,
) -> None:
    """A JSON Schema's `required` error names the missing field in its loc, as Pydantic does."""
    with pytest.raises(flowlock.InvalidPayload) as caught:
        await typed.fire("s", "note", payload={})
    assert caught.value.errors == ({"loc": ["text"], "msg": "'text' is a required property",
                                    "type": "required"},)  # fmt: skip


async def test_a_good_payload_reaches_the_steps_as_the_model_and_history_keeps_the_json(
    typed: flowlock.Engine, strategy: str
) -> None:
    """The guard and effect get the parsed model ("2" became 2); the history row keeps the JSON
    as sent; a retry under the same request id with the same JSON is a replay."""
    outcome = await typed.fire("s", "pay", payload=GOOD_ORDER, request_id="k", strategy=strategy)
    assert outcome.applied
    assert outcome.instance.data == {"customer": "ann", "units": 5}
    assert len(SEEN) == 1 and isinstance(SEEN[0], Order)
    assert SEEN[0].items[0].qty == 2
    entry = (await typed.history("s"))[-1]
    assert entry.payload == GOOD_ORDER
    again = await typed.fire("s", "pay", payload=GOOD_ORDER, request_id="k", strategy=strategy)
    assert again.replayed and again.instance.version == outcome.instance.version
    shipped = await typed.fire("s", "ship", payload={"carrier": "post"})
    assert shipped.applied and SEEN[-1] == {"carrier": "post"}


async def test_calls_batched_on_one_instance_are_checked_each_on_its_own(
    typed: flowlock.Engine,
) -> None:
    """Concurrent calls decided together: each bad payload is its own InvalidPayload, the good
    ones apply, and the history holds exactly the good ones."""
    texts: list[Any] = ["a", 7, "b", "much too long", "c"]
    answers = await asyncio.gather(
        *(typed.fire("s", "note", payload={"text": t}) for t in texts), return_exceptions=True
    )
    kinds = [type(a).__name__ for a in answers]
    assert kinds == ["Outcome", "InvalidPayload", "Outcome", "InvalidPayload", "Outcome"]
    inst = await typed.get("s")
    assert sorted(inst.data["notes"]) == ["a", "b", "c"]
    assert [e.payload["text"] for e in await typed.history("s")] == inst.data["notes"]


async def test_create_checks_data_against_the_workflow_schema(typed: flowlock.Engine) -> None:
    """Workflow(data=Model) and data=dict: bad data is InvalidPayload (event None) and creates
    nothing; good data is stored as sent (no defaults filled in)."""
    with pytest.raises(flowlock.InvalidPayload) as caught:
        await typed.create("shop", instance_id="s2", data={"credit": "lots"})
    assert caught.value.paths == ("customer", "credit")
    assert caught.value.event is None and "'shop'" in str(caught.value)
    with pytest.raises(flowlock.InvalidPayload) as desk_data:
        await typed.create("desk", instance_id="d2", data={"owner": 3})
    assert desk_data.value.paths == ("owner",)
    assert await stored(typed, "s2") is None and await stored(typed, "d2") is None
    made = await typed.create("shop", instance_id="s2", data={"customer": "cy"})
    assert made.data == {"customer": "cy"}
    assert (await typed.get("s2")).data == {"customer": "cy"}
