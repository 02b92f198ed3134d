"""Several hosts on one machine: Linux network namespaces on a bridge (needs root, iproute2).

Used by `flowlock bench --hosts N` and the multi-host tests; docs/deployment.md draws it.
The address plan and command lines are pure, so tests run them unprivileged.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from ipaddress import IPv4Interface, IPv4Network
from pathlib import Path
from typing import Any

from flowlock.bench.config import MAX_DELAY_MS, MAX_HOSTS
from flowlock.core.errors import InvalidInput
from flowlock.core.lifecycle import BlockingResource
from flowlock_lab.errors import HostsError, HostsUnavailable

__all__ = [
    "DEFAULT_DELAY_MS",
    "MAX_DELAY_MS",
    "MAX_HOSTS",
    "SUBNET_POOL",
    "Host",
    "HostPlan",
    "NamespacedHosts",
    "check_available",
    "pick_subnet",
    "plan_hosts",
    "used_networks",
]

DEFAULT_DELAY_MS = 1.0
"""The netem delay of `--hosts N` (N > 1) when none is given and the kernel has netem."""
SUBNET_POOL = IPv4Network("10.213.0.0/16")
"""Where a run's /24 comes from: private, and unlikely to be anyone's LAN; a /24 some interface
or route of the machine already uses is never picked."""
_FIRST_HOST = 10  # host i gets .10+i; the bridge is .1
_COMMAND_TIMEOUT = 15.0
_KILL_WAIT = 5.0
_NO_NETEM = "qdisc kind is unknown"  # what tc says when the kernel lacks sch_netem
_ADVICE_ROOT = (
    "run as root (the harness creates network namespaces, a bridge and veth pairs), "
    "or leave --hosts out"
)


def _ip_advice(what: str) -> str:
    return f"install iproute2 ({what}), or leave --hosts out"


# -- the plan (pure) -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Host:
    """One namespaced host: its namespace, its veth pair to the bridge, and its address.

    `veth` is the root end of the pair, `peer` the end inside the namespace.
    """

    index: int
    netns: str
    veth: str
    peer: str
    address: IPv4Interface

    @property
    def ip(self) -> str:
        """Its address without the prefix length, as a server sees a client on it."""
        return str(self.address.ip)

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this host's namespace.

        `ip netns exec` execs it, so the process is `argv[0]` itself, not a wrapper.
        """
        return ["ip", "netns", "exec", self.netns, *argv]


def _ms(delay_ms: float) -> str:
    return f"{delay_ms:g}ms"


