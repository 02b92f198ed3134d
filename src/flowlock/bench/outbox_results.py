"""What the outbox section of `flowlock bench` measured, as plain values.

Three measurements, all on PostgreSQL (docs/benchmarks.md, "The outbox section"):

- each `hot-outbox` and `spread-outbox` pair's rounds with one message per transition against
  its rounds without (the same calls on the same session, alternating): applied/s both ways;
- the messages of those rounds: every one delivered, and the lag from its commit to its
  handler;
- the idle cost: what an engine with a handler sends while nothing is pending.

Nothing here does I/O. The targets are the issue's; they are reported, never asserted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flowlock.bench.timer_results import Quantiles

if TYPE_CHECKING:
    from flowlock.bench.results import BenchReport, ScenarioResult

__all__ = [
    "IDLE_TARGET",
    "RATIO_TARGET",
    "DeliveryFigures",
    "OutboxIdle",
    "OutboxPair",
    "OutboxSection",
    "Quantiles",
    "outbox_pairs",
    "section_to_json",
]

RATIO_TARGET = 0.9
"""applied/s with one message per transition, at least this much of the same pair's without."""
IDLE_TARGET = 0.0
"""Statements per second the dispatcher should send while nothing is pending (LISTEN aside)."""


@dataclass(frozen=True, slots=True)
class DeliveryFigures:
    """The messages of one outbox pair's timed rounds, as its handler saw them.

    - `emitted`: transitions in the rounds' histories, each of which emitted one message;
    - `delivered`: those whose message reached the handler; `lost` the others;
    - `duplicates`: deliveries beyond the first of a message (at-least-once allows them; a run
      without crashes should have none); `stray`: messages of no transition in the history;
    - `left`: messages pending, running or dead once the rounds settled (0 expected);
    - `lag`: the message's commit (its `created_at`, as the store stamps it) to its handler's
      start, both on the server's clock (the handler's corrected by the measured offset);
    - `claim_lag`: the store's own `Message.lag`, the commit to the claim.
    """

    emitted: int
    delivered: int
    duplicates: int
    lost: int
    stray: int
    left: int
    lag: Quantiles
    claim_lag: Quantiles
    baseline: str = ""
    """The scenario without messages this one is compared with (`hot` for `hot-outbox`)."""

    @property
    def ok(self) -> bool:
        """Every message delivered, no stray one, none left."""
        return self.lost == 0 and self.stray == 0 and self.left == 0

    def to_json(self) -> dict[str, Any]:
        return {
            "emitted": self.emitted,
            "delivered": self.delivered,
            "duplicates": self.duplicates,
            "lost": self.lost,
            "stray": self.stray,
            "left": self.left,
            "all_delivered": self.ok,
            "lag": self.lag.to_json(),
            "claim_lag": self.claim_lag.to_json(),
        }


@dataclass(frozen=True, slots=True)
class OutboxPair:
    """One strategy on one emitting scenario: its rounds with messages and without."""

    scenario: str
    """The scenario with messages (`hot-outbox`)."""
    baseline: str
    """The scenario its rounds without messages are (`hot`)."""
    strategy: str
    delivery: DeliveryFigures
    with_per_s: float
    """applied/s with one message per transition."""
    without_per_s: float | None
    """applied/s of the same calls without messages; None when none ran."""
    violations: int
    """The pair's verdict: violations of the steps' rules and the delivery's, both kinds of
    round."""
    with_p99_ms: float = 0.0
    without_p99_ms: float | None = None

    @property
    def verdict_ok(self) -> bool:
        return self.violations == 0

    @property
    def ratio(self) -> float | None:
        if self.without_per_s is None or self.without_per_s <= 0:
            return None
        return self.with_per_s / self.without_per_s

    @property
    def met(self) -> bool | None:
        """Whether the ratio reached `RATIO_TARGET`; None without a baseline to judge by."""
        ratio = self.ratio
        return None if ratio is None else ratio >= RATIO_TARGET

    def to_json(self) -> dict[str, Any]:
        ratio = self.ratio
        return {
            "scenario": self.scenario,
            "baseline": self.baseline,
            "strategy": self.strategy,
            "applied_per_s": round(self.with_per_s, 1),
            "without_applied_per_s": (
                None if self.without_per_s is None else round(self.without_per_s, 1)
            ),
            "p99_ms": round(self.with_p99_ms, 3),
            "without_p99_ms": (
                None if self.without_p99_ms is None else round(self.without_p99_ms, 3)
            ),
            "ratio": None if ratio is None else round(ratio, 3),
            "target_ratio": RATIO_TARGET,
            "met": self.met,
            **self.delivery.to_json(),
            "verdict": {"ok": self.verdict_ok, "violations": self.violations},
        }


