"""What the benchmark measures and concludes, as plain values and pure arithmetic.

Nothing here does I/O. `summarise` turns what the runner recorded into results.
The report package reads only these dataclasses.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol

from flowlock.checker import (
    BROKEN_CHAIN,
    DOUBLE_APPLY,
    FINAL_MISMATCH,
    LOST_UPDATE,
    OVERSELL,
    VERSION_GAP,
    Invariant,
    Verdict,
    Violation,
    check,
)
from flowlock.core.models import HistoryEntry, Instance

if TYPE_CHECKING:
    from flowlock.bench.capacity_results import CapacityFigures
    from flowlock.bench.outbox_results import DeliveryFigures, OutboxSection
    from flowlock.bench.timer_results import RaceFigures, TimersSection

__all__ = [
    "HTTP",
    "IN_PROCESS",
    "BenchReport",
    "CallResult",
    "CallSpec",
    "ConnectionStats",
    "Judged",
    "Judgement",
    "Kind",
    "Latencies",
    "Params",
    "RoundPlan",
    "RoundRecord",
    "ScenarioResult",
    "Timed",
    "Transport",
    "failures",
    "mean_batch",
    "percentile",
    "summarise",
    "verdict_of",
]

Kind = Literal["applied", "idempotent", "refused", "failed"]
"""How one call ended: it applied the transition (or ran the job), was answered idempotently
(already done), was refused by the workflow (a business rule: TransitionRefused), or failed
(lost to concurrency, a lock timeout, a store error...)."""


Transport = Literal["in-process", "http"]
"""How a result's calls reached the engine: `engine.fire` in the bench's process, or HTTP
requests to a `flowlock serve` subprocess (`flowlock bench --http`)."""
IN_PROCESS: Transport = "in-process"
HTTP: Transport = "http"


# -- what a round is made of ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Params:
    """The knobs of one run that a scenario sees."""

    workers: int = 100
    """Concurrent callers (across all processes, for the multi-process scenarios)."""
    ops: int = 1
    """Calls each caller makes one after another in a round (the sustained-load scenarios)."""
    processes: int = 1
    """OS processes the multi-process scenarios spread their callers over."""
    warmup: bool = False
    """The untimed warm-up round: it only has to fill the pools, so it may do less."""
    quiet: bool = False
    """A round of an emitting scenario without its messages (the outbox pairs' twin rounds):
    the same calls on a workflow that emits nothing."""

    def evolve(self, **changes: Any) -> Params:
        """A copy with `changes` applied."""
        return replace(self, **changes)


@dataclass(frozen=True, slots=True)
class CallSpec:
    """One call a caller makes when the round is released.

    Usually an `engine.fire`. For `singleton` it is a job run:
    `instance_id` is the job and `payload` the tick.
    """

    instance_id: str
    event: str
    actor: str | None = None
    payload: Mapping[str, Any] | None = None
    request_id: str | None = None
    at: float | None = None
    """When to make the call, in seconds since the epoch on this machine's clock (`deadline`:
    the instance's due time); None: as soon as the caller may. Its latency counts from then."""

    def to_json(self) -> dict[str, Any]:
        """For the worker processes' pipe."""
        return {
            "instance_id": self.instance_id,
            "event": self.event,
            "actor": self.actor,
            "payload": None if self.payload is None else dict(self.payload),
            "request_id": self.request_id,
            "at": self.at,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> CallSpec:
        at = doc.get("at")
        return cls(
            doc["instance_id"],
            doc["event"],
            doc["actor"],
            doc["payload"],
            doc["request_id"],
            None if at is None else float(at),
        )


@dataclass(frozen=True, slots=True)
class RoundPlan:
    """The instances a round created, with their states, and its callers.

    `calls`: one call per caller, all released at once (storm, countersign).
    `lanes`: per caller, calls fired one after another (hot, spread).
    A plan uses one or the other.
    """

    instances: Mapping[str, str]
    """instance id -> initial state"""
    calls: tuple[CallSpec, ...] = ()
    lanes: tuple[tuple[CallSpec, ...], ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)
    """What setup learned that the judge needs (deadline: each instance's due time)."""

    def callers(self) -> tuple[tuple[CallSpec, ...], ...]:
        """Every caller's calls, in order."""
        return self.lanes if self.lanes else tuple((c,) for c in self.calls)


@dataclass(frozen=True, slots=True)
class CallResult:
    """What one call came to.

    `latency` runs from when the caller could start to the call's end.
    That start is the round's release, or the caller's previous call's end.
    """

    call: CallSpec
    kind: Kind
    latency: float
    attempts: int
    error: str | None = None
    """The exception's class name for refused and failed calls."""
    message: str | None = None
    batch_size: int | None = None
    """The engine's `Outcome.batch_size`: how many calls on the instance were decided and
    written together with this one (1: alone). None when no Outcome came back: the call failed,
    or no engine answered it (the raw floor, a `RunOnce` job)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "call": self.call.to_json(),
            "kind": self.kind,
            "latency": self.latency,
            "attempts": self.attempts,
            "error": self.error,
            "message": self.message,
            "batch_size": self.batch_size,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> CallResult:
        batch = doc["batch_size"]
        return cls(
            CallSpec.from_json(doc["call"]),
            doc["kind"],
            float(doc["latency"]),
            int(doc["attempts"]),
            doc["error"],
            doc["message"],
            None if batch is None else int(batch),
        )


@dataclass(frozen=True, slots=True)
class RoundRecord:
    """A finished round: its plan, every call's result, and what the store holds afterwards."""

    plan: RoundPlan
    results: tuple[CallResult, ...]
    finals: Mapping[str, Instance]
    histories: Mapping[str, Sequence[HistoryEntry]]
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Anything else a scenario's readback collected (singleton: the job's runs)."""

    def applied_by_instance(self) -> Counter[str]:
        """How many calls answered applied, per instance id."""
        return Counter(r.call.instance_id for r in self.results if r.kind == "applied")


@dataclass(frozen=True, slots=True)
class Judgement:
    """A scenario's verdict on one round, beyond the generic history check."""

    double_advanced: bool
    violations: tuple[Violation, ...] = field(default=())


class Judged(Protocol):
    """What `summarise` needs from a scenario: its name and its judging rules."""

    @property
    def name(self) -> str: ...

    @property
    def floor(self) -> str: ...

    @property
    def invariant_kind(self) -> str: ...

    def checked(self) -> bool: ...

    def invariant(self, params: Params) -> Invariant | None: ...

    def judge(self, record: RoundRecord, params: Params) -> Judgement: ...


# -- what the runner measured ----------------------------------------------------------------------


@dataclass(slots=True)
class Timed:
    """What one pair's timed rounds recorded: each round, the summed wall time and lease wait,
    and the CPU seconds the calling processes spent while the calls ran."""

    records: list[RoundRecord] = field(default_factory=list)
    wall: float = 0.0
    lease_wait: float = 0.0
    cpu: float = 0.0


@dataclass(frozen=True, slots=True)
class ConnectionStats:
    """What the sampler saw while the calls ran: peak connections and lock wait.

    Connections are counted in use, active and open. Lock wait is count x interval, summed.
    """

    peak: int = 0
    peak_active: int = 0
    peak_open: int = 0
    lock_wait: float = 0.0


def percentile(ordered: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile of an ascending sequence (0 for an empty one)."""
    if not ordered:
        return 0.0
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


@dataclass(frozen=True, slots=True)
class Latencies:
    """Per-call latency in milliseconds: mean, nearest-rank p50 and p99, and the maximum."""

    avg_ms: float
    p50_ms: float
    p99_ms: float
    max_ms: float

    @classmethod
    def of(cls, seconds: Iterable[float]) -> Latencies:
        """The summary of these latencies (seconds); all zero for none."""
        ordered = sorted(s * 1000 for s in seconds)
        if not ordered:
            return cls(0.0, 0.0, 0.0, 0.0)
        return cls(
            sum(ordered) / len(ordered),
            percentile(ordered, 50),
            percentile(ordered, 99),
            ordered[-1],
        )


# -- the verdict ---------------------------------------------------------------------------------


def _history_violations(
    scenario: Judged, record: RoundRecord, invariant: Invariant | None
) -> list[Violation]:
    """The generic exactly-once check of every instance of one round."""
    found: list[Violation] = []
    applied = record.applied_by_instance()
    for iid, initial in record.plan.instances.items():
        found.extend(
            check(
                record.finals[iid],
                record.histories[iid],
                initial_state=initial,
                expected_applied=applied[iid],
                invariant=invariant,
                invariant_kind=scenario.invariant_kind,
            ).violations
        )
    return found


def verdict_of(
    scenario: Judged,
    records: Sequence[RoundRecord],
    judgements: Sequence[Judgement],
    params: Params,
) -> Verdict:
    """Each round's exactly-once check plus the scenario's own judgement, as one verdict.

    The generic check runs only when the scenario is history-checked.
    """
    found: list[Violation] = []
    invariant = scenario.invariant(params)
    for record, judgement in zip(records, judgements, strict=True):
        if scenario.checked():
            found.extend(_history_violations(scenario, record, invariant))
        found.extend(judgement.violations)
    return Verdict.of(found)


# -- one pair, the whole run ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ScenarioResult:
    """The measurements and the verdict of one (scenario, strategy) pair's timed rounds.

    Latencies are in milliseconds.
    `success_pct` counts calls that applied, were idempotent or were refused by a rule.
    Lock and conflict failures do not count as success.
    `peak_connections`: the run's connections in use at the busiest sample.
    `open_connections`: all of them, idle ones included.
    `lock_wait_ms`: lock wait per call (row locks on the server, leases in the client).
    """

    scenario: str
    strategy: str
    workers: int
    rounds: int
    calls: int
    avg_ms: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    success_pct: float
    attempts_per_call: float
    calls_per_s: float
    applied_per_s: float
    peak_connections: int
    peak_active_connections: int
    double_advanced_rounds: int
    applied: int
    idempotent: int
    refused: int
    failed: int
    applied_per_round: tuple[int, ...]
    errors: Mapping[str, int]
    wall_s: float
    loop: str
    verdict: Verdict
    ops: int = 1
    processes: int = 1
    lock_wait_ms: float = 0.0
    row_lock_wait_s: float = 0.0
    lease_wait_s: float = 0.0
    open_connections: int = 0
    floor: str | None = None
    """For the raw strategy: how it did this scenario's calls (statement, locked, cas, claim)."""
    mean_batch: float | None = None
    """The mean `Outcome.batch_size` over the calls that got an Outcome (see
    `mean_batch`); None when none did."""
    hosts: int = 0
    """The namespaced hosts the worker processes ran on (`--hosts`); 0: this machine's own
    network."""
    escalated: int | None = None
    """Instances the engines' adaptive monitors escalated during the pair, each engine counted
    once per instance (one engine per worker process); None when not counted (the raw floor)."""
    adopted: int | None = None
    """Of `escalated`, those an engine took from the escalation board in PostgreSQL:
    decided by another engine, on another worker process or host."""
    transport: Transport = IN_PROCESS
    """How the calls were made. Over `http` the connections are the service's, which the
    sampler does not see: the peak connections and the lock wait are not measured (0)."""
    race: RaceFigures | None = None
    """`deadline` only: how the approvals and the expiries shared the instances."""
    delivery: DeliveryFigures | None = None
    """The outbox pairs only (`hot-outbox`, `spread-outbox`): what their handler received."""
    without: ScenarioResult | None = None
    """The outbox pairs only: their rounds without messages (`Params.quiet`), each run just
    before a round with them, on the same session; this result holds the rounds with them."""
    capacity: CapacityFigures | None = None
    """The capacity scenarios only: holders proved from the slot log, refusals, fairness."""
    cpu_us: float | None = None
    """Process CPU microseconds per call, on the calling side: the bench's process, or the sum
    of the worker processes' for the multi-process scenarios (docs/benchmarks.md). None when
    not measured: over HTTP the engine's CPU is the service's."""

    @property
    def label(self) -> str:
        """`scenario/strategy`, with ` (http)` after a result measured through the service."""
        suffix = " (http)" if self.transport == HTTP else ""
        return f"{self.scenario}/{self.strategy}{suffix}"


def _per(amount: float, count: float) -> float:
    """`amount / count`, 0 when there is nothing to divide by."""
    return amount / count if count > 0 else 0.0


def mean_batch(results: Iterable[CallResult]) -> float | None:
    """The mean `batch_size` of calls an engine answered; None when no engine answered.

    It is 1.0 when batching is off or no two calls on an instance met.
    None covers the raw floor, `RunOnce` and runs where every call failed.
    """
    sizes = [r.batch_size for r in results if r.batch_size is not None]
    return sum(sizes) / len(sizes) if sizes else None


def summarise(
    scenario: Judged,
    strategy: str,
    params: Params,
    timed: Timed,
    conns: ConnectionStats,
    *,
    loop: str,
    floor: bool = False,
    hosts: int = 0,
    escalations: tuple[int, int] | None = None,
    transport: Transport = IN_PROCESS,
) -> ScenarioResult:
    """One pair's result from its timed rounds and the sampler's figures.

    Throughput is per second of round wall time; lock wait is per call.
    `floor` marks the raw floor, so the result names how it made the calls.
    `hosts` are the namespaced hosts it ran on.
    `escalations` is (escalated, adopted), summed over the engines.
    `transport` says how its calls were made.
    """
    records, wall = timed.records, timed.wall
    results = [r for record in records for r in record.results]
    judgements = [scenario.judge(record, params) for record in records]
    errors = Counter(r.error for r in results if r.kind == "failed" and r.error)
    kinds: Counter[Kind] = Counter(r.kind for r in results)
    latency = Latencies.of(r.latency for r in results)
    calls = len(results)
    ok = kinds["applied"] + kinds["idempotent"] + kinds["refused"]
    waited = conns.lock_wait + timed.lease_wait
    return ScenarioResult(
        scenario=scenario.name,
        strategy=strategy,
        workers=params.workers,
        rounds=len(records),
        calls=calls,
        avg_ms=latency.avg_ms,
        p50_ms=latency.p50_ms,
        p99_ms=latency.p99_ms,
        max_ms=latency.max_ms,
        success_pct=_per(100.0 * ok, calls),
        attempts_per_call=_per(sum(r.attempts for r in results), calls),
        calls_per_s=_per(calls, wall),
        applied_per_s=_per(kinds["applied"], wall),
        peak_connections=conns.peak,
        peak_active_connections=conns.peak_active,
        double_advanced_rounds=sum(1 for j in judgements if j.double_advanced),
        applied=kinds["applied"],
        idempotent=kinds["idempotent"],
        refused=kinds["refused"],
        failed=kinds["failed"],
        applied_per_round=tuple(sum(rec.applied_by_instance().values()) for rec in records),
        errors=dict(errors.most_common()),
        wall_s=wall,
        loop=loop,
        verdict=verdict_of(scenario, records, judgements, params),
        ops=params.ops,
        processes=params.processes,
        lock_wait_ms=_per(1000 * waited, calls),
        row_lock_wait_s=conns.lock_wait,
        lease_wait_s=timed.lease_wait,
        open_connections=conns.peak_open,
        floor=scenario.floor if floor else None,
        mean_batch=mean_batch(results),
        hosts=hosts,
        escalated=None if escalations is None else escalations[0],
        adopted=None if escalations is None else escalations[1],
        transport=transport,
        cpu_us=None if transport == HTTP or not calls else 1e6 * timed.cpu / calls,
    )


@dataclass(frozen=True, slots=True)
class BenchReport:
    """A whole run: the environment, the arguments, and one result per pair."""

    flowlock_version: str
    postgres_version: str
    redis_version: str | None
    cores: int
    args: Mapping[str, Any]
    results: tuple[ScenarioResult, ...]
    loop: str
    database: str
    """`"embedded"` or `"external"`."""
    pool_size: int
    duration_s: float
    notes: tuple[str, ...] = ()
    redis: str = "none"
    """`"embedded"`, `"external"`, or `"none"` (no strategy needed Redis, or none found)."""
    skipped: tuple[str, ...] = ()
    """`scenario/strategy` pairs that could not run (see `notes`)."""
    log: tuple[str, ...] = ()
    """What flowlock logged (WARNING and above) during the run, one line per kind of message."""
    timers: TimersSection | None = None
    """The firing lag and idle cost, measured when the run had `deadline` (None otherwise)."""
    outbox: OutboxSection | None = None
    """The dispatcher's idle cost, measured when the run had an outbox pair (None otherwise)."""

    @property
    def ok(self) -> bool:
        """Every pair's checker verdict is ok, and so is every timers measurement's."""
        timers_ok = self.timers is None or self.timers.ok
        return timers_ok and all(r.verdict.ok for r in self.results)


# Violation kinds, the most serious first: what a reader of a failed run should see first.
_SEVERITY = (DOUBLE_APPLY, LOST_UPDATE, OVERSELL, VERSION_GAP, BROKEN_CHAIN, FINAL_MISMATCH)


def failures(report: BenchReport, limit: int = 5) -> list[str]:
    """One line per failed verdict, with its violations counted by kind.

    Then up to `limit` violations, the most serious kinds (double applies) first.
    """
    lines: list[str] = []
    for r in report.results:
        if r.verdict.ok:
            continue
        found = sorted(
            r.verdict.violations,
            key=lambda v: _SEVERITY.index(v.kind) if v.kind in _SEVERITY else len(_SEVERITY),
        )
        kinds = Counter(v.kind for v in found)
        counted = ", ".join(f"{n} {kind}" for kind, n in kinds.items())
        lines.append(f"{r.label}: {len(found)} violation(s): {counted}")
        lines.extend(f"  - {v}" for v in found[:limit])
        if len(found) > limit:
            lines.append(f"  ... and {len(found) - limit} more")
    return lines
