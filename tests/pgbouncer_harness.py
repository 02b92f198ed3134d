"""A throwaway PgBouncer in front of the test PostgreSQL (tests/integration/test_pgbouncer_pg.py).

Debian's ``pgbouncer`` binary is used as installed (``apt-get install -y pgbouncer``; .ci/run
installs it); :func:`missing` says when it is absent, so the tests skip with that reason. It is
never run as a service: each :class:`PgBouncer` starts its own process on a free 127.0.0.1 port
with an ini of its own, and stops it. The ini is the stock one but for what a test must set:
where PostgreSQL is, where to listen, trust authentication (the user listed in an auth file),
and ``pool_mode``. So ``ignore_startup_parameters`` is empty (an unknown startup parameter such
as ``lock_timeout`` is refused), PgBouncer 1.18 keeps no prepared statement across transactions,
``default_pool_size`` is 20 server connections per database and user, and ``max_client_conn``
is 100. A test's connections through a session pooler must stay within those 20: a client past
them waits for a server connection until another client disconnects.

PgBouncer refuses to run as root: when the tests do, it runs as ``nobody``.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

from flowlock.embedded import process

__all__ = ["PgBouncer", "PoolMode", "missing"]

PoolMode = Literal["session", "transaction"]

HOST = "127.0.0.1"
_USER = "nobody"  # who PgBouncer runs as when the tests run as root
_START_TIMEOUT = 10.0
_STOP_TIMEOUT = 5.0
_ATTEMPTS = 3  # fresh ports tried when the one picked was taken meanwhile
_UP = re.compile(r"process up: PgBouncer")
_IN_USE = re.compile(r"Address already in use")


def missing() -> str | None:
    """Why a PgBouncer cannot be started here, or None when it can."""
    if shutil.which("pgbouncer") is None:
        return (
            "needs the pgbouncer binary (Debian: apt-get install -y pgbouncer); the PgBouncer "
            "tests start one of their own"
        )
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(_USER)
        except KeyError:
            return f"runs PgBouncer as the {_USER!r} account when root, and it is missing"
    return None


@dataclass
class PgBouncer:
    """A PgBouncer in `pool_mode` in front of the PostgreSQL server of `server_url`.

    `url(database)`: the same user and database through the pooler. `start()` returns once it
    logs that it is up (within 10 s, or raises with its log); `stop()` ends it.
    """

    server_url: str
    pool_mode: PoolMode
    port: int = 0
    root: Path | None = None
    proc: subprocess.Popen[bytes] | None = None
    _log: Path | None = field(default=None, repr=False)

    @property
    def _server(self) -> tuple[str, int, str, str, str]:
        parts = urlsplit(self.server_url)
        user = unquote(parts.username or "postgres")
        password = unquote(parts.password or "")
        database = parts.path.lstrip("/") or user
        return parts.hostname or HOST, parts.port or 5432, user, password, database

    def url(self, database: str | None = None) -> str:
        """The test database (or `database`) as the test's user, through this pooler."""
        _, _, user, password, default = self._server
        secret = f":{password}" if password else ""
        return f"postgresql://{user}{secret}@{HOST}:{self.port}/{database or default}"

    def start(self) -> PgBouncer:
        """Start it on a free port; a port taken meanwhile is retried with another."""
        self.root = process.make_root("flowlock-pgbouncer-")
        # PgBouncer, as `nobody`, reads its ini and auth file from here.
        self.root.chmod(0o755)
        last = ""
        for _ in range(_ATTEMPTS):
            self.port = process.free_port()
            if self._spawn_and_wait():
                return self
            last = process.log_tail(self._log) if self._log else ""
            self._kill()
            if not _IN_USE.search(last):
                break
        self.stop()
        raise RuntimeError(f"pgbouncer ({self.pool_mode}) did not start:\n{last}")

    def _spawn_and_wait(self) -> bool:
        assert self.root is not None
        host, port, user, password, _ = self._server
        auth = self.root / "userlist.txt"
        auth.write_text(f'"{user}" "{password}"\n')
        ini = self.root / f"pgbouncer-{self.port}.ini"
        ini.write_text(
            "[databases]\n"
            f"* = host={host} port={port}\n"
            "[pgbouncer]\n"
            f"listen_addr = {HOST}\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {auth}\n"
            f"pool_mode = {self.pool_mode}\n"
        )
        for path in (auth, ini):
            path.chmod(0o644)
        self._log = self.root / f"pgbouncer-{self.port}.log"
        with self._log.open("wb") as log:
            self.proc = subprocess.Popen(
                ["pgbouncer", str(ini)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.root,
                start_new_session=True,
                **_run_as(),
            )
        log_path = self._log
        return process.wait_ready(
            self.proc,
            lambda: bool(_UP.search(log_path.read_text(errors="replace"))),
            time.monotonic() + _START_TIMEOUT,
        )

    def log(self) -> str:
        """The tail of its log (for a failing test's message)."""
        return process.log_tail(self._log) if self._log else ""

    def _kill(self) -> None:
        if self.proc is not None:
            process.terminate(self.proc, _STOP_TIMEOUT)
            self.proc = None

    def stop(self) -> None:
        """End the process (SIGTERM, then SIGKILL) and remove its directory. Idempotent."""
        self._kill()
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None


def _run_as() -> dict[str, Any]:
    """The subprocess credentials of an unprivileged account, when we are root."""
    if os.geteuid() != 0:
        return {}
    entry = pwd.getpwnam(_USER)
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
