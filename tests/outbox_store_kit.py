"""What the outbox store tests share (the contract and the PostgreSQL tests): a workflow whose
transitions emit messages, hand-made entries that emit, and bounds."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import flowlock
from flowlock.core.models import HistoryEntry, Instance

# Every wait is bounded by this (seconds): generous, so a loaded machine only makes a test
# slower, while a hang still fails it.
BOUND = 30.0
QUIET = 0.3  # seconds a test waits to see that something does NOT happen
WF = "order"
TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _reserved(inst: Instance, payload: Mapping[str, Any], actor: str | None) -> list[flowlock.Emit]:
    return [
        flowlock.Emit("reserve", {"order": inst.id, "version": inst.version}),
        flowlock.Emit("notify", {"to": actor or "ops"}),
    ]


def _noted(inst: Instance, payload: Mapping[str, Any], actor: str | None) -> flowlock.Step:
    notes = int(inst.data.get("notes", 0)) + 1
    emits = [flowlock.Emit("notify", {"n": notes})]
    return flowlock.Step({**inst.data, "notes": notes}, emit=emits)


def _paid(inst: Instance, payload: Mapping[str, Any], actor: str | None) -> list[flowlock.Emit]:
    return [flowlock.Emit("charge", {"amount": payload.get("amount", 1)})]


def order() -> flowlock.Workflow:
    """An order: `reserve` emits a `reserve` and a `notify` message (from its emit function),
    `note` one `notify` (from its effect's Step) and stays, `pay` one `charge`, `touch` none."""
    return flowlock.Workflow(
        WF,
        states=["new", "reserved", "paid"],
        initial="new",
        transitions=[
            flowlock.Transition("reserve", source="new", target="reserved", emit=_reserved),
            flowlock.Transition("note", source="reserved", target="reserved", effect=_noted),
            flowlock.Transition("pay", source="reserved", target="paid", emit=_paid),
            flowlock.Transition("touch", source="new", target="new"),
        ],
    )


def emitting(
    inst: Instance,
    event: str,
    emits: Sequence[flowlock.Emit],
    *,
    offset: int = 1,
    fencing_token: int | None = None,
    trace: str | None = None,
) -> HistoryEntry:
    """A hand-made entry of `event` at version `inst.version + offset` that keeps the state and
    emits `emits` (for commits sent to the store directly)."""
    return HistoryEntry(
        instance_id=inst.id,
        version=inst.version + offset,
        event=event,
        from_state=inst.state,
        to_state=inst.state,
        actor=None,
        request_id=None,
        strategy="optimistic",
        data=dict(inst.data),
        fencing_token=fencing_token,
        emits=tuple(emits),
        trace=trace,
    )
