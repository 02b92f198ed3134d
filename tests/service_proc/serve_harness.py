"""Runs ``flowlock serve`` as a real process for the tests in this directory.

Each server is ``python -m flowlock serve`` with this checkout's ``src`` first on PYTHONPATH (the
workers uvicorn spawns inherit it), on a free loopback port, with a temporary directory of its
own as TMPDIR: the metrics directory of several workers and the embedded servers of ``--dev``
are made in it, so a test can look at them and at the processes running there. The server
runs in a session of its own so that teardown can kill the whole group.

:class:`Services` starts servers and, on close, stops whatever is still running: SIGTERM first
(the service's own clean-up), then SIGKILL for the group and for any process left working in the
server's directory. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from urllib.parse import urlsplit, urlunsplit

import httpx
from prometheus_client.multiprocess import MultiProcessCollector

import flowlock
import pg_budget

SRC = Path(flowlock.__file__).resolve().parents[1]
START_TIMEOUT = 90.0
"""Seconds a server gets to answer /livez with every worker started (--dev runs initdb)."""
STOP_TIMEOUT = 30.0
"""Seconds teardown gives a server to exit on SIGTERM before it is killed."""
STARTED = "Application startup complete."
STOPPED = "Application shutdown complete."


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def child_env(home: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a server: this checkout's code, TMPDIR in ``home``, and none of the
    caller's own FLOWLOCK_* settings (each flag of ``serve`` reads one), so only the flags the
    test gives count."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not (k.startswith("FLOWLOCK_") and not k.startswith("FLOWLOCK_TEST_"))
        and k != "PROMETHEUS_MULTIPROC_DIR"
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))
    env["TMPDIR"] = str(home)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def strays(home: Path) -> set[int]:
    """Processes working in ``home`` (their current directory or command line is in it): the
    embedded servers of ``--dev`` run there. The test process itself is never one."""
    found: set[int] = set()
    needle = str(home)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if os.readlink(entry / "cwd").startswith(needle):
                found.add(int(entry.name))
                continue
            if needle.encode() in (entry / "cmdline").read_bytes():
                found.add(int(entry.name))
    return found


def wait_for(what: str, ready: Callable[[], bool], timeout: float, interval: float = 0.1) -> None:
    """Call ``ready()`` until it is true; AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        time.sleep(interval)


