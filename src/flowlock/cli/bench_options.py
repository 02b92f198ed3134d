"""The options of ``flowlock bench``, one alias each, so the command stays a short function."""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from flowlock.cli._common import ENV_DATABASE_URL, ENV_REDIS_URL, need

__all__ = [
    "BatchingOption",
    "BenchDatabaseUrl",
    "BenchRedisUrl",
    "EmbeddedOption",
    "FaultsOption",
    "HostsOption",
    "HttpOption",
    "JsonOption",
    "NetemDelayOption",
    "OnOff",
    "OpsOption",
    "PlotOption",
    "PoolSizeOption",
    "ProcessesOption",
    "QuickOption",
    "RoundsOption",
    "ScenarioOption",
    "SeedOption",
    "SoakOption",
    "StrategyOption",
    "WorkersOption",
]


def _known(kind: str, names: list[str] | None, known: list[str]) -> list[str] | None:
    for name in names or []:
        if name not in known:
            raise typer.BadParameter(f"unknown {kind} {name!r}; choose from {', '.join(known)}")
    return names


def _check_scenarios(names: list[str] | None) -> list[str] | None:
    need_bench()
    from flowlock.bench import SCENARIOS

    return _known("scenario", names, list(SCENARIOS))


def _check_strategies(names: list[str] | None) -> list[str] | None:
    need_bench()
    from flowlock.bench import ALIASES, STRATEGIES

    return _known("strategy", names, [*STRATEGIES, *ALIASES])


def _check_out_path(path: Path | None) -> Path | None:
    # Checked before the run, so a typo does not cost the whole benchmark.
    if path is not None:
        if path.is_dir():
            raise typer.BadParameter(f"{path} is a directory")
        if not path.parent.is_dir():
            raise typer.BadParameter(f"directory {path.parent} does not exist")
    return path


def _names(registry: Iterable[str]) -> str:
    return ", ".join(registry)


def need_bench() -> None:
    """One error line naming the bench extra when its drivers are missing."""
    need("bench", "flowlock bench", "asyncpg", "redis")


# The help texts name the registries' entries; without the bench extra they say what to install.
_WITHOUT_BENCH = "Needs the bench extra: pip install 'flowlock[bench]'."


def _scenario_help() -> str:
    try:
        from flowlock.bench import SCENARIOS
    except ImportError:
        return f"Scenario to run (repeatable). {_WITHOUT_BENCH}"
    return f"Scenario to run (repeatable): {_names(SCENARIOS)}. Default: all."


def _strategy_help() -> str:
    try:
        from flowlock.bench import ALIASES, STRATEGIES
    except ImportError:
        return f"Strategy to run (repeatable). {_WITHOUT_BENCH}"
    return (
        f"Strategy to run (repeatable): {_names(STRATEGIES)}; 'distributed' means "
        f"{' and '.join(ALIASES['distributed'])}. 'raw' is the floor: bare asyncpg, no engine. "
        "Default: all."
    )


ScenarioOption = Annotated[
    list[str] | None,
    typer.Option(
        "--scenario",
        "-s",
        help=_scenario_help(),
        callback=_check_scenarios,
        show_default=False,
    ),
]
StrategyOption = Annotated[
    list[str] | None,
    typer.Option(
        "--strategy",
        "-t",
        help=_strategy_help(),
        callback=_check_strategies,
        show_default=False,
    ),
]
WorkersOption = Annotated[
    int,
    typer.Option(
        "--workers",
        "-w",
        min=1,
        help="Concurrent callers per round (across all processes in cluster/singleton).",
    ),
]
RoundsOption = Annotated[
    int | None,
    typer.Option(
        "--rounds",
        "-r",
        min=1,
        help="Timed rounds per scenario. Default: each scenario's own (storm 10, "
        "countersign 3, inventory 5, hot/spread/cluster 1, singleton 10 ticks; fewer "
        "with --quick).",
        show_default=False,
    ),
]
OpsOption = Annotated[
    int | None,
    typer.Option(
        "--ops",
        min=1,
        help="Calls each caller makes one after another per round in hot, spread and "
        "cluster. Default: hot 20, spread 60, cluster 40 (3 with --quick).",
        show_default=False,
    ),
]
ProcessesOption = Annotated[
    int | None,
    typer.Option(
        "--processes",
        "-p",
        min=1,
        help="OS processes the cluster and singleton scenarios run their callers in. Default: 4.",
        show_default=False,
    ),
]
SeedOption = Annotated[
    int | None,
    typer.Option(
        "--seed",
        help="Seed for the retry jitter and the spread's choices, to repeat a run. "
        "Default: random (reported).",
        show_default=False,
    ),
]
QuickOption = Annotated[
    bool,
    typer.Option(
        "--quick",
        help="Fewer rounds and calls: the same matrix in 25-40 s on 2 cores (CI runs it).",
    ),
]
PoolSizeOption = Annotated[
    int | None,
    typer.Option(
        "--pool-size",
        min=1,
        help="Database connections per session pool. Default: --workers (one per "
        "caller, like the seed's experiment), lowered if the server cannot take that many.",
        show_default=False,
    ),
]
JsonOption = Annotated[
    Path | None,
    typer.Option(
        "--json",
        help="Also write every figure as JSON (the shape in docs/benchmarks.md) to this file.",
        callback=_check_out_path,
        dir_okay=False,
        show_default=False,
    ),
]
PlotOption = Annotated[
    Path | None,
    typer.Option(
        "--plot",
        help="Also draw latency percentiles, success % and throughput per strategy and "
        "scenario as a PNG (needs matplotlib, part of the 'bench' extra).",
        callback=_check_out_path,
        dir_okay=False,
        show_default=False,
    ),
]
BenchDatabaseUrl = Annotated[
    str | None,
    typer.Option(
        "--database-url",
        envvar=ENV_DATABASE_URL,
        help="Run against this PostgreSQL server, in a scratch schema (flowlock_bench_ and "
        "random hex) dropped at the end. Default: start an embedded PostgreSQL for the run.",
        show_default=False,
    ),
]
BenchRedisUrl = Annotated[
    str | None,
    typer.Option(
        "--redis-url",
        envvar=ENV_REDIS_URL,
        help="Run distributed-redis against this Redis, under a scratch key namespace "
        "deleted at the end. Default: start an embedded Redis for the run.",
        show_default=False,
    ),
]


