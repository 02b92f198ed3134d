"""A retry with the same Idempotency-Key at the other worker, while the first request is still
running, waits and answers what the first answered (issue 22, item 2; the create half is item 7).

``flowlock serve --workers 2``. The first request is held open on a lock the test holds (the
instance's row FOR UPDATE for an event; for a create, the create key inserted by an uncommitted
transaction of the test). Its retry is sent to the other worker: uvicorn's workers accept from
one shared socket, so which worker gets a connection is the kernel's choice. The test opens a
connection, finds the worker that accepted it (the process whose file descriptors hold the
server side of that TCP connection, looked up in /proc), and opens more until one lands on the
other worker; only then does it send the retry on it. Both requests are then seen waiting for
locks in pg_stat_activity, the test lets go, and both answers are compared: same status, same
body, one row in the history (or one instance), and the checker agrees.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_harness import Served, Services, database_name, fresh_database, read_back

import flowlock
import pg_budget
from flowlock._inspect import check_instances
from flowlock.checker import check

pytestmark = pytest.mark.slow

FIND_TRIES = 64  # connections opened at most to land one on the other worker


@pytest.fixture(scope="module")
def database(pg_url: str) -> Iterator[str]:
    with fresh_database(pg_url) as url:
        yield url


@pytest.fixture(scope="module")
def server(database: str) -> Iterator[Served]:
    with Services() as services:
        yield services.start("--database-url", database, workers=2)


@dataclass
class Raw:
    """One HTTP/1.1 connection of its own, so the test knows which worker holds it."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    worker: int

    async def send(self, path: str, body: dict[str, Any], key: str) -> None:
        data = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nIdempotency-Key: {key}\r\nConnection: close\r\n\r\n"
        )
        self.writer.write(head.encode() + data)
        await self.writer.drain()

    async def answer(self) -> tuple[int, dict[str, str], Any]:
        """Status, headers (lower-case names) and JSON body; the server closes after it."""
        raw = await asyncio.wait_for(self.reader.read(), 30.0)
        self.writer.close()
        head, _, body = raw.partition(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines)}
        return int(status_line.split()[1]), headers, json.loads(body)

    def close(self) -> None:
        self.writer.close()


def _server_side_inode(server_port: int, client_port: int) -> str | None:
    """The socket inode of the server's end of the loopback connection from ``client_port``."""
    want_local, want_remote = f":{server_port:04X}", f":{client_port:04X}"
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1].endswith(want_local) and fields[2].endswith(want_remote):
            return fields[9]
    return None


def _descendants(root: int) -> list[int]:
    """The processes below ``root`` (its workers), from each process's parent in /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                # The command name, in parentheses, may hold spaces: the fields after it are fixed.
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            parents[int(entry.name)] = int(fields[1])
    found, frontier = [], [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent]
        found += children
        frontier += children
    return found


def _holder(pids: list[int], inode: str) -> int | None:
    target = f"socket:[{inode}]"
    for pid in pids:
        fds = Path(f"/proc/{pid}/fd")
        try:
            names = os.listdir(fds)
        except OSError:
            continue
        for fd in names:
            try:
                if os.readlink(fds / fd) == target:
                    return pid
            except OSError:
                continue
    return None


async def connect(server: Served) -> Raw:
    """A new connection and the pid of the worker that accepted it (a bounded wait: the worker
    accepts it from the shared socket's queue a moment after the handshake)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    client_port = writer.get_extra_info("sockname")[1]
    pids = _descendants(server.pid)
    for _ in range(500):
        inode = _server_side_inode(server.port, client_port)
        holder = None if inode is None or inode == "0" else _holder(pids, inode)
        if holder is not None:
            return Raw(reader, writer, holder)
        await asyncio.sleep(0.01)
    writer.close()
    raise AssertionError(f"no worker of {pids} accepted the connection from port {client_port}")


async def connect_elsewhere(server: Served, not_this: int) -> Raw:
    """A connection accepted by a worker other than ``not_this``."""
    for _ in range(FIND_TRIES):
        raw = await connect(server)
        if raw.worker != not_this:
            return raw
        raw.close()
    raise AssertionError(f"{FIND_TRIES} connections all landed on worker {not_this}")


async def lock_waiters(pg_url: str, database: str, count: int) -> None:
    """Until ``count`` sessions of the service wait for a lock (a bounded wait)."""
    conn = await pg_budget.connect(pg_url)
    try:
        for _ in range(1000):
            waiting = await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = $1"
                " AND application_name = 'flowlock' AND wait_event_type = 'Lock'",
                database_name(database),
            )
            if waiting >= count:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"{count} request(s) of the service never waited for the lock")
    finally:
        await conn.close()


