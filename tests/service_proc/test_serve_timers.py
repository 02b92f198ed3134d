"""``flowlock serve`` fires due timers by default, and ``--no-timers`` (or FLOWLOCK_TIMERS=false)
runs a service that only takes calls: its timers arm and come due, and nothing fires them."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from serve_harness import SRC, Services, wait_for

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
ENV = {"PYTHONPATH": os.pathsep.join([str(SRC), str(HERE)])}
APP = ("--database-url", "memory://", "--app", "timed_app:workflows")
BOUND = 30.0


def test_serve_fires_due_timers() -> None:
    """The default service rejects the instance by its expiry, as the timer."""
    with Services() as services:
        server = services.start(*APP, env=ENV)
        with httpx.Client(base_url=server.url, timeout=30.0) as http:
            assert http.post("/instances", json={"workflow": "quick", "id": "q"}).is_success
            wait_for(
                "the expiry",
                lambda: bool(http.get("/instances/q").json()["state"] == "rejected"),
                BOUND,
            )
            [row] = http.get("/instances/q/history").json()["items"]
            assert (row["actor"], row["request_id"]) == ("flowlock:timer", "timer:1:expire:0")


@pytest.mark.parametrize("how", ["flag", "env"])
def test_serve_without_timers_takes_calls_only(how: str) -> None:
    """--no-timers (or FLOWLOCK_TIMERS=false): the expiry arms and comes due, the instance stays
    pending, and a caller's own expire still applies."""
    args = [*APP, "--no-timers"] if how == "flag" else list(APP)
    env = ENV if how == "flag" else {**ENV, "FLOWLOCK_TIMERS": "false"}
    with Services() as services:
        server = services.start(*args, env=env)
        with httpx.Client(base_url=server.url, timeout=30.0) as http:
            assert http.post("/instances", json={"workflow": "quick", "id": "q"}).is_success

            def overdue() -> bool:
                items = http.get("/instances/q/timers").json()["items"]
                return bool(items) and items[0]["lag"] > 0.5

            wait_for("the expiry overdue", overdue, BOUND)
            assert http.get("/instances/q").json()["state"] == "pending"
            fired = http.post("/instances/q/events/expire")
            assert fired.json()["instance"]["state"] == "rejected", fired.text
            assert http.get("/instances/q/timers").json() == {"items": []}
