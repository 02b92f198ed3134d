"""The namespaced hosts of ``flowlock bench --hosts``, without privileges: the address plan, the
command lines that make and remove the hosts and start a worker on one, the choice of a free
subnet, the config and command-line rules, what the report says, and the typed refusal where the
machine cannot make hosts.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from dataclasses import replace
from ipaddress import IPv4Interface, IPv4Network
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

import flowlock
from flowlock.bench import BenchConfig, BenchReport
from flowlock.bench import runner as bench_runner
from flowlock.bench.config import HOSTS_SCENARIOS
from flowlock.bench.extend import Lab
from flowlock.bench.procs import WORKER_ARGV, Closed, WorkerPool, reply_from_dict
from flowlock.bench.progress import Progress
from flowlock.bench.report import render, to_json
from flowlock.bench.report.tables import title
from flowlock.bench.results import HTTP, IN_PROCESS, ConnectionStats, Params, Timed, summarise
from flowlock.bench.scenarios import SCENARIOS
from flowlock.cli import app
from flowlock.core.errors import FlowlockError, InvalidInput
from flowlock.embedded import EmbeddedPostgres, EmbeddedRedis
from flowlock_lab.errors import HostsError, HostsUnavailable
from flowlock_lab.hosts import (
    MAX_HOSTS,
    SUBNET_POOL,
    NamespacedHosts,
    check_available,
    pick_subnet,
    plan_hosts,
    used_networks,
)

SUBNET = IPv4Network("10.213.7.0/24")


# -- the plan ------------------------------------------------------------------------------------


def test_the_plan_names_and_addresses_every_host() -> None:
    """The bridge takes .1, host i takes .10+i; every name carries the run id, and interface
    names fit Linux's 15 characters even at the most hosts."""
    plan = plan_hosts(3, SUBNET, "3fa2c1")
    assert plan.gateway == IPv4Interface("10.213.7.1/24")
    assert plan.server_address == "10.213.7.1"
    assert [h.ip for h in plan.hosts] == ["10.213.7.10", "10.213.7.11", "10.213.7.12"]
    assert [h.netns for h in plan.hosts] == [f"flowlock-3fa2c1-h{i}" for i in range(3)]
    assert all("3fa2c1" in name for name in plan.names())
    widest = plan_hosts(MAX_HOSTS, SUBNET, "abcdef")
    interfaces = [widest.bridge, *(h.veth for h in widest.hosts), *(h.peer for h in widest.hosts)]
    assert max(len(n) for n in interfaces) <= 15
    assert len(set(widest.names())) == len(widest.names())


def test_workers_go_round_robin_over_the_hosts() -> None:
    plan = plan_hosts(2, SUBNET, "ab")
    assert [plan.host_for(p).index for p in range(5)] == [0, 1, 0, 1, 0]


@pytest.mark.parametrize(
    ("count", "subnet", "run_id", "message"),
    [
        (0, SUBNET, "ab", "hosts must be 1 to 16, not 0"),
        (MAX_HOSTS + 1, SUBNET, "ab", "hosts must be 1 to 16"),
        (2, IPv4Network("10.213.0.0/16"), "ab", "must be a /24"),
        (2, SUBNET, "abcdefg", "run_id must be 1 to 6 letters or digits"),
        (2, SUBNET, "a-b", "run_id must be 1 to 6 letters or digits"),
    ],
)
def test_the_plan_refuses_what_cannot_be_made(
    count: int, subnet: IPv4Network, run_id: str, message: str
) -> None:
    with pytest.raises(InvalidInput, match=message):
        plan_hosts(count, subnet, run_id)