@asynccontextmanager
async def own_engine(database: str) -> AsyncIterator[flowlock.Engine]:
    async with flowlock.Engine.connect(
        database, max_size=2, application_name="svcproc-test"
    ) as engine:
        await engine.register(flowlock.examples.inventory())
        yield engine


async def test_an_event_retried_at_the_other_worker_while_the_first_waits_answers_the_same(
    server: Served, database: str, pg_url: str
) -> None:
    """The first reserve (key K) waits for the row lock the test holds in worker A; its retry,
    sent to worker B, waits too; the lock released, both answer 200 with the same body (one of
    them marked replayed) and the history holds one row for K."""
    async with httpx.AsyncClient(base_url=server.url, timeout=30.0) as http:
        made = await http.post(
            "/instances", json={"workflow": "inventory", "id": "r", "data": {"stock": 10}}
        )
        assert made.status_code == 201, made.text
    request = ("/instances/r/events/reserve", {"payload": {"qty": 2}}, "order-7")
    conn = await pg_budget.connect(database)
    try:
        tx = conn.transaction()
        await tx.start()
        await conn.execute("SELECT 1 FROM flowlock_instances WHERE id = 'r' FOR UPDATE")
        first = await connect(server)
        await first.send(*request)
        await lock_waiters(pg_url, database, 1)
        retry = await connect_elsewhere(server, first.worker)
        await retry.send(*request)
        await lock_waiters(pg_url, database, 2)
        await tx.commit()
    finally:
        await conn.close()
    (s1, h1, b1), (s2, h2, b2) = await asyncio.gather(first.answer(), retry.answer())
    assert first.worker != retry.worker
    assert (s1, s2) == (200, 200), (b1, b2)
    assert b1 == b2 and b1["applied"] is True and b1["request_id"] == "order-7"
    # One applied it, the other found it applied and replayed its answer.
    assert {h1.get("idempotent-replayed"), h2.get("idempotent-replayed")} == {"true", None}
    assert h1["etag"] == h2["etag"] == '"2"'
    [(inst, history)] = (await read_back(database, ["r"])).values()
    assert [e.request_id for e in history] == ["order-7"]
    verdict = check(inst, history, initial_state="open", expected_applied=1)
    assert verdict.ok, verdict.violations
    assert dict(inst.data) == {"stock": 8, "reserved": 2}


async def test_a_create_retried_at_the_other_worker_while_the_first_waits_answers_the_same(
    server: Served, database: str, pg_url: str
) -> None:
    """The first create (key C, no id) waits in worker A for the key the test's uncommitted
    create holds; its retry, at worker B, waits for A's insert. The test rolls back: both answer
    201 with the same body, and there is one instance, made under C."""
    request = ("/instances", {"workflow": "inventory", "data": {"stock": 3}}, "create-C")
    async with own_engine(database) as engine:
        conn = await pg_budget.connect(database)
        try:
            tx = conn.transaction()
            await tx.start()
            await engine.create(
                "inventory", instance_id="placeholder", request_id="create-C", connection=conn
            )
            first = await connect(server)
            await first.send(*request)
            await lock_waiters(pg_url, database, 1)
            retry = await connect_elsewhere(server, first.worker)
            await retry.send(*request)
            await lock_waiters(pg_url, database, 2)
            await tx.rollback()
        finally:
            await conn.close()
        (s1, h1, b1), (s2, h2, b2) = await asyncio.gather(first.answer(), retry.answer())
        assert first.worker != retry.worker
        assert (s1, s2) == (201, 201), (b1, b2)
        assert b1 == b2 and b1["version"] == 1 and b1["data"] == {"stock": 3}
        assert h1["location"] == h2["location"] and h1["etag"] == h2["etag"]
        made = [i for i in await engine.list(workflow="inventory") if i.id != "r"]
        assert [i.id for i in made] == [b1["id"]]
        assert await engine.store.create_request(b1["id"]) == ("create-C", made[0])
        report = await check_instances(engine, None)
        assert report.verdict.ok, report.verdict.violations
