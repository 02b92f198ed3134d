"""Comparisons with the floor and the performance aims, shared by the tables and the JSON.

Aims are ratios to the floor of the same run, so they hold on any machine.
They are reported, never asserted. docs/benchmarks.md lists each aim and why.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from flowlock.bench.results import HTTP, IN_PROCESS, BenchReport, ScenarioResult, Transport

__all__ = [
    "AIMS",
    "FLOOR",
    "FLOOR_METHOD",
    "HTTP_AIM",
    "HTTP_P99_FACTOR",
    "HTTP_P99_SLACK_MS",
    "HTTP_RATE_AIM",
    "HTTP_RATE_FACTOR",
    "MET",
    "NOT_MET",
    "NO_FLOOR",
    "Aim",
    "AimSpec",
    "Overhead",
    "aims",
    "floors",
    "in_process",
    "is_distributed",
    "overhead",
    "vs_floor",
]

FLOOR = "raw"
"""The strategy every other one is compared with."""

Metric = Literal["p99", "applied_per_s"]
Status = Literal["met", "not met", "no floor"]

MET: Status = "met"
NOT_MET: Status = "not met"
NO_FLOOR: Status = "no floor"
"""An aim's status when there is no ratio to judge: the run has no `raw` result for the
scenario, or the floor's figure is 0."""


@dataclass(frozen=True, slots=True)
class AimSpec:
    """One ratio aim: `metric` on `scenario` as a multiple of the floor's.

    A p99 must be at most the target; an applied/s at least it.
    `distributed` is the target for strategies that take a lease; `target` for the rest.
    """

    scenario: str
    metric: Metric
    target: float
    distributed: float

    @property
    def what(self) -> str:
        """The aim's name in the JSON document: `p99_vs_floor` or `applied_per_s_vs_floor`."""
        return f"{self.metric}_vs_floor"

    @property
    def compare(self) -> Literal["<=", ">="]:
        return "<=" if self.metric == "p99" else ">="

    def target_for(self, strategy: str) -> float:
        return self.distributed if is_distributed(strategy) else self.target

    def met(self, ratio: float, strategy: str) -> bool:
        limit = self.target_for(strategy)
        return ratio <= limit if self.compare == "<=" else ratio >= limit


AIMS: tuple[AimSpec, ...] = (
    AimSpec("storm", "p99", 0.2, 0.2),
    AimSpec("hot", "applied_per_s", 12.0, 12.0),
    AimSpec("hot", "p99", 0.25, 0.25),
    AimSpec("countersign", "applied_per_s", 3.0, 3.0),
    AimSpec("inventory", "applied_per_s", 3.0, 3.0),
    AimSpec("spread", "applied_per_s", 1.0, 1.0),
    AimSpec("cluster", "applied_per_s", 1.0, 1.0),
    AimSpec("singleton", "applied_per_s", 1.0, 0.5),
)
"""Every ratio aim, in the order the aims table shows them."""

FLOOR_METHOD: Mapping[str, str] = {
    "statement": "one conditional UPDATE",
    "locked": "row-locked read-modify-write transaction",
    "cas": "read + compare-and-swap, retried until it lands",
    "claim": "INSERT ... ON CONFLICT DO NOTHING claim",
    "counter": "counter row UPDATE ... WHERE holders < limit, then the instance's versioned "
    "UPDATE, in one transaction",
}
"""How the raw floor does a scenario's calls, in words (flowlock.bench.raw)."""


HTTP_AIM = "http_p99_vs_in_process"
"""The HTTP overhead aim's name in the JSON document."""
HTTP_P99_FACTOR = 1.5
HTTP_P99_SLACK_MS = 5.0
"""The HTTP aim: HTTP p99 <= HTTP_P99_FACTOR x in-process p99 + HTTP_P99_SLACK_MS."""
HTTP_RATE_AIM = "http_calls_per_s_vs_in_process"
"""The HTTP rate aim's name in the JSON document."""
HTTP_RATE_FACTOR = 0.5
"""The HTTP rate aim: HTTP calls/s >= HTTP_RATE_FACTOR x in-process calls/s."""


def is_distributed(strategy: str) -> bool:
    """Whether the strategy of that name takes a lease on every call.

    The bench names those "distributed-<backend>", and a test holds the registry to it.
    Deciding by name keeps the report pure: it imports no backend.
    """
    return strategy.startswith("distributed")


def floors(report: BenchReport) -> dict[str, ScenarioResult]:
    """The raw floor's result per scenario (scenarios run without it are missing)."""
    return {
        r.scenario: r for r in report.results if r.strategy == FLOOR and r.transport == IN_PROCESS
    }


def in_process(report: BenchReport) -> dict[tuple[str, str], ScenarioResult]:
    """The in-process results by (scenario, strategy): each HTTP result's twin."""
    return {(r.scenario, r.strategy): r for r in report.results if r.transport == IN_PROCESS}