@dataclass(frozen=True, slots=True)
class HostPlan:
    """The names and addresses of one run's hosts, and the commands that make and remove them."""

    run_id: str
    subnet: IPv4Network
    bridge: str
    gateway: IPv4Interface
    """The bridge's address: the servers listen on it."""
    hosts: tuple[Host, ...]

    @property
    def server_address(self) -> str:
        return str(self.gateway.ip)

    def host_for(self, worker: int) -> Host:
        """The host that worker number `worker` runs on: round robin, one per host."""
        return self.hosts[worker % len(self.hosts)]

    def names(self) -> tuple[str, ...]:
        """Every network namespace and interface name the run creates."""
        return (
            self.bridge,
            *(h.netns for h in self.hosts),
            *(h.veth for h in self.hosts),
            *(h.peer for h in self.hosts),
        )

    def bridge_commands(self) -> list[list[str]]:
        return [
            ["ip", "link", "add", self.bridge, "type", "bridge"],
            ["ip", "addr", "add", str(self.gateway), "dev", self.bridge],
            ["ip", "link", "set", self.bridge, "up"],
        ]

    def host_commands(self, host: Host) -> list[list[str]]:
        ns = host.netns
        # The peer is born inside the namespace: no moment where it sits in ours.
        peer = ["peer", "name", host.peer, "netns", ns]
        return [
            ["ip", "netns", "add", ns],
            ["ip", "link", "add", host.veth, "type", "veth", *peer],
            ["ip", "link", "set", host.veth, "master", self.bridge],
            ["ip", "link", "set", host.veth, "up"],
            ["ip", "-n", ns, "addr", "add", str(host.address), "dev", host.peer],
            ["ip", "-n", ns, "link", "set", host.peer, "up"],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
        ]

    def delay_commands(self, host: Host, delay_ms: float) -> list[list[str]]:
        """netem on both ends of the host's veth: each direction is delayed by `delay_ms`."""
        netem = ["root", "netem", "delay", _ms(delay_ms)]
        return [
            ["tc", "qdisc", "add", "dev", host.veth, *netem],
            ["tc", "-n", host.netns, "qdisc", "add", "dev", host.peer, *netem],
        ]

    def setup_commands(self, delay_ms: float = 0.0) -> list[list[str]]:
        """Every command that makes the run's hosts, in order."""
        found = self.bridge_commands()
        for host in self.hosts:
            found += self.host_commands(host)
        if delay_ms > 0:
            for host in self.hosts:
                found += self.delay_commands(host, delay_ms)
        return found

    def teardown_commands(self) -> list[list[str]]:
        """Every command that removes the hosts, whatever part exists.

        Deleting a namespace deletes its veth, and so the root end.
        Root ends are deleted too, in case a namespace never got its peer.
        """
        return [
            *(["ip", "netns", "delete", h.netns] for h in self.hosts),
            *(["ip", "link", "delete", h.veth] for h in self.hosts),
            ["ip", "link", "delete", self.bridge],
        ]


def _check_run_id(run_id: str) -> str:
    # Interface names have at most 15 characters: "flv" + id + "h" + two digits is 12.
    if not (isinstance(run_id, str) and 1 <= len(run_id) <= 6 and run_id.isalnum()):
        raise InvalidInput(f"run_id must be 1 to 6 letters or digits, not {run_id!r}")
    return run_id.lower()


def check_count(count: int) -> int:
    """`count` if it is a number of hosts a run can make, else InvalidInput."""
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_HOSTS:
        raise InvalidInput(f"hosts must be 1 to {MAX_HOSTS}, not {count!r}")
    return count


def check_delay(delay_ms: float) -> float:
    """`delay_ms` if it is a netem delay (0 for none), else InvalidInput."""
    if (
        isinstance(delay_ms, bool)
        or not isinstance(delay_ms, int | float)
        or not 0 <= delay_ms <= MAX_DELAY_MS
    ):
        raise InvalidInput(f"the netem delay must be 0 to {MAX_DELAY_MS:g} ms, not {delay_ms!r}")
    return float(delay_ms)


def plan_hosts(count: int, subnet: IPv4Network, run_id: str) -> HostPlan:
    """The names and addresses of `count` hosts on `subnet` (a /24) for run `run_id`."""
    check_count(count)
    run_id = _check_run_id(run_id)
    if subnet.prefixlen != 24:
        raise InvalidInput(f"the hosts' subnet must be a /24, not {subnet}")
    base = subnet.network_address
    hosts = tuple(
        Host(
            index=i,
            netns=f"flowlock-{run_id}-h{i}",
            veth=f"flv{run_id}h{i}",
            peer=f"flp{run_id}h{i}",
            address=IPv4Interface(f"{base + _FIRST_HOST + i}/24"),
        )
        for i in range(count)
    )
    return HostPlan(run_id, subnet, f"flb{run_id}", IPv4Interface(f"{base + 1}/24"), hosts)


