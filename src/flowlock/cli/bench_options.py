"""The options of `flowlock bench`, one alias each, so the command stays a short function."""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from flowlock.cli._common import ENV_DATABASE_URL, ENV_REDIS_URL, need
from flowlock.core.install import pip_install

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
    "ScaleOption",
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
    from flowlock.bench import SCENARIO_ALIASES, SCENARIOS

    return _known("scenario", names, [*SCENARIOS, *SCENARIO_ALIASES])


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
_WITHOUT_BENCH = f"Needs the bench extra: {pip_install('bench')}."


def _scenario_help() -> str:
    try:
        from flowlock.bench import SCENARIO_ALIASES, SCENARIOS
    except ImportError:
        return f"Scenario to run (repeatable). {_WITHOUT_BENCH}"
    return (
        f"Scenario to run (repeatable): {_names(SCENARIOS)}; 'outbox' means "
        f"{', '.join(SCENARIO_ALIASES['outbox'])} (the outbox section), 'capacity' "
        f"{', '.join(SCENARIO_ALIASES['capacity'])}. Default: all, but the capacity ones "
        "only with --quick (at full size they take minutes a strategy)."
    )


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
        help="Concurrent callers per round (across all processes in cluster, singleton and "
        "deadline).",
    ),
]
RoundsOption = Annotated[
    int | None,
    typer.Option(
        "--rounds",
        "-r",
        min=1,
        help="Timed rounds per scenario. Default: each scenario's own. That is storm 10, "
        "countersign 3, inventory 5, hot/spread/cluster/deadline 1, singleton 10 ticks, "
        "hot-outbox 3 and spread-outbox 2 (each after a round without messages), "
        "capacity-spread and capacity-storm 1. "
        "--quick runs fewer.",
        show_default=False,
    ),
]
OpsOption = Annotated[
    int | None,
    typer.Option(
        "--ops",
        min=1,
        help="Calls each caller makes in turn per round, in hot, spread, cluster and the "
        "outbox pairs. Default: hot 20, spread 60, cluster 40, hot-outbox and spread-outbox "
        "as hot and spread (3 with --quick). In deadline, approvals per "
        "caller, each due at once with a caller of its own: default 20 (2 with --quick). "
        "In capacity-spread, instances each caller moves in and out (10); in capacity-storm, "
        "times each caller enters and leaves (3); 1 with --quick.",
        show_default=False,
    ),
]
ProcessesOption = Annotated[
    int | None,
    typer.Option(
        "--processes",
        "-p",
        min=1,
        help="OS processes the cluster, singleton and deadline scenarios run their callers "
        "in (deadline: and its engines that fire the timers). Default: 4.",
        show_default=False,
    ),
]
SeedOption = Annotated[
    int | None,
    typer.Option(
        "--seed",
        help="Seed for the retry jitter and the spread's choices, to repeat a run. "
        "Default: random, and reported.",
        show_default=False,
    ),
]
QuickOption = Annotated[
    bool,
    typer.Option(
        "--quick",
        help="Fewer rounds and calls: the same matrix in 35-55 s on 2 cores (CI runs it).",
    ),
]
PoolSizeOption = Annotated[
    int | None,
    typer.Option(
        "--pool-size",
        min=1,
        help="Database connections per session pool. Default: --workers, one per caller "
        "as in the seed's experiment. Lowered if the server cannot take that many.",
        show_default=False,
    ),
]
JsonOption = Annotated[
    Path | None,
    typer.Option(
        "--json",
        help="Also write every figure to this file as JSON (shape: docs/benchmarks.md).",
        callback=_check_out_path,
        dir_okay=False,
        show_default=False,
    ),
]
PlotOption = Annotated[
    Path | None,
    typer.Option(
        "--plot",
        help="Also draw latency, success % and throughput per strategy and scenario as a "
        "PNG. Needs matplotlib, part of the 'bench' extra.",
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
        help="Run against this PostgreSQL server. The run uses a scratch schema "
        "(flowlock_bench_ and random hex), dropped at the end. "
        "Default: start an embedded PostgreSQL for the run.",
        show_default=False,
    ),
]
BenchRedisUrl = Annotated[
    str | None,
    typer.Option(
        "--redis-url",
        envvar=ENV_REDIS_URL,
        help="Run distributed-redis against this Redis. Its keys go under a scratch "
        "namespace, deleted at the end. Default: start an embedded Redis for the run.",
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
        help="Whether the bench's engines batch concurrent calls on one instance "
        "(Engine(batching=)). This covers every process, the soak's too. "
        "'on' (the engine's default) decides them in order on one read and writes them "
        "together. 'off' runs one transaction per call. The raw floor has no engine, so it is "
        "the same either way. Each row reports its mean batch size (1.00 with off).",
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
        help="Run every scenario's callers in worker processes on N Linux network "
        "namespaces. These are N 'hosts' on a bridge of this machine, each with its own "
        "address. The embedded PostgreSQL and Redis listen on the bridge. "
        "Default scenarios: spread and cluster; --processes defaults to at least N. "
        "Needs root and iproute2. The namespaces are removed at the end. Not with --http.",
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
        help="With --hosts: tc netem delay in ms, each way on each host's link. "
        "A round trip gains twice that. Default: 1 with 2 hosts or more, where the kernel "
        "has netem (else none, noted). 0 means none.",
        show_default=False,
    ),
]
HttpOption = Annotated[
    bool,
    typer.Option(
        "--http",
        help="Also run each pair through the HTTP service. A `flowlock serve` is started "
        "for the run on the same database and scratch schema. It has one worker process and "
        "as many connections as the in-process pool. --workers callers in a load generator "
        "process of their own call it, one keep-alive connection each. "
        "Runs storm, hot and spread with optimistic, pessimistic and adaptive, "
        "unless --scenario/--strategy pick some of them. "
        "Every pair warms up first, also with --quick. "
        "An extra table shows requests/s, p50, p99, success % and verdict per pair. "
        "Beside them: the in-process p99 of the same run, the ratio, the difference and the "
        "aim (HTTP p99 <= 1.5 x in-process p99 + 5 ms); the ratio of the requests/s and the "
        "rate aim (HTTP requests/s >= 0.5 x in-process calls/s). "
        "The callers share the machine's cores with the service and PostgreSQL. "
        "Not with --hosts.",
    ),
]
SoakOption = Annotated[
    int | None,
    typer.Option(
        "--soak",
        min=1,
        max=3600,
        metavar="SECONDS",
        help="Soak instead of measuring, for SECONDS (at most 3600). "
        "Mixed load with every strategy on storm, hot and spread instances. "
        "It comes from --processes worker processes (default 3), 4 callers each "
        "or --workers in all. Every call is recorded and judged: outcomes by kind, leaks, "
        "and the linearizability and exactly-once verdicts. "
        "Always on an embedded PostgreSQL and Redis of its own. "
        "Takes --strategy, --workers, --processes, --seed, --batching, --json.",
        show_default=False,
    ),
]
ScaleOption = Annotated[
    str | None,
    typer.Option(
        "--scale",
        metavar="SIZES",
        help="Measure cost against size instead: a scratch schema per size in SIZES, counts "
        "of instances separated by commas (e.g. 1e4,1e5,1e6), or 'default' for 1e4,1e5,1e6 "
        "(with --quick 1e3,4e3). Ten history rows each and one long history, loaded in the "
        "server. The sizes are measured in interleaved rounds (medians): fire p50/p99, spread "
        "applied/s, list and count with filters, a history page deep in a long history; with "
        "table and index sizes, and each figure's slope (largest size over smallest). "
        "Takes --quick, --seed, --database-url, --json.",
        show_default=False,
    ),
]
FaultsOption = Annotated[
    bool,
    typer.Option(
        "--faults",
        help="With --soak: inject a fault every ~3 s, at most 2 per 3 s of soak. "
        "A fault kills a worker with kill -9 (it is replaced), or pauses one with SIGSTOP "
        "for up to twice the 2 s lease. Or it ends some of the workers' PostgreSQL sessions, "
        "restarts PostgreSQL, or restarts Redis empty.",
    ),
]
