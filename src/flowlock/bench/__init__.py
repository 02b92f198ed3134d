"""The benchmark behind `flowlock bench`: the seed's experiment and every scenario.

Each strategy is measured against a floor measured in the same run.
docs/benchmarks.md describes the scenarios, the report and how the modules fit together.


    from flowlock.bench import BenchConfig, run
    report = run(BenchConfig(quick=True))   # embedded PostgreSQL and Redis, uvloop when installed
    assert report.ok
"""

from __future__ import annotations

from flowlock.bench.config import BenchConfig
from flowlock.bench.progress import NullProgress, Progress
from flowlock.bench.registry import (
    ALIASES,
    DEFAULT_STRATEGIES,
    STRATEGIES,
    BuildContext,
    StrategySpec,
    register_strategy,
)
from flowlock.bench.results import BenchReport, Params, ScenarioResult
from flowlock.bench.runner import run, run_bench
from flowlock.bench.scenarios import SCENARIO_ALIASES, SCENARIOS, Scenario, register_scenario

__all__ = [
    "ALIASES",
    "DEFAULT_STRATEGIES",
    "SCENARIOS",
    "SCENARIO_ALIASES",
    "STRATEGIES",
    "BenchConfig",
    "BenchReport",
    "BuildContext",
    "NullProgress",
    "Params",
    "Progress",
    "Scenario",
    "ScenarioResult",
    "StrategySpec",
    "register_scenario",
    "register_strategy",
    "run",
    "run_bench",
]
