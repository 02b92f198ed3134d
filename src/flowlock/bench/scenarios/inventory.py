"""Stock for half the callers, every caller reserving one unit at once: never oversell."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from flowlock import examples
from flowlock.bench.results import CallSpec, Judgement, Params, RoundPlan, RoundRecord
from flowlock.bench.scenarios.base import Floor, Scenario, actors_match, results_for
from flowlock.checker import INVARIANT, OVERSELL, Invariant, Violation
from flowlock.core.definition import Workflow
from flowlock.engine import Engine

__all__ = ["Inventory"]


class Inventory(Scenario):
    """Stock S = N / 2; N callers each `reserve` one unit at once.

    Correct when the stock never goes below zero and each reservation is in history once.
    Stock plus reserved must stay S.
    A caller may be refused "out of stock" only when the stock really ran out.
    """

    name = "inventory"
    summary = "stock N/2; N callers reserve one unit each at once (never oversell)"
    default_rounds = 5
    quick_rounds = 1
    floor: Floor = "locked"
    invariant_kind = OVERSELL

    @staticmethod
    def stock(params: Params) -> int:
        return max(1, params.workers // 2)

    def workflows(self, params: Params) -> Sequence[Workflow]:
        return [examples.inventory()]

    def invariant(self, params: Params) -> Invariant | None:
        total = self.stock(params)

        def never_oversold(data: Mapping[str, Any]) -> str | None:
            stock, reserved = int(data.get("stock", 0)), int(data.get("reserved", 0))
            if stock < 0:
                return f"stock is {stock}: oversold by {-stock}"
            if stock + reserved != total:
                return f"stock {stock} + reserved {reserved} is not the initial {total}"
            return None

        return never_oversold

    async def setup(
        self, engine: Engine, key: str, params: Params, rng: random.Random
    ) -> RoundPlan:
        data = {"stock": self.stock(params), "reserved": 0}
        inst = await engine.create("inventory", instance_id=key, data=data)
        calls = tuple(
            CallSpec(inst.id, "reserve", actor=f"buyer-{i}", payload={"qty": 1})
            for i in range(params.workers)
        )
        return RoundPlan({inst.id: inst.state}, calls)

    def judge(self, record: RoundRecord, params: Params) -> Judgement:
        found: list[Violation] = []
        for iid in record.plan.instances:
            found.extend(actors_match(iid, record.histories.get(iid, ()), record, "reservation"))
            final = record.finals.get(iid)
            refused = results_for(record, iid, "refused")
            left = int(final.data.get("stock", 0)) if final is not None else 0
            if refused and left > 0:
                # Stock only goes down, so a true "out of stock" leaves it at zero for good.
                found.append(
                    Violation(
                        INVARIANT,
                        f"instance {iid!r}: {len(refused)} caller(s) refused although "
                        f"{left} unit(s) are still in stock",
                    )
                )
        return Judgement(False, tuple(found))