class Served:
    """One running ``flowlock serve``."""

    def __init__(
        self, proc: subprocess.Popen[bytes], port: int, workers: int, home: Path, log: Path
    ) -> None:
        self.proc = proc
        self.port = port
        self.workers = workers
        self.home = home
        self.log = log
        self.url = f"http://127.0.0.1:{port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        """Until /livez answers and every worker has opened its engine."""
        deadline = time.monotonic() + timeout
        with httpx.Client(base_url=self.url, timeout=5.0) as client:
            while True:
                if self.proc.poll() is not None:
                    raise AssertionError(
                        f"flowlock serve exited with {self.proc.returncode} before it was up:\n"
                        + self.output()[-4000:]
                    )
                with contextlib.suppress(httpx.TransportError):
                    live = client.get("/livez").status_code == 200
                    if live and self.output().count(STARTED) >= self.workers:
                        return
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"flowlock serve was not up within {timeout:.0f} s:\n"
                        + self.output()[-4000:]
                    )
                time.sleep(0.1)

    def terminate(self) -> float:
        """SIGTERM to the server's main process only (as a supervisor sends it); returns the
        moment it was sent."""
        os.kill(self.proc.pid, signal.SIGTERM)
        return time.monotonic()

    def wait(self, timeout: float) -> int:
        """The exit status; AssertionError with the log when it has not exited in time."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"flowlock serve did not exit within {timeout:.0f} s:\n" + self.output()[-4000:]
            ) from None

    def metrics_dirs(self) -> list[Path]:
        return sorted(self.home.glob("flowlock-metrics-*"))

    def transitions_by_pid(self, workflow: str | None = None) -> dict[int, float]:
        """``flowlock_transitions_total`` of each worker (of ``workflow`` only, when given), read
        from the counter file each worker writes in the shared metrics directory."""
        [metrics] = self.metrics_dirs()
        counts: dict[int, float] = {}
        for path in metrics.glob("counter_*.db"):
            pid = int(path.stem.split("_")[-1])
            total = 0.0
            for family in MultiProcessCollector.merge([str(path)]):  # type: ignore[no-untyped-call]
                for sample in family.samples:
                    if sample.name != "flowlock_transitions_total":
                        continue
                    if workflow is None or sample.labels.get("workflow") == workflow:
                        total += sample.value
            counts[pid] = total
        return counts

    def stop(self) -> None:
        """SIGTERM, then SIGKILL for the group and anything left in the server's directory."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(STOP_TIMEOUT)
        # The group (the workers) and the servers of --dev, whichever outlived the main process.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in strays(self.home):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


class Services:
    """Starts ``flowlock serve`` processes; ``close()`` (or the end of ``with``) stops every one
    still running and removes their directories."""

    def __init__(self) -> None:
        self._started: list[Served] = []

    def __enter__(self) -> Services:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def start(
        self,
        *args: str,
        workers: int = 1,
        wait: bool = True,
        timeout: float = START_TIMEOUT,
        env: dict[str, str] | None = None,
    ) -> Served:
        """``flowlock serve --port <free> --workers N *args``, up (unless ``wait=False``)."""
        home = Path(tempfile.mkdtemp(prefix="fl-svc-"))
        # The embedded PostgreSQL of --dev runs as another user, who must reach its directory.
        home.chmod(0o755)
        log = home / "serve.log"
        port = free_port()
        argv = [sys.executable, "-m", "flowlock", "serve", "--port", str(port)]
        argv += ["--workers", str(workers), *args]
        with log.open("wb") as out:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=child_env(home, env),
                start_new_session=True,
            )
        served = Served(proc, port, workers, home, log)
        self._started.append(served)
        if wait:
            served.wait_ready(timeout)
        return served

    def close(self) -> None:
        for served in self._started:
            try:
                served.stop()
            finally:
                shutil.rmtree(served.home, ignore_errors=True)
        self._started.clear()


def run_serve(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """``flowlock serve *args`` to completion (a command expected to refuse and exit)."""
    home = Path(tempfile.mkdtemp(prefix="fl-svc-"))
    try:
        return subprocess.run(
            [sys.executable, "-m", "flowlock", "serve", *args],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            env=child_env(home),
            timeout=timeout,
            check=False,
        )
    finally:
        shutil.rmtree(home, ignore_errors=True)


# -- databases ---------------------------------------------------------------------------------


def with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{name}"))


@contextlib.contextmanager
def fresh_database(server_url: str) -> Iterator[str]:
    """A new database on the server of ``server_url`` (its URL), dropped afterwards with
    whatever is still connected to it."""
    with pg_budget.fresh_database(server_url, "svc") as url:
        yield url


async def sessions(server_url: str, database: str, application_name: str) -> int:
    """How many sessions ``application_name`` has open on ``database``."""
    conn = await pg_budget.connect(server_url)
    try:
        count = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND application_name = $2",
            database,
            application_name,
        )
    finally:
        await conn.close()
    return int(count)


def database_name(url: str) -> str:
    return urlsplit(url).path.lstrip("/")


async def read_back(
    url: str, instance_ids: Sequence[str]
) -> dict[str, tuple[flowlock.Instance, list[flowlock.HistoryEntry]]]:
    """Each instance and its history, read with an engine of the test's own (its sessions are
    named apart from the service's)."""
    found: dict[str, tuple[flowlock.Instance, list[flowlock.HistoryEntry]]] = {}
    async with flowlock.Engine.connect(url, max_size=2, application_name="svcproc-check") as engine:
        for instance_id in instance_ids:
            found[instance_id] = (
                await engine.get(instance_id),
                await engine.history(instance_id),
            )
    return found
