"""The bulk operation tests' workflow and helpers (tests/unit/test_bulk*.py,
tests/integration/test_bulk*.py and their worker process).

`meter`: instances start `open` and count `bump`s in `data["n"]`; `bump` keeps the state (open
or held), so live callers never stop being allowed while a bulk run moves instances to `held`
(by `hold`, or by force). A lost update shows as `n` below the bumps applied.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flowlock
from flowlock import Step, Transition, Workflow

METER = "meter"


def _count(inst: flowlock.Instance, payload: Mapping[str, Any], actor: str | None) -> Step:
    return Step(data={**inst.data, "n": int(inst.data.get("n", 0)) + 1}, target=inst.state)


def meter() -> Workflow:
    return Workflow(
        METER,
        # bump stays in its state and must apply: adaptive, as the engine advises.
        strategy="adaptive",
        states=["open", "held", "closed"],
        initial="open",
        transitions=[
            Transition("bump", source=["open", "held"], target=["open", "held"], effect=_count),
            Transition("hold", source="open", target="held"),
            Transition("close", source=["open", "held"], target="closed"),
        ],
    )


def workflows() -> list[Workflow]:
    """What `flowlock admin ... --app bulk_kit:workflows` registers."""
    return [meter()]
