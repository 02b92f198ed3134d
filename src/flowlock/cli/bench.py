"""`flowlock bench`: the seed's benchmark matrix, and the lab's modes forwarded to it.

`--soak`, `--hosts` and `--http` need the lab (`flowlock_lab`, `lab/` in a checkout).
It is an optional import: without it, those modes exit with one line on how to install it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import typer

from flowlock.cli._common import (
    EXIT_VERDICT_FAILED,
    app,
    errors_as_exit,
    fail,
    stderr,
    stdout,
    write_file,
)
from flowlock.cli.bench_options import (
    BatchingOption,
    BenchDatabaseUrl,
    BenchRedisUrl,
    EmbeddedOption,
    FaultsOption,
    HostsOption,
    HttpOption,
    JsonOption,
    NetemDelayOption,
    OnOff,
    OpsOption,
    PlotOption,
    PoolSizeOption,
    ProcessesOption,
    QuickOption,
    RoundsOption,
    ScaleOption,
    ScenarioOption,
    SeedOption,
    SoakOption,
    StrategyOption,
    WorkersOption,
    need_bench,
)
from flowlock.core.errors import FlowlockError

if TYPE_CHECKING:
    from flowlock.bench import BenchConfig, BenchReport

__all__ = ["bench"]


def _lab() -> ModuleType:
    """The lab's command-line module; one red line and exit 1 when it is not installed."""
    from flowlock.bench.extend import LAB_MISSING

    try:
        # The one place flowlock imports the lab, and only when a lab mode is asked for.
        import flowlock_lab.cli as lab
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != "flowlock_lab":
            raise  # something the lab needs is missing: its own error says what
        fail(LAB_MISSING)
    return lab


def _run_bench(config: BenchConfig, plot: bool) -> BenchReport:
    """Validate `config` and plot support before starting, then run with progress on stderr.

    flowlock errors and Ctrl-C become exits. `--hosts` and `--http` runs take the lab's parts.
    """
    from flowlock.bench import runner
    from flowlock.bench.report import RichProgress, check_plot_support

    with errors_as_exit():
        config.validate()  # before starting anything: a bad URL must not cost a server start
        lab = _lab().LAB if config.hosts is not None or config.http else None
        if plot:
            check_plot_support()
        with RichProgress(stderr()) as progress:
            report = runner.run(config, progress, lab=lab)
    return report


def _show(report: BenchReport, json_file: Path | None, plot_file: Path | None) -> None:
    """Print the tables, write the JSON and chart where asked; exit 3 on a failed verdict."""
    from flowlock.bench.report import failures, plot, render, write_json

    render(report, stdout(piped=160))
    write_file(json_file, lambda path: write_json(report, path))
    write_file(plot_file, lambda path: plot(report, path))
    if not report.ok:
        fail(
            "checker verdict FAILED: the history is not exactly-once\n"
            + "\n".join(failures(report)),
            EXIT_VERDICT_FAILED,
        )


def _run_scale_mode(
    sizes: str,
    quick: bool,
    seed: int | None,
    database_url: str | None,
    json_file: Path | None,
    meaningless: Mapping[str, object],
) -> None:
    """Run `--scale`, print its table and write its JSON."""
    from flowlock.bench.report import RichProgress
    from flowlock.bench.report.scale_table import render_scale, write_scale_json
    from flowlock.bench.scale import run
    from flowlock.bench.scale_results import ScaleConfig, parse_sizes

    named = [name for name, value in meaningless.items() if value]
    if named:
        raise typer.BadParameter(f"{', '.join(named)} mean(s) nothing to --scale; drop it")
    try:
        config = ScaleConfig(parse_sizes(sizes, quick=quick), quick, seed, database_url)
    except FlowlockError as exc:
        raise typer.BadParameter(str(exc)) from None
    with errors_as_exit(), RichProgress(stderr()) as progress:
        report = run(config, progress)
    render_scale(report, stdout(piped=160))
    write_file(json_file, lambda path: write_scale_json(report, path))


def _run_soak(config: Any, json_file: Path | None) -> None:
    """Run the lab's soak, print its table and write its JSON; exit 3 on an unclean verdict."""
    _lab().run_soak(config, json_file)


def _soak_config(
    ctx: typer.Context,
    seconds: int,
    faults: bool,
    meaningless: Mapping[str, object],
    **given: Any,
) -> Any:
    """The lab's soak config from the bench options.

    An option that means nothing to a soak is a usage error (exit 2).
    So is anything the config refuses, such as a server URL or too many callers.
    """
    named = [name for name, value in meaningless.items() if value]
    if named:
        raise typer.BadParameter(f"{', '.join(named)} mean(s) nothing to --soak; drop it")
    # By name: typer may bring click's ParameterSource under another module.
    source = ctx.get_parameter_source("workers")
    workers_given = source is not None and source.name == "COMMANDLINE"
    try:
        return _lab().soak_config(
            seconds=seconds,
            faults=faults,
            processes=given["processes"],
            callers=given["workers"] if workers_given else None,
            strategies=given["strategies"],
            seed=given["seed"],
            database_url=given["database_url"],
            redis_url=given["redis_url"],
            batching=given["batching"],
        )
    except FlowlockError as exc:
        raise typer.BadParameter(str(exc)) from None


