"""The benchmark's scenarios: what a round's callers fire, and what "correct" means.

One module per family, on the base class in `.base`.
`SCENARIOS` holds them by name, in the order `flowlock bench` runs them.
A new one subclasses `Scenario` and calls `register_scenario`.
"""

from __future__ import annotations

from flowlock.bench.results import (
    CallResult,
    CallSpec,
    Judgement,
    Kind,
    Params,
    RoundPlan,
    RoundRecord,
)
from flowlock.bench.scenarios.base import Fired, Floor, Scenario, Session
from flowlock.bench.scenarios.capacity import CapacitySpread, CapacityStorm, CapacityWait
from flowlock.bench.scenarios.countersign import Countersign
from flowlock.bench.scenarios.deadline import Deadline
from flowlock.bench.scenarios.inventory import Inventory
from flowlock.bench.scenarios.outbox import HotOutbox, SpreadOutbox
from flowlock.bench.scenarios.singleton import Singleton
from flowlock.bench.scenarios.steps import Cluster, Hot, Spread, counter
from flowlock.bench.scenarios.storm import Storm

__all__ = [
    "SCENARIOS",
    "SCENARIO_ALIASES",
    "CallResult",
    "CallSpec",
    "CapacitySpread",
    "CapacityStorm",
    "CapacityWait",
    "Cluster",
    "Countersign",
    "Deadline",
    "Fired",
    "Floor",
    "Hot",
    "HotOutbox",
    "Inventory",
    "Judgement",
    "Kind",
    "Params",
    "RoundPlan",
    "RoundRecord",
    "Scenario",
    "Session",
    "Singleton",
    "Spread",
    "SpreadOutbox",
    "Storm",
    "counter",
    "register_scenario",
]

SCENARIOS: dict[str, Scenario] = {}
"""Every known scenario by name, in the order `flowlock bench` runs them by default."""

SCENARIO_ALIASES: dict[str, tuple[str, ...]] = {
    "outbox": ("hot-outbox", "spread-outbox"),
    "capacity": ("capacity-spread", "capacity-storm", "capacity-wait"),
}
"""Names `--scenario` takes for several scenarios: `outbox` is the outbox section's two,
`capacity` the capacity scenarios' three."""


def register_scenario(scenario: Scenario) -> Scenario:
    """Add `scenario` to `SCENARIOS` (replacing one of the same name)."""
    SCENARIOS[scenario.name] = scenario
    return scenario


for _scenario in (
    Storm(),
    Countersign(),
    Inventory(),
    Hot(),
    HotOutbox(),
    Spread(),
    SpreadOutbox(),
    Cluster(),
    Singleton(),
    Deadline(),
    CapacitySpread(),
    CapacityStorm(),
    CapacityWait(),
):
    register_scenario(_scenario)
