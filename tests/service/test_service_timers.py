"""Timers over HTTP: every answer about one instance (create, fire, GET) shows its next due
timer, GET /instances/{id}/timers lists the armed ones, the service fires them (unless started
with timers off), and a firing's history row says the timer wrote it."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from typing import Any

import httpx
import pytest

import flowlock
from flowlock.core.errors import StoreError
from flowlock.core.models import TIMER_ACTOR
from flowlock.service import ServiceSettings
from lock_probes import wait_until
from service.kit import Service, assert_problem, create, served

BOUND = 20.0  # the most a test waits for a due timer to fire (a loaded machine is slow)


def _workflows() -> list[flowlock.Workflow]:
    """`slow`: an expiry in two days and an hourly reminder (`hold` and `resume` leave and
    re-enter pending); `quick`: an expiry 100 ms in;
    `plain`: no timer at all."""
    slow = flowlock.Workflow(
        "slow",
        states=["pending", "held", "approved", "rejected"],
        initial="pending",
        transitions=[
            flowlock.Transition("approve", source="pending", target="approved"),
            flowlock.Transition("hold", source="pending", target="held"),
            flowlock.Transition("resume", source="held", target="pending"),
            flowlock.Transition(
                "expire", source="pending", target="rejected", after=timedelta(days=2)
            ),
            flowlock.Transition(
                "remind", source="pending", target="pending", every=timedelta(hours=1), limit=3
            ),
        ],
    )
    quick = flowlock.Workflow(
        "quick",
        states=["pending", "approved", "rejected"],
        initial="pending",
        transitions=[
            flowlock.Transition("approve", source="pending", target="approved"),
            flowlock.Transition(
                "expire",
                source="pending",
                target="rejected",
                after=timedelta(milliseconds=100),
            ),
        ],
    )
    plain = flowlock.Workflow(
        "plain",
        states=["pending", "approved"],
        initial="pending",
        transitions=[flowlock.Transition("approve", source="pending", target="approved")],
    )
    return [slow, quick, plain]


@pytest.fixture
async def timed() -> AsyncIterator[Service]:
    """The app on the memory store serving the two timed workflows."""
    async with served(workflows=_workflows()) as running:
        yield running


async def _state(client: httpx.AsyncClient, iid: str, state: str) -> None:
    async def there() -> bool:
        return bool((await client.get(f"/instances/{iid}")).json()["state"] == state)

    await wait_until(there, within=BOUND, what=f"{iid} in {state}")


async def test_the_instance_shows_its_next_timer_and_lists_them_all(timed: Service) -> None:
    """GET shows the earliest armed timer (event, due_at, stay); /timers lists each with its
    firing number, period and limit; once the stay ends both are empty."""
    client = timed.client
    await create(client, "slow", "s-1")
    got = await client.get("/instances/s-1")
    assert got.status_code == 200, got.text
    nxt = got.json()["next_timer"]
    assert (nxt["event"], nxt["stay"]) == ("remind", 1)
    listed = await client.get("/instances/s-1/timers")
    assert listed.status_code == 200, listed.text
    items = listed.json()["items"]
    assert [(t["event"], t["stay"], t["n"]) for t in items] == [("remind", 1, 0), ("expire", 1, 0)]
    assert items[0]["due_at"] == nxt["due_at"]
    assert (items[0]["every"], items[0]["limit"]) == (3600.0, 3)
    assert (items[1]["every"], items[1]["limit"]) == (None, None)
    assert all(t["lag"] == 0 and t["claimed_until"] is None for t in items)
    remind = datetime.fromisoformat(items[0]["due_at"])
    expire = datetime.fromisoformat(items[1]["due_at"])
    # Armed by one commit: due `after` apart (the memory store shows its monotonic due times
    # on the wall clock, read once per timer: a few microseconds may differ).
    assert abs(expire - remind - (timedelta(days=2) - timedelta(hours=1))) < timedelta(seconds=1)

    fired = await client.post("/instances/s-1/events/approve")
    assert fired.status_code == 200, fired.text
    assert (await client.get("/instances/s-1")).json()["next_timer"] is None
    assert (await client.get("/instances/s-1/timers")).json() == {"items": []}


async def test_the_service_fires_a_due_timer_as_the_timer(timed: Service) -> None:
    """The quick expiry fires by itself: the instance is rejected, its history row's actor is
    flowlock:timer under the request id timer:1:expire:0, and nothing is left armed."""
    client = timed.client
    await create(client, "quick", "q-1")
    await _state(client, "q-1", "rejected")
    history = (await client.get("/instances/q-1/history")).json()["items"]
    assert [(h["event"], h["actor"], h["request_id"]) for h in history] == [
        ("expire", TIMER_ACTOR, "timer:1:expire:0")
    ]
    assert (await client.get("/instances/q-1/timers")).json() == {"items": []}


async def test_timers_of_an_unknown_instance_are_a_404(timed: Service) -> None:
    """No such instance: 404 instance-not-found, not an empty list."""
    assert_problem(await timed.client.get("/instances/nope/timers"), 404, "instance-not-found")


async def test_with_timers_off_timers_arm_and_nothing_fires() -> None:
    """ServiceSettings(timers=False): the engine runs no timer service; a create still arms
    the quick expiry, which comes due (its lag grows) while the instance stays pending, and a
    caller may still fire the event itself."""
    async with served(ServiceSettings(timers=False), workflows=_workflows()) as svc:
        assert svc.engine.timer_service is None
        client = svc.client
        await create(client, "quick", "q-2")

        async def overdue() -> bool:
            items = (await client.get("/instances/q-2/timers")).json()["items"]
            return bool(items) and items[0]["lag"] > 0.2

        await wait_until(overdue, within=BOUND, what="the expiry overdue")
        assert (await client.get("/instances/q-2")).json()["state"] == "pending"
        fired = await client.post("/instances/q-2/events/expire")
        assert fired.status_code == 200, fired.text
        assert fired.json()["instance"]["state"] == "rejected"
        assert (await client.get("/instances/q-2/timers")).json() == {"items": []}


def _count_timer_reads(svc: Service, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The ids whose timers the engine is asked for from now on (it still answers them)."""
    asked: list[str] = []
    read = svc.engine.timers

    async def counted(instance_id: str) -> list[flowlock.Timer]:
        asked.append(instance_id)
        return await read(instance_id)

    monkeypatch.setattr(svc.engine, "timers", counted)
    return asked


