"""The outbox over HTTP: GET /instances/{id}/messages lists what an instance's transitions
emitted, in order, with where each delivery is; an unknown instance is a 404; a missing message
maps to the 404 problem message-not-found; `outbox=False` round-trips like `timers`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from datetime import datetime, timedelta
from typing import Any

import pytest
from typer.testing import CliRunner

import flowlock
from flowlock.core.errors import MessageNotFound
from flowlock.http import problem
from flowlock.service import ServiceSettings, create_app
from flowlock.stores.base import OutboxStore
from lock_probes import wait_until
from service.kit import TYPE_PREFIX, Service, assert_problem, create, served

BOUND = 20.0  # the most a test waits for a delivery (a loaded machine is slow)

FIELDS = {
    "key", "instance_id", "workflow", "version", "n", "kind", "status", "attempts",
    "last_error", "next_attempt_at", "created_at", "done_at", "claimed_until",
    "fencing_token", "payload",
}  # fmt: skip


def _ship(inst: flowlock.Instance, payload: Mapping[str, Any], actor: str | None) -> list[Any]:
    return [flowlock.Emit("warehouse", {"order": inst.id, "by": actor})]


def _pay(inst: flowlock.Instance, payload: Mapping[str, Any], actor: str | None) -> Any:
    amount = payload.get("amount", 0)
    return flowlock.Step(
        {**inst.data, "paid": amount},
        emit=[flowlock.Emit("receipt", {"amount": amount}), flowlock.Emit("ledger", {})],
    )


def _orders() -> flowlock.Workflow:
    """`pay` emits two messages from its effect (a receipt, a ledger line), `ship` one from the
    transition's emit function; `cancel` emits nothing."""
    return flowlock.Workflow(
        "order",
        states=["new", "paid", "shipped", "cancelled"],
        initial="new",
        transitions=[
            flowlock.Transition("pay", source="new", target="paid", effect=_pay),
            flowlock.Transition("ship", source="paid", target="shipped", emit=_ship),
            flowlock.Transition("cancel", source="new", target="cancelled"),
        ],
    )


@pytest.fixture
async def orders() -> AsyncIterator[Service]:
    """The app on the memory store serving the order workflow (no handler: nothing delivers)."""
    async with served(workflows=[_orders()]) as running:
        yield running


async def _fire(svc: Service, iid: str, event: str, **payload: Any) -> None:
    fired = await svc.client.post(
        f"/instances/{iid}/events/{event}", json={"payload": payload, "actor": "alice"}
    )
    assert fired.status_code == 200, fired.text


async def _by_key(svc: Service, iid: str) -> dict[str, dict[str, Any]]:
    got = await svc.client.get(f"/instances/{iid}/messages")
    assert got.status_code == 200, got.text
    return {m["key"]: m for m in got.json()["items"]}


async def test_messages_lists_what_each_transition_emitted_in_order(orders: Service) -> None:
    """Keyed <id>:<version>:<n>, in emitting order, pending and not yet tried, with their
    kind, payload, version and place; every documented field is there and nothing else."""
    await create(orders.client, "order", "o-1")
    await _fire(orders, "o-1", "pay", amount=30)
    await _fire(orders, "o-1", "ship")
    got = await orders.client.get("/instances/o-1/messages")
    assert got.status_code == 200, got.text
    items = got.json()["items"]
    assert all(set(m) == FIELDS for m in items)
    assert [(m["key"], m["kind"], m["version"], m["n"]) for m in items] == [
        ("o-1:2:0", "receipt", 2, 0),
        ("o-1:2:1", "ledger", 2, 1),
        ("o-1:3:0", "warehouse", 3, 0),
    ]
    assert [m["payload"] for m in items] == [{"amount": 30}, {}, {"order": "o-1", "by": "alice"}]
    for m in items:
        assert (m["instance_id"], m["workflow"], m["status"]) == ("o-1", "order", "pending")
        assert (m["attempts"], m["last_error"], m["done_at"], m["claimed_until"]) == (
            0, None, None, None
        )  # fmt: skip
        assert m["fencing_token"] is None  # the optimistic strategy has none
        assert datetime.fromisoformat(m["created_at"]).utcoffset() is not None
        # Due at once: at its commit (the memory store shows its monotonic times on the wall
        # clock, read once per field: a few microseconds may differ).
        due = datetime.fromisoformat(m["next_attempt_at"])
        assert abs(due - datetime.fromisoformat(m["created_at"])) < timedelta(seconds=1)


async def test_an_instance_that_emitted_nothing_has_an_empty_list(orders: Service) -> None:
    """Created, then cancelled (no emit): 200 with no items."""
    await create(orders.client, "order", "o-2")
    await _fire(orders, "o-2", "cancel")
    got = await orders.client.get("/instances/o-2/messages")
    assert got.status_code == 200, got.text
    assert got.json() == {"items": []}


async def test_messages_of_an_unknown_instance_are_a_404(orders: Service) -> None:
    """No such instance: 404 instance-not-found, not an empty list."""
    body = assert_problem(
        await orders.client.get("/instances/nope/messages"), 404, "instance-not-found"
    )
    assert body["instance_id"] == "nope"