class OnOff(StrEnum):
    """An on/off switch on the command line."""

    on = "on"
    off = "off"


BatchingOption = Annotated[
    OnOff,
    typer.Option(
        "--batching",
        case_sensitive=False,
        help="Whether every flowlock engine the bench builds (in this process and in the worker "
        "processes; the soak's too) batches concurrent calls on one instance, Engine(batching=): "
        "on (the engine's default) decides them in order on one read and writes them together; "
        "off runs one transaction per call. The raw floor has no engine and is the same either "
        "way. Each row reports its mean batch size (1.00 with off).",
    ),
]
EmbeddedOption = Annotated[
    bool,
    typer.Option(
        "--embedded",
        help=f"Use an embedded PostgreSQL and Redis even if {ENV_DATABASE_URL} or "
        f"{ENV_REDIS_URL} is set.",
    ),
]


HostsOption = Annotated[
    int | None,
    typer.Option(
        "--hosts",
        min=1,
        max=16,
        metavar="N",
        help="Run every scenario's callers in the worker processes spread over N Linux network "
        "namespaces (one machine, N 'hosts' on a bridge, each with its own address), against an "
        "embedded PostgreSQL and Redis listening on the bridge. Default scenarios: spread and "
        "cluster; --processes defaults to at least N. Needs root and iproute2; the namespaces "
        "are removed at the end. Not with --http.",
        show_default=False,
    ),
]
NetemDelayOption = Annotated[
    float | None,
    typer.Option(
        "--netem-delay",
        min=0,
        max=1000,
        metavar="MS",
        help="With --hosts: tc netem delay of each direction of each host's link, in ms (a "
        "round trip gains twice that). Default: 1 with 2 hosts or more where the kernel has "
        "netem (else none, noted); 0: none.",
        show_default=False,
    ),
]
HttpOption = Annotated[
    bool,
    typer.Option(
        "--http",
        help="Also run each pair through the HTTP service: a `flowlock serve` started for the "
        "run on the same database and scratch schema (one worker process, as many connections "
        "as the in-process pool), called by --workers concurrent httpx clients from this "
        "process, one connection each. Runs storm, hot and spread "
        "with optimistic, pessimistic and adaptive unless --scenario/--strategy say which of "
        "them; every pair warms up first, also with --quick. Adds a table of requests/s, p50, "
        "p99, success % and verdict per pair beside the in-process p99 of the same run, with "
        "the ratio, the difference and the aim: HTTP p99 <= 1.5 x in-process p99 + 5 ms. The "
        "callers share the machine's cores with the service and PostgreSQL. Not with --hosts.",
    ),
]
SoakOption = Annotated[
    int | None,
    typer.Option(
        "--soak",
        min=1,
        max=3600,
        metavar="SECONDS",
        help="Soak instead of measuring: mixed load (every strategy; storm, hot and spread "
        "instances) from --processes worker processes (default 3, 4 callers each, or --workers "
        "in all) for SECONDS (at most 3600), every call recorded and judged: outcomes by kind, "
        "leaks, the linearizability and exactly-once verdicts. Always on an embedded PostgreSQL "
        "and Redis of its own. Takes --strategy, --workers, --processes, --seed, --batching, "
        "--json.",
        show_default=False,
    ),
]
FaultsOption = Annotated[
    bool,
    typer.Option(
        "--faults",
        help="With --soak: every ~3 s kill -9 or pause (SIGSTOP, up to twice the 2 s lease) a "
        "worker process (a killed one is replaced), end some of the workers' PostgreSQL "
        "sessions, restart PostgreSQL, or restart Redis empty; at most 2 per 3 s of soak.",
    ),
]
