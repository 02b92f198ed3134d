"""SIGTERM to ``flowlock serve --workers 2`` in the middle of a storm of requests.

What a deploy relies on: every request gets an answer or a connection error (never a hang, never
a 500), everything the service answered as applied is in the history exactly once and nothing
is half-applied, the service exits 0 within its drain bound, each worker closes its engine (no
session of the service is left in ``pg_stat_activity``), and the metrics directory the workers
shared is removed.

Nothing here sleeps to let something happen: the signal is sent once every held request is seen
waiting in PostgreSQL for the test's row lock, and the lock is let go once both workers have
logged that they are shutting down.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from serve_harness import (
    STOPPED,
    Served,
    Services,
    database_name,
    fresh_database,
    read_back,
    sessions,
)

import flowlock
from flowlock.checker import check
from pg_budget import connect

pytestmark = pytest.mark.slow

DRAIN = 5.0  # --drain-timeout
MARGIN = 20.0  # beyond the drain bound, for a loaded machine
INSTANCES = 20
REQUESTS = 200
STOCK = 10_000
SIGTERM_AFTER = 60  # answers seen before the signal is sent
SPREAD = 0.02  # seconds between two requests' start: the storm lasts about 4 s
HELD = 4  # requests kept in flight across the signal by row locks the test holds
WAIT = 30.0  # bound on each wait for a cause (a loaded machine only makes it slower)
WORKERS = 2
POOL = 8  # connections per worker: the service and the test stay well inside a busy server
SHUTTING_DOWN = "Shutting down"  # what each uvicorn worker logs when the signal reaches it


@dataclass
class Call:
    instance: str
    actor: str
    key: str | None
    delay: float = 0.0
    strategy: str | None = None
    status: int | None = None
    body: dict[str, Any] | None = None
    error: str | None = None
    retry_after: str | None = None

    async def send(self, http: httpx.AsyncClient) -> None:
        await asyncio.sleep(self.delay)
        headers = {"Idempotency-Key": self.key} if self.key else {}
        body: dict[str, Any] = {"payload": {"qty": 1}, "actor": self.actor}
        if self.strategy is not None:
            body["strategy"] = self.strategy
        try:
            answer = await http.post(
                f"/instances/{self.instance}/events/reserve", headers=headers, json=body
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


def held_calls() -> list[Call]:
    """One request per held instance, pessimistic: each waits for its own row lock on a
    connection of its own (a pessimistic call that finds its row held waits alone, never in a
    batch or a pipelined group), so PostgreSQL shows one waiting session per held request."""
    return [
        Call(f"held-{i}", f"held-{i}", f"held-{i}", strategy="pessimistic") for i in range(HELD)
    ]


async def test_sigterm_in_a_storm_drains_and_exits_clean(pg_url: str, database: str) -> None:
    """SIGTERM in a storm, with HELD requests waiting in PostgreSQL: every answer is a success,
    a refusal or a connection error (none hangs, none is a 500), the held requests are drained
    (answered 200 and applied), history is exactly once, and the service exits 0 within its
    drain bound, its sessions closed and its metrics directory removed."""
    with Services() as services:
        server = services.start(
            "--database-url", database, "--drain-timeout", str(DRAIN),
            "--pool-size", str(POOL), workers=WORKERS,
        )  # fmt: skip
        [metrics_dir] = server.metrics_dirs()
        calls = storm()
        held = held_calls()
        instances = [*(f"sku-{i}" for i in range(INSTANCES)), *(c.instance for c in held)]
        limits = httpx.Limits(max_connections=REQUESTS, max_keepalive_connections=REQUESTS)
        async with httpx.AsyncClient(
            base_url=server.url, limits=limits, timeout=DRAIN + MARGIN
        ) as http:
            for name in instances:
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
                """Mid-storm, with HELD requests waiting in PostgreSQL for the test's row
                locks: SIGTERM; once both workers are shutting down (the held requests still
                waiting), let go of the rows while the workers drain."""
                await half_way.wait()
                async with row_locks(database, [c.instance for c in held]) as holder:
                    waiting = [asyncio.create_task(c.send(http)) for c in held]
                    await lock_waiters(pg_url, database_name(database), holder, HELD)
                    signalled = server.terminate()
                    await logged(server, SHUTTING_DOWN, WORKERS)
                    assert not any(w.done() for w in waiting), held
                    await lock_waiters(pg_url, database_name(database), holder, HELD)
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
        assert log.count(STOPPED) == WORKERS, log[-4000:]  # each lifespan closed its engine
        await no_session_left(pg_url, database_name(database))

        timeouts = [c for c in calls if c.error and c.error.startswith("timeout")]
        assert not timeouts, timeouts
        bad = [c for c in calls if c.status is not None and not ok_status(c.status, c.retry_after)]
        assert not bad, bad
        # The requests in flight when the signal came were drained: answered, and applied.
        assert [(c.status, c.error) for c in held] == [(200, None)] * HELD
        assert all(c.body and c.body["applied"] for c in held), [c.body for c in held]
        calls += held
        found = await read_back(database, instances)
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
async def row_locks(database: str, instance_ids: list[str]) -> AsyncIterator[int]:
    """The instances' rows locked (FOR UPDATE) by one session of the test, whose pid it yields:
    the service's pessimistic calls on them wait until the block ends."""
    conn = await connect(database)
    try:
        async with conn.transaction():
            locked = await conn.fetch(
                "SELECT id FROM flowlock_instances WHERE id = ANY($1::text[]) FOR UPDATE",
                instance_ids,
            )
            assert len(locked) == len(instance_ids), locked
            yield conn.get_server_pid()
    finally:
        await conn.close()


async def lock_waiters(server_url: str, database: str, holder: int, count: int) -> None:
    """Until ``count`` sessions of the service on ``database`` wait for a lock that the session
    ``holder`` holds (bounded): each held request has reached a worker and waits there."""
    conn = await connect(server_url)
    try:
        deadline = time.monotonic() + WAIT
        while True:
            waiting = await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = $1"
                " AND application_name = 'flowlock' AND $2 = ANY(pg_blocking_pids(pid))",
                database,
                holder,
            )
            if waiting >= count:
                return
            assert time.monotonic() < deadline, f"{waiting} of {count} held requests wait"
            await asyncio.sleep(0.05)
    finally:
        await conn.close()


async def logged(server: Served, line: str, count: int) -> None:
    """Until the service's log holds ``line`` ``count`` times (bounded)."""
    deadline = time.monotonic() + WAIT
    while (seen := server.output().count(line)) < count:
        assert time.monotonic() < deadline, f"{line!r} logged {seen} of {count} times"
        await asyncio.sleep(0.05)


def ok_status(status: int, retry_after: str | None) -> bool:
    return 200 <= status < 300 or 400 <= status < 500 or (status == 503 and retry_after == "1")


async def no_session_left(server_url: str, database: str) -> None:
    """The service's sessions ("flowlock") are gone from pg_stat_activity (bounded wait: a
    backend leaves the view a moment after its client said goodbye)."""
    deadline = time.monotonic() + 10.0
    while (left := await sessions(server_url, database, "flowlock")) > 0:
        assert time.monotonic() < deadline, f"{left} sessions of the service are still open"
        await asyncio.sleep(0.1)
