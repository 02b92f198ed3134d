"""The benchmark that reproduces, and checks, the seed article's experiment.

- :mod:`~flowlock.bench.scenarios`: what the callers fire and what "correct" means (a registry);
- :mod:`~flowlock.bench.runner`: runs scenarios x strategies against PostgreSQL, measures, checks
  every history with :mod:`flowlock.checker`, and returns dataclasses;
- :mod:`~flowlock.bench.report`: renders those as rich tables and as the ``--json`` document.

::

    from flowlock.bench import BenchConfig, run
    report = run(BenchConfig(quick=True))          # embedded PostgreSQL, uvloop when installed
    assert report.ok
"""

from __future__ import annotations

from flowlock.bench.runner import (
    DEFAULT_STRATEGIES,
    STRATEGIES,
    BenchConfig,
    BenchReport,
    NullProgress,
    Progress,
    ScenarioResult,
    StrategySpec,
    register_strategy,
    run,
    run_bench,
)
from flowlock.bench.scenarios import SCENARIOS, Scenario, register_scenario

__all__ = [
    "DEFAULT_STRATEGIES",
    "SCENARIOS",
    "STRATEGIES",
    "BenchConfig",
    "BenchReport",
    "NullProgress",
    "Progress",
    "Scenario",
    "ScenarioResult",
    "StrategySpec",
    "register_scenario",
    "register_strategy",
    "run",
    "run_bench",
]
