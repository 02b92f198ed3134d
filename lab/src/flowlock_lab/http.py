"""Calls through the service for `flowlock bench --http`.

`running_service` runs `flowlock serve` for the run; the load generator
(`flowlock_lab.http_load`, a process of its own) makes each call an HTTP request to it.
docs/benchmarks.md describes the setup.
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
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from flowlock.bench.config import Target
from flowlock.bench.measure import RemoteFailure
from flowlock.bench.progress import Progress
from flowlock.core import errors
from flowlock.core.errors import InvalidInput
from flowlock.core.install import pip_install
from flowlock.embedded.errors import EmbeddedServerError

if TYPE_CHECKING:
    pass

__all__ = [
    "SERVICE_APP",
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
"""Seconds the load generator keeps an idle connection: below uvicorn's 5, so it never reuses a
connection the server is closing."""
_PROBLEM = "urn:flowlock:problem:"


def check_http_support() -> None:
    """Raise InvalidInput, before anything starts, when httpx (the bench extra) is missing."""
    try:
        import httpx  # noqa: F401
    except ImportError:
        advice = pip_install("bench")
        raise InvalidInput(f"--http needs httpx to watch the service start: {advice}") from None


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
