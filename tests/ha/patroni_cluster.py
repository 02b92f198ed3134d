"""A throwaway Patroni cluster for the failover tests: one etcd and Patroni-managed PostgreSQL
nodes, all on 127.0.0.1 ports picked free, in one temporary directory.

Debian's ``patroni`` and ``etcd-server`` packages and the system PostgreSQL binaries
(``/usr/lib/postgresql/<version>/bin``) are used as installed; :func:`missing` says what is
absent, so the tests skip with that reason. PostgreSQL refuses to run as root, so when the tests
run as root Patroni (and so PostgreSQL) runs as the ``postgres`` system account, which the
distribution's PostgreSQL packages create.

Everything is synchronous and bounded (run it in a thread from async code). :meth:`stop` kills
every process the cluster started (Patroni first, so that it restarts nothing; then PostgreSQL
and etcd), removes the directory, and returns whatever process survived, which the tests assert
is nothing. The settings are Patroni's fast ones (ttl 10 s, loop_wait 1 s, retry_timeout 3 s:
``loop_wait + 2 * retry_timeout <= ttl`` as Patroni asks), so a killed leader is replaced
about ``ttl`` seconds after its last renewal of the leader key.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowlock.embedded import process

__all__ = ["Node", "PatroniCluster", "missing", "postgres_bin_dir"]

HOST = "127.0.0.1"
TTL = 10  # seconds the leader key lives without renewal: a killed leader is replaced after it
LOOP_WAIT = 1  # seconds between Patroni's HA loops
RETRY_TIMEOUT = 3  # seconds Patroni retries etcd and PostgreSQL before giving up on an action
_SYSTEM_USER = "postgres"
_POLL = 0.1
_HTTP_TIMEOUT = 5.0
_KILL_WAIT = 5.0


def postgres_bin_dir() -> Path | None:
    """The newest ``/usr/lib/postgresql/<version>/bin`` holding a ``postgres`` binary."""
    found = [p.parent for p in Path("/usr/lib/postgresql").glob("*/bin/postgres")]
    if not found:
        return None
    return max(found, key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0)


def missing() -> str | None:
    """Why a Patroni cluster cannot be started here, or None when it can."""
    lacking = [name for name in ("patroni", "etcd") if shutil.which(name) is None]
    if lacking:
        return (
            f"needs {' and '.join(lacking)} (Debian: apt-get install -y patroni etcd-server); "
            "the Patroni failover tests start a cluster of their own"
        )
    if postgres_bin_dir() is None:
        return "needs the PostgreSQL server binaries under /usr/lib/postgresql/<version>/bin"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(_SYSTEM_USER)
        except KeyError:
            return f"runs PostgreSQL as the {_SYSTEM_USER!r} account when root, and it is missing"
    return None


@dataclass
class Node:
    """One Patroni member: its PostgreSQL port, its REST API port and its directory."""

    name: str
    pg_port: int
    api_port: int
    root: Path
    proc: subprocess.Popen[bytes] | None = None
    killed: bool = False

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def api(self) -> str:
        return f"http://{HOST}:{self.api_port}"

    @property
    def url(self) -> str:
        """This node alone, as the superuser, database ``postgres``."""
        return f"postgresql://postgres@{HOST}:{self.pg_port}/postgres"


@dataclass
class PatroniCluster:
    """``nodes`` Patroni members on one etcd. ``synchronous``: Patroni's ``synchronous_mode``
    (a commit is acknowledged once the synchronous standby has flushed it, and only that
    standby may be promoted); off, replication is asynchronous."""

    synchronous: bool
    nodes_wanted: int = 2
    start_timeout: float = 90.0
    root: Path | None = None
    etcd: subprocess.Popen[bytes] | None = None
    etcd_port: int = 0
    nodes: list[Node] = field(default_factory=list)
    scope: str = ""
    # start() and stop() may run at once (a test interrupted while the cluster starts, stop()
    # from its finally or at exit): each process is started under the lock, and not at all once
    # stop() has begun, so that stop() finds everything there is to kill.
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stopped: bool = False

    # -- addresses -------------------------------------------------------------------------

    def url(self, *, attrs: str = "read-write", query: Mapping[str, str] | None = None) -> str:
        """Every node in one libpq multi-host URL, ``target_session_attrs=attrs``."""
        hosts = ",".join(f"{HOST}:{n.pg_port}" for n in self.nodes)
        params = {"target_session_attrs": attrs, **(query or {})}
        shown = "&".join(f"{k}={v}" for k, v in params.items())
        return f"postgresql://postgres@{hosts}/postgres?{shown}"

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    # -- start -----------------------------------------------------------------------------

    def start(self) -> None:
        """etcd, then every node; returns once a leader runs and every other node streams from
        it (and, in synchronous mode, one is its synchronous standby). Stops everything and
        raises when that takes longer than ``start_timeout``."""
        bin_dir = postgres_bin_dir()
        assert bin_dir is not None, missing()
        deadline = time.monotonic() + self.start_timeout
        with self._lock:
            self.root = Path(tempfile.mkdtemp(prefix="flowlock-patroni-"))
            self.scope = self.root.name
            # A safety net, as the embedded servers have: an interpreter that exits without
            # stop() (a test run killed by its timeout) still takes the cluster down.
            atexit.register(self.stop)
        try:
            # The system account must reach its node directories under ours.
            self.root.chmod(0o755)
            self._start_etcd(deadline)
            for i in range(self.nodes_wanted):
                ports = process.free_port(), process.free_port()
                node = Node(f"node{i}", *ports, self.root / f"n{i}")
                node.root.mkdir()
                self._own(node.root)
                self.nodes.append(node)
                (node.root / "patroni.json").write_text(json.dumps(self._config(node, bin_dir)))
                self._start_node(node)
                if i == 0:  # the first bootstraps the cluster; the others clone it
                    self._wait(lambda: self.leader() == "node0", deadline, "node0 to lead")
            self._wait(self.healthy, deadline, "every replica to stream from the leader")
        except BaseException:
            self.stop()
            raise

    @contextlib.contextmanager
    def _starting(self) -> Iterator[Path]:
        """Held while one process is started: the cluster's directory, unless stop() began."""
        with self._lock:
            if self._stopped or self.root is None:
                raise RuntimeError("the Patroni cluster was stopped while it started")
            yield self.root

    def _start_etcd(self, deadline: float) -> None:
        self.etcd_port, peer = process.free_port(), process.free_port()
        client, peers = f"http://{HOST}:{self.etcd_port}", f"http://{HOST}:{peer}"
        with self._starting() as root:
            self._spawn_etcd(root, client, peers)

        def healthy() -> bool:
            return bool(_get_json(f"{client}/health").get("health") == "true")

        self._wait(healthy, deadline, "etcd to answer")

    def _spawn_etcd(self, root: Path, client: str, peers: str) -> None:
        log = (root / "etcd.log").open("wb")
        self.etcd = subprocess.Popen(
            [
                "etcd", "--name", "e0", "--data-dir", str(root / "etcd"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peers, "--initial-advertise-peer-urls", peers,
                "--initial-cluster", f"e0={peers}", "--initial-cluster-state", "new",
                "--initial-cluster-token", self.scope, "--log-level", "warn",
            ],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=root,
            start_new_session=True, env=_clean_env(),
        )  # fmt: skip
        log.close()

    def _config(self, node: Node, bin_dir: Path) -> dict[str, Any]:
        pg, api = f"{HOST}:{node.pg_port}", f"{HOST}:{node.api_port}"
        parameters = {
            "max_connections": 100,
            "shared_buffers": "32MB",
            # A process kill loses nothing the kernel has (fsync protects against power loss,
            # which no test makes); off, the shared 2-core machine's disk stays out of it.
            "fsync": "off",
            "wal_keep_size": "128MB",
        }
        return {
            "scope": self.scope,
            "namespace": "/flowlock-test/",
            "name": node.name,
            "log": {"level": "INFO"},
            "restapi": {"listen": api, "connect_address": api},
            "etcd3": {"hosts": [f"{HOST}:{self.etcd_port}"]},
            "bootstrap": {
                "dcs": {
                    "ttl": TTL,
                    "loop_wait": LOOP_WAIT,
                    "retry_timeout": RETRY_TIMEOUT,
                    "maximum_lag_on_failover": 16 * 1024 * 1024,
                    "synchronous_mode": self.synchronous,
                    "postgresql": {
                        "use_pg_rewind": False, "use_slots": True, "parameters": parameters,
                    },
                },
                "initdb": [{"encoding": "UTF8"}, {"locale": "C"}, {"auth": "trust"}],
            },
            "postgresql": {
                "listen": pg,
                "connect_address": pg,
                "data_dir": str(node.data_dir),
                "bin_dir": str(bin_dir),
                "pgpass": str(node.root / "pgpass"),
                "authentication": {
                    "superuser": {"username": "postgres", "password": "postgres"},
                    "replication": {"username": "replicator", "password": "replicator"},
                },
                "parameters": {
                    "unix_socket_directories": str(node.root),
                    "logging_collector": "on",
                    "log_directory": str(node.root / "log"),
                },
                "pg_hba": [
                    "local all all trust",
                    f"host all all {HOST}/32 trust",
                    f"host replication all {HOST}/32 trust",
                ],
            },
        }  # fmt: skip

    def _start_node(self, node: Node) -> None:
        with self._starting():
            log = (node.root / "patroni.log").open("wb")
            node.proc = subprocess.Popen(
                ["patroni", str(node.root / "patroni.json")],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=node.root,
                start_new_session=True,
                env={**_clean_env(), "HOME": str(node.root)},
                **_run_as(),
            )
            log.close()

    @staticmethod
    def _own(path: Path) -> None:
        creds = _run_as()
        if creds:
            os.chown(path, creds["user"], creds["group"])

    def _wait(self, ready: Callable[[], bool], deadline: float, what: str) -> None:
        while time.monotonic() < deadline:
            for node in self.nodes:
                if node.proc is not None and not node.killed and node.proc.poll() is not None:
                    raise RuntimeError(f"patroni {node.name} exited:\n{self.logs()}")
            with contextlib.suppress(OSError, ValueError, KeyError):
                if ready():
                    return
            time.sleep(_POLL)
        raise TimeoutError(f"waited in vain for {what}:\n{self.logs()}")

    # -- the REST API ----------------------------------------------------------------------

    def members(self) -> list[dict[str, Any]]:
        """``GET /cluster`` of the first node that answers: every member's name, role
        (leader, sync_standby, replica) and state."""
        last: Exception | None = None
        for node in self.nodes:
            if node.killed:
                continue
            try:
                found: list[dict[str, Any]] = _get_json(f"{node.api}/cluster")["members"]
            except (OSError, ValueError, KeyError) as exc:
                last = exc
                continue
            return found
        raise OSError(f"no Patroni REST API answered: {last}")

    def leader(self) -> str | None:
        """The member holding the leader key with PostgreSQL running, or None."""
        for member in self.members():
            if member["role"] == "leader" and member["state"] == "running":
                return str(member["name"])
        return None

    def healthy(self) -> bool:
        """A running leader, every other live member streaming (Patroni 3.0 says "running" for
        a replica) and, in synchronous mode, one of them its synchronous standby."""
        members = {m["name"]: m for m in self.members()}
        live = [n.name for n in self.nodes if not n.killed]
        if self.leader() is None or any(name not in members for name in live):
            return False
        if any(members[name]["state"] != "running" for name in live):
            return False
        return (
            not self.synchronous
            or len(live) < 2
            or any(m["role"] == "sync_standby" for m in members.values())
        )

    def wait_healthy(self, seconds: float) -> None:
        """Until :meth:`healthy` (a node that left comes back as a streaming standby)."""
        self._wait(self.healthy, time.monotonic() + seconds, "the cluster to be healthy again")

    def switchover(self, candidate: str | None = None) -> tuple[str, str]:
        """``POST /switchover`` from the current leader (to ``candidate``, or the one Patroni
        picks); returns (old leader, new leader) once Patroni reports it done."""
        leader = self.leader()
        assert leader is not None, "no leader to switch over from"
        body: dict[str, str] = {"leader": leader}
        if candidate is not None:
            body["candidate"] = candidate
        request = urllib.request.Request(
            f"{self.node(leader).api}/switchover",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        # Patroni answers once the new leader holds the key (it polls for up to ~20 s).
        with urllib.request.urlopen(request, timeout=60) as answer:
            text = answer.read().decode()
        assert "over to" in text, text
        new = self.leader_within(30.0, not_name=leader)
        return leader, new

    def leader_within(self, seconds: float, *, not_name: str | None = None) -> str:
        """The running leader (other than ``not_name``) once there is one, within ``seconds``."""
        deadline = time.monotonic() + seconds
        found: list[str] = []

        def elected() -> bool:
            name = self.leader()
            if name is None or name == not_name:
                return False
            found.append(name)
            return True

        self._wait(elected, deadline, f"a leader other than {not_name}")
        return found[-1]

    # -- faults ----------------------------------------------------------------------------

    def kill(self, name: str) -> None:
        """SIGKILL node ``name`` whole at once, as if its machine died: Patroni, the
        postmaster and every backend (their clients see the sockets close, with no goodbye)."""
        node = self.node(name)
        assert node.proc is not None
        pids = process.process_tree({node.proc.pid}, argument=str(node.data_dir))
        node.killed = True
        process.signal_all(pids, signal.SIGKILL)
        left = process.wait_gone(pids, _KILL_WAIT)
        node.proc.wait(_KILL_WAIT)
        assert not left, f"{sorted(left)} of {name} survived SIGKILL"

    # -- stop ------------------------------------------------------------------------------

    def stop(self) -> set[int]:
        """Kill everything this cluster started and remove its directory; idempotent. Returns
        the pids of any process still running from it afterwards (normally none)."""
        with self._lock:
            self._stopped = True
            root, self.root = self.root, None
        if root is None:
            return set()
        atexit.unregister(self.stop)
        try:
            # Patroni first, so that none of them restarts its PostgreSQL under us.
            patronis = {n.proc.pid for n in self.nodes if n.proc is not None}
            process.signal_all(patronis, signal.SIGKILL)
            process.wait_gone(patronis, _KILL_WAIT)
            for node in self.nodes:
                if node.proc is not None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        node.proc.wait(_KILL_WAIT)
                # SIGQUIT to the postmaster: PostgreSQL's immediate shutdown, which takes its
                # backends down and frees its shared memory; SIGKILL for whatever outlives it.
                postmaster = _postmaster(node.data_dir)
                pids = process.process_tree(set(), argument=str(node.data_dir))
                process.stop_tree(
                    pids, leaders={postmaster}, first=signal.SIGQUIT, timeout=_KILL_WAIT
                )
                _free_shared_memory(node.data_dir)
            if self.etcd is not None:
                process.terminate(self.etcd, _KILL_WAIT)
            return leftovers(root)
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def logs(self, lines: int = 30) -> str:
        if self.root is None:
            return ""
        parts = []
        for path in [*sorted(self.root.glob("*/patroni.log")), self.root / "etcd.log"]:
            parts.append(f"--- {path.relative_to(self.root)}\n{process.log_tail(path, lines)}")
        return "\n".join(parts)


def leftovers(root: Path) -> set[int]:
    """Live processes with ``root`` in their command line, and their descendants."""
    needle = str(root).encode()
    found: set[int] = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if needle in (entry / "cmdline").read_bytes():
                    found.add(int(entry.name))
    found.discard(os.getpid())
    return process.process_tree(found)


def _postmaster(data_dir: Path) -> int:
    """The postmaster's pid from its pid file (0 when there is none)."""
    try:
        return int((data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return 0


def _free_shared_memory(data_dir: Path) -> None:
    """Remove the System V segment of a postmaster killed with SIGKILL (its key and id are on
    line 7 of postmaster.pid), once nothing is attached to it: a clean or immediate shutdown
    removes it itself, a SIGKILL cannot."""
    with contextlib.suppress(OSError, IndexError, ValueError):
        lines = (data_dir / "postmaster.pid").read_text().splitlines()
        shmid = int(lines[6].split()[1])
        for row in Path("/proc/sysvipc/shm").read_text().splitlines()[1:]:
            cols = row.split()
            if int(cols[1]) == shmid and int(cols[6]) == 0:  # shmid, nattch
                subprocess.run(["ipcrm", "-m", str(shmid)], check=False, capture_output=True)


def _run_as() -> dict[str, Any]:
    """The subprocess credentials of the system account, when we are root."""
    if os.geteuid() != 0:
        return {}
    entry = pwd.getpwnam(_SYSTEM_USER)
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}


def _clean_env() -> dict[str, str]:
    # A developer's PGHOST, PATRONI_* or ETCD_* must not steer the throwaway cluster.
    prefixes = ("PG", "PATRONI", "ETCD")
    return {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=_HTTP_TIMEOUT) as answer:
        return json.loads(answer.read())
