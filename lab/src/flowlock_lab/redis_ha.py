"""Throwaway highly available Redis on 127.0.0.1, for failover tests and benchmarks.


    with EmbeddedRedisSentinel() as ha:
        locks = RedisLocks(ha.url)  # redis+sentinel://127.0.0.1:p1,...,127.0.0.1:p3/flowlock
        old = ha.kill_primary()
        new = ha.wait_failover(old)

    with EmbeddedRedisCluster() as cluster:
        locks = RedisLocks(cluster.url)  # redis+cluster://127.0.0.1:p1,...
        killed = cluster.kill(cluster.primaries()[0])
        cluster.wait_failover(killed)

Every server is an [`EmbeddedRedis`][flowlock.embedded.EmbeddedRedis]. `stop()` removes every
process and directory, also after a failed start.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Self

import redis

from flowlock.core.lifecycle import BlockingResource
from flowlock.embedded import process
from flowlock.embedded.errors import EmbeddedServerError
from flowlock.embedded.redis import EmbeddedRedis

__all__ = ["EmbeddedRedisCluster", "EmbeddedRedisSentinel", "redis_cli", "sentinel_command"]

_ASK = 0.5  # seconds one admin command may take
_POLL = 0.05


def sentinel_command() -> list[str] | None:
    """How to start a sentinel: `redis-sentinel`, else `redis-server --sentinel`.

    None when neither is on PATH.
    """
    found = shutil.which("redis-sentinel")
    if found:
        return [found]
    server = shutil.which("redis-server")
    return [server, "--sentinel"] if server else None


def redis_cli() -> str | None:
    """`redis-cli` from PATH (it creates a cluster), or None."""
    return shutil.which("redis-cli")


def _ask(port: int, *command: str) -> Any:
    """One admin command to the server (or sentinel) on `port`, on a connection of its own."""
    with redis.Redis(
        host=process.HOST,
        port=port,
        socket_timeout=_ASK,
        socket_connect_timeout=_ASK,
        decode_responses=True,
    ) as client:
        return client.execute_command(*command)


def _until(what: str, ready: object, timeout: float) -> None:
    """Poll `ready()` until it is true; errors count as not yet.

    Raises EmbeddedServerError after `timeout` seconds.
    """
    assert callable(ready)
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(redis.RedisError, OSError):
            if ready():
                return
        if time.monotonic() > deadline:
            raise EmbeddedServerError("Redis", f"{what} did not happen within {timeout:g} s")
        time.sleep(_POLL)


class _Group(BlockingResource):
    """Servers started together and stopped together, whatever happened in between."""

    _thread_name = "flowlock-redis-group-stop"

    def __init__(self, start_timeout: float) -> None:
        self._start_timeout = start_timeout
        self.servers: list[EmbeddedRedis] = []

    def _server(self, settings: dict[str, str]) -> EmbeddedRedis:
        # A replica's first sync starts at once (the default waits 5 s for more replicas).
        settings = {"repl-diskless-sync-delay": "0", **settings}
        server = EmbeddedRedis(start_timeout=self._start_timeout, settings=settings)
        self.servers.append(server)
        server.start()
        return server

    def stop(self) -> None:
        """Stop every process and remove every directory; idempotent."""
        for server in self.servers:
            server.stop()

    def _synced(self) -> bool:
        """Whether every running replica has synced its primary's data.

        A replica that never synced is not promoted.
        """
        for server in self.servers:
            if server.running:
                info = _ask(server.port, "INFO", "replication")  # parsed by redis-py
                if info.get("role") == "slave" and info.get("master_link_status") != "up":
                    return False
        return True

    def __enter__(self) -> Self:
        # A group that came up in part (a replica, no sentinels) is taken down whole.
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self


class EmbeddedRedisSentinel(_Group):
    """A primary with `replicas` replicas, watched by `sentinels` sentinels.

    They monitor it as `service_name`, with a majority quorum. `down_after` is how many
    seconds a primary may be silent before it is seen down; keep it short for fast failovers.
    """

    def __init__(
        self,
        *,
        replicas: int = 2,
        sentinels: int = 3,
        service_name: str = "flowlock",
        down_after: float = 1.0,
        failover_timeout: float = 5.0,
        start_timeout: float = 30.0,
    ) -> None:
        super().__init__(start_timeout)
        self.service_name = service_name
        self._replicas = replicas
        self._sentinels = sentinels
        self._down_after_ms = int(down_after * 1000)
        self._failover_ms = int(failover_timeout * 1000)
        self._procs: list[subprocess.Popen[bytes]] = []
        self.sentinel_ports: list[int] = []
        self._root: Path | None = None

    @property
    def url(self) -> str:
        """`redis+sentinel://127.0.0.1:<port>,.../<service_name>`."""
        hosts = ",".join(f"{process.HOST}:{port}" for port in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{self.service_name}"

    def start(self) -> None:
        """Start the servers and sentinels, and return once every sentinel sees them all.

        A failover needs every sentinel to know the primary, its replicas and each other.
        """
        command = sentinel_command()
        if command is None:
            raise EmbeddedServerError("Redis", "no redis-sentinel or redis-server on PATH")
        primary = self._server({})
        for _ in range(self._replicas):
            self._server({"replicaof": f"{process.HOST} {primary.port}"})
        self._root = process.make_root("flowlock-sentinel-")
        for n in range(self._sentinels):
            self._sentinel(command, n, primary.port)
        _until("the replicas' first sync", self._synced, self._start_timeout)
        for port in self.sentinel_ports:
            _until(
                f"sentinel {port} seeing every replica and sentinel",
                lambda port=port: self._sees_all(port),
                self._start_timeout,
            )

    def _sentinel(self, command: list[str], n: int, primary_port: int) -> None:
        assert self._root is not None
        port = process.free_port()
        conf = self._root / f"sentinel-{n}.conf"
        name, quorum = self.service_name, self._sentinels // 2 + 1
        conf.write_text(
            f"port {port}\nbind {process.HOST}\ndir {self._root}\n"
            f"logfile {self._root / f'sentinel-{n}.log'}\n"
            f"sentinel monitor {name} {process.HOST} {primary_port} {quorum}\n"
            f"sentinel down-after-milliseconds {name} {self._down_after_ms}\n"
            f"sentinel failover-timeout {name} {self._failover_ms}\n"
            f"sentinel parallel-syncs {name} 1\n"
        )
        # The configuration file comes first: redis-server reads it from its first argument.
        proc = process.spawn([command[0], str(conf), *command[1:]], cwd=self._root)
        self._procs.append(proc)
        self.sentinel_ports.append(port)

        def ping() -> bool:
            try:
                return bool(_ask(port, "PING"))
            except redis.RedisError:  # not listening yet
                return False

        if not process.wait_ready(proc, ping, time.monotonic() + self._start_timeout):
            tail = process.log_tail(self._root / f"sentinel-{n}.log")
            raise EmbeddedServerError("Redis", f"sentinel {n} did not start\n{tail}")

    def _sees_all(self, port: int) -> bool:
        reply = _ask(port, "SENTINEL", "MASTER", self.service_name)
        # redis-py answers with a dict (its response callback), a bare client with a flat list.
        flat = isinstance(reply, list)
        state = dict(zip(reply[::2], reply[1::2], strict=True)) if flat else reply
        return bool(
            int(state["num-slaves"]) >= self._replicas
            and int(state["num-other-sentinels"]) >= self._sentinels - 1
        )

    def primary_port(self) -> int:
        """The primary's port as the first sentinel that answers names it."""
        for port in self.sentinel_ports:
            with contextlib.suppress(redis.RedisError, OSError):
                _, primary = _ask(port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service_name)
                return int(primary)
        raise EmbeddedServerError("Redis", "no sentinel answered")

    def server(self, port: int) -> EmbeddedRedis:
        """The server on `port`."""
        return next(s for s in self.servers if s.running and s.port == port)

    @property
    def primary(self) -> EmbeddedRedis:
        """The server the sentinels name as the primary now."""
        return self.server(self.primary_port())

    def kill_primary(self) -> int:
        """SIGKILL the primary (a crash); its port."""
        primary = self.primary
        port = primary.port
        primary.kill()
        return port

    def wait_failover(self, old_port: int, timeout: float = 30.0) -> EmbeddedRedis:
        """Wait for a new primary other than `old_port`, and return it.

        Every sentinel must name it, and the server must say it is a primary.
        """

        def done() -> bool:
            ports = {
                int(_ask(s, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service_name)[1])
                for s in self.sentinel_ports
            }
            if len(ports) != 1 or old_port in ports:
                return False
            return str(_ask(ports.pop(), "ROLE")[0]) == "master"

        _until("the failover", done, timeout)
        return self.primary

    def stop(self) -> None:
        """Stop the sentinels and the servers, and remove their directories; idempotent."""
        procs, self._procs = self._procs, []
        for proc in procs:
            process.terminate(proc, 5.0)
        root, self._root = self._root, None
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)
        super().stop()


