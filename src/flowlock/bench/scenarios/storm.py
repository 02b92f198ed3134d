"""The seed's incident scaled up: N callers `approve` one pending instance at once."""

from __future__ import annotations

import random
from collections.abc import Sequence

from flowlock import examples
from flowlock.bench.results import CallSpec, Judgement, Params, RoundPlan, RoundRecord
from flowlock.bench.scenarios.base import Floor, Scenario, results_for
from flowlock.checker import DOUBLE_APPLY, LOST_UPDATE, Violation
from flowlock.core.definition import Workflow
from flowlock.engine import Engine

__all__ = ["Storm"]


class Storm(Scenario):
    """The seed's two-admins incident, scaled up to N callers on one pending instance.

    Correct when exactly one call applies and the rest are idempotent.
    """

    name = "storm"
    summary = "N callers fire approve at one pending instance at once"
    default_rounds = 10
    quick_rounds = 2
    floor: Floor = "statement"

    def workflows(self, params: Params) -> Sequence[Workflow]:
        return [examples.approval()]

    async def setup(
        self, engine: Engine, key: str, params: Params, rng: random.Random
    ) -> RoundPlan:
        inst = await engine.create("approval", instance_id=key, data={"amount": 120})
        calls = tuple(
            CallSpec(inst.id, "approve", actor=f"admin-{i}") for i in range(params.workers)
        )
        return RoundPlan({inst.id: inst.state}, calls)

    def judge(self, record: RoundRecord, params: Params) -> Judgement:
        found: list[Violation] = []
        double = False
        applied = record.applied_by_instance()
        for iid in record.plan.instances:
            rows = len(record.histories.get(iid, ()))
            # Why both counts: the seed's bug showed up as several callers told "applied"
            # (and several history rows); either alone is a double advance.
            if applied[iid] > 1 or rows > 1:
                double = True
                found.append(
                    Violation(
                        DOUBLE_APPLY,
                        f"instance {iid!r}: storm double-advanced ({applied[iid]} calls applied, "
                        f"{rows} history rows; exactly one of each expected)",
                    )
                )
            idempotent = len(results_for(record, iid, "idempotent"))
            final = record.finals.get(iid)
            if idempotent and final is not None and final.state != "approved":
                # An idempotent answer claims the approval happened; the store must agree.
                found.append(
                    Violation(
                        LOST_UPDATE,
                        f"instance {iid!r}: {idempotent} call(s) answered idempotent but the "
                        f"instance is still {final.state!r}",
                    )
                )
        return Judgement(double, tuple(found))
