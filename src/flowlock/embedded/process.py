"""The process toolkit behind the embedded servers.

Free ports, temporary directories, child processes, readiness waits, `/proc` lookups
and log tails. Nothing here knows PostgreSQL or Redis; every function is bounded.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "HOST",
    "LOG_TAIL_LINES",
    "MAX_SOCKET_PATH",
    "Completed",
    "alive",
    "free_port",
    "log_tail",
    "make_root",
    "process_tree",
    "run",
    "signal_all",
    "spawn",
    "stop_tree",
    "terminate",
    "wait_gone",
    "wait_ready",
]

# Every embedded server listens on loopback only: it is for tests and benchmarks on this machine.
HOST = "127.0.0.1"
# How much of a server's log a failure quotes: enough for the error and the lines leading to it.
LOG_TAIL_LINES = 40
# sun_path is 108 bytes on Linux and 104 on macOS, with the terminating NUL.
MAX_SOCKET_PATH = 103
# How often the waits below look again: short next to a server's start, cheap for the CPU.
_POLL = 0.02


def free_port(host: str = HOST) -> int:
    """A TCP port on `host` (default `HOST`) that was free a moment ago.

    Another process may take it before the server binds it. Callers retry with a fresh port
    when the server reports it in use.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def make_root(prefix: str) -> Path:
    """A fresh private temporary directory for one server (its data, log and unix socket)."""
    return Path(tempfile.mkdtemp(prefix=prefix))


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of a log file; "" when it does not exist (yet) or is unreadable."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


# --- running a command -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Completed:
    """A command that ran: its exit status and its interleaved stdout and stderr.

    A status of None means it was still running at its bound, and was killed.
    """

    returncode: int | None
    output: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def run(
    argv: Sequence[str],
    *,
    cwd: Path,
    timeout: float,
    env: Mapping[str, str] | None = None,
    **options: Any,
) -> Completed:
    """Run `argv` to completion within `timeout` seconds.

    `options` go to `subprocess.run`. Raises OSError when it cannot be started.
    """
    # Output goes to a file, not a pipe. A daemon the command forks (pg_ctl's postmaster) could
    # inherit a pipe, and reading it would block until that daemon exits.
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as out:
        try:
            result = subprocess.run(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                env=None if env is None else dict(env),
                timeout=timeout,
                check=False,
                **options,
            )
            returncode: int | None = result.returncode
        except subprocess.TimeoutExpired:
            returncode = None  # subprocess.run has killed and reaped it
        out.seek(0)
        return Completed(returncode, out.read())


# --- a child process we own -------------------------------------------------------------------


def spawn(argv: Sequence[str], *, cwd: Path) -> subprocess.Popen[bytes]:
    """Start a long-running child with no stdin, stdout or stderr, in its own session.

    It logs to its own file. Its own session keeps a Ctrl-C meant for the tests away from it.
    """
    return subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=cwd,
        start_new_session=True,
    )


def wait_ready(proc: subprocess.Popen[bytes], ready: Callable[[], bool], deadline: float) -> bool:
    """Whether `ready()` said yes before the monotonic `deadline`.

    False at once if the process exits. `ready` may raise OSError, for nobody listening
    yet, which counts as not ready.
    """
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        with contextlib.suppress(OSError):
            if ready():
                return True
        time.sleep(0.01)
    return False


def terminate(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM, and SIGKILL if it has not exited within `timeout`; the process is reaped."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout)


# --- processes we do not own (a daemon's tree, found in /proc) --------------------------------


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of a process from /proc, or None if it does not exist."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text(errors="replace")
    except OSError:
        return None
    # The command name is in parentheses and may itself contain spaces or parentheses.
    fields = raw[raw.rfind(")") + 2 :].split()
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    """Whether the process exists and has not exited.

    A zombie counts as gone: in a container, init may reap a reparented daemon late or never.
    """
    if Path("/proc/self/stat").exists():
        stat = _proc_stat(pid)
        return stat is not None and stat[0] not in ("Z", "X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_tree(roots: Iterable[int], *, argument: str | None = None) -> set[int]:
    """The live processes among `roots` and those naming `argument`, with all descendants.

    `argument` finds a daemon whose pid file was never written. Without `/proc` only the
    live `roots` are found.
    """
    found = {pid for pid in roots if alive(pid)}
    proc = Path("/proc")
    if not proc.is_dir():
        return found
    parents: dict[int, int] = {}
    needle = None if argument is None else argument.encode()
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        stat = _proc_stat(pid)
        if stat is None or stat[0] in ("Z", "X"):
            continue
        parents[pid] = stat[1]
        with contextlib.suppress(OSError):
            if needle is not None and needle in (entry / "cmdline").read_bytes().split(b"\0"):
                found.add(pid)
    frontier = set(found)
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def wait_gone(pids: set[int], timeout: float) -> set[int]:
    """Wait until none of `pids` is alive; returns the ones still alive at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        left = {pid for pid in pids if alive(pid)}
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(_POLL)


def signal_all(pids: Iterable[int], sig: signal.Signals) -> None:
    """Send `sig` to each process; one that is gone or not ours is skipped."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def stop_tree(
    pids: set[int], *, leaders: set[int], first: signal.Signals, timeout: float
) -> set[int]:
    """Stop a process tree; returns the pids that survived, normally none.

    Sends `first` to the `leaders` (or to every pid when none is in `pids`), then
    SIGKILL to what is left after `timeout`.
    """
    if not pids:
        return set()
    signal_all(pids & leaders or pids, first)
    left = wait_gone(pids, timeout)
    if left:
        signal_all(left, signal.SIGKILL)
        left = wait_gone(left, timeout)
    return left
