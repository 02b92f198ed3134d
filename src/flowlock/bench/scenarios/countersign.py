"""A quorum of N signatures collected by N callers at once."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from flowlock import examples
from flowlock.bench.results import CallSpec, Judgement, Params, RoundPlan, RoundRecord
from flowlock.bench.scenarios.base import Floor, Scenario, actors_match
from flowlock.checker import DOUBLE_APPLY, INVARIANT, Invariant, Violation
from flowlock.core.definition import Workflow
from flowlock.engine import Engine

__all__ = ["Countersign"]


class Countersign(Scenario):
    """One document needs N distinct signatures; N callers each sign once, at once.

    Correct when each applied signature is in history once.
    The state must move to approved exactly once, at quorum and not before.
    """

    name = "countersign"
    summary = "one instance with quorum N; N callers each sign once at once"
    default_rounds = 3
    quick_rounds = 1
    floor: Floor = "locked"

    def workflows(self, params: Params) -> Sequence[Workflow]:
        return [examples.countersign(quorum=params.workers)]

    def invariant(self, params: Params) -> Invariant | None:
        def signers_unique(data: Mapping[str, Any]) -> str | None:
            signers = list(data.get("signers", []))
            twice = sorted(s for s, n in Counter(signers).items() if n > 1)
            return f"signed more than once: {', '.join(twice)}" if twice else None

        return signers_unique

    async def setup(
        self, engine: Engine, key: str, params: Params, rng: random.Random
    ) -> RoundPlan:
        inst = await engine.create("countersign", instance_id=key, data={"signers": []})
        calls = tuple(CallSpec(inst.id, "sign", actor=f"signer-{i}") for i in range(params.workers))
        return RoundPlan({inst.id: inst.state}, calls)

    def judge(self, record: RoundRecord, params: Params) -> Judgement:
        found: list[Violation] = []
        double = False
        for iid in record.plan.instances:
            history = record.histories.get(iid, ())
            found.extend(actors_match(iid, history, record, "signature"))
            advances = [
                e for e in history if e.to_state == "approved" and e.from_state != "approved"
            ]
            if len(advances) > 1:
                double = True
                found.append(
                    Violation(
                        DOUBLE_APPLY,
                        f"instance {iid!r}: moved to 'approved' {len(advances)} times",
                    )
                )
            for e in history:
                n = len(e.data.get("signers", []))
                if (e.to_state == "approved") != (n >= params.workers):
                    found.append(
                        Violation(
                            INVARIANT,
                            f"instance {iid!r}: state {e.to_state!r} with {n} of "
                            f"{params.workers} signatures",
                            e.version,
                        )
                    )
        return Judgement(double, tuple(found))
