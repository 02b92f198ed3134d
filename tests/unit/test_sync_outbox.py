"""The sync API's outbox: `flowlock.sync.Engine` reads, retries and drops messages as the async
engine does, its errors reach the caller's thread as they are, and a sync handler may call the
blocking engine from its worker thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import pytest

import flowlock
import flowlock.sync

BOUND = 20.0


def _reserve(inst: flowlock.Instance, payload: Mapping[str, Any], actor: str | None) -> Any:
    return flowlock.Step(
        dict(inst.data),
        emit=[
            flowlock.Emit("payment", {"amount": payload.get("amount", 0)}),
            flowlock.Emit("audit", {"by": actor}),
        ],
    )


def _orders() -> flowlock.Workflow:
    """`reserve` emits a payment and an audit line; `confirm`, fed back by the payment's
    handler, emits nothing; `ship` emits one warehouse message."""
    return flowlock.Workflow(
        "order",
        states=["new", "reserved", "confirmed", "shipped"],
        initial="new",
        transitions=[
            flowlock.Transition("reserve", source="new", target="reserved", effect=_reserve),
            flowlock.Transition("confirm", source="reserved", target="confirmed"),
            flowlock.Transition(
                "ship",
                source="confirmed",
                target="shipped",
                emit=lambda inst, payload, actor: [flowlock.Emit("warehouse", {"id": inst.id})],
            ),
        ],
    )


def test_messages_are_read_retried_and_dropped_from_a_plain_thread() -> None:
    """messages() in emitting order, find_messages() in key order with its filters, message()
    by key; retry_message() answers the message pending again; drop_message() removes it; a
    missing key raises MessageNotFound and a done one InvalidInput, in the caller's thread."""
    with flowlock.sync.Engine.connect("memory://") as engine:
        engine.register(_orders())
        for iid in ("o-1", "o-2"):
            engine.create("order", instance_id=iid)
            engine.fire(iid, "reserve", actor="ann", payload={"amount": 7})
        listed = engine.messages("o-1")
        assert [(m.key, m.kind, m.status) for m in listed] == [
            ("o-1:2:0", "payment", "pending"),
            ("o-1:2:1", "audit", "pending"),
        ]
        assert all(isinstance(m, flowlock.Message) for m in listed)
        assert listed[0].payload == {"amount": 7} and listed[1].payload == {"by": "ann"}
        found = engine.find_messages(kind="payment")
        assert [m.key for m in found] == ["o-1:2:0", "o-2:2:0"]
        assert [m.key for m in engine.find_messages(after="o-1:2:1", limit=1)] == ["o-2:2:0"]
        assert engine.find_messages(status="dead") == []
        assert engine.message("o-2:2:1").kind == "audit"

        again = engine.retry_message("o-1:2:0")
        assert (again.key, again.status, again.attempts) == ("o-1:2:0", "pending", 0)
        engine.drop_message("o-1:2:1")
        assert [m.key for m in engine.messages("o-1")] == ["o-1:2:0"]
        with pytest.raises(flowlock.MessageNotFound) as missing:
            engine.message("o-1:2:1")
        assert missing.value.key == "o-1:2:1"
        with pytest.raises(flowlock.MessageNotFound):
            engine.drop_message("o-1:2:1")
        with pytest.raises(flowlock.InvalidInput, match="not '<instance_id>:<version>:<n>'"):
            engine.retry_message("o-1")
        with pytest.raises(flowlock.InvalidInput, match="status"):
            engine.find_messages(status="lost")


def test_a_sync_handler_may_call_the_sync_engine_and_a_done_message_is_not_retried() -> None:
    """A sync handler runs in a worker thread (not the caller's, not the engine's loop), so it
    may call the blocking engine itself: it sees its own message running. Once done, the
    message is refused by retry_message (InvalidInput, nothing changed)."""
    seen: list[tuple[str, str, int]] = []
    caller = threading.current_thread()

    def payment(message: flowlock.Message) -> None:
        here = threading.current_thread()
        assert here is not caller and here.name != "flowlock-sync"
        shown = engine.message(message.key)
        seen.append((shown.key, shown.status, shown.attempts))

    with flowlock.sync.Engine.connect("memory://") as engine:
        engine.register(_orders())
        engine.on_emit("payment", payment)
        engine.create("order", instance_id="o-1")
        engine.fire("o-1", "reserve", payload={"amount": 3})
        deadline = time.monotonic() + BOUND
        while engine.message("o-1:2:0").status != "done":
            assert time.monotonic() < deadline, "the payment was not delivered"
            time.sleep(0.02)
        assert seen == [("o-1:2:0", "running", 1)]
        with pytest.raises(flowlock.InvalidInput, match="delivered already"):
            engine.retry_message("o-1:2:0")
        assert engine.message("o-1:2:0").status == "done"