def outbox_pairs(report: BenchReport) -> list[OutboxPair]:
    """Each outbox result of the run with its rounds without messages, in the order they ran."""
    found: list[OutboxPair] = []
    for r in report.results:
        if r.delivery is None:
            continue
        without: ScenarioResult | None = r.without
        found.append(
            OutboxPair(
                r.scenario,
                r.delivery.baseline,
                r.strategy,
                r.delivery,
                r.applied_per_s,
                None if without is None else without.applied_per_s,
                len(r.verdict.violations),
                r.p99_ms,
                None if without is None else without.p99_ms,
            )
        )
    return found


@dataclass(frozen=True, slots=True)
class OutboxIdle:
    """What one engine with a handler sent while nothing was pending.

    Counted as the timers' idle cost is (`flowlock.bench.idle`): in a database of its own, after
    the engine settled, its connections' statements seen in `pg_stat_activity` by kind
    (`outbox`: they name the outbox's table; `listen`: the LISTEN connection's own;
    `escalations`, `timers` and `other`), and each table's scans as the server counts them.
    `done` messages were delivered there before the engine opened (none pending).
    """

    engines: int
    done: int
    window_s: float
    statements_per_s: Mapping[str, float]
    scans_per_s: Mapping[str, float] | None
    """None when not counted (`--quick`: too short a settle for the counts to be in)."""
    database: str
    method: str
    others_seen: int = 0
    table: str = "flowlock_outbox"
    """The outbox's table, whose scans the dispatcher's idle cost counts."""

    @property
    def outbox_statements_per_s(self) -> float:
        return self.statements_per_s.get("outbox", 0.0)

    @property
    def total_per_s(self) -> float:
        return sum(self.statements_per_s.values())

    @property
    def met(self) -> bool:
        return self.outbox_statements_per_s <= IDLE_TARGET

    def to_json(self) -> dict[str, Any]:
        return {
            "engines": self.engines,
            "done": self.done,
            "window_s": round(self.window_s, 3),
            "statements_per_s": round(self.total_per_s, 3),
            "outbox_statements_per_s": round(self.outbox_statements_per_s, 3),
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
            "target_outbox_statements_per_s": IDLE_TARGET,
            "met": self.met,
        }


@dataclass(frozen=True, slots=True)
class OutboxSection:
    """The outbox section's measurements beyond the pairs: the idle cost, and notes."""

    idle: OutboxIdle | None = None
    notes: tuple[str, ...] = field(default=())


def section_to_json(pairs: Sequence[OutboxPair], section: OutboxSection | None) -> dict[str, Any]:
    """The JSON's `outbox`: each pair beside its twin, the idle cost, notes and targets."""
    idle = None if section is None or section.idle is None else section.idle.to_json()
    return {
        "pairs": [p.to_json() for p in pairs],
        "idle": idle,
        "notes": [] if section is None else list(section.notes),
        "targets": {
            "applied_per_s_ratio": RATIO_TARGET,
            "idle_outbox_statements_per_s": IDLE_TARGET,
        },
    }