class EmbeddedRedisCluster(_Group):
    """A Redis Cluster of `primaries` primaries with `replicas` replicas each.

    Created with `redis-cli --cluster create`. `node_timeout` is how many seconds a silent
    primary keeps its slots before a replica takes over.
    """

    def __init__(
        self,
        *,
        primaries: int = 3,
        replicas: int = 1,
        node_timeout: float = 1.0,
        start_timeout: float = 60.0,
    ) -> None:
        super().__init__(start_timeout)
        self._primaries = primaries
        self._replicas = replicas
        self._node_timeout_ms = int(node_timeout * 1000)

    @property
    def url(self) -> str:
        """`redis+cluster://127.0.0.1:<port>,...` (every node)."""
        ports = [s.port for s in self.servers if s.running]
        return "redis+cluster://" + ",".join(f"{process.HOST}:{port}" for port in ports)

    def start(self) -> None:
        """Start the nodes, create the cluster, and return once every node sees it whole."""
        cli = redis_cli()
        if cli is None:
            raise EmbeddedServerError("Redis", "no redis-cli on PATH (it creates the cluster)")
        for _ in range(self._primaries * (1 + self._replicas)):
            # The cluster bus port is the data port + 10000 unless given: a free one of its own.
            self._server(
                {
                    "cluster-enabled": "yes",
                    "cluster-config-file": "nodes.conf",
                    "cluster-node-timeout": str(self._node_timeout_ms),
                    "cluster-port": str(process.free_port()),
                }
            )
        addresses = [f"{process.HOST}:{s.port}" for s in self.servers]
        created = process.run(
            [cli, "--cluster", "create", *addresses, "--cluster-replicas", str(self._replicas),
             "--cluster-yes"],
            cwd=Path(tempfile.gettempdir()), timeout=self._start_timeout,
        )  # fmt: skip
        if not created.ok:
            raise EmbeddedServerError(
                "Redis", f"redis-cli --cluster create failed:\n{created.output[-2000:]}"
            )
        _until("the cluster coming up", self._whole, self._start_timeout)
        _until("the replicas' first sync", self._synced, self._start_timeout)

    def _whole(self) -> bool:
        for server in self.servers:
            if not server.running:
                continue
            if "cluster_state:ok" not in _ask(server.port, "CLUSTER", "INFO"):
                return False
            if len(self._nodes(server.port)) < len(self.servers):
                return False
        return True

    @staticmethod
    def _nodes(port: int) -> list[list[str]]:
        text = _ask(port, "CLUSTER", "NODES")
        return [line.split() for line in str(text).splitlines() if line.strip()]

    def primaries(self) -> list[EmbeddedRedis]:
        """The running nodes that are primaries now (with slots)."""
        found = []
        for server in self.servers:
            if not server.running:
                continue
            with contextlib.suppress(redis.RedisError, OSError):
                if str(_ask(server.port, "ROLE")[0]) == "master":
                    found.append(server)
        return found

    def kill(self, server: EmbeddedRedis) -> int:
        """SIGKILL one node (a crash); its port."""
        port = server.port
        server.kill()
        return port

    def wait_failover(self, killed_port: int, timeout: float = 30.0) -> None:
        """Wait until a replica took over the killed node's slots, and the cluster is ok."""

        def done() -> bool:
            for server in self.servers:
                if not server.running:
                    continue
                if "cluster_state:ok" not in _ask(server.port, "CLUSTER", "INFO"):
                    return False
                for node in self._nodes(server.port):
                    address, flags = node[1], node[2]
                    owns_slots = len(node) > 8
                    dead = address.startswith(f"{process.HOST}:{killed_port}@")
                    if dead and "master" in flags and owns_slots:
                        return False
            return True

        _until("the cluster failover", done, timeout)
