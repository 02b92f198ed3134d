"""What the outbox tests share.

The crash matrix's order workflow, whose chain runs through two handlers, and the sink its
handlers write into (a table with a unique index on the message key, as a receiving service
would have): `submit` (a caller) takes an order from placed to submitted and emits `charge`. The
charge handler records the key in the sink and answers `Then("paid")`, which takes the order to
paid and emits `ship`; the ship handler records its key too. So each order, once done, has two
history rows (submit, paid), two messages, and two sink rows.

The dispatcher's tests' workflows, and waiting for a message's status:

- ``noter``: ``note`` stays in ``open`` and emits ``count`` messages (payload ``{"i": i}``) of
  kind ``kind`` (payload keys of the call, defaults 1 and ``"k"``);
- ``shop``: ``reserve`` (a caller) emits ``charge``; ``charged`` emits ``ship``; ``shipped``
  ends it: the chain a handler's ``Then`` drives.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Mapping
from typing import Any

import flowlock
from flowlock import Emit, Step, Transition, Workflow
from lock_probes import wait_until

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


def _note(inst: flowlock.Instance, payload: Mapping[str, Any], actor: str | None) -> Any:
    kind, count = payload.get("kind", "k"), payload.get("count", 1)
    emits = [flowlock.Emit(kind, {"i": i}) for i in range(count)]
    return flowlock.Step({"notes": inst.data.get("notes", 0) + 1}, emit=emits)


def noter() -> flowlock.Workflow:
    return flowlock.Workflow(
        "noter",
        states=["open"],
        initial="open",
        policy="inventory",
        transitions=[flowlock.Transition("note", source="open", target="open", effect=_note)],
    )


def _emits(kind: str) -> Callable[[flowlock.Instance, Mapping[str, Any], str | None], Any]:
    return lambda inst, payload, actor: [flowlock.Emit(kind, {"order": inst.id})]


def shop() -> flowlock.Workflow:
    return flowlock.Workflow(
        "shop",
        states=["new", "reserved", "charged", "shipped"],
        initial="new",
        transitions=[
            flowlock.Transition("reserve", source="new", target="reserved", emit=_emits("charge")),
            flowlock.Transition(
                "charged", source="reserved", target="charged", emit=_emits("ship")
            ),
            flowlock.Transition("shipped", source="charged", target="shipped"),
        ],
    )


async def noted(engine: flowlock.Engine, instance_id: str, **payload: Any) -> None:
    """Fire ``note`` at the noter ``instance_id``, created first when it does not exist."""
    try:
        await engine.get(instance_id)
    except flowlock.InstanceNotFound:
        await engine.create("noter", instance_id=instance_id)
    await engine.fire(instance_id, "note", payload=payload)


async def status_is(
    engine: flowlock.Engine, key: str, status: str, *, within: float = 10.0
) -> flowlock.Message:
    """The message of `key` once it has `status` (it may not be emitted yet when called)."""
    found: list[flowlock.Message] = []

    async def there() -> bool:
        try:
            message = await engine.message(key)
        except flowlock.MessageNotFound:
            return False
        found[:] = [message]
        return message.status == status

    await wait_until(there, within=within, what=f"message {key} {status}")
    return found[0]