def used_networks(addresses: Any, routes: Any) -> list[IPv4Network]:
    """The IPv4 networks the machine uses, from `ip -j -4 addr` and `ip -j -4 route`.

    That is every interface's network and every route's destination but the default.
    """
    found: list[IPv4Network] = []
    for link in addresses or ():
        for info in link.get("addr_info", ()):
            with contextlib.suppress(KeyError, ValueError, TypeError):
                found.append(IPv4Interface(f"{info['local']}/{info['prefixlen']}").network)
    for route in routes or ():
        dst = route.get("dst")
        if dst and dst != "default":
            with contextlib.suppress(ValueError, TypeError):
                found.append(IPv4Network(dst, strict=False))
    return found


def pick_subnet(used: Iterable[IPv4Network], rng: random.Random) -> IPv4Network:
    """A /24 of `SUBNET_POOL` that overlaps none of `used`.

    Subnets are tried in random order, so two runs rarely try the same one first.
    Raises HostsUnavailable when every one is taken.
    """
    taken = list(used)
    candidates = list(SUBNET_POOL.subnets(new_prefix=24))[1:-1]
    rng.shuffle(candidates)
    for net in candidates:
        if not any(net.overlaps(other) for other in taken):
            return net
    raise HostsUnavailable(
        f"every /24 of {SUBNET_POOL} overlaps a network of this machine",
        advice="free one of them, or leave --hosts out",
    )


def check_available(*, delay: bool = False) -> None:
    """Check what can be told without changing anything: Linux, root, `ip`, `tc`.

    `tc` is needed only for a delay. Raises HostsUnavailable naming the first missing fact.
    """
    if not sys.platform.startswith("linux"):
        raise HostsUnavailable(
            f"network namespaces are Linux only, and this is {sys.platform}",
            advice="run on Linux, or leave --hosts out",
        )
    if os.geteuid() != 0:
        raise HostsUnavailable("not running as root", advice=_ADVICE_ROOT)
    if shutil.which("ip") is None:
        raise HostsUnavailable("no 'ip' command on PATH", advice=_ip_advice("the ip command"))
    if delay and shutil.which("tc") is None:
        raise HostsUnavailable(
            "no 'tc' command on PATH for the netem delay",
            advice="install iproute2 (tc), or give a delay of 0",
        )


# -- running commands ------------------------------------------------------------------------------


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            timeout=_COMMAND_TIMEOUT,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return subprocess.CompletedProcess(list(argv), -1, "", str(exc))


def _must(argv: Sequence[str]) -> str:
    """Run `argv` and return its stdout, or raise HostsError quoting its output.

    It raises HostsUnavailable when the kernel refused the privilege.
    """
    done = _run(argv)
    if done.returncode == 0:
        return done.stdout
    said = (done.stderr or done.stdout).strip() or f"exit status {done.returncode}"
    line = " ".join(argv)
    if "Operation not permitted" in said or "Permission denied" in said:
        raise HostsUnavailable(
            f"{line!r} was refused: {said}",
            advice="run as root with CAP_NET_ADMIN and CAP_SYS_ADMIN (a container needs "
            "--privileged or those capabilities), or leave --hosts out",
        )
    raise HostsError(f"{line!r} failed: {said}", advice="read the message above")


def _json(argv: Sequence[str]) -> Any:
    try:
        return json.loads(_must(argv) or "[]")
    except ValueError:
        return []


