"""What the monitor panel shows: the adaptive strategy's escalations and conflict rates.

All of it is this worker's view. Escalations are shared between engines through the board, so
every worker shows the fleet's (within a sync interval); the conflict windows and the counters
are this process's own, so with several workers each shows its share of the traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

from flowlock.engine import Engine
from flowlock.metrics import Metrics

__all__ = ["MonitorView", "monitor_view"]

HOT_SHOWN = 50


@dataclass(frozen=True, slots=True)
class EscalationRow:
    key: str
    strategy: str
    seconds_left: float
    reason: str


@dataclass(frozen=True, slots=True)
class HotRow:
    key: str
    conflicts: int
    attempts: int

    @property
    def rate(self) -> float:
        return self.conflicts / self.attempts if self.attempts else 0.0


@dataclass(frozen=True, slots=True)
class WorkflowRow:
    workflow: str
    calls: float
    conflicts: float

    @property
    def rate(self) -> float:
        """Lost compare-and-swaps per optimistic attempt (each conflict cost one more)."""
        attempts = self.calls + self.conflicts
        return self.conflicts / attempts if attempts else 0.0


@dataclass(frozen=True, slots=True)
class MonitorView:
    threshold: float
    escalate_to: str
    escalations: tuple[EscalationRow, ...]
    hot: tuple[HotRow, ...]
    workflows: tuple[WorkflowRow, ...]
    escalated_total: int
    adopted_total: int
    deescalated_total: int


def _per_workflow(engine: Engine, metrics: Metrics | None) -> tuple[WorkflowRow, ...]:
    if metrics is None:
        return ()
    calls: dict[str, float] = {}
    conflicts: dict[str, float] = {}
    for family in metrics.transitions.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                name = sample.labels["workflow"]
                calls[name] = calls.get(name, 0.0) + sample.value
    for family in metrics.conflicts.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                name = sample.labels["workflow"]
                conflicts[name] = conflicts.get(name, 0.0) + sample.value
    names = sorted(set(engine.workflows) | set(calls))
    return tuple(WorkflowRow(n, calls.get(n, 0.0), conflicts.get(n, 0.0)) for n in names)


def monitor_view(engine: Engine, metrics: Metrics | None) -> MonitorView:
    """The monitor as of now (no I/O: the monitor and the counters are in memory)."""
    monitor = engine.monitor
    escalations = tuple(
        EscalationRow(e.key, e.strategy, left, e.reason) for e, left in monitor.escalations_now()
    )
    hot = tuple(HotRow(k, c, a) for k, c, a in monitor.hot_keys(HOT_SHOWN))
    return MonitorView(
        threshold=monitor.threshold,
        escalate_to=monitor.escalate_to,
        escalations=escalations,
        hot=hot,
        workflows=_per_workflow(engine, metrics),
        escalated_total=monitor.escalations,
        adopted_total=monitor.adopted,
        deescalated_total=monitor.deescalations,
    )
