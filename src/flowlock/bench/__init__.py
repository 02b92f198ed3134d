"""The benchmark that reproduces, and checks, the seed article's experiment, and every scenario
of DESIGN.md, against a floor measured in the same run.

- :mod:`~flowlock.bench.scenarios`: what the callers fire and what "correct" means (a registry);
- :mod:`~flowlock.bench.raw`: the floor, what bare asyncpg does for the same calls;
- :mod:`~flowlock.bench.runner`: runs scenarios x strategies against PostgreSQL (and Redis),
  in this process or in worker processes (:mod:`~flowlock.bench.worker`), measures, checks every
  history with :mod:`flowlock.checker`, and returns dataclasses (a strategy registry);
- :mod:`~flowlock.bench.report`: renders those as rich tables, the ``--json`` document and the
  ``--plot`` chart.

::

    from flowlock.bench import BenchConfig, run
    report = run(BenchConfig(quick=True))   # embedded PostgreSQL and Redis, uvloop when installed
    assert report.ok
"""

from __future__ import annotations

from flowlock.bench.runner import (
    ALIASES,
    DEFAULT_STRATEGIES,
    STRATEGIES,
    BenchConfig,
    BenchReport,
    BuildContext,
    NullProgress,
    Progress,
    ScenarioResult,
    StrategySpec,
    register_strategy,
    run,
    run_bench,
)
from flowlock.bench.scenarios import SCENARIOS, Params, Scenario, register_scenario

__all__ = [
    "ALIASES",
    "DEFAULT_STRATEGIES",
    "SCENARIOS",
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
