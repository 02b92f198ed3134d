"""The benchmark's configuration and pool sizing, without any server: validation, defaults,
aliases, per-scenario parameters, the batching switch from the command line to the config, URL
redaction, and how large a pool the server can take.
"""

from __future__ import annotations

from typing import Any

import pytest
from typer.testing import CliRunner

import flowlock
from flowlock.bench import ALIASES, DEFAULT_STRATEGIES, SCENARIOS, BenchConfig, BenchReport
from flowlock.bench import runner as bench_runner
from flowlock.bench.config import Target, redact
from flowlock.bench.extend import Lab
from flowlock.bench.progress import Progress
from flowlock.bench.servers import connections_needed, demand, fit_pool
from flowlock.cli import app
from flowlock.cli import bench as cli_module
from flowlock.core.errors import InvalidInput
from flowlock_lab.soak_config import SoakConfig


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (BenchConfig(scenarios=("nope",)), "unknown scenario 'nope'"),
        (BenchConfig(strategies=("magic",)), "unknown strategy 'magic'"),
        (BenchConfig(workers=0), "workers must be at least 1, not 0"),
        (BenchConfig(rounds=-1), "rounds must be at least 1, not -1"),
        (BenchConfig(pool_size=0), "pool_size must be at least 1, not 0"),
        (BenchConfig(database_url="sqlite:///x.db"), "the benchmark needs PostgreSQL"),
        (BenchConfig(database_url="mysql://u:secret@h/db"), "'mysql://u:***@h/db'"),
        (BenchConfig(redis_url="http://h:6379"), "unsupported redis url 'http://h:6379'"),
        (BenchConfig(batching="off"), "batching must be True or False, not 'off'"),  # type: ignore[arg-type]
    ],
)
def test_validate_refuses_what_cannot_run(config: BenchConfig, message: str) -> None:
    """Each impossible configuration raises InvalidInput naming the problem (passwords
    redacted), before any I/O."""
    with pytest.raises(InvalidInput) as caught:
        config.validate()
    assert message in str(caught.value)
    assert "secret" not in str(caught.value)


def test_validate_accepts_the_defaults_and_real_urls() -> None:
    """The default configuration and PostgreSQL/Redis URLs are valid."""
    BenchConfig().validate()
    BenchConfig(
        database_url="postgres://u@h/db", redis_url="rediss://h:6380/1", strategies=("raw",)
    ).validate()


def test_names_default_to_every_scenario_and_strategy() -> None:
    """No names given: every registered scenario, every registered strategy, in order; a full
    run leaves out the scenarios that run when named (capacity), --quick runs them too."""
    config = BenchConfig()
    assert config.scenario_names() == tuple(n for n, s in SCENARIOS.items() if s.full_by_default)
    assert "capacity-spread" not in config.scenario_names()
    assert BenchConfig(quick=True).scenario_names() == tuple(SCENARIOS)
    assert config.strategy_names() == DEFAULT_STRATEGIES
    assert DEFAULT_STRATEGIES[0] == "raw"


def test_aliases_expand_and_duplicates_go() -> None:
    """'distributed' stands for both distributed strategies; a name given twice runs once."""
    config = BenchConfig(
        scenarios=("hot", "storm", "hot"),
        strategies=("distributed-advisory", "distributed", "raw"),
    )
    assert config.scenario_names() == ("hot", "storm")
    assert ALIASES["distributed"] == ("distributed-redis", "distributed-advisory")
    assert config.strategy_names() == ("distributed-advisory", "distributed-redis", "raw")


def test_rounds_and_ops_follow_quick_unless_given() -> None:
    """Each scenario's own rounds and calls per caller, fewer under quick, unless given; --ops
    means nothing to a scenario that does not use it."""
    storm, hot = SCENARIOS["storm"], SCENARIOS["hot"]
    assert (BenchConfig().rounds_for(storm), BenchConfig(quick=True).rounds_for(storm)) == (10, 2)
    assert BenchConfig(rounds=4, quick=True).rounds_for(storm) == 4
    assert (BenchConfig().ops_for(hot), BenchConfig(quick=True).ops_for(hot)) == (20, 3)
    assert BenchConfig(ops=7).ops_for(hot) == 7
    assert BenchConfig(ops=7).ops_for(storm) == 1


def test_warm_up_and_processes() -> None:
    """The warm-up round runs unless quick or turned off; processes default to 4 and never
    exceed the callers."""
    assert BenchConfig().warms_up()
    assert not BenchConfig(quick=True).warms_up()
    assert not BenchConfig(warmup=False).warms_up()
    assert BenchConfig().process_count() == 4
    assert BenchConfig(workers=2).process_count() == 2
    assert BenchConfig(processes=8).process_count() == 8


