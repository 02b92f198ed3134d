"""Timers over HTTP: GET /instances/{id} shows the next due timer, GET /instances/{id}/timers
lists the armed ones, the service fires them (unless started with timers off), and a firing's
history row says the timer wrote it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime, timedelta

import httpx
import pytest

import flowlock
from flowlock.core.models import TIMER_ACTOR
from flowlock.service import ServiceSettings
from lock_probes import wait_until
from service.kit import Service, assert_problem, create, served

BOUND = 20.0  # the most a test waits for a due timer to fire (a loaded machine is slow)


def _workflows() -> list[flowlock.Workflow]:
    """`slow`: an expiry in two days and an hourly reminder; `quick`: an expiry 100 ms in."""
    slow = flowlock.Workflow(
        "slow",
        states=["pending", "approved", "rejected"],
        initial="pending",
        transitions=[
            flowlock.Transition("approve", source="pending", target="approved"),
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
    return [slow, quick]


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