def test_the_commands_make_and_remove_exactly_the_plan() -> None:
    """Bridge first, then per host its namespace and veth (the peer born inside it), the
    addresses, links up; netem on both ends of each link only when asked; teardown deletes the
    namespaces, the root ends and the bridge, whatever part exists."""
    plan = plan_hosts(2, SUBNET, "ab12")
    h0 = plan.hosts[0]
    setup = plan.setup_commands()
    assert setup[:3] == [
        ["ip", "link", "add", "flbab12", "type", "bridge"],
        ["ip", "addr", "add", "10.213.7.1/24", "dev", "flbab12"],
        ["ip", "link", "set", "flbab12", "up"],
    ]
    assert ["ip", "netns", "add", "flowlock-ab12-h0"] in setup
    assert [
        "ip", "link", "add", "flvab12h0", "type", "veth",
        "peer", "name", "flpab12h0", "netns", "flowlock-ab12-h0",
    ] in setup  # fmt: skip
    assert ["ip", "-n", h0.netns, "addr", "add", "10.213.7.10/24", "dev", "flpab12h0"] in setup
    assert not [c for c in setup if c[0] == "tc"]
    delayed = plan.setup_commands(delay_ms=1.5)
    netem = [c for c in delayed if c[0] == "tc"]
    assert len(netem) == 4
    assert ["tc", "qdisc", "add", "dev", "flvab12h0", "root", "netem", "delay", "1.5ms"] in netem
    assert [
        "tc", "-n", "flowlock-ab12-h1", "qdisc", "add", "dev", "flpab12h1",
        "root", "netem", "delay", "1.5ms",
    ] in netem  # fmt: skip
    assert plan.teardown_commands() == [
        ["ip", "netns", "delete", "flowlock-ab12-h0"],
        ["ip", "netns", "delete", "flowlock-ab12-h1"],
        ["ip", "link", "delete", "flvab12h0"],
        ["ip", "link", "delete", "flvab12h1"],
        ["ip", "link", "delete", "flbab12"],
    ]


def test_a_worker_runs_inside_its_host_namespace() -> None:
    """``ip netns exec`` execs the command itself, so the process started is the worker."""
    host = plan_hosts(1, SUBNET, "ab").hosts[0]
    assert host.command(WORKER_ARGV) == [
        "ip", "netns", "exec", "flowlock-ab-h0", *WORKER_ARGV,
    ]  # fmt: skip
    assert WORKER_ARGV[1:] == ("-m", "flowlock.bench.worker")


# -- the subnet ----------------------------------------------------------------------------------

ADDRESSES = [
    {"ifname": "lo", "addr_info": [{"family": "inet", "local": "127.0.0.1", "prefixlen": 8}]},
    {"ifname": "eth0", "addr_info": [{"family": "inet", "local": "10.213.5.2", "prefixlen": 24}]},
    {"ifname": "odd", "addr_info": [{"family": "inet"}]},
]
ROUTES = [
    {"dst": "default", "gateway": "10.213.5.1"},
    {"dst": "10.213.6.0/23"},
    {"dst": "10.213.9.4"},
    {"dst": "not-an-address"},
]


def test_used_networks_read_addresses_and_routes_but_not_the_default() -> None:
    assert used_networks(ADDRESSES, ROUTES) == [
        IPv4Network("127.0.0.0/8"),
        IPv4Network("10.213.5.0/24"),
        IPv4Network("10.213.6.0/23"),
        IPv4Network("10.213.9.4/32"),
    ]
    assert used_networks(None, []) == []


def test_a_subnet_in_use_is_never_picked() -> None:
    """Whatever the order tried, the pick is a /24 of the pool overlapping nothing in use."""
    used = used_networks(ADDRESSES, ROUTES)
    for seed in range(200):
        net = pick_subnet(used, random.Random(seed))
        assert net.prefixlen == 24 and net.subnet_of(SUBNET_POOL)
        assert not any(net.overlaps(u) for u in used)
        assert net.network_address.packed[2] not in (0, 255)


def test_no_subnet_left_is_a_typed_refusal() -> None:
    with pytest.raises(HostsUnavailable, match=re.escape("every /24 of 10.213.0.0/16 overlaps")):
        pick_subnet([IPv4Network("10.0.0.0/8")], random.Random(1))


# -- without privileges --------------------------------------------------------------------------


def test_not_root_is_refused_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """The machine's facts are read, not assumed: this pretends only to be another user (and
    then to lack ``ip``), and nothing is created."""
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    hosts = NamespacedHosts(2)
    with pytest.raises(HostsUnavailable) as caught:
        hosts.start()
    assert caught.value.reason == "not running as root"
    assert "run as root" in str(caught.value)
    assert isinstance(caught.value, HostsError) and isinstance(caught.value, FlowlockError)
    with pytest.raises(HostsError, match="not set up"):
        _ = hosts.plan
    hosts.stop()  # nothing to remove: a no-op

    monkeypatch.setattr(os, "geteuid", lambda: 0)
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name: None if name == "ip" else real_which(name))
    with pytest.raises(HostsUnavailable, match="no 'ip' command"):
        check_available()