def test_params_spread_processes_only_for_multiprocess_scenarios() -> None:
    """A scenario sees the callers, its calls per caller, and processes only when it runs in
    several."""
    config = BenchConfig(workers=40, processes=3, quick=True)
    assert config.params_for(SCENARIOS["cluster"]).processes == 3
    assert config.params_for(SCENARIOS["cluster"]).ops == 3
    single = config.params_for(SCENARIOS["storm"])
    assert (single.workers, single.ops, single.processes) == (40, 1, 1)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://me:pw@db:5432/x", "postgresql://me:***@db:5432/x"),
        ("postgresql://me@db/x", "postgresql://me@db/x"),
        ("redis://:pw@cache:6379/0", "redis://:***@cache:6379/0"),
    ],
)
def test_redact_hides_only_the_password(url: str, shown: str) -> None:
    """A URL keeps its user, host and path; its password becomes ***."""
    assert redact(url) == shown


def test_target_round_trips_through_json() -> None:
    """The target sent to worker processes comes back equal, application name included."""
    target = Target("postgresql://h/db", "s", "ns", "abcd", 25, "redis://h/0")
    assert Target.from_json(target.to_json()) == target
    assert target.application_name == "flowlock-abcd"


def test_demand_adds_the_advisory_lease_pool() -> None:
    """A session needs its pool, plus, with advisory locks, a lease pool (up to 20) and its
    headroom."""
    assert demand(100, advisory=False) == 100
    assert demand(100, advisory=True) == 100 + 20 + 5
    assert demand(4, advisory=True) == 4 + 4 + 2


def test_multiprocess_runs_need_the_workers_and_the_admin_pool() -> None:
    """Four workers share the pool out, each with a few connections more, beside the parent's
    admin pool of 10; a single-process run needs only its session."""
    assert connections_needed(100, advisory=False, multi=False, processes=4) == 100
    assert connections_needed(100, advisory=False, multi=True, processes=4) == 4 * 29 + 10
    assert connections_needed(8, advisory=False, multi=True, processes=4) == 4 * 6 + 10


def test_fit_pool_takes_the_largest_pool_that_fits() -> None:
    """The pool shrinks one connection at a time until what it needs fits, but never below 1."""
    assert fit_pool(100, 500, lambda pool: pool) == 100
    assert fit_pool(100, 60, lambda pool: pool + 10) == 50
    assert fit_pool(100, 5, lambda pool: pool + 10) == 1


# -- the batching switch ---------------------------------------------------------------------


def test_batching_is_on_unless_turned_off() -> None:
    """Engines batch by default, in a run and in a soak; off is a plain False, and anything but
    a bool is refused before any I/O."""
    assert BenchConfig().batching is True
    assert SoakConfig(seconds=5).batching is True
    BenchConfig(batching=False).validate()
    SoakConfig(seconds=5, batching=False).validate()
    with pytest.raises(InvalidInput, match="batching must be True or False, not 1"):
        SoakConfig(seconds=5, batching=1).validate()  # type: ignore[arg-type]


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    """A runner whose environment names no server (so none can steer a case)."""
    monkeypatch.delenv("FLOWLOCK_DATABASE_URL", raising=False)
    monkeypatch.delenv("FLOWLOCK_REDIS_URL", raising=False)
    return CliRunner()


def _empty_report(config: BenchConfig) -> BenchReport:
    return BenchReport(
        flowlock_version=flowlock.__version__,
        postgres_version="18.0",
        redis_version=None,
        cores=2,
        args={"workers": config.workers, "batching": config.batching},
        results=(),
        loop="asyncio",
        database="embedded",
        pool_size=1,
        duration_s=0.1,
    )


@pytest.mark.parametrize(
    ("given", "batching"),
    [([], True), (["--batching", "on"], True), (["--batching", "off"], False)],
)
def test_the_command_line_passes_batching_to_the_run(
    cli: CliRunner, monkeypatch: pytest.MonkeyPatch, given: list[str], batching: bool
) -> None:
    """`--batching on|off` (default on) reaches the run's config, and the title says which."""
    seen: list[BenchConfig] = []

    def run(
        config: BenchConfig, progress: Progress | None = None, lab: Lab | None = None
    ) -> BenchReport:
        seen.append(config)
        return _empty_report(config)

    monkeypatch.setattr(bench_runner, "run", run)
    result = cli.invoke(app, ["bench", "--quick", "-s", "storm", *given])
    assert result.exit_code == 0, result.output
    assert [c.batching for c in seen] == [batching]
    assert f"batching {'on' if batching else 'off'}" in result.stdout


def test_the_command_line_refuses_another_batching_value(cli: CliRunner) -> None:
    """Only on and off (any case) are accepted: anything else is a usage error naming them, and
    the help names the option."""
    result = cli.invoke(app, ["bench", "--batching", "maybe"])
    assert result.exit_code == 2
    assert "'on'" in result.output and "'off'" in result.output
    shown = cli.invoke(app, ["bench", "--help"])
    assert "--batching" in shown.stdout


def test_the_command_line_passes_batching_to_a_soak(
    cli: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With --soak, --batching reaches the soak's config too (its workers' engines)."""
    seen: list[SoakConfig] = []

    def soak(config: SoakConfig, json_file: Any) -> None:
        seen.append(config)

    monkeypatch.setattr(cli_module, "_run_soak", soak)
    result = cli.invoke(app, ["bench", "--soak", "5", "--batching", "OFF"])
    assert result.exit_code == 0, result.output
    assert [c.batching for c in seen] == [False]
