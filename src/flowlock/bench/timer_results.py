"""What the timers section of `flowlock bench` measured, as plain values.

Three measurements, all on PostgreSQL (docs/benchmarks.md, "The timers section"):

- the race (`deadline` scenario): approvals and expiries due at once, fired by several engines;
- the firing lag: due time to history row, with many timers armed and a steady due rate;
- the idle cost: what an engine sends while timers are armed and none is due.

Nothing here does I/O. The targets are the issue's; they are reported, never asserted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from flowlock.bench.results import percentile

__all__ = [
    "IDLE_TARGET",
    "LAG_P99_TARGET_MS",
    "RACE_TARGET",
    "IdleFigures",
    "LagFigures",
    "Quantiles",
    "RaceFigures",
    "TimersSection",
]

RACE_TARGET = 1000.0
"""Resolved instances per second the race should reach (the issue's figure)."""
LAG_P99_TARGET_MS = 100.0
"""The p99 firing lag the timer services should stay under, in ms."""
IDLE_TARGET = 0.0
"""Statements per second the timer service should send while nothing is due (LISTEN aside)."""


@dataclass(frozen=True, slots=True)
class Quantiles:
    """A distribution in milliseconds: how many, p50, p99 and max (nearest rank)."""

    count: int = 0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    max_ms: float = 0.0

    @classmethod
    def of(cls, seconds: Iterable[float]) -> Quantiles:
        """The quantiles of these durations (seconds); all zero for none."""
        ordered = sorted(s * 1000 for s in seconds)
        if not ordered:
            return cls()
        return cls(
            len(ordered),
            percentile(ordered, 50),
            percentile(ordered, 99),
            ordered[-1],
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "p50_ms": round(self.p50_ms, 3),
            "p99_ms": round(self.p99_ms, 3),
            "max_ms": round(self.max_ms, 3),
        }


@dataclass(frozen=True, slots=True)
class RaceFigures:
    """One `deadline` pair: instances whose approval and expiry fell due together.

    Times are on the database server's clock: each timer's due time, each expiry's history
    row `at` (the start of the transaction that wrote it) and each approval's answer to its
    caller. `exactly_one`: every instance ended approved or rejected, with one history row.
    `left_armed`: timers still armed once every instance was resolved (should be 0).
    """

    engines: int
    instances: int
    approved: int
    rejected: int
    unresolved: int
    exactly_one: bool
    span_s: float
    """From the first due time to the last instance resolved (the last expiry written, or the
    last approval answered)."""
    expiry_lag: Quantiles
    """Due time to the expiry's history row, for the instances the timers rejected."""
    left_armed: int
    checker_ok: bool
    violations: int
    firings_by_engine: tuple[int, ...] = ()
    """Timers each engine's service fired (applied, or found the instance already approved)."""

    @property
    def resolved_per_s(self) -> float:
        resolved = self.approved + self.rejected
        return resolved / self.span_s if self.span_s > 0 else 0.0

    @property
    def met(self) -> bool:
        return self.exactly_one and self.checker_ok and self.resolved_per_s >= RACE_TARGET

    def to_json(self, strategy: str) -> dict[str, Any]:
        return {
            "strategy": strategy,
            "engines": self.engines,
            "instances": self.instances,
            "approved": self.approved,
            "rejected": self.rejected,
            "unresolved": self.unresolved,
            "exactly_one": self.exactly_one,
            "span_s": round(self.span_s, 4),
            "resolved_per_s": round(self.resolved_per_s, 1),
            "expiry_lag": self.expiry_lag.to_json(),
            "left_armed": self.left_armed,
            "checker": {"ok": self.checker_ok, "violations": self.violations},
            "firings_by_engine": list(self.firings_by_engine),
            "target_resolved_per_s": RACE_TARGET,
            "met": self.met,
        }


@dataclass(frozen=True, slots=True)
class LagFigures:
    """The firing lag with `engines` engines: `armed` timers armed, `due_per_s` falling due.

    The lag of a firing is its history row's `at` minus the timer's due time, both on the
    server's clock; only timers due inside the `window_s` measured window count.
    `missed`: due in the window, not fired when the engines stopped.
    """

    engines: int
    armed: int
    due_per_s: float
    window_s: float
    lag: Quantiles
    missed: int
    fired_total: int
    """Firings the engines applied over the whole run (warm-up and drain included)."""
    firings_by_engine: tuple[int, ...]
    """Firings each engine's timer service made (applied or not)."""
    checker_ok: bool
    violations: int
    strategy: str
    armed_by: str = "sql"
    """How the timers were armed: `sql` (one bulk statement, see docs) or `engine`."""

    @property
    def met(self) -> bool:
        return self.checker_ok and self.missed == 0 and self.lag.p99_ms < LAG_P99_TARGET_MS

    def to_json(self) -> dict[str, Any]:
        return {
            "engines": self.engines,
            "armed": self.armed,
            "due_per_s": self.due_per_s,
            "window_s": round(self.window_s, 3),
            "fired": self.lag.count,
            "p50_ms": round(self.lag.p50_ms, 3),
            "p99_ms": round(self.lag.p99_ms, 3),
            "max_ms": round(self.lag.max_ms, 3),
            "missed": self.missed,
            "fired_total": self.fired_total,
            "firings_by_engine": list(self.firings_by_engine),
            "checker": {"ok": self.checker_ok, "violations": self.violations},
            "strategy": self.strategy,
            "armed_by": self.armed_by,
            "target_p99_ms": LAG_P99_TARGET_MS,
            "met": self.met,
        }


@dataclass(frozen=True, slots=True)
class IdleFigures:
    """What one engine sent while `armed` timers were armed and none fell due.

    Counted on the server, in a database of its own that nothing else used, after the engine
    settled:

    - `statements_per_s`: the statements the engine's connections started in the window, seen
      in `pg_stat_activity` (sampled every few ms, so a lower bound: two statements on one
      connection between two samples count once, but a connection that sends anything is seen
      sending something), by kind: `timers` (they name `flowlock_timers`), `listen` (the
      LISTEN connection's), `escalations` (the adaptive strategy's escalation board, which
      every engine on PostgreSQL syncs with) and `other`;
    - `scans_per_s`: sequential and index scans of each flowlock table, as the server counts
      them (only the timer service reads `flowlock_timers`); None under `--quick`.

    The timer service's target is zero statements of kind `timers`.
    """

    engines: int
    armed: int
    window_s: float
    statements_per_s: Mapping[str, float]
    scans_per_s: Mapping[str, float] | None
    """None when not counted (`--quick`: too short a settle for the counts to be in)."""
    database: str
    method: str
    others_seen: int = 0
    """Backends of anything but the engine seen in the database meanwhile (autovacuum)."""

    @property
    def timer_statements_per_s(self) -> float:
        """The timer service's statements seen a second (those naming its table)."""
        return self.statements_per_s.get("timers", 0.0)

    @property
    def total_per_s(self) -> float:
        """Every statement the engine was seen to start, a second."""
        return sum(self.statements_per_s.values())

    @property
    def met(self) -> bool:
        return self.timer_statements_per_s <= IDLE_TARGET

    def to_json(self) -> dict[str, Any]:
        return {
            "engines": self.engines,
            "armed": self.armed,
            "window_s": round(self.window_s, 3),
            "statements_per_s": round(self.total_per_s, 3),
            "timer_statements_per_s": round(self.timer_statements_per_s, 3),
            "statements_by_kind": {
                k: round(v, 3) for k, v in sorted(self.statements_per_s.items())
            },
            "scans_per_s": (
                None
                if self.scans_per_s is None
                else {k: round(v, 3) for k, v in sorted(self.scans_per_s.items())}
            ),
            "database": self.database,
            "method": self.method,
            "others_seen": self.others_seen,
            "target_timer_statements_per_s": IDLE_TARGET,
            "met": self.met,
        }


@dataclass(frozen=True, slots=True)
class TimersSection:
    """The lag and idle measurements of a run that ran `deadline` (the race is in its results).

    `notes` say what could not be measured, and why.
    """

    lag: tuple[LagFigures, ...] = ()
    idle: IdleFigures | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        """Every lag run's firings were applied exactly once (the checker)."""
        return all(f.checker_ok for f in self.lag)
