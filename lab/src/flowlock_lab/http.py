"""Calls through the service for `flowlock bench --http`.

`running_service` runs `flowlock serve` for the run, and `HttpSession`
makes each call an HTTP request to it. docs/benchmarks.md describes the setup.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import asyncpg

from flowlock.bench.config import Target
from flowlock.bench.measure import RemoteFailure
from flowlock.bench.progress import Progress
from flowlock.bench.results import CallSpec
from flowlock.bench.scenarios import Fired
from flowlock.bench.session import BenchSession
from flowlock.core import errors
from flowlock.core.errors import InvalidInput
from flowlock.core.install import pip_install
from flowlock.embedded.errors import EmbeddedServerError
from flowlock.engine import Engine

if TYPE_CHECKING:
    import httpx

__all__ = [
    "SERVICE_APP",
    "HttpCallers",
    "HttpSession",
    "Service",
    "check_http_support",
    "running_service",
    "service_url",
]

SERVICE_APP = "flowlock_lab.http_app:workflows"
"""What the service serves (`--app`): the workflows of the scenarios `--http` runs."""
START_TIMEOUT = 60.0
"""Seconds the service gets to answer `/livez` (imports, uvicorn, the engine's pool and
migration check), generous for a busy 2-core machine."""
STOP_TIMEOUT = 15.0
"""Seconds SIGTERM gets to stop the service (it drains for at most `DRAIN` of them)."""
DRAIN = 3
"""The service's `--drain-timeout`: no call is in flight when the bench stops it."""
REQUEST_TIMEOUT = 60.0
"""Seconds one request may take: far beyond the service's own bounds (5 s for a lock, 10 s for
a pooled connection), so a timeout here means the service is stuck, not busy."""
KEEPALIVE = 4.0
"""Seconds the client keeps an idle connection: below uvicorn's 5, so the client never reuses a
connection the server is closing."""
_PROBLEM = "urn:flowlock:problem:"


def check_http_support() -> None:
    """Raise InvalidInput, before anything starts, when httpx (the bench extra) is missing."""
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise InvalidInput(f"--http needs httpx for its callers: {pip_install('bench')}") from None


def service_url(url: str, schema: str) -> str:
    """`url` with `schema` as every connection's `search_path`.

    asyncpg passes unknown query parameters to the server as settings.
    So the service's tables are the run's.
    """
    parts = urlsplit(url)
    given = parse_qsl(parts.query, keep_blank_values=True)
    query = [(k, v) for k, v in given if k != "search_path"] + [("search_path", schema)]
    return urlunsplit(parts._replace(query=urlencode(query)))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass(frozen=True, slots=True)
class Service:
    """A running service: where it listens, its process, and how it was started."""

    base_url: str
    pid: int
    workers: int
    pool_size: int
    """PostgreSQL connections per worker process."""

    def to_json(self) -> dict[str, Any]:
        return {
            "command": f"flowlock serve --workers {self.workers} --pool-size {self.pool_size} "
            f"--app {SERVICE_APP} --strategy pessimistic --log-level warning",
            "workers": self.workers,
            "pool_size": self.pool_size,
        }


def _environment(url: str) -> dict[str, str]:
    # None of the caller's service settings may steer the bench's service (a FLOWLOCK_API_TOKEN
    # would refuse every call): only the database, given here.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("FLOWLOCK_") and k != "PROMETHEUS_MULTIPROC_DIR"
    }
    env["FLOWLOCK_DATABASE_URL"] = url
    return env


def _tail(log: IO[bytes], lines: int = 30) -> str:
    log.flush()
    log.seek(0)
    text = log.read().decode(errors="replace")
    return "\n".join(text.splitlines()[-lines:])


