"""Several hosts on one machine: engines in separate Linux network namespaces, each reaching an
embedded PostgreSQL (and Redis) on the namespaces' bridge over its own link and address.

- an instance escalated by one host's adaptive engine is seen escalated, and run under the lock,
  by the engines of the other hosts, which made no call on it before: they learnt it from the
  escalation board in PostgreSQL;
- ``run_bench(hosts=3)``: the cluster scenario with its worker processes on three hosts, every
  call applied exactly once, the checker clean;
- an explicit netem delay is applied, or refused with the reason (a kernel without netem).

Each test ends with the checker (where there is a history) and a check that no namespace, veth,
bridge, process or connection of it is left. Without root, iproute2 or network namespaces they
skip, saying which.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flowlock.bench import BenchConfig
from flowlock.bench.scenarios import counter
from flowlock.bench.servers import count_connections_from
from flowlock.checker import check
from flowlock.embedded import EmbeddedPostgres, EmbeddedRedis
from flowlock.engine import Engine
from flowlock.stores.postgres import PostgresStore
from flowlock_lab.errors import HostsUnavailable
from flowlock_lab.hosts import NamespacedHosts, check_available
from flowlock_lab.matrix import run_bench

WORKER = Path(__file__).with_name("host_worker.py")
SCHEMA = "flowlock_hosts"
WAIT = 90.0  # seconds a host's worker may take, on a loaded 2-core machine


def _skip_unless_available() -> None:
    try:
        check_available()
    except HostsUnavailable as exc:
        pytest.skip(f"namespaced hosts unavailable: {exc.reason}")


@pytest.fixture
def hosts() -> Iterator[NamespacedHosts]:
    """Three namespaced hosts, removed after the test (which checks that nothing is left)."""
    _skip_unless_available()
    made = NamespacedHosts(3)
    try:
        made.start()
    except HostsUnavailable as exc:
        pytest.skip(f"namespaced hosts unavailable: {exc.reason}")
    try:
        yield made
    finally:
        made.stop()


def _our_children() -> list[str]:
    """This process's live child processes (their command lines): the workers must be gone."""
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        # The parent pid is the 2nd field after the command name, which is in parentheses.
        fields = stat.rpartition(")")[2].split()
        if int(fields[1]) == me and fields[0] != "Z" and "flowlock" in cmdline:
            found.append(cmdline.strip())
    return found


def _output(argv: list[str]) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=False).stdout


def _namespaces_and_links() -> str:
    """Every network namespace and interface of the machine, as ``ip`` lists them."""
    return _output(["ip", "netns", "list"]) + _output(["ip", "-o", "link"])


def _assert_nothing_left(made: NamespacedHosts) -> None:
    assert made.leftovers() == []
    assert made.killed == ()  # no process was still inside a namespace at the end
    assert _our_children() == []


async def _settled_connections(url: str, addresses: list[str]) -> int:
    """Connections from the hosts' addresses, once the servers have seen the closed sockets."""
    for _ in range(50):
        left = await count_connections_from(url, addresses)
        if not left:
            return 0
        await asyncio.sleep(0.1)
    return left