async def test_the_list_shows_a_running_a_dead_and_a_retried_message(orders: Service) -> None:
    """A message claimed by a dispatcher reads running (its claim's end shown, one attempt);
    one whose delivery failed for good reads dead with its last error; a retry makes it pending
    again with no attempt counted; a dropped one is gone."""
    store = orders.engine.store
    assert isinstance(store, OutboxStore)
    await create(orders.client, "order", "o-3")
    await _fire(orders, "o-3", "pay", amount=5)

    [claimed] = await store.claim_messages({"receipt": 1}, lease=60.0, owner="test")
    shown = await _by_key(orders, "o-3")
    assert shown["o-3:2:0"]["status"] == "running"
    assert shown["o-3:2:0"]["attempts"] == 1
    assert shown["o-3:2:0"]["claimed_until"] is not None

    assert await store.fail_message(claimed, "test", "HTTP 400 from the mail service", None)
    shown = await _by_key(orders, "o-3")
    dead = shown["o-3:2:0"]
    assert (dead["status"], dead["attempts"], dead["last_error"]) == (
        "dead", 1, "HTTP 400 from the mail service"
    )  # fmt: skip
    assert dead["next_attempt_at"] is None and dead["claimed_until"] is None

    await orders.engine.retry_message("o-3:2:0")
    await orders.engine.drop_message("o-3:2:1")
    items = (await orders.client.get("/instances/o-3/messages")).json()["items"]
    assert [(m["key"], m["status"], m["attempts"]) for m in items] == [("o-3:2:0", "pending", 0)]
    assert items[0]["last_error"] == "HTTP 400 from the mail service"  # kept for the operator


def test_a_missing_message_is_the_404_problem_message_not_found() -> None:
    """The one mapping (flowlock.http, which the service uses) answers MessageNotFound with
    404, type message-not-found, the key as a member, and a detail that says what to do."""
    status, body, headers = problem(MessageNotFound("o-9:4:0"), "/somewhere")
    assert status == 404
    assert headers["Content-Type"] == "application/problem+json"
    assert body["type"] == TYPE_PREFIX + "message-not-found"
    assert (body["title"], body["status"], body["key"]) == ("Message not found", 404, "o-9:4:0")
    assert "/instances/{instance_id}/messages" in body["detail"]
    assert body["instance"] == "/somewhere"


def test_outbox_off_round_trips_through_the_environment() -> None:
    """FLOWLOCK_OUTBOX=false is ServiceSettings(outbox=False); on by default; a word that is
    not true or false is refused naming the variable."""
    off = ServiceSettings(outbox=False)
    assert off.to_env()["FLOWLOCK_OUTBOX"] == "false"
    assert ServiceSettings.from_env({"FLOWLOCK_OUTBOX": "false"}) == off
    assert ServiceSettings.from_env({}).outbox is True
    with pytest.raises(flowlock.InvalidInput, match=r"^FLOWLOCK_OUTBOX"):
        ServiceSettings.from_env({"FLOWLOCK_OUTBOX": "sometimes"})


async def _paid(svc: Service, iid: str) -> None:
    await create(svc.client, "order", iid)
    await _fire(svc, iid, "pay", amount=12)


async def test_the_service_engine_delivers_to_a_handler_registered_on_it() -> None:
    """By default the service's engine runs a dispatcher: a handler registered on it gets the
    receipt, and the list shows it done after one attempt."""
    got: list[str] = []

    async def receipt(message: flowlock.Message) -> None:
        got.append(message.key)

    async with served(workflows=[_orders()]) as svc:
        assert svc.engine.dispatcher is not None
        svc.engine.on_emit("receipt", receipt)
        await _paid(svc, "o-4")

        async def delivered() -> bool:
            return bool((await _by_key(svc, "o-4"))["o-4:2:0"]["status"] == "done")

        await wait_until(delivered, within=BOUND, what="the receipt delivered")
        assert got == ["o-4:2:0"]
        assert (await _by_key(svc, "o-4"))["o-4:2:0"]["attempts"] == 1


async def test_with_outbox_off_messages_are_written_and_nothing_delivers() -> None:
    """ServiceSettings(outbox=False): the engine has no dispatcher; a handler registered on it
    is kept but never called, and the messages stay pending, not attempted."""
    called: list[str] = []

    async def receipt(message: flowlock.Message) -> None:
        called.append(message.key)

    async with served(ServiceSettings(outbox=False), workflows=[_orders()]) as svc:
        assert svc.engine.dispatcher is None
        svc.engine.on_emit("receipt", receipt)
        await _paid(svc, "o-5")
        await asyncio.sleep(0.3)  # time a dispatcher would have used to deliver
        shown = await _by_key(svc, "o-5")
        assert [(m["status"], m["attempts"]) for m in shown.values()] == [("pending", 0)] * 2
        assert called == []


@pytest.mark.parametrize(
    ("args", "env", "outbox"),
    [
        ([], {}, True),
        (["--no-outbox"], {}, False),
        ([], {"FLOWLOCK_OUTBOX": "false"}, False),
        (["--outbox"], {"FLOWLOCK_OUTBOX": "false"}, True),
    ],
)
def test_serve_takes_outbox_from_its_flag_or_variable(
    monkeypatch: pytest.MonkeyPatch, args: list[str], env: dict[str, str], outbox: bool
) -> None:
    """`flowlock serve --no-outbox` (or FLOWLOCK_OUTBOX=false) hands the workers settings with
    outbox off, which create_app turns into an engine without a dispatcher; the flag wins over
    the variable. (The server itself is replaced: only the settings it is given are read.)"""
    import flowlock.service.server
    from flowlock.cli import app

    given: list[ServiceSettings] = []
    monkeypatch.setattr(
        flowlock.service.server, "serve", lambda settings, listen, dev=False: given.append(settings)
    )
    for var in ("FLOWLOCK_OUTBOX", "FLOWLOCK_DATABASE_URL"):
        monkeypatch.delenv(var, raising=False)
    result = CliRunner().invoke(app, ["serve", "--database-url", "memory://", *args], env=env)
    assert result.exit_code == 0, result.output
    [settings] = given
    assert settings.outbox is outbox
    assert ServiceSettings.from_env(settings.to_env()).outbox is outbox
    assert (create_app(settings).state.engine.dispatcher is None) is not outbox