@app.command()
def bench(
    ctx: typer.Context,
    scenario: ScenarioOption = None,
    strategy: StrategyOption = None,
    workers: WorkersOption = 100,
    rounds: RoundsOption = None,
    ops: OpsOption = None,
    processes: ProcessesOption = None,
    seed: SeedOption = None,
    quick: QuickOption = False,
    pool_size: PoolSizeOption = None,
    json_file: JsonOption = None,
    plot_file: PlotOption = None,
    database_url: BenchDatabaseUrl = None,
    redis_url: BenchRedisUrl = None,
    embedded: EmbeddedOption = False,
    batching: BatchingOption = OnOff.on,
    hosts: HostsOption = None,
    netem_delay: NetemDelayOption = None,
    http: HttpOption = False,
    soak: SoakOption = None,
    faults: FaultsOption = False,
    scale: ScaleOption = None,
) -> None:
    """Reproduce the seed article's experiment and every scenario, against a floor.

    Runs each scenario (storm, countersign, inventory, hot, hot-outbox, spread,
    spread-outbox, cluster, singleton, deadline, capacity-spread, capacity-storm) with each
    strategy. It adds 'raw', the floor:
    bare asyncpg, measured in the same run (not in deadline, whose expiries the engines' timers
    fire, nor in the outbox pairs, whose messages their dispatchers deliver). It starts and
    removes an embedded PostgreSQL and Redis, unless you give your servers.

    It prints one row per scenario x strategy: latency, success %, attempts, mean batch size,
    throughput, peak connections, lock wait, CPU per call (the calling processes'), and the
    checker's exactly-once verdict. The seed's
    published figures appear beside storm. The aims against this run's floor follow, each with
    its ratio and met or not met. With deadline, the timers section follows: the race of
    approvals and expiries, the firing lag with 1 and 4 engines, and an idle engine's cost.
    With hot-outbox and spread-outbox (-s outbox names both), the outbox section follows:
    applied/s with one message per transition against the same calls without, every message
    delivered, the lag from commit to handler, and an idle dispatcher's cost. With
    capacity-spread and capacity-storm (-s capacity names both), the capacity table follows:
    the most holders of a key proved from the slot log, refusals, and Jain's fairness index.
    Exits 3 if any verdict fails.

    With --hosts N the worker processes run on N namespaced hosts of this machine: see --hosts.

    With --http each pair also runs through `flowlock serve`, and a table shows the HTTP
    overhead: see --http, and docs/benchmarks.md. --http and --hosts do not combine.

    With --soak SECONDS (and --faults) it soaks instead: see --soak, and docs/benchmarks.md.

    With --scale SIZES it measures what calls cost as the tables grow: see --scale.

    --hosts, --http and --soak run in flowlock's lab, the lab/ directory of a flowlock checkout.
    Install it with pip install -e ./lab; the test extra installs it.
    """
    need_bench()
    from flowlock.bench import BenchConfig

    if faults and soak is None:
        raise typer.BadParameter("--faults needs --soak SECONDS")
    if scale is not None:
        given = {"--scenario": scenario, "--strategy": strategy, "--soak": soak, "--http": http}
        _run_scale_mode(scale, quick, seed, None if embedded else database_url, json_file, given)
        return
    if soak is not None:
        meaningless = {
            "--scenario": scenario,
            "--rounds": rounds,
            "--ops": ops,
            "--quick": quick,
            "--pool-size": pool_size,
            "--plot": plot_file,
            "--hosts": hosts,
            "--netem-delay": netem_delay is not None,
            "--http": http,
        }
        soak_config = _soak_config(
            ctx,
            soak,
            faults,
            meaningless,
            processes=processes,
            workers=workers,
            strategies=tuple(strategy) if strategy else None,
            seed=seed,
            database_url=None if embedded else database_url,
            redis_url=None if embedded else redis_url,
            batching=batching is OnOff.on,
        )
        _run_soak(soak_config, json_file)
        return

    config = BenchConfig(
        scenarios=tuple(scenario) if scenario else None,
        strategies=tuple(strategy) if strategy else None,
        workers=workers,
        rounds=rounds,
        ops=ops,
        processes=processes,
        quick=quick,
        seed=seed,
        pool_size=pool_size,
        database_url=None if embedded else database_url,
        redis_url=None if embedded else redis_url,
        batching=batching is OnOff.on,
        hosts=hosts,
        netem_delay_ms=netem_delay,
        http=http,
    )
    _show(_run_bench(config, plot_file is not None), json_file, plot_file)
