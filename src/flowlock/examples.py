"""The seed article's cases as flowlock workflows, shared by the benchmark and the tests.

Each carries the strategy that fits it; `strategy=` overrides it, and None leaves the
engine's default.

- `approval`: pending -> approved | rejected (the two-admins incident). Any strategy fits.
- `countersign(quorum)`: approved once `quorum` distinct approvers signed. Pessimistic.
- `inventory`: `reserve` takes stock and refuses at zero; `restock` adds. Pessimistic.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from flowlock.core.definition import Step, StrategyName, Transition, Workflow
from flowlock.core.errors import GuardRejected
from flowlock.core.models import Instance

__all__ = ["approval", "countersign", "defaults", "inventory"]


def approval(name: str = "approval", *, strategy: StrategyName | None = None) -> Workflow:
    """A request that one of several administrators approves or rejects.

    It keeps the engine's default strategy: approvals rarely conflict. Every strategy
    answers the two-admins race with one approval and one idempotent answer.
    """
    return Workflow(
        name,
        strategy=strategy,
        states=["pending", "approved", "rejected"],
        initial="pending",
        transitions=[
            Transition("approve", source="pending", target="approved"),
            Transition("reject", source="pending", target="rejected"),
        ],
    )


def countersign(
    quorum: int, name: str = "countersign", *, strategy: StrategyName | None = "pessimistic"
) -> Workflow:
    """A document that needs `quorum` distinct signatures.

    `sign` records each actor once, refusing a second signature, and moves to
    `approved` at quorum. Pessimistic by default: every signer must get through, and
    optimistic retries give up under a crowd (`ConflictRetriesExhausted`).
    """
    if quorum < 1:
        raise ValueError("quorum must be at least 1")

    def not_signed_yet(inst: Instance, payload: Mapping[str, Any], actor: str | None) -> bool:
        if actor is None:
            raise GuardRejected("a signature needs an actor")
        if actor in inst.data.get("signers", []):
            raise GuardRejected(f"{actor} has already signed")
        return True

    def record(inst: Instance, payload: Mapping[str, Any], actor: str | None) -> Step:
        signers = [*inst.data.get("signers", []), actor]
        target = "approved" if len(signers) >= quorum else "pending"
        return Step(data={**inst.data, "signers": signers}, target=target)

    return Workflow(
        name,
        strategy=strategy,
        states=["pending", "approved"],
        initial="pending",
        transitions=[
            Transition(
                "sign",
                source="pending",
                target=("pending", "approved"),
                guard=not_signed_yet,
                effect=record,
            )
        ],
    )


@functools.cache
def quantity_model() -> type[Any]:
    """The Pydantic model of a typed inventory's payload: `{"qty": n}`, n >= 1, default 1.

    Built on first use: Pydantic comes with the `service` extra, not with flowlock itself."""
    from pydantic import BaseModel, Field

    class Quantity(BaseModel):
        """How many units an inventory event takes or adds."""

        qty: int = Field(default=1, ge=1, strict=True, description="Units (1 when left out).")

    return Quantity


def inventory(
    name: str = "inventory", *, strategy: StrategyName | None = "pessimistic", typed: bool = False
) -> Workflow:
    """A stock count. Data: `{"stock": int, "reserved": int}`.

    `reserve` (payload `{"qty": n}`, default 1) refuses when stock is short. `restock`
    adds `qty`. Pessimistic by default: on a hot row, optimistic retries run out and leave
    units unsold. In one run, 100 buyers for 50 units bought only 24.

    `typed`: both events declare their payload as a Pydantic model (`quantity_model()`), so
    a bad `qty` is InvalidPayload before anything is read; `flowlock serve` serves this one.
    """

    def qty(payload: Any) -> int:
        if typed:
            return int(payload.qty)  # the model checked it
        n = payload.get("qty", 1)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise GuardRejected(f"qty must be a positive integer, not {n!r}")
        return n

    def in_stock(inst: Instance, payload: Any, actor: str | None) -> bool:
        want, have = qty(payload), int(inst.data.get("stock", 0))
        if want > have:
            raise GuardRejected(f"out of stock: {have} left, {want} requested")
        return True

    def take(inst: Instance, payload: Any, actor: str | None) -> dict[str, Any]:
        n = qty(payload)
        return {
            **inst.data,
            "stock": int(inst.data.get("stock", 0)) - n,
            "reserved": int(inst.data.get("reserved", 0)) + n,
        }

    def add(inst: Instance, payload: Any, actor: str | None) -> dict[str, Any]:
        return {**inst.data, "stock": int(inst.data.get("stock", 0)) + qty(payload)}

    model = quantity_model() if typed else None
    return Workflow(
        name,
        strategy=strategy,
        states=["open"],
        initial="open",
        transitions=[
            Transition(
                "reserve", source="open", target="open", guard=in_stock, effect=take, payload=model
            ),
            Transition("restock", source="open", target="open", effect=add, payload=model),
        ],
    )


def defaults() -> list[Workflow]:
    """What `flowlock serve` serves, and `flowlock admin purge --final` reads, without `--app`:
    the seed article's three cases, approval, countersign (quorum 3) and inventory."""
    return [approval(), countersign(3), inventory()]
