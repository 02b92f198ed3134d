"""Typed workflows the payload tests share: a shop whose events declare Pydantic models and
JSON Schema dicts, and a desk that shares one event's schema with it and not another's."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

import flowlock
from flowlock.core.models import Instance


class Item(BaseModel):
    sku: str
    qty: int = Field(ge=1)


class Order(BaseModel):
    """An order's lines."""

    items: list[Item]
    note: str | None = None


class Customer(BaseModel):
    """A shop instance's data at creation."""

    customer: str
    credit: int = 0


# The same schema in the shop and the desk: its payload is checked before anything is read.
SHIP: dict[str, Any] = {
    "type": "object",
    "properties": {"carrier": {"type": "string", "enum": ["post", "courier"]}},
    "required": ["carrier"],
}
# A different schema per workflow for one event: its payload is checked in the step.
SHOP_NOTE: dict[str, Any] = {
    "type": "object",
    "properties": {"text": {"type": "string", "maxLength": 10}},
    "required": ["text"],
}
DESK_NOTE: dict[str, Any] = {"type": "object", "properties": {"text": {"type": "string"}}}
DESK_DATA: dict[str, Any] = {
    "type": "object",
    "properties": {"owner": {"type": "string"}},
    "required": ["owner"],
}

# What the guards saw, in call order (a test clears it first).
SEEN: list[Any] = []


def sees(inst: Instance, payload: Any, actor: str | None) -> bool:
    SEEN.append(payload)
    return True


def sees_order(inst: Instance, payload: Order, actor: str | None) -> bool:
    """Typed as the model: a guard annotated with its payload model type-checks."""
    SEEN.append(payload)
    return bool(payload.items)


def totals(inst: Instance, payload: Order, actor: str | None) -> dict[str, Any]:
    return {**inst.data, "units": sum(item.qty for item in payload.items)}


def noted(inst: Instance, payload: Any, actor: str | None) -> dict[str, Any]:
    return {**inst.data, "notes": [*inst.data.get("notes", []), payload["text"]]}


def shop() -> flowlock.Workflow:
    return flowlock.Workflow(
        "shop",
        data=Customer,
        states=["cart", "paid", "shipped"],
        initial="cart",
        transitions=[
            flowlock.Transition(
                "pay", source="cart", target="paid", guard=sees_order, effect=totals, payload=Order
            ),
            flowlock.Transition(
                "note", source=("cart", "paid"), target="cart", effect=noted, payload=SHOP_NOTE
            ),
            flowlock.Transition("ship", source="paid", target="shipped", guard=sees, payload=SHIP),
            flowlock.Transition("reopen", source="shipped", target="cart"),
        ],
    )


def desk() -> flowlock.Workflow:
    return flowlock.Workflow(
        "desk",
        data=DESK_DATA,
        states=["open", "sent"],
        initial="open",
        transitions=[
            flowlock.Transition(
                "note", source="open", target="open", effect=noted, payload=DESK_NOTE
            ),
            flowlock.Transition("ship", source="open", target="sent", guard=sees, payload=SHIP),
        ],
    )


BAD_ORDER: dict[str, Any] = {"items": [{"qty": 0}, {"sku": "b", "qty": 2}]}
BAD_ORDER_PATHS = ("items.0.sku", "items.0.qty")
GOOD_ORDER: dict[str, Any] = {"items": [{"sku": "a", "qty": "2"}, {"sku": "b", "qty": 3}]}
