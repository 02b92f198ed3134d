"""The comparisons with the floor (the ``raw`` strategy of the same run) and the issue's
performance aims, computed from the results; shared by the tables and the JSON document."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flowlock.bench.results import BenchReport, ScenarioResult

__all__ = [
    "AIM_P99",
    "AIM_THROUGHPUT",
    "FLOOR",
    "FLOOR_METHOD",
    "Aim",
    "aims",
    "floors",
    "vs_floor",
]

FLOOR = "raw"
"""The strategy every other one is compared with."""

AIM_P99 = {"storm": 1.5}
"""Scenario -> the largest p99 latency, as a multiple of the floor's, the aims allow."""
AIM_THROUGHPUT = {"hot": 0.8, "spread": 0.8}
"""Scenario -> the smallest applied/s, as a fraction of the floor's, the aims allow."""

FLOOR_METHOD: Mapping[str, str] = {
    "statement": "one conditional UPDATE",
    "locked": "row-locked read-modify-write transaction",
    "cas": "read + compare-and-swap, retried until it lands",
    "claim": "INSERT ... ON CONFLICT DO NOTHING claim",
}
"""How the raw floor does a scenario's calls, in words (flowlock.bench.raw)."""


def floors(report: BenchReport) -> dict[str, ScenarioResult]:
    """The raw floor's result per scenario (scenarios run without it are missing)."""
    return {r.scenario: r for r in report.results if r.strategy == FLOOR}


def _ratio(mine: float, floor: float) -> float | None:
    return mine / floor if floor > 0 else None


def vs_floor(result: ScenarioResult, floor: ScenarioResult | None) -> dict[str, float | None]:
    """``result``'s p99 latency and applied/s as multiples of the floor's, measured in the same
    run (None without a floor, or for the floor itself)."""
    if floor is None or result.strategy == FLOOR:
        return {"p99": None, "applied_per_s": None}
    return {
        "p99": _ratio(result.p99_ms, floor.p99_ms),
        "applied_per_s": _ratio(result.applied_per_s, floor.applied_per_s),
    }


@dataclass(frozen=True, slots=True)
class Aim:
    """One performance aim of the issue, checked for one strategy on one scenario."""

    strategy: str
    scenario: str
    what: str
    """``success``, ``violations``, ``p99_vs_floor`` or ``applied_per_s_vs_floor``."""
    target: float
    measured: float | None
    ok: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "scenario": self.scenario,
            "what": self.what,
            "target": self.target,
            "measured": None if self.measured is None else round(self.measured, 4),
            "ok": self.ok,
        }


def aims(report: BenchReport) -> list[Aim]:
    """Every flowlock strategy at 100 % success with zero violations; storm p99 within 1.5x the
    floor's; hot and spread applied/s at least 0.8x the floor's (all measured in this run)."""
    found: list[Aim] = []
    base = floors(report)
    for r in report.results:
        if r.strategy == FLOOR:
            continue
        found.append(
            Aim(r.strategy, r.scenario, "success", 100.0, r.success_pct, r.success_pct >= 100.0)
        )
        n = len(r.verdict.violations)
        found.append(Aim(r.strategy, r.scenario, "violations", 0, n, n == 0))
        ratios = vs_floor(r, base.get(r.scenario))
        if r.scenario in AIM_P99 and ratios["p99"] is not None:
            limit = AIM_P99[r.scenario]
            got = ratios["p99"]
            found.append(Aim(r.strategy, r.scenario, "p99_vs_floor", limit, got, got <= limit))
        if r.scenario in AIM_THROUGHPUT and ratios["applied_per_s"] is not None:
            limit = AIM_THROUGHPUT[r.scenario]
            got = ratios["applied_per_s"]
            found.append(
                Aim(r.strategy, r.scenario, "applied_per_s_vs_floor", limit, got, got >= limit)
            )
    return found