@pytest.mark.parametrize("delay", [-1, 1001, True, "1"])
def test_a_delay_out_of_range_is_refused(delay: Any) -> None:
    with pytest.raises(InvalidInput, match="netem delay must be 0 to 1000 ms"):
        NamespacedHosts(2, delay_ms=delay)


# -- the config, the command line, the report ----------------------------------------------------


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (BenchConfig(hosts=0), "hosts must be 1 to 16, not 0"),
        (BenchConfig(hosts=17), "hosts must be 1 to 16, not 17"),
        (BenchConfig(netem_delay_ms=1.0), "a netem delay needs hosts"),
        (BenchConfig(hosts=2, netem_delay_ms=-1), "netem delay must be 0 to 1000 ms"),
        (BenchConfig(hosts=2, database_url="postgresql://u@h/db"), "refuses --database-url"),
        (BenchConfig(hosts=2, redis_url="redis://h:6379/0"), "refuses --redis-url"),
        (BenchConfig(hosts=3, processes=2), "2 process(es) cannot cover 3 hosts"),
        (BenchConfig(hosts=3, workers=2), "2 process(es) cannot cover 3 hosts"),
        (BenchConfig(hosts=2, http=True), "--http and --hosts cannot be combined"),
        # The combination is named first, not whatever else --hosts or --http would refuse.
        (
            BenchConfig(hosts=2, http=True, database_url="postgresql://u@h/db"),
            "--http and --hosts cannot be combined",
        ),
        (BenchConfig(hosts=2, http=True, scenarios=("cluster",)), "cannot be combined"),
    ],
)
def test_hosts_config_refuses_what_cannot_run(config: BenchConfig, message: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        config.validate()
    assert message in str(caught.value)


def test_with_hosts_every_scenario_runs_in_the_workers_one_host_each_at_least() -> None:
    """Default scenarios spread and cluster; every scenario's callers in the worker processes;
    at least one process per host (4 unless more hosts)."""
    plain, two, six = BenchConfig(), BenchConfig(hosts=2), BenchConfig(hosts=6)
    for config in (two, six, BenchConfig(hosts=2, netem_delay_ms=0)):
        config.validate()
    assert two.scenario_names() == HOSTS_SCENARIOS == ("spread", "cluster")
    assert BenchConfig(hosts=2, scenarios=("hot",)).scenario_names() == ("hot",)
    assert (two.process_count(), six.process_count(), plain.process_count()) == (4, 6, 4)
    spread = SCENARIOS["spread"]
    assert two.in_processes(spread) and not plain.in_processes(spread)
    assert plain.in_processes(SCENARIOS["cluster"])
    assert two.params_for(spread).processes == 4
    assert plain.params_for(spread).processes == 1


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.delenv("FLOWLOCK_DATABASE_URL", raising=False)
    monkeypatch.delenv("FLOWLOCK_REDIS_URL", raising=False)
    return CliRunner()


def _report(config: BenchConfig, hosts: dict[str, Any] | None) -> BenchReport:
    return BenchReport(
        flowlock_version=flowlock.__version__,
        postgres_version="18.0",
        redis_version=None,
        cores=2,
        args={"workers": config.workers, "batching": config.batching, "hosts": hosts},
        results=(),
        loop="asyncio",
        database="embedded",
        pool_size=1,
        duration_s=0.1,
    )


def test_the_command_line_passes_hosts_and_delay_and_the_title_says_them(
    cli: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[BenchConfig] = []
    hosts = {"count": 3, "netem_delay_ms": 1.0, "left": {"processes": 0}}

    def run(
        config: BenchConfig, progress: Progress | None = None, lab: Lab | None = None
    ) -> BenchReport:
        seen.append(config)
        return _report(config, hosts)

    monkeypatch.setattr(bench_runner, "run", run)
    result = cli.invoke(app, ["bench", "--quick", "--hosts", "3", "--netem-delay", "1"])
    assert result.exit_code == 0, result.output
    assert [(c.hosts, c.netem_delay_ms) for c in seen] == [(3, 1.0)]
    assert "3 namespaced hosts (netem 1 ms each way)" in result.stdout
    report = _report(BenchConfig(), {"count": 2, "netem_delay_ms": 0.0})
    assert "2 namespaced hosts (no netem delay)" in title(report)
    assert "hosts" not in title(_report(BenchConfig(), None))


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (["--netem-delay", "1"], 1, "a netem delay needs hosts"),
        (["--hosts", "2", "--database-url", "postgresql://u@h/db"], 1, "--embedded"),
        (["--hosts", "0"], 2, "--hosts"),
        (["--hosts", "2", "--soak", "5"], 2, "--hosts"),
        (["--hosts", "2", "--http"], 1, "--http and --hosts cannot be combined"),
        (["--http", "--quick", "--hosts", "1", "-s", "spread"], 1, "cannot be combined"),
    ],
)
def test_the_command_line_refuses_hosts_it_cannot_run(
    cli: CliRunner, monkeypatch: pytest.MonkeyPatch, args: list[str], code: int, says: str
) -> None:
    started: list[BenchConfig] = []

    def run(
        config: BenchConfig, progress: Progress | None = None, lab: Lab | None = None
    ) -> BenchReport:
        # Only reached if the command line let the config through: refused before any run.
        started.append(config)
        return _report(config, None)

    monkeypatch.setattr(bench_runner, "run", run)
    result = cli.invoke(app, ["bench", *args])
    assert result.exit_code == code, result.output
    assert says in result.output
    assert started == []


