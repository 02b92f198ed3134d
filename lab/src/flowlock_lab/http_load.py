"""The `--http` load generator: `python -m flowlock_lab.http_load BASE_URL`.

It runs in its own process and speaks the bench workers' protocol on stdin and stdout
(`flowlock.bench.procs`): the runner arms it with a round's callers, releases them, and
gets every call's result back. Each call is one HTTP/1.1 request on a keep-alive connection
of its own caller, written and read with plain asyncio streams: no HTTP library, so a
request costs this process little and the service's cost is what the rows measure.
docs/benchmarks.md ("Through HTTP") describes the setup.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import quote, urlsplit

from flowlock.bench.measure import Armed
from flowlock.bench.procs import (
    Arm,
    ArmedReply,
    Close,
    Closed,
    Done,
    Go,
    Open,
    Opened,
    Reply,
    Request,
)
from flowlock.bench.results import CallSpec
from flowlock.bench.scenarios import SCENARIOS, Fired, Scenario
from flowlock.bench.worker import serve
from flowlock.engine import Engine
from flowlock_lab.http import KEEPALIVE, REQUEST_TIMEOUT, failure

__all__ = ["Connections", "LoadSession", "main"]


class _Closed(Exception):
    """The server closed the connection: it answered nothing more on it."""


class _Connection:
    """One keep-alive HTTP/1.1 connection, one request at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.used = time.monotonic()
        self.open = True

    async def request(self, data: bytes) -> tuple[int, dict[str, str], bytes]:
        self.writer.write(data)
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            self.open = False
            raise _Closed("the service closed the connection before answering") from None
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        if "content-length" in headers:
            body = await self.reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            body = await self._chunked()
        else:
            body = await self.reader.read()
            self.open = False
        if headers.get("connection", "").lower() == "close":
            self.open = False
        self.used = time.monotonic()
        return status, headers, body

    async def _chunked(self) -> bytes:
        parts: list[bytes] = []
        while True:
            size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await self.reader.readuntil(b"\r\n")  # no trailers are sent
                return b"".join(parts)
            parts.append(await self.reader.readexactly(size))
            await self.reader.readexactly(2)

    def close(self) -> None:
        self.open = False
        self.writer.close()


class Connections:
    """Keep-alive connections to the service, one per caller at a time, kept across rounds.

    A connection idle for `KEEPALIVE` seconds is closed instead of reused: the service
    closes idle ones after 5, and a request must never meet a connection being closed.
    """

    def __init__(self, base_url: str) -> None:
        parts = urlsplit(base_url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self._host_header = f"Host: {parts.netloc}\r\n".encode("latin-1")
        self._free: list[_Connection] = []
        self._all: list[_Connection] = []

    def encode(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> bytes:
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        length = f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        start = f"{method} {path} HTTP/1.1\r\n".encode("latin-1")
        return start + self._host_header + (length + extra + "\r\n").encode("latin-1") + body

    async def _take(self) -> _Connection:
        while self._free:
            conn = self._free.pop()
            if conn.open and time.monotonic() - conn.used < KEEPALIVE:
                return conn
            conn.close()
        reader, writer = await asyncio.open_connection(self.host, self.port)
        conn = _Connection(reader, writer)
        self._all.append(conn)
        return conn

    async def send(self, data: bytes) -> tuple[int, dict[str, str], bytes]:
        """One request on a connection no other call uses; its status, headers and body."""
        conn = await self._take()
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT):
                answer = await conn.request(data)
        except BaseException:
            conn.close()
            raise
        self._free.append(conn)
        return answer

    def close(self) -> None:
        for conn in self._all:
            conn.close()
        self._all.clear()
        self._free.clear()


def _header_int(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() else None


class LoadSession:
    """One strategy through the service, in the load generator: each `fire` is a request.

    It has no engine: the runner's admin session sets up and reads back."""

    def __init__(self, strategy: str, connections: Connections) -> None:
        self._strategy = strategy
        self._connections = connections

    @property
    def strategy(self) -> str:
        return self._strategy

    @property
    def engine(self) -> Engine:
        raise RuntimeError("the load generator has no engine: the runner sets up and reads back")

    @property
    def pool(self) -> Any:
        raise RuntimeError("the load generator has no pool: the runner sets up and reads back")

    @property
    def lease_wait(self) -> float:
        return 0.0  # any lease is the service's

    async def fire(self, call: CallSpec) -> Fired:
        body: dict[str, Any] = {"strategy": self._strategy}
        if call.actor is not None:
            body["actor"] = call.actor
        if call.payload is not None:
            body["payload"] = dict(call.payload)
        headers = {"Idempotency-Key": call.request_id} if call.request_id is not None else {}
        path = f"/instances/{quote(call.instance_id, safe='')}/events/{quote(call.event, safe='')}"
        data = self._connections.encode("POST", path, json.dumps(body).encode(), headers)
        status, answer_headers, raw = await self._connections.send(data)
        if status != 200:
            try:
                doc: object = json.loads(raw)
            except ValueError:
                doc = raw.decode(errors="replace")
            raise failure(status, doc)
        answer = json.loads(raw)
        return Fired(
            "applied" if answer["applied"] else "idempotent",
            _header_int(answer_headers.get("flowlock-attempts")) or 1,
            _header_int(answer_headers.get("flowlock-batch-size")),
        )

    async def run_once(self, job: str, tick: int, fn: Callable[[], Awaitable[None]]) -> bool | None:
        return None  # no scenario --http runs has jobs


class _Load:
    """The worker protocol's side in the load generator: Open names the strategy and
    scenario, Arm parks a round's callers, Go releases them, Close forgets the pair."""

    def __init__(self, base_url: str) -> None:
        self._connections = Connections(base_url)
        self._session: LoadSession | None = None
        self._scenario: Scenario | None = None
        self._armed: Armed | None = None

    async def handle(self, request: Request) -> Reply:
        match request:
            case Open():
                self._scenario = SCENARIOS[request.scenario]
                self._session = LoadSession(request.strategy, self._connections)
                return Opened()
            case Arm():
                if self._session is None or self._scenario is None:
                    raise RuntimeError("arm before open")
                self._armed = Armed(self._scenario, self._session, request.lanes)
                await self._armed.ready()
                return ArmedReply()
            case Go():
                if self._armed is None:
                    raise RuntimeError("go before arm")
                armed, self._armed = self._armed, None
                results, wall = await armed.go()
                return Done(tuple(results), wall, 0.0)
            case Close():
                self._session = self._scenario = None
                return Closed()
        raise RuntimeError(f"unexpected request {request!r}")

    async def close(self) -> None:
        armed, self._armed = self._armed, None
        if armed is not None:
            await armed.cancel()
        self._connections.close()


def main() -> None:
    """Serve the runner's requests for the service at `sys.argv[1]` until stdin closes."""
    base_url = sys.argv[1]
    serve(lambda: _Load(base_url))


if __name__ == "__main__":
    main()
