"""What the outbox tests share: an order workflow whose chain runs through two handlers, and the
sink its handlers write into (a table with a unique index on the message key, as a receiving
service would have).

`submit` (a caller) takes an order from placed to submitted and emits `charge`. The charge
handler records the key in the sink and answers `Then("paid")`, which takes the order to paid
and emits `ship`; the ship handler records its key too. So each order, once done, has two
history rows (submit, paid), two messages, and two sink rows.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from typing import Any

import flowlock
from flowlock import Emit, Step, Transition, Workflow

SINK_SQL = """
CREATE TABLE IF NOT EXISTS outbox_sink (
    key text PRIMARY KEY,
    kind text NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS outbox_deliveries (
    key text NOT NULL,
    pid int NOT NULL,
    at float8 NOT NULL
);
"""
# The receiving side's idempotency: the key's unique index drops a redelivery.
RECORD = "INSERT INTO outbox_sink (key, kind) VALUES ($1, $2) ON CONFLICT (key) DO NOTHING"
# Every delivery, redeliveries too, with the process and its time (CLOCK_MONOTONIC).
DELIVERED = "INSERT INTO outbox_deliveries (key, pid, at) VALUES ($1, $2, $3)"


def _guard(_inst: flowlock.Instance, payload: Mapping[str, Any], _actor: str | None) -> bool:
    # Fault injection: a call asked to die kills its process inside the step, before the commit.
    if payload.get("die"):
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def _charge(inst: flowlock.Instance, payload: Mapping[str, Any], _actor: str | None) -> list[Emit]:
    return [Emit("charge", {"order": inst.id, "amount": payload.get("amount", 1)})]


def _paid(inst: flowlock.Instance, _payload: Mapping[str, Any], _actor: str | None) -> Step:
    return Step({**inst.data, "paid": True}, emit=[Emit("ship", {"order": inst.id})])


def order() -> Workflow:
    return Workflow(
        "order",
        states=["placed", "submitted", "paid"],
        initial="placed",
        transitions=[
            Transition("submit", source="placed", target="submitted", guard=_guard, emit=_charge),
            Transition("paid", source="submitted", target="paid", effect=_paid),
        ],
    )