def test_json_has_both_the_hosts_and_the_transport_fields() -> None:
    """A result has both features' fields: ``hosts`` and ``escalations`` from --hosts,
    ``transport`` and ``vs_in_process`` from --http, each at its neutral value when the other
    feature made the result (an HTTP result's escalations are the service's, not counted)."""
    common = (Params(workers=4, processes=2), Timed(), ConnectionStats())
    on_hosts = summarise(
        SCENARIOS["spread"], "adaptive", *common, loop="asyncio", hosts=2, escalations=(1, 1)
    )
    over_http = summarise(SCENARIOS["spread"], "adaptive", *common, loop="asyncio", transport=HTTP)
    report = replace(_report(BenchConfig(), None), results=(on_hosts, over_http))
    first, second = to_json(report)["results"]
    assert (first["hosts"], first["escalations"]) == (2, {"escalated": 1, "adopted": 1})
    assert (first["transport"], first["vs_in_process"]) == (IN_PROCESS, None)
    assert (second["hosts"], second["escalations"], second["transport"]) == (0, None, HTTP)
    assert second["vs_in_process"] is not None


def test_the_report_shows_fleet_wide_escalations() -> None:
    """An adaptive row run by several engines says how many escalations they made and how many
    one adopted from another's decision; the JSON has both, and the hosts."""
    result = summarise(
        SCENARIOS["cluster"],
        "adaptive",
        Params(workers=4, processes=3),
        Timed(),
        ConnectionStats(),
        loop="asyncio",
        hosts=3,
        escalations=(5, 2),
    )
    report = replace(_report(BenchConfig(), None), results=(result,))
    doc = to_json(report)["results"][0]
    assert (doc["hosts"], doc["escalations"]) == (3, {"escalated": 5, "adopted": 2})
    console = Console(width=200, record=True)
    render(report, console)
    text = console.export_text()
    assert "adaptive escalations, shared through PostgreSQL" in text
    assert "cluster: 5 escalations by 3 engines on 3 hosts, 2 adopted from another" in text


# -- the pieces the runner wires together --------------------------------------------------------


def test_the_worker_pool_takes_one_command_and_label_per_worker() -> None:
    WorkerPool(2, commands=[WORKER_ARGV, WORKER_ARGV], labels=["h0", "h1"])
    with pytest.raises(ValueError, match="2 workers need 2 commands and labels"):
        WorkerPool(2, commands=[WORKER_ARGV])


def test_closed_carries_the_escalation_counts() -> None:
    assert reply_from_dict(Closed(5, 2).to_dict()) == Closed(5, 2)
    assert reply_from_dict({"op": "closed"}) == Closed(0, 0)  # an older worker's reply


@pytest.mark.parametrize("host", ["localhost", "10.213.7", "::1", ""])
def test_embedded_servers_listen_on_an_ipv4_address_only(host: str) -> None:
    with pytest.raises(InvalidInput, match="host must be an IPv4 address"):
        EmbeddedPostgres(host=host)
    with pytest.raises(InvalidInput, match="host must be an IPv4 address"):
        EmbeddedRedis(host=host)


def test_embedded_postgres_trusts_only_networks_in_cidr_form() -> None:
    EmbeddedPostgres(host="10.213.7.1", trusted_networks=["10.213.7.0/24"])
    for bad in (["10.213.7.1/24"], ["nope"], "10.213.7.0/24"):
        with pytest.raises(InvalidInput):
            EmbeddedPostgres(trusted_networks=bad)
