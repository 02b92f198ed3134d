"""SIGTERM to ``flowlock serve --workers 2`` in the middle of a storm of requests.

What a deploy relies on: every request gets an answer or a connection error (never a hang, never
a 500), everything the service answered as applied is in the history exactly once and nothing
is half-applied, the service exits 0 within its drain bound, each worker closes its engine (no
session of the service is left in ``pg_stat_activity``), and the metrics directory the workers
shared is removed.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import asyncpg
import httpx
import pytest
from serve_harness import (
    STOPPED,
    Services,
    database_name,
    fresh_database,
    read_back,
    sessions,
)

import flowlock
from flowlock.checker import check

pytestmark = pytest.mark.slow

DRAIN = 5.0  # --drain-timeout
MARGIN = 20.0  # beyond the drain bound, for a loaded machine
INSTANCES = 20
REQUESTS = 200
STOCK = 10_000
SIGTERM_AFTER = 60  # answers seen before the signal is sent
SPREAD = 0.02  # seconds between two requests' start: the storm lasts about 4 s
HELD = 4  # requests kept in flight across the signal by a row lock the test holds


@dataclass
class Call:
    instance: str
    actor: str
    key: str | None
    delay: float = 0.0
    status: int | None = None
    body: dict[str, Any] | None = None
    error: str | None = None
    retry_after: str | None = None

    async def send(self, http: httpx.AsyncClient) -> None:
        await asyncio.sleep(self.delay)
        headers = {"Idempotency-Key": self.key} if self.key else {}
        try:
            answer = await http.post(
                f"/instances/{self.instance}/events/reserve",
                headers=headers,
                json={"payload": {"qty": 1}, "actor": self.actor},
            )
        except httpx.TimeoutException as exc:
            self.error = f"timeout: {exc!r}"  # a hang: never acceptable
        except httpx.TransportError as exc:
            self.error = type(exc).__name__
        else:
            self.status = answer.status_code
            self.body = answer.json()
            self.retry_after = answer.headers.get("retry-after")


def storm() -> list[Call]:
    """Requests spread over the instances and over about 4 s, every other one with a key."""
    return [
        Call(
            instance=f"sku-{n % INSTANCES}",
            actor=f"buyer-{n}",
            key=f"key-{n}" if n % 2 == 0 else None,
            delay=n * SPREAD,
        )
        for n in range(REQUESTS)
    ]


def conserved(data: Mapping[str, Any]) -> str | None:
    if data.get("stock", 0) < 0 or data.get("stock", 0) + data.get("reserved", 0) != STOCK:
        return f"units appeared or vanished: {data}"
    return None


@pytest.fixture
def database(pg_url: str) -> Iterator[str]:
    """A database of the test's own: the service's sessions are told apart by its name."""
    with fresh_database(pg_url) as url:
        yield url


async def test_sigterm_in_a_storm_drains_and_exits_clean(pg_url: str, database: str) -> None:
    with Services() as services:
        server = services.start(
            "--database-url", database, "--drain-timeout", str(DRAIN), workers=2
        )
        [metrics_dir] = server.metrics_dirs()
        calls = storm()
        held = [Call("held", f"held-{i}", f"held-{i}") for i in range(HELD)]
        limits = httpx.Limits(max_connections=REQUESTS, max_keepalive_connections=REQUESTS)
        async with httpx.AsyncClient(
            base_url=server.url, limits=limits, timeout=DRAIN + MARGIN
        ) as http:
            for name in [*(f"sku-{i}" for i in range(INSTANCES)), "held"]:
                created = await http.post(
                    "/instances",
                    json={"workflow": "inventory", "id": name, "data": {"stock": STOCK}},
                )
                assert created.status_code == 201, created.text
            half_way = asyncio.Event()

            async def send(call: Call) -> None:
                await call.send(http)
                if sum(c.status is not None or c.error is not None for c in calls) >= SIGTERM_AFTER:
                    half_way.set()

            async def stop() -> float:
                """Mid-storm, with requests held in flight on a row lock: SIGTERM, then let
                the held requests go on while the workers drain."""
                await half_way.wait()
                async with row_lock(database, "held"):
                    waiting = [asyncio.create_task(c.send(http)) for c in held]
                    await lock_waiter(pg_url, database_name(database))
                    await asyncio.sleep(0.5)  # every held request has reached a worker
                    signalled = server.terminate()
                    await asyncio.sleep(1.0)
                await asyncio.gather(*waiting)
                return signalled

            sending = [asyncio.create_task(send(c)) for c in calls]
            try:
                signalled = await stop()
            finally:
                await asyncio.gather(*sending)
        code = server.wait(DRAIN + MARGIN)
        took = time.monotonic() - signalled
        log = server.output()

        assert code == 0, log[-4000:]
        assert took < DRAIN + MARGIN
        assert not metrics_dir.exists(), "the metrics directory outlived the service"
        assert log.count(STOPPED) == 2, log[-4000:]  # each worker's lifespan closed its engine
        await no_session_left(pg_url, database_name(database))

        timeouts = [c for c in calls if c.error and c.error.startswith("timeout")]
        assert not timeouts, timeouts
        bad = [c for c in calls if c.status is not None and not ok_status(c.status, c.retry_after)]
        assert not bad, bad
        # The requests in flight when the signal came were drained: answered, and applied.
        assert [(c.status, c.error) for c in held] == [(200, None)] * HELD
        calls += held
        found = await read_back(database, [*(f"sku-{i}" for i in range(INSTANCES)), "held"])
        exactly_once(found, calls)


def exactly_once(
    found: Mapping[str, tuple[flowlock.Instance, list[flowlock.HistoryEntry]]], calls: list[Call]
) -> None:
    """Each instance passes the checker; every call answered applied is one row, the one its
    answer described; every other row is a call whose answer was lost with its connection."""
    applied = {c.actor: c for c in calls if c.status == 200 and c.body and c.body["applied"]}
    unknown = {c.actor for c in calls if c.error}
    assert len(applied) >= SIGTERM_AFTER - len(unknown)
    rows: dict[str | None, flowlock.HistoryEntry] = {}
    for inst, history in found.values():
        verdict = check(inst, history, initial_state="open", invariant=conserved)
        assert verdict.ok, verdict
        assert inst.data["reserved"] == len(history)  # nothing half-applied
        rows.update({e.actor: e for e in history})
    counts = Counter(e.actor for _, history in found.values() for e in history)
    assert all(n == 1 for n in counts.values()), counts.most_common(3)
    for actor, call in applied.items():
        assert actor in rows, f"{actor} was answered applied but is not in history"
        entry = rows[actor]
        assert call.body is not None
        assert entry.version == call.body["instance"]["version"]
        assert entry.instance_id == call.instance and entry.request_id == call.key
    assert set(rows) - set(applied) <= unknown


@asynccontextmanager
async def row_lock(database: str, instance_id: str) -> AsyncIterator[None]:
    """The instance's row locked (FOR UPDATE) by a session of the test: the service's
    pessimistic writes to it wait until the block ends."""
    conn = await asyncpg.connect(database)
    try:
        async with conn.transaction():
            await conn.execute(
                "SELECT 1 FROM flowlock_instances WHERE id = $1 FOR UPDATE", instance_id
            )
            yield
    finally:
        await conn.close()


async def lock_waiter(server_url: str, database: str) -> None:
    """Until a session of the service waits for a row lock on ``database`` (bounded)."""
    conn = await asyncpg.connect(server_url)
    try:
        deadline = time.monotonic() + 10.0
        while not await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 "
            "AND application_name = 'flowlock' AND wait_event_type = 'Lock'",
            database,
        ):
            assert time.monotonic() < deadline, "no request of the service waits for the lock"
            await asyncio.sleep(0.05)
    finally:
        await conn.close()


def ok_status(status: int, retry_after: str | None) -> bool:
    return 200 <= status < 300 or 400 <= status < 500 or (status == 503 and retry_after == "1")


async def no_session_left(server_url: str, database: str) -> None:
    """The service's sessions ("flowlock") are gone from pg_stat_activity (bounded wait: a
    backend leaves the view a moment after its client said goodbye)."""
    deadline = time.monotonic() + 10.0
    while (left := await sessions(server_url, database, "flowlock")) > 0:
        assert time.monotonic() < deadline, f"{left} sessions of the service are still open"
        await asyncio.sleep(0.1)
