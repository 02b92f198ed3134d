"""Every 5xx answer of ``flowlock serve``, provoked for real on a running server (issue 22, item 2).

One server (one worker) on a fresh database, serving ``hooked_app``'s workflows:

- ``conflict-retries-exhausted``: each time the service's step runs, the test commits a
  competing transition before letting it write, so all three compare-and-swaps lose;
- ``lock-timeout``: the test holds the instance's row FOR UPDATE past the store's lock_timeout;
- ``connection-lost``: the service's session is terminated (pg_terminate_backend) while it waits
  for the row lock in a pessimistic transaction, before anything was written;
- ``outcome-unknown``: the service's session is terminated while its write (the optimistic
  compare-and-swap, an autocommit statement) is on its way, waiting for the row lock;
- ``step-failed``: a step raises (500).

Each answer is an RFC 9457 problem of that type, a 503 carries ``Retry-After``, and no body names
the database, its host or port, or what the step's error said. A retry with the same
Idempotency-Key then applies once (the checker reads the history). The 503s of the service's
pool (store-busy) and of a closing engine (engine-closed) are in
tests/service/test_service_5xx_pg.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from hooked_app import SECRET, workflows
from serve_harness import SRC, Served, Services, database_name, fresh_database, read_back

import flowlock
import pg_budget
from flowlock.checker import check

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
PROBLEM = "urn:flowlock:problem:"


@pytest.fixture(scope="module")
def database(pg_url: str) -> Iterator[str]:
    with fresh_database(pg_url) as url:
        yield url


@pytest.fixture(scope="module")
def hook_socket() -> Iterator[str]:
    """Where the hooked step calls the test (a path the test binds when it wants the calls)."""
    home = tempfile.mkdtemp(prefix="fl-hook-")
    path = os.path.join(home, "hook.sock")
    yield path
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    os.rmdir(home)


@pytest.fixture(scope="module")
def server(database: str, hook_socket: str) -> Iterator[Served]:
    env = {"PYTHONPATH": os.pathsep.join([str(SRC), str(HERE)]), "HOOK_SOCKET": hook_socket}
    with Services() as services:
        yield services.start("--database-url", database, "--app", "hooked_app:workflows", env=env)


@pytest.fixture
async def http(server: Served) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=server.url, timeout=60.0) as client:
        yield client


@pytest.fixture
async def own_engine(database: str) -> AsyncIterator[flowlock.Engine]:
    """The test's engine on the service's database (its sessions named apart)."""
    async with flowlock.Engine.connect(
        database, max_size=2, application_name="svcproc-test"
    ) as engine:
        for wf in workflows():
            await engine.register(wf)
        yield engine


def assert_problem_5xx(answer: httpx.Response, status: int, slug: str, database: str) -> Any:
    """``answer`` is the problem ``slug``: ``Retry-After: 1`` on a 503 (none on a 500), and
    nothing in it that names the database server or repeats the step's error."""
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    body = answer.json()
    assert body["type"] == PROBLEM + slug and body["status"] == status, body
    if status == 503:
        assert answer.headers.get("retry-after") == "1", answer.headers
    else:
        assert "retry-after" not in answer.headers
    text = answer.text
    for secret in (database_name(database), "127.0.0.1", "5432", "postgres", *SECRET.split()):
        assert secret not in text, (secret, text)
    return body


async def create_counter(http: httpx.AsyncClient, instance_id: str) -> None:
    made = await http.post("/instances", json={"workflow": "counter", "id": instance_id})
    assert made.status_code == 201, made.text


async def fire(
    http: httpx.AsyncClient, instance_id: str, event: str, key: str, **body: Any
) -> httpx.Response:
    return await http.post(
        f"/instances/{instance_id}/events/{event}", json=body, headers={"Idempotency-Key": key}
    )


async def exactly_once(database: str, instance_id: str, keys: list[str]) -> None:
    """The instance passes the checker, each of ``keys`` is in its history once."""
    [(inst, history)] = (await read_back(database, [instance_id])).values()
    verdict = check(inst, history, initial_state="on")
    assert verdict.ok, verdict.violations
    found = [e.request_id for e in history if e.request_id is not None]
    assert sorted(found) == sorted(keys), found


@asynccontextmanager
async def row_lock(database: str, instance_id: str) -> AsyncIterator[None]:
    """The instance's row held FOR UPDATE by a session of the test until the block ends."""
    conn = await pg_budget.connect(database)
    try:
        async with conn.transaction():
            await conn.execute(
                "SELECT 1 FROM flowlock_instances WHERE id = $1 FOR UPDATE", instance_id
            )
            yield
    finally:
        await conn.close()