@dataclass(frozen=True, slots=True)
class Overhead:
    """An HTTP result's p99 and calls/s against its in-process twin's, in the same run."""

    in_process_p99_ms: float
    http_p99_ms: float
    in_process_calls_per_s: float = 0.0
    http_calls_per_s: float = 0.0

    @property
    def ratio(self) -> float | None:
        """HTTP p99 over in-process p99 (None when the in-process one is 0)."""
        return _ratio(self.http_p99_ms, self.in_process_p99_ms)

    @property
    def diff_ms(self) -> float:
        """What HTTP adds to the p99, in ms (negative when it came out faster)."""
        return self.http_p99_ms - self.in_process_p99_ms

    @property
    def limit_ms(self) -> float:
        """The aim's bound on the HTTP p99: 1.5 x the in-process p99 + 5 ms."""
        return HTTP_P99_FACTOR * self.in_process_p99_ms + HTTP_P99_SLACK_MS

    @property
    def met(self) -> bool:
        return self.http_p99_ms <= self.limit_ms

    @property
    def rate_ratio(self) -> float | None:
        """HTTP calls/s over in-process calls/s (None when the in-process one is 0)."""
        return _ratio(self.http_calls_per_s, self.in_process_calls_per_s)

    @property
    def rate_floor(self) -> float:
        """The rate aim's bound on the HTTP calls/s: half the in-process calls/s."""
        return HTTP_RATE_FACTOR * self.in_process_calls_per_s

    @property
    def rate_met(self) -> bool:
        return self.http_calls_per_s >= self.rate_floor

    def to_json(self) -> dict[str, Any]:
        ratio, rate = self.ratio, self.rate_ratio
        return {
            "in_process_p99_ms": round(self.in_process_p99_ms, 3),
            "p99_ratio": None if ratio is None else round(ratio, 3),
            "p99_diff_ms": round(self.diff_ms, 3),
            "aim_limit_ms": round(self.limit_ms, 3),
            "aim_met": self.met,
            "in_process_calls_per_s": round(self.in_process_calls_per_s, 3),
            "calls_per_s_ratio": None if rate is None else round(rate, 3),
            "rate_aim_floor": round(self.rate_floor, 3),
            "rate_aim_met": self.rate_met,
        }


def overhead(result: ScenarioResult, twin: ScenarioResult | None) -> Overhead | None:
    """`result`'s p99 and calls/s against its in-process `twin`'s.

    None unless `result` went through HTTP and its twin ran.
    """
    if result.transport != HTTP or twin is None:
        return None
    return Overhead(twin.p99_ms, result.p99_ms, twin.calls_per_s, result.calls_per_s)


def _ratio(mine: float, floor: float) -> float | None:
    return mine / floor if floor > 0 else None


def vs_floor(result: ScenarioResult, floor: ScenarioResult | None) -> dict[str, float | None]:
    """`result`'s p99 and applied/s as multiples of the same run's floor.

    None without a floor, or for the floor itself.
    """
    if floor is None or result.strategy == FLOOR:
        return {"p99": None, "applied_per_s": None}
    return {
        "p99": _ratio(result.p99_ms, floor.p99_ms),
        "applied_per_s": _ratio(result.applied_per_s, floor.applied_per_s),
    }


@dataclass(frozen=True, slots=True)
class Aim:
    """One performance aim, checked for one strategy on one scenario.

    `compare` says which side of `target` `measured` must be on.
    `measured` is None when there was no floor; `ok` is then False.
    """

    strategy: str
    scenario: str
    what: str
    """`success`, `violations`, `p99_vs_floor` or `applied_per_s_vs_floor`."""
    target: float
    measured: float | None
    ok: bool
    compare: Literal["<=", ">="] = ">="
    transport: Transport = IN_PROCESS
    """The calls' transport: the aims of an HTTP result are its success, its violations and
    `HTTP_AIM` (`measured` its p99 in ms, `target` the bound in ms) and `HTTP_RATE_AIM`
    (`measured` its calls/s, `target` half its in-process twin's)."""

    @property
    def status(self) -> Status:
        if self.measured is None:
            return NO_FLOOR
        return MET if self.ok else NOT_MET

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "scenario": self.scenario,
            "what": self.what,
            "target": self.target,
            "measured": None if self.measured is None else round(self.measured, 4),
            "ok": self.ok,
            "compare": self.compare,
            "status": self.status,
            "transport": self.transport,
        }


def _ratio_aims(result: ScenarioResult, floor: ScenarioResult | None) -> list[Aim]:
    found: list[Aim] = []
    ratios = vs_floor(result, floor)
    for spec in AIMS:
        if spec.scenario != result.scenario:
            continue
        got = ratios[spec.metric]
        found.append(
            Aim(
                result.strategy,
                result.scenario,
                spec.what,
                spec.target_for(result.strategy),
                got,
                got is not None and spec.met(got, result.strategy),
                spec.compare,
            )
        )
    return found


def _http_aim(result: ScenarioResult, twin: ScenarioResult | None) -> list[Aim]:
    found = overhead(result, twin)
    if found is None:
        return []  # no in-process twin to measure the overhead against
    return [
        Aim(
            result.strategy,
            result.scenario,
            HTTP_AIM,
            round(found.limit_ms, 3),
            result.p99_ms,
            found.met,
            "<=",
            HTTP,
        ),
        Aim(
            result.strategy,
            result.scenario,
            HTTP_RATE_AIM,
            round(found.rate_floor, 3),
            result.calls_per_s,
            found.rate_met,
            ">=",
            HTTP,
        ),
    ]


def aims(report: BenchReport) -> list[Aim]:
    """Every aim of every flowlock strategy on every scenario it ran.

    First 100 % success and zero violations, then each of `AIMS` against this run's floor.
    A scenario without a floor gets `no floor`. An HTTP result is checked against
    `HTTP_AIM` and `HTTP_RATE_AIM` against its in-process twin instead.
    """
    found: list[Aim] = []
    base = floors(report)
    twins = in_process(report)
    for r in report.results:
        if r.strategy == FLOOR:
            continue
        how = r.transport
        ok = r.success_pct >= 100.0
        found.append(Aim(r.strategy, r.scenario, "success", 100.0, r.success_pct, ok, ">=", how))
        n = len(r.verdict.violations)
        found.append(Aim(r.strategy, r.scenario, "violations", 0, n, n == 0, "<=", how))
        if how == HTTP:
            found.extend(_http_aim(r, twins.get((r.scenario, r.strategy))))
        else:
            found.extend(_ratio_aims(r, base.get(r.scenario)))
    return found