@contextlib.contextmanager
def _subnet_lock() -> Iterator[None]:
    """Held from picking a subnet until the bridge holds its address.

    So two runs starting at once never pick the same /24: the second sees the first's bridge.
    """
    import fcntl

    folder = Path("/run/lock") if Path("/run/lock").is_dir() else Path(tempfile.gettempdir())
    with (folder / "flowlock-hosts.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _netns_pids(netns: str) -> list[int]:
    done = _run(["ip", "netns", "pids", netns])
    if done.returncode != 0:
        return []
    return [int(p) for p in done.stdout.split() if p.isdigit()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- the harness -----------------------------------------------------------------------------------


@dataclass(slots=True)
class _State:
    plan: HostPlan | None = None
    delay_ms: float = 0.0
    notes: list[str] = field(default_factory=list)
    killed: list[int] = field(default_factory=list)


class NamespacedHosts(BlockingResource):
    """`count` namespaced hosts on a bridge of their own.

    `start` makes them and `stop` removes them; `with` and `async with` do both.
    `delay_ms` is the netem delay in each direction of each host's link.
    A round trip to the servers then gains twice the delay.
    None means `DEFAULT_DELAY_MS` when `count` > 1 and netem exists, else none.
    `notes` then says why. A number means exactly that; 0 means none.
    A delay that cannot be applied raises HostsUnavailable.
    `run_id` goes in every name, so parallel runs never meet (default: random).
    """

    _thread_name = "flowlock-hosts-stop"

    def __init__(
        self, count: int, *, delay_ms: float | None = None, run_id: str | None = None
    ) -> None:
        self.count = check_count(count)
        self._wanted = None if delay_ms is None else check_delay(delay_ms)
        self.run_id = _check_run_id(run_id if run_id is not None else secrets.token_hex(3))
        self._lock = threading.RLock()
        self._state = _State()

    # -- what a caller reads -----------------------------------------------------------------------

    @property
    def plan(self) -> HostPlan:
        plan = self._state.plan
        if plan is None:
            raise HostsError("the hosts are not set up", advice="call start() or use `with`")
        return plan

    @property
    def hosts(self) -> tuple[Host, ...]:
        return self.plan.hosts

    @property
    def server_address(self) -> str:
        """The bridge's address, for the servers to listen on."""
        return self.plan.server_address

    @property
    def delay_ms(self) -> float:
        """The netem delay applied (0: none)."""
        return self._state.delay_ms

    @property
    def notes(self) -> tuple[str, ...]:
        """What a report should say about the hosts, such as a delay that could not be applied."""
        return tuple(self._state.notes)

    @property
    def killed(self) -> tuple[int, ...]:
        """Processes `stop` found still inside a namespace and ended."""
        return tuple(self._state.killed)

    def describe(self) -> dict[str, Any]:
        """The hosts as a report states them."""
        plan = self.plan
        return {
            "count": self.count,
            "subnet": str(plan.subnet),
            "server_address": plan.server_address,
            "addresses": [h.ip for h in plan.hosts],
            "netem_delay_ms": self.delay_ms,
            "run_id": self.run_id,
        }

    # -- start -------------------------------------------------------------------------------------

    def start(self) -> None:
        """Make the hosts; on any failure, Ctrl-C included, remove what was made and raise.

        Raises HostsUnavailable when the machine cannot make them at all.
        """
        with self._lock:
            if self._state.plan is not None:
                return
            check_available(delay=bool(self._wanted))
            try:
                self._make()
            except BaseException:
                with contextlib.suppress(Exception):
                    self._teardown()
                raise

    def _make(self) -> None:
        with _subnet_lock():
            used = used_networks(
                _json(["ip", "-j", "-4", "addr"]), _json(["ip", "-j", "-4", "route"])
            )
            plan = plan_hosts(self.count, pick_subnet(used, random.Random()), self.run_id)
            # Known from here on, so a failure below removes whatever part exists.
            self._state.plan = plan
            for argv in plan.bridge_commands():
                _must(argv)
        try:
            _must(["ip", "netns", "add", plan.hosts[0].netns])
        except HostsError as exc:
            raise HostsUnavailable(
                f"cannot create a network namespace: {exc.problem}",
                advice="run as root on a kernel with network namespaces (a container needs "
                "--privileged), or leave --hosts out",
            ) from exc
        for host in plan.hosts:
            for argv in plan.host_commands(host):
                if argv[:3] == ["ip", "netns", "add"] and host.index == 0:
                    continue  # made above, to tell "no namespaces here" from other failures
                _must(argv)
        self._delay(plan)

    def _delay(self, plan: HostPlan) -> None:
        wanted = self._wanted
        if wanted is None:
            if self.count == 1:
                return
            if shutil.which("tc") is None:
                self._state.notes.append("no netem delay: no 'tc' command (install iproute2)")
                return
            wanted = DEFAULT_DELAY_MS
        if wanted <= 0:
            return
        for host in plan.hosts:
            for argv in plan.delay_commands(host, wanted):
                try:
                    _must(argv)
                except HostsError as exc:
                    if _NO_NETEM not in exc.problem:
                        raise
                    if self._wanted is not None:
                        raise HostsUnavailable(
                            "the kernel has no netem (CONFIG_NET_SCH_NETEM), so no delay "
                            "can be added to the hosts' links",
                            advice="give a netem delay of 0, or use a kernel with netem",
                        ) from exc
                    self._state.notes.append(
                        "no netem delay: the kernel has no netem (CONFIG_NET_SCH_NETEM); "
                        "the hosts' links add only the veth and bridge hops"
                    )
                    self._clear_delay(plan)
                    return
        self._state.delay_ms = wanted

    @staticmethod
    def _clear_delay(plan: HostPlan) -> None:
        for host in plan.hosts:
            _run(["tc", "qdisc", "del", "dev", host.veth, "root"])
            _run(["tc", "-n", host.netns, "qdisc", "del", "dev", host.peer, "root"])

    # -- stop --------------------------------------------------------------------------------------

    def stop(self) -> None:
        """End processes left in the namespaces, remove everything, and check no name is left.

        Raises HostsError naming what is left. Idempotent.
        It finishes even when interrupted, then re-raises the interruption.
        """
        with self._lock:
            self._teardown()

    def _teardown(self) -> None:
        plan = self._state.plan
        if plan is None:
            return
        interrupted: BaseException | None = None
        try:
            self._end_processes(plan)
        except BaseException as exc:
            interrupted = exc
        for argv in plan.teardown_commands():
            try:
                _run(argv)  # a name already gone fails harmlessly; what is left is checked
            except BaseException as exc:
                # Ctrl-C mid-way: the remaining names are still removed, then it propagates.
                interrupted = interrupted or exc
        left = self._still_there(plan)
        self._state.plan = None
        if interrupted is not None:
            raise interrupted
        if left:
            raise HostsError(
                f"could not remove {', '.join(left)}",
                advice="remove them by hand: ip netns delete NAME / ip link delete NAME",
            )

    def _still_there(self, plan: HostPlan) -> list[str]:
        """What is left of the run, looked at again for a moment.

        The kernel destroys a deleted namespace's interfaces in the background.
        So a veth may briefly outlive its namespace; it is deleted again meanwhile.
        """
        deadline = time.monotonic() + _KILL_WAIT
        while True:
            left = self.leftovers()
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.1)
            for argv in plan.teardown_commands():
                if argv[-1] in left:
                    _run(argv)

    def _end_processes(self, plan: HostPlan) -> None:
        """End processes still in our namespaces (workers that did not exit): TERM, then KILL."""
        pids = {pid for host in plan.hosts for pid in _netns_pids(host.netns)}
        pids.discard(os.getpid())
        if not pids:
            return
        self._state.killed.extend(sorted(pids))
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + _KILL_WAIT
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.05)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def pids(self) -> dict[str, list[int]]:
        """The processes inside each of the run's namespaces now."""
        return {h.netns: _netns_pids(h.netns) for h in self.plan.hosts}

    def leftovers(self) -> list[str]:
        """The run's namespaces and interfaces that exist now (none once stopped)."""
        found = [n for n in _run(["ip", "netns", "list"]).stdout.split() if self.run_id in n]
        links = _run(["ip", "-o", "link", "show"]).stdout
        for line in links.splitlines():
            parts = line.split(":", 2)
            if len(parts) > 1:
                name = parts[1].strip().partition("@")[0]
                if self.run_id in name:
                    found.append(name)
        return found