async def lock_waiter(pg_url: str, database: str) -> int:
    """The backend pid of the service's session waiting for a lock (a bounded wait)."""
    conn = await pg_budget.connect(pg_url)
    try:
        for _ in range(1000):
            pid = await conn.fetchval(
                "SELECT pid FROM pg_stat_activity WHERE datname = $1"
                " AND application_name = 'flowlock' AND wait_event_type = 'Lock'",
                database_name(database),
            )
            if pid is not None:
                return int(pid)
            await asyncio.sleep(0.01)
        raise AssertionError("no session of the service waits for the row lock")
    finally:
        await conn.close()


async def terminate(pg_url: str, pid: int) -> None:
    conn = await pg_budget.connect(pg_url)
    try:
        assert await conn.fetchval("SELECT pg_terminate_backend($1)", pid)
    finally:
        await conn.close()


async def test_every_compare_and_swap_lost_is_503_conflict_retries_exhausted(
    http: httpx.AsyncClient, own_engine: flowlock.Engine, database: str, hook_socket: str
) -> None:
    """Three real lost compare-and-swaps (the test commits a transition between the service's
    read and its write, each time) are 503 conflict-retries-exhausted with attempts 3; the
    retry under the same key, uncontended, applies once."""
    await create_counter(http, "c")
    compete = True
    seen: list[int] = []

    async def on_step(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(int(await reader.readline()))
        if compete:
            out = await own_engine.fire("c", "tick", request_id=f"tick-{len(seen)}")
            assert out.applied
        writer.write(b"g")
        await writer.drain()
        writer.close()

    hook = await asyncio.start_unix_server(on_step, path=hook_socket)
    try:
        answer = await fire(http, "c", "hooked", "hooked-1")
        body = assert_problem_5xx(answer, 503, "conflict-retries-exhausted", database)
        assert (body["attempts"], body["instance_id"], body["event"]) == (3, "c", "hooked")
        assert seen == [1, 2, 3]  # each attempt read the version the last competitor left
        compete = False
        again = await fire(http, "c", "hooked", "hooked-1")
        assert again.status_code == 200, again.text
        assert again.json()["applied"] is True and again.json()["instance"]["version"] == 5
    finally:
        hook.close()
        await hook.wait_closed()
    await exactly_once(database, "c", ["tick-1", "tick-2", "tick-3", "hooked-1"])


async def test_a_row_lock_held_past_lock_timeout_is_503_lock_timeout(
    http: httpx.AsyncClient, database: str
) -> None:
    """The test holds the row FOR UPDATE: the service's write waits its lock_timeout (5 s) and
    answers 503 lock-timeout, nothing applied; once the lock is gone the retry applies."""
    await create_counter(http, "l")
    async with row_lock(database, "l"):
        answer = await fire(http, "l", "tick", "tick-l")
    body = assert_problem_5xx(answer, 503, "lock-timeout", database)
    assert body["key"] == "l"
    again = await fire(http, "l", "tick", "tick-l")
    assert again.status_code == 200 and again.json()["applied"] is True, again.text
    await exactly_once(database, "l", ["tick-l"])


@pytest.mark.parametrize(
    ("strategy", "slug"),
    [("pessimistic", "connection-lost"), ("optimistic", "outcome-unknown")],
)
async def test_a_session_terminated_under_a_request_is_503(
    http: httpx.AsyncClient, pg_url: str, database: str, strategy: str, slug: str
) -> None:
    """The service's session is terminated while the request waits for the row lock: in a
    pessimistic transaction (nothing sent to commit yet) that is 503 connection-lost; in the
    optimistic compare-and-swap (an autocommit write already sent) 503 outcome-unknown. The
    retry with the same key, the lock gone, applies once."""
    iid = f"t-{strategy}"
    await create_counter(http, iid)
    async with row_lock(database, iid):
        sent = asyncio.create_task(fire(http, iid, "tick", iid, strategy=strategy))
        await terminate(pg_url, await lock_waiter(pg_url, database))
        answer = await sent
    assert_problem_5xx(answer, 503, slug, database)
    again = await fire(http, iid, "tick", iid, strategy=strategy)
    assert again.status_code == 200 and again.json()["applied"] is True, again.text
    # And the service's pool recovered: the next call on a fresh session is answered.
    assert (await http.get(f"/instances/{iid}")).json()["version"] == 2
    await exactly_once(database, iid, [iid])


async def test_a_raising_step_is_500_step_failed(http: httpx.AsyncClient, database: str) -> None:
    """A step that raises is 500 step-failed, without Retry-After and without the error's text;
    nothing is applied."""
    await create_counter(http, "b")
    answer = await fire(http, "b", "boom", "boom-1")
    body = assert_problem_5xx(answer, 500, "step-failed", database)
    assert (body["instance_id"], body["event"], body["version"]) == ("b", "boom", 1)
    await exactly_once(database, "b", [])
