"""Declaring typed payloads: what Transition(payload=) and Workflow(data=) accept at definition
time, the schema's JSON form, InvalidPayload's fields, which events are checked before the read,
the missing `schema` extra, and the sync engine."""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import Any, assert_type

import pytest
from pydantic import BaseModel, field_validator

import flowlock
import flowlock.sync
from flowlock.core.payloads import early_schemas, payload_schema
from payload_kit import BAD_ORDER, BAD_ORDER_PATHS, GOOD_ORDER, SEEN, SHIP, Order, desk, shop


def wf(*transitions: flowlock.Transition, **extra: Any) -> flowlock.Workflow:
    return flowlock.Workflow(
        "w", states=["a", "b"], initial="a", transitions=list(transitions), **extra
    )


@pytest.mark.parametrize(
    "bad", [int, "Order", 3, Order(items=[]), [SHIP], object], ids=lambda v: type(v).__name__
)
def test_a_payload_that_is_no_model_class_or_schema_dict_is_a_definition_error(bad: Any) -> None:
    """A class without model_validate/model_json_schema, a model instance, a string or a list is
    refused when the transition is built, naming the transition."""
    with pytest.raises(flowlock.DefinitionError, match="transition 'go'"):
        flowlock.Transition("go", source="a", target="b", payload=bad)
    with pytest.raises(flowlock.DefinitionError, match="workflow 'w': data"):
        wf(flowlock.Transition("go", source="a", target="b"), data=bad)


@pytest.mark.parametrize(
    "schema",
    [{"type": 5}, {"properties": {"x": {"type": "nope"}}}, {"x": float("nan")}, {"x": object()}],
    ids=["bad type", "bad nested type", "nan", "not json"],
)
def test_an_invalid_json_schema_is_a_definition_error(schema: dict[str, Any]) -> None:
    """A dict that is not a valid JSON Schema (or not JSON) is refused at definition time."""
    with pytest.raises(flowlock.DefinitionError, match="transition 'go': the JSON Schema"):
        flowlock.Transition("go", source="a", target="b", payload=schema)


def test_the_schema_json_form_is_the_model_schema_or_the_dict() -> None:
    """`payload.json` is model_json_schema() for a model and the dict for a JSON Schema (a
    copy: changing the caller's dict later changes nothing)."""
    t = flowlock.Transition("go", source="a", target="b", payload=Order)
    assert t.payload is not None and t.payload.model and t.payload.source is Order
    assert t.payload.json == Order.model_json_schema()
    given = {"type": "object", "properties": {"n": {"type": "integer"}}}
    d = flowlock.Transition("go", source="a", target="b", payload=given)
    given["properties"] = {}
    assert d.payload is not None and not d.payload.model
    assert d.payload.json == {"type": "object", "properties": {"n": {"type": "integer"}}}
    assert flowlock.Transition("go", source="a", target="b").payload is None
    assert wf(t).data is None


def test_a_timed_transition_must_accept_the_empty_payload_a_timer_sends() -> None:
    """A timer fires with {}: a timed transition whose schema requires a field is refused at
    definition time; one whose fields all have defaults is fine."""
    with pytest.raises(flowlock.DefinitionError, match=r"timed.*items"):
        flowlock.Transition("late", source="a", target="b", after=timedelta(hours=1), payload=Order)
    ok = flowlock.Transition(
        "late", source="a", target="b", after=timedelta(hours=1), payload={"type": "object"}
    )
    assert ok.payload is not None


def test_invalid_payload_carries_errors_and_dotted_paths() -> None:
    """errors are plain {loc, msg, type} dicts; paths join loc with dots; the message names the
    workflow, the event and each field."""
    schema = payload_schema(Order, "transition 'pay'")
    assert schema is not None
    with pytest.raises(flowlock.InvalidPayload) as caught:
        schema.parse(BAD_ORDER, workflow="shop", event="pay")
    error = caught.value
    assert_type(error.errors, tuple[dict[str, Any], ...])
    assert_type(error.paths, tuple[str, ...])
    assert error.paths == BAD_ORDER_PATHS
    assert all(set(e) == {"loc", "msg", "type"} for e in error.errors)
    text = str(error)
    assert text.startswith("the payload of event 'pay' (workflow 'shop') does not match")
    assert "items.0.sku: Field required" in text and "nothing was written" in text
    parsed = schema.parse(GOOD_ORDER, workflow="shop", event="pay")
    assert isinstance(parsed, Order) and parsed.items[0].qty == 2


def test_a_validator_that_raises_something_else_is_still_invalid_payload() -> None:
    """A model validator that raises TypeError (a bug by Pydantic's rules) is refused like a
    bad field, never let out raw."""

    class Picky(BaseModel):
        n: int

        @field_validator("n")
        @classmethod
        def boom(cls, value: int) -> int:
            raise TypeError("no")

    schema = payload_schema(Picky, "transition 'go'")
    assert schema is not None
    with pytest.raises(flowlock.InvalidPayload) as caught:
        schema.parse({"n": 1}, workflow="w", event="go")
    assert caught.value.errors[0]["type"] == "validator_error"


def test_events_checked_before_the_read_are_those_with_one_schema_everywhere() -> None:
    """pay (one workflow) and ship (the same dict in two) are early; note (two schemas) and an
    event typed in one workflow but not in another are not; untyped events are not listed."""
    plain = flowlock.Workflow(
        "plain", states=["a", "b"], initial="a",
        transitions=[flowlock.Transition("pay", source="a", target="b")],
    )  # fmt: skip
    early = early_schemas([shop(), desk()])
    assert set(early) == {"pay", "ship"}
    assert early["ship"][1] == "shop, desk"
    assert set(early_schemas([shop(), desk(), plain])) == {"ship"}


def test_a_json_schema_payload_without_the_schema_extra_names_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without jsonschema installed, a dict schema raises ExtraNotInstalled naming the `schema`
    extra; a Pydantic model needs nothing."""
    monkeypatch.setitem(sys.modules, "jsonschema", None)
    with pytest.raises(flowlock.ExtraNotInstalled) as caught:
        flowlock.Transition("go", source="a", target="b", payload=SHIP)
    assert caught.value.extra == "schema"
    assert flowlock.Transition("go", source="a", target="b", payload=Order).payload is not None


def test_the_sync_engine_checks_payloads_and_data() -> None:
    """flowlock.sync.Engine: bad data and a bad payload are InvalidPayload, nothing written; a
    good payload reaches the guard as the model."""
    SEEN.clear()
    with flowlock.sync.Engine.connect("memory://") as engine:
        engine.register(shop())
        with pytest.raises(flowlock.InvalidPayload):
            engine.create("shop", instance_id="s", data={})
        engine.create("shop", instance_id="s", data={"customer": "ann"})
        with pytest.raises(flowlock.InvalidPayload) as caught:
            engine.fire("s", "pay", payload=BAD_ORDER)
        assert caught.value.paths == BAD_ORDER_PATHS
        assert engine.get("s").version == 1 and engine.history("s") == []
        assert engine.fire("s", "pay", payload=GOOD_ORDER).applied
        assert isinstance(SEEN[0], Order)
        assert engine.history("s")[0].payload == GOOD_ORDER