async def _on_host(made: NamespacedHosts, index: int, **conf: Any) -> asyncio.subprocess.Process:
    argv = made.hosts[index].command([sys.executable, str(WORKER), json.dumps(conf)])
    return await asyncio.create_subprocess_exec(
        *argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


async def _answer(proc: asyncio.subprocess.Process) -> dict[str, Any]:
    try:
        out, err = await asyncio.wait_for(proc.communicate(), WAIT)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()[-3000:]
    answer: dict[str, Any] = json.loads(out.decode().splitlines()[-1])
    return answer


@pytest.mark.slow
async def test_an_escalation_decided_on_one_host_is_adopted_on_the_others(
    hosts: NamespacedHosts,
) -> None:
    """Host h0 runs a storm of adaptive calls on one instance until its engine escalates it;
    hosts h1 and h2, which make no call until they see it escalated, adopt it from the board
    in PostgreSQL and run their calls under the row lock. Every engine connects from its own
    host's address; every step is in history exactly once."""
    subnet = str(hosts.plan.subnet)
    addresses = [h.ip for h in hosts.hosts]
    async with EmbeddedPostgres(host=hosts.server_address, trusted_networks=[subnet]) as pg:
        engine = await Engine(PostgresStore(pg.url, schema=SCHEMA, pool_size=2)).open()
        try:
            await engine.register(counter())
            await engine.create("counter", instance_id="hot", data={"n": 0})
            conf = {"url": pg.url, "schema": SCHEMA, "instance": "hot"}
            # The observers first: they must be waiting before anything is escalated.
            observers = [await _on_host(hosts, i, role="observe", calls=5, **conf) for i in (1, 2)]
            escalator = await _on_host(hosts, 0, role="escalate", **conf)
            answers = await asyncio.gather(_answer(escalator), *map(_answer, observers))
        finally:
            await engine.aclose()
        decided, *adopted = answers
        assert [a["seen_as"] for a in answers] == addresses
        assert "conflict rate" in decided["reason"], decided
        assert decided["on_board"] is True
        assert (decided["escalations"], decided["adopted"]) == (1, 0)
        for seen in adopted:
            # Learnt from the board: its own engine never saw a conflict on the instance.
            assert (seen["escalations"], seen["adopted"]) == (1, 1), seen
            assert seen["reason"] == decided["reason"]
            assert seen["strategies"] == ["pessimistic"] * 5

        engine = await Engine(PostgresStore(pg.url, schema=SCHEMA, pool_size=2)).open()
        try:
            await engine.register(counter())
            final, history = await engine.get("hot"), await engine.history("hot")
        finally:
            await engine.aclose()
        applied = sum(a["applied"] for a in answers)
        verdict = check(final, history, initial_state="open", expected_applied=applied)
        assert verdict.ok, verdict.violations
        assert final.data["n"] == applied == len(history)
        assert {e.strategy for e in history} == {"optimistic", "pessimistic"}
        assert await _settled_connections(pg.url, addresses) == 0
    hosts.stop()
    _assert_nothing_left(hosts)


@pytest.mark.slow
async def test_the_cluster_scenario_across_three_hosts() -> None:
    """The cluster scenario's worker processes on three namespaced hosts (one each), adaptive
    and distributed-redis: every call applied once, the checker clean, the escalation counts
    reported, nothing left on the hosts before they are removed, and nothing of them after."""
    _skip_unless_available()
    if EmbeddedRedis.find_executable() is None:
        pytest.skip("no redis-server for distributed-redis")
    config = BenchConfig(
        hosts=3,
        scenarios=("cluster",),
        strategies=("adaptive", "distributed-redis"),
        quick=True,
        workers=60,
        processes=3,
        seed=13,
    )
    try:
        report = await run_bench(config)
    except HostsUnavailable as exc:
        pytest.skip(f"namespaced hosts unavailable: {exc.reason}")
    assert report.ok, [r.verdict for r in report.results]
    hosts_doc = report.args["hosts"]
    assert hosts_doc["count"] == 3 and len(hosts_doc["addresses"]) == 3
    assert hosts_doc["left"] == {"processes": 0, "connections": 0, "redis_clients": 0}
    assert [(r.scenario, r.strategy) for r in report.results] == [
        ("cluster", "adaptive"),
        ("cluster", "distributed-redis"),
    ]
    for r in report.results:
        assert (r.hosts, r.processes) == (3, 3)
        assert r.verdict.ok and r.double_advanced_rounds == 0
        # Must-apply steps: every call applied, once.
        assert r.applied == r.calls == 60 * r.ops, (r.strategy, r.errors)
        assert r.escalated is not None and r.adopted is not None
        assert 0 <= r.adopted <= r.escalated
    # Removed: no namespace or interface of the run, no worker process.
    assert hosts_doc["run_id"] not in _namespaces_and_links()
    assert _our_children() == []


def test_an_explicit_netem_delay_is_applied_or_refused_with_its_reason() -> None:
    """A delay asked for by number is on both ends of every host's link, or, on a kernel
    without netem, refused with that reason and nothing left behind."""
    _skip_unless_available()
    made = NamespacedHosts(2, delay_ms=1.5)
    try:
        made.start()
    except HostsUnavailable as exc:
        if "netem" not in exc.reason:
            pytest.skip(f"namespaced hosts unavailable: {exc.reason}")
        assert "CONFIG_NET_SCH_NETEM" in exc.reason
        _assert_nothing_left(made)
        return
    try:
        assert made.delay_ms == 1.5
        for host in made.hosts:
            ours = _output(["tc", "qdisc", "show", "dev", host.veth])
            theirs = _output(["tc", "-n", host.netns, "qdisc", "show", "dev", host.peer])
            assert "netem" in ours and "delay 1.5ms" in ours
            assert "netem" in theirs and "delay 1.5ms" in theirs
    finally:
        made.stop()
    _assert_nothing_left(made)


def _our_namespaces() -> set[str]:
    listed = _output(["ip", "netns", "list"])
    return {line.split()[0] for line in listed.splitlines() if line.startswith("flowlock-")}


def _netns_pids(names: set[str]) -> set[int]:
    found: set[int] = set()
    for name in names:
        found.update(int(p) for p in _output(["ip", "netns", "pids", name]).split())
    return found


@pytest.mark.slow
def test_ctrl_c_removes_the_hosts_and_their_workers() -> None:
    """Ctrl-C while the workers run on two namespaced hosts: exit code 130, the workers gone,
    the namespaces, veths and bridge removed, and the embedded servers' directories too."""
    _skip_unless_available()
    before = _our_namespaces()
    root = Path(tempfile.mkdtemp(prefix="flowlock-test-hosts-"))
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("FLOWLOCK_")},
        "TMPDIR": str(root),
    }
    argv = [sys.executable, "-m", "flowlock", "bench", "--hosts", "2", "-t", "raw"]
    proc = subprocess.Popen(
        [*argv, "-s", "spread", "--ops", "400"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 60
        # Running: the run's namespaces exist and its workers run inside them.
        while time.monotonic() < deadline:
            made = _our_namespaces() - before
            workers = _netns_pids(made)
            if len(made) == 2 and len(workers) == 4:
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        else:
            pytest.fail("the run did not get going within 60 s")
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        leftovers = sorted(p.name for p in root.iterdir())
        shutil.rmtree(root, ignore_errors=True)
    assert proc.returncode == 130, err[-3000:]
    assert _our_namespaces() & made == set()
    listed = _namespaces_and_links()
    assert not [run_id for run_id in {name.split("-")[1] for name in made} if run_id in listed]
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()]
    assert leftovers == []
