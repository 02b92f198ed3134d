"""The benchmark that reproduces, and checks, the seed article's experiment, and every scenario
of docs/benchmarks.md, against a floor measured in the same run.

- :mod:`~flowlock.bench.config`: what to run (:class:`BenchConfig`, validated without I/O);
- :mod:`~flowlock.bench.registry`: the strategies it can run, by name;
- :mod:`~flowlock.bench.scenarios`: what the callers fire and what "correct" means (a registry,
  one module per scenario family);
- :mod:`~flowlock.bench.raw`: the floor, what bare asyncpg does for the same calls;
- :mod:`~flowlock.bench.runner`: runs scenarios x strategies against PostgreSQL (and Redis), on
  the servers of :mod:`~flowlock.bench.servers`, one pair at a time (:mod:`~flowlock.bench.pairs`)
  in sessions of :mod:`~flowlock.bench.session`, in this process or in worker processes
  (:mod:`~flowlock.bench.procs`), measured by :mod:`~flowlock.bench.measure`;
- :mod:`~flowlock.bench.extend`: what ``--hosts`` and ``--http`` take from the lab
  (``flowlock_lab``), which flowlock does not import;
- :mod:`~flowlock.bench.results`: what it returns, as dataclasses, and the pure arithmetic
  (percentiles, summaries, verdicts) that makes them;
- :mod:`~flowlock.bench.report`: renders those as rich tables, the ``--json`` document and the
  ``--plot`` chart.

::

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
from flowlock.bench.scenarios import SCENARIOS, Scenario, register_scenario

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