def _signal_group(pid: int, sig: int) -> bool:
    """Send `sig` to the service's process group; False when none of it is left.

    The service runs in its own session, so only its processes are hit.
    """
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        return False
    return True


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the service, wait, then SIGKILL what is left of its group; reap the process.

    On SIGTERM uvicorn stops its workers and drains.
    """
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(STOP_TIMEOUT)
    deadline = time.monotonic() + 2.0
    # A worker may outlive its supervisor for a moment; none may outlive the run.
    while _signal_group(proc.pid, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    _signal_group(proc.pid, signal.SIGKILL)
    proc.wait()


async def _wait_live(proc: subprocess.Popen[bytes], base_url: str, log: IO[bytes]) -> None:
    import httpx

    deadline = time.monotonic() + START_TIMEOUT
    async with httpx.AsyncClient(base_url=base_url, timeout=2.0, trust_env=False) as client:
        while True:
            if proc.poll() is not None:
                raise EmbeddedServerError(
                    "flowlock service",
                    f"flowlock serve exited with code {proc.returncode} before answering /livez",
                    details=_tail(log),
                    advice="read the service's output above; `flowlock serve --database-url "
                    "...` reproduces it",
                )
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get("/livez")).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise EmbeddedServerError(
                    "flowlock service",
                    f"flowlock serve did not answer /livez within {START_TIMEOUT:.0f} s",
                    details=_tail(log),
                    advice="the machine may be overloaded; read the service's output above",
                )
            await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def running_service(
    target: Target, *, workers: int, pool_size: int, progress: Progress
) -> AsyncIterator[Service]:
    """Run `flowlock serve` on the run's database and schema until the block ends.

    It has `workers` worker processes of `pool_size` connections each.
    It listens on a free port of 127.0.0.1 and is ready once `/livez` answers.
    It stops also on errors and Ctrl-C.
    The URL goes in the environment: argv is visible to every user and may show a password.
    """
    port = _free_port()
    argv = [
        sys.executable, "-m", "flowlock", "serve",
        "--host", "127.0.0.1", "--port", str(port),
        "--workers", str(workers), "--pool-size", str(pool_size),
        "--app", SERVICE_APP,
        # Every call names its strategy; the default only decides the startup safety warnings,
        # as in the bench's own engines.
        "--strategy", "pessimistic",
        "--drain-timeout", str(DRAIN),
        "--log-level", "warning",
    ]  # fmt: skip
    progress.status(f"starting flowlock serve ({workers} worker(s)) on port {port}")
    base_url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        # Started on the loop, not in a thread: a cancellation (Ctrl-C) must not land between
        # the start and the try that stops it. Popen returns once the child is forked.
        proc = subprocess.Popen(  # noqa: ASYNC220
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_environment(service_url(target.url, target.schema)),
            start_new_session=True,  # its own process group: stopped as one, never ours
        )
        try:
            await _wait_live(proc, base_url, log)
            yield Service(base_url, proc.pid, workers, pool_size)
            progress.status("stopping flowlock serve")
        finally:
            # In a thread: waiting for the drain must not block the loop; shielded from a
            # second Ctrl-C so the service is never left running.
            stopping = asyncio.ensure_future(asyncio.to_thread(_stop, proc))
            try:
                await asyncio.shield(stopping)
            except asyncio.CancelledError:
                await stopping
                raise


def _client(base_url: str) -> httpx.AsyncClient:
    import httpx

    return httpx.AsyncClient(
        base_url=base_url,
        limits=httpx.Limits(max_connections=1, keepalive_expiry=KEEPALIVE),
        timeout=httpx.Timeout(REQUEST_TIMEOUT, connect=10.0),
        trust_env=False,
    )


class HttpCallers:
    """One `httpx.AsyncClient` per concurrent caller, as independent clients would be.

    Each has one keep-alive HTTP/1.1 connection and no proxy from the environment.
    Its timeout is reached only by a stuck service.
    One shared client would cost more CPU per request as requests queue (encode/httpx#3215).
    On shared cores that cost would be billed to HTTP.
    A call takes a free client and gives it back when answered.
    """

    def __init__(self, base_url: str, count: int) -> None:
        self._base_url = base_url
        self._all = [_client(base_url) for _ in range(count)]
        self._free = list(self._all)

    @contextlib.asynccontextmanager
    async def one(self) -> AsyncIterator[httpx.AsyncClient]:
        """A client no other call is using, until the block ends."""
        if not self._free:  # more calls at once than callers: not in a bench round
            self._all.append(_client(self._base_url))
            self._free.append(self._all[-1])
        client = self._free.pop()
        try:
            yield client
        finally:
            self._free.append(client)

    async def aclose(self) -> None:
        for client in self._all:
            await client.aclose()

    async def __aenter__(self) -> HttpCallers:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


def _error_name(slug: str) -> str:
    """The flowlock error a problem type names, as the in-process rows name errors.

    For example `conflict-retries-exhausted` becomes `ConflictRetriesExhausted`.
    """
    return "".join(part.capitalize() for part in slug.split("-"))


def _refused(name: str) -> bool:
    found = getattr(errors, name, None)
    return isinstance(found, type) and issubclass(found, errors.TransitionRefused)


def failure(status: int, doc: object) -> RemoteFailure:
    """What a non-200 answer means for the report: the error it names, refused or failed.

    A body that is no problem document is named `HTTP <status>`.
    """
    if isinstance(doc, dict) and str(doc.get("type", "")).startswith(_PROBLEM):
        name = _error_name(str(doc["type"])[len(_PROBLEM) :])
        attempts = doc.get("attempts")
        detail = str(doc.get("detail", ""))
        return RemoteFailure(
            name,
            f"HTTP {status}: {detail}",
            refused=_refused(name),
            attempts=attempts if isinstance(attempts, int) else 1,
        )
    return RemoteFailure(f"HTTP {status}", f"HTTP {status}: {str(doc)[:200]}")


def _header_int(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() else None


class HttpSession:
    """One strategy through the service: each `fire` is one HTTP request.

    Setup and readback use `admin`'s engine and pool in this process, untimed.
    """

    def __init__(self, strategy: str, admin: BenchSession, callers: HttpCallers) -> None:
        self._strategy = strategy
        self._admin = admin
        self._callers = callers

    @property
    def strategy(self) -> str:
        return self._strategy

    @property
    def engine(self) -> Engine:
        return self._admin.engine

    @property
    def pool(self) -> asyncpg.Pool:
        return self._admin.pool

    @property
    def lease_wait(self) -> float:
        return 0.0  # any lease is the service's

    async def fire(self, call: CallSpec) -> Fired:
        body: dict[str, Any] = {"strategy": self._strategy}
        if call.actor is not None:
            body["actor"] = call.actor
        if call.payload is not None:
            body["payload"] = dict(call.payload)
        headers = {"Idempotency-Key": call.request_id} if call.request_id is not None else None
        path = f"/instances/{quote(call.instance_id, safe='')}/events/{quote(call.event, safe='')}"
        async with self._callers.one() as client:
            response = await client.post(path, json=body, headers=headers)
        if response.status_code != 200:
            try:
                doc: object = response.json()
            except ValueError:
                doc = response.text
            raise failure(response.status_code, doc)
        answer = response.json()
        return Fired(
            "applied" if answer["applied"] else "idempotent",
            _header_int(response.headers.get("Flowlock-Attempts")) or 1,
            _header_int(response.headers.get("Flowlock-Batch-Size")),
        )

    async def run_once(self, job: str, tick: int, fn: Callable[[], Awaitable[None]]) -> bool | None:
        return None  # no scenario --http runs has jobs