async def _post(client: httpx.AsyncClient, url: str, **kwargs: Any) -> dict[str, Any]:
    response = await client.post(url, **kwargs)
    assert response.status_code in (200, 201), response.text
    body: dict[str, Any] = response.json()
    return body


async def test_create_and_fire_answers_carry_the_next_timer(
    timed: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A create's and a fire's instance have the same next_timer as a GET, each from one read
    of the timers after the call; once the stay ends it is null."""
    client = timed.client
    asked = _count_timer_reads(timed, monkeypatch)
    made = await _post(client, "/instances", json={"workflow": "slow", "id": "s-2"})
    assert asked == ["s-2"]
    shown = (await client.get("/instances/s-2")).json()["next_timer"]
    assert made["next_timer"] == shown
    assert (shown["event"], shown["stay"]) == ("remind", 1)
    # A caller fires the reminder itself: the state stays, and so do the stay's timers.
    kept = await _post(client, "/instances/s-2/events/remind")
    assert kept["instance"]["next_timer"] == shown
    assert asked == ["s-2", "s-2"]
    left = await _post(client, "/instances/s-2/events/approve")
    assert left["instance"]["state"] == "approved"
    assert left["instance"]["next_timer"] is None


async def test_an_untimed_workflow_answers_null_without_reading_timers(
    timed: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A workflow with no timed transition: next_timer is null in the create and fire answers,
    and the timers are never read."""
    client = timed.client
    asked = _count_timer_reads(timed, monkeypatch)
    made = await _post(client, "/instances", json={"workflow": "plain", "id": "p-1"})
    assert made["next_timer"] is None
    fired = await _post(client, "/instances/p-1/events/approve")
    assert fired["instance"]["next_timer"] is None
    assert asked == []


async def test_a_replay_shows_the_timer_of_the_stay_it_answers_with(timed: Service) -> None:
    """A replayed create or fire repeats the first body, next_timer included, while the stay
    lasts; once the instance has left that stay, the replay's next_timer is null (the stay it
    shows has no timer left), not the timer of the stay begun since."""
    client = timed.client
    create_key = {"Idempotency-Key": "make-s-3"}
    body = {"workflow": "slow", "id": "s-3"}
    made = await _post(client, "/instances", json=body, headers=create_key)
    assert made["next_timer"] is not None
    assert await _post(client, "/instances", json=body, headers=create_key) == made
    remind_key = {"Idempotency-Key": "remind-s-3"}
    reminded = await _post(client, "/instances/s-3/events/remind", headers=remind_key)
    assert reminded["instance"]["next_timer"] == made["next_timer"]
    again = await client.post("/instances/s-3/events/remind", headers=remind_key)
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json() == reminded

    # Leave pending and come back: a new stay (version 4) with timers of its own.
    await _post(client, "/instances/s-3/events/hold")
    await _post(client, "/instances/s-3/events/resume")
    now = (await client.get("/instances/s-3")).json()["next_timer"]
    assert (now["event"], now["stay"]) == ("remind", 4)
    late = await client.post("/instances/s-3/events/remind", headers=remind_key)
    assert late.headers["idempotent-replayed"] == "true"
    assert late.json() == {**reminded, "instance": {**reminded["instance"], "next_timer": None}}
    late_made = await _post(client, "/instances", json=body, headers=create_key)
    assert late_made == {**made, "next_timer": None}


async def test_a_failed_timers_read_leaves_next_timer_out_of_a_call_that_applied(
    timed: Service, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """When reading the timers fails after a create or fire applied, the answer is still the
    call's success, without next_timer (not a null that would say none is armed), and the
    failure is logged."""

    async def failing(instance_id: str) -> list[flowlock.Timer]:
        raise StoreError(f"injected: the timers of {instance_id!r} could not be read")

    monkeypatch.setattr(timed.engine, "timers", failing)
    client = timed.client
    with caplog.at_level(logging.WARNING, logger="flowlock.service"):
        made = await _post(client, "/instances", json={"workflow": "slow", "id": "s-4"})
        fired = await _post(client, "/instances/s-4/events/approve")
    assert "next_timer" not in made
    assert fired["applied"] and "next_timer" not in fired["instance"]
    assert fired["instance"]["state"] == "approved"
    assert sum("injected" in r.getMessage() for r in caplog.records) == 2
