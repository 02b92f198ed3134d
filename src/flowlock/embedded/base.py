"""What every embedded server shares: the lifecycle, the temporary directory and the errors.

Start and stop are idempotent and thread-safe, with `with` and `async with` forms.
The server also stops after a cancelled async start, and at interpreter exit.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from flowlock.core.errors import InvalidInput
from flowlock.core.lifecycle import BlockingResource
from flowlock.core.settings import check_seconds, check_text
from flowlock.embedded import process
from flowlock.embedded.errors import EmbeddedServerError

__all__ = ["EmbeddedServer", "check_host", "check_networks", "check_settings"]

# A server setting's name: what postgresql.conf and redis-server's --options take.
_SETTING = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,99}")


def check_host(host: str) -> str:
    """`host` if it is an IPv4 address (the one a server listens on), else InvalidInput."""
    try:
        return str(ipaddress.IPv4Address(host))
    except (ipaddress.AddressValueError, TypeError, ValueError):
        raise InvalidInput(
            f"host must be an IPv4 address of this machine, such as 127.0.0.1, not {host!r}"
        ) from None


def check_networks(networks: Sequence[str]) -> tuple[str, ...]:
    """`networks` as IPv4 networks in CIDR form (`10.213.7.0/24`), else InvalidInput."""
    if isinstance(networks, str) or not isinstance(networks, Sequence):
        raise InvalidInput(f"networks must be a list of CIDR strings, not {networks!r}")
    found: list[str] = []
    for net in networks:
        try:
            found.append(str(ipaddress.IPv4Network(net)))
        except (ipaddress.AddressValueError, ipaddress.NetmaskValueError, TypeError, ValueError):
            raise InvalidInput(
                f"{net!r} is not an IPv4 network in CIDR form, such as 10.213.7.0/24"
            ) from None
    return tuple(found)


def check_settings(settings: Mapping[str, str] | None) -> dict[str, str]:
    """`settings` as a plain dict of names to one-line text values.

    A newline would start another setting in postgresql.conf.
    """
    if settings is None:
        return {}
    if not isinstance(settings, Mapping):
        raise InvalidInput(f"settings must be a mapping of names to values, not {settings!r}")
    for name, value in settings.items():
        if not isinstance(name, str) or not _SETTING.fullmatch(name):
            raise InvalidInput(f"settings: {name!r} is not a server setting's name")
        if not isinstance(value, str):
            raise InvalidInput(f"settings[{name!r}] must be a string, not {value!r}")
        if value:  # an empty value is a setting too (redis-server --save "")
            check_text(f"settings[{name!r}]", value, most=1000)
    return dict(settings)


class EmbeddedServer(BlockingResource):
    """A throwaway server process of ours in a temporary directory.

    `start()` makes the directory and calls `_launch`, cleaning up if that fails.
    `stop()` calls `_halt` and deletes the directory. Both are idempotent,
    thread-safe and re-entrant: a signal handler may call `stop()` inside `start()`.
    Subclasses name the server, say whether it is `running`, and implement the two
    hooks. Every failure they report is an
    [`EmbeddedServerError`][flowlock.embedded.base.EmbeddedServerError].
    """

    server = "server"  # as the errors name it: "PostgreSQL", "Redis"
    _dir_prefix = "flowlock-server-"
    _thread_name = "flowlock-server-stop"
    # What to do about a failed start, unless the failure knows better.
    _advice = "read the server output above, or point flowlock at a server of your own"

    def __init__(self, *, start_timeout: float, stop_timeout: float) -> None:
        self._start_timeout = check_seconds("start_timeout", start_timeout)
        self._stop_timeout = check_seconds("stop_timeout", stop_timeout)
        # Re-entrant so a signal handler that calls stop() on the thread already inside
        # start()/stop() proceeds instead of deadlocking on itself.
        self._lock = threading.RLock()
        self._root: Path | None = None
        self._owner_pid: int | None = None
        # The processes pause() stopped, continued by resume(), stop() and restart().
        self._stopped_pids: set[int] = set()

    # --- for subclasses ----------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """Whether this object started a server that is still alive."""
        raise NotImplementedError

    def _prepare(self) -> None:
        """Check what the server needs (binaries, accounts) before a directory is made."""

    def _launch(self, root: Path, deadline: float) -> None:
        """Start the server in `root` and return once it answers, by `deadline`.

        On failure raise; the caller then calls `_halt` and cleans up.
        """
        raise NotImplementedError

    def _halt(self, root: Path) -> list[str]:
        """Stop every process of the server, in whatever state, and forget them.

        Returns problems to report, such as processes that survived. Must kill what is left even
        when interrupted, and re-raise the interruption afterwards.
        """
        raise NotImplementedError

    def _log_tail(self) -> str:
        """The tail of the server's log, quoted in failures ("" when there is none)."""
        return ""

    def _pause_targets(self) -> list[int]:
        """The processes `pause` stops; empty when the server is not running.

        The one that starts new processes comes first, so none is forked in between.
        """
        raise NotImplementedError

    def _failure(
        self, problem: str, output: str = "", *, advice: str | None = None
    ) -> EmbeddedServerError:
        """The error for `problem`, quoting `output` (a command's) and the log's tail."""
        parts = []
        if output.strip():
            parts.append(f"--- command output ---\n{output.strip()}")
        tail = self._log_tail()
        if tail:
            parts.append(f"--- server log (last {process.LOG_TAIL_LINES} lines) ---\n{tail}")
        return EmbeddedServerError(
            self.server, problem, details="\n".join(parts), advice=advice or self._advice
        )

    def _not_running(self) -> EmbeddedServerError:
        return EmbeddedServerError(
            self.server,
            "the server is not running",
            advice="call start() first, or use `with` / `async with` around it",
        )

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the server; a no-op if it is running. One that died is replaced.

        Bounded by `start_timeout`. On failure the processes are killed, the directory is
        removed, and EmbeddedServerError says what the server said.
        """
        with self._lock:
            if self.running:
                return
            if self._root is not None:
                # The server died under us (killed, crashed): clear the remains, start afresh.
                self._teardown()
            deadline = time.monotonic() + self._start_timeout
            self._prepare()
            root = self._root = process.make_root(self._dir_prefix)
            self._owner_pid = os.getpid()
            atexit.register(self._stop_at_exit)
            try:
                self._launch(root, deadline)
            except BaseException:
                # Includes KeyboardInterrupt: a half-started server must not outlive start().
                with contextlib.suppress(Exception):
                    self._teardown()
                raise

    def stop(self) -> None:
        """Stop the server, leave none of its processes behind and delete its directory.

        A no-op when not started or already stopped, so it is safe in `finally` blocks,
        signal handlers and `atexit`. Raises EmbeddedServerError only if a process survived
        SIGKILL or the directory could not be deleted.
        """
        with self._lock:
            self._teardown()

    # --- pause / resume ----------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        """Whether `pause` stopped the server and nothing has continued it since."""
        return bool(self._stopped_pids)

    def pause(self) -> None:
        """Freeze the server with SIGSTOP, as a hung machine would.

        Connections stay open and nothing is answered until `resume`. A no-op when already
        paused; EmbeddedServerError when not running. `stop()` and `restart()` resume it
        first.
        """
        with self._lock:
            if self._stopped_pids:
                return
            if self._root is None or not self.running:
                raise self._not_running()
            stopped: set[int] = set()
            # Signalled one after another, looked up again after each round: a process forked
            # before its parent was stopped is found and stopped on the next pass.
            for _ in range(3):
                fresh = [pid for pid in self._pause_targets() if pid not in stopped]
                if not fresh:
                    break
                process.signal_all(fresh, signal.SIGSTOP)
                stopped.update(fresh)
            self._stopped_pids = stopped

    def resume(self) -> None:
        """Continue a server `pause` froze (SIGCONT).

        A no-op when not paused; EmbeddedServerError when never started or already stopped.
        """
        with self._lock:
            if self._root is None:
                raise self._not_running()
            self._continue()

    def _continue(self) -> None:
        stopped, self._stopped_pids = self._stopped_pids, set()
        process.signal_all(stopped, signal.SIGCONT)

    def _teardown(self) -> None:
        """Stop whatever part of the server exists and delete the directory.

        Also when interrupted; the interruption is re-raised afterwards.
        """
        root = self._root
        if root is None:
            return
        # A stopped process would sit out a graceful shutdown until its bound runs out.
        self._continue()
        problems: list[str] = []
        try:
            problems += self._halt(root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
            if root.exists():
                problems.append(f"could not delete {root}; delete it by hand")
            self._root = None
            atexit.unregister(self._stop_at_exit)
        if problems:
            raise EmbeddedServerError(
                self.server,
                "did not stop cleanly: " + "; ".join(problems),
                advice="kill the processes named above and delete the directory by hand",
            )

    def _stop_at_exit(self) -> None:
        # A forked child inherits this atexit hook; only the process that started the server
        # may stop it, or the child's exit would pull the server from under its parent.
        if os.getpid() == self._owner_pid:
            self._stop_quietly()
