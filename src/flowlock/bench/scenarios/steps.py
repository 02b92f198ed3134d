"""Must-apply steps on counters: hot (one instance), spread (many), cluster (many processes)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping, Sequence
from typing import Any

from flowlock.bench.results import CallSpec, Judgement, Params, RoundPlan, RoundRecord
from flowlock.bench.scenarios.base import Floor, Scenario, actors_match
from flowlock.checker import LOST_UPDATE, Invariant, Violation
from flowlock.core.definition import Transition, Workflow
from flowlock.core.models import Instance
from flowlock.engine import Engine

__all__ = ["Cluster", "Hot", "Spread", "counter"]


def counter(name: str = "counter") -> Workflow:
    """A counter whose `step` adds one to `data["n"]`.

    Each step must apply: there is no guard and the state never changes.
    So nothing is ever "already done".
    """

    def add(inst: Instance, payload: Mapping[str, Any], actor: str | None) -> dict[str, Any]:
        return {**inst.data, "n": int(inst.data.get("n", 0)) + 1}

    return Workflow(
        name,
        states=["open"],
        initial="open",
        transitions=[Transition("step", source="open", target="open", effect=add)],
    )


def _counter_never_skips(data: Mapping[str, Any]) -> str | None:
    n = data.get("n")
    return None if isinstance(n, int) and n >= 0 else f"counter is {n!r}"


class _Steps(Scenario):
    """N callers x M `step` calls over the counters: what hot, spread and cluster share.

    Correct when each applied step is in history once, by caller.
    Each counter must equal its number of history rows: no lost update.
    """

    default_rounds = 1
    quick_rounds = 1
    default_ops = 20
    quick_ops = 3
    uses_ops = True
    counter_workflow = "counter"
    """The workflow the round's counters are instances of."""

    def instances(self, params: Params) -> int:
        raise NotImplementedError

    def workflows(self, params: Params) -> Sequence[Workflow]:
        return [counter(self.counter_workflow)]

    def counter_for(self, params: Params) -> str:
        """The workflow of this round's counters."""
        return self.counter_workflow

    def invariant(self, params: Params) -> Invariant | None:
        return _counter_never_skips

    async def setup(
        self, engine: Engine, key: str, params: Params, rng: random.Random
    ) -> RoundPlan:
        count = self.instances(params)
        if params.warmup:
            count = min(count, params.workers)
        ids = [f"{key}-{k}" for k in range(count)]
        workflow = self.counter_for(params)
        # Created concurrently (not timed): a thousand sequential round trips would dominate.
        sem = asyncio.Semaphore(64)

        async def create(iid: str) -> None:
            async with sem:
                await engine.create(workflow, instance_id=iid, data={"n": 0})

        await asyncio.gather(*(create(i) for i in ids))
        lanes = tuple(
            tuple(
                CallSpec(ids[0] if count == 1 else rng.choice(ids), "step", actor=f"w{w}-{j}")
                for j in range(params.ops)
            )
            for w in range(params.workers)
        )
        return RoundPlan(dict.fromkeys(ids, "open"), lanes=lanes)

    def judge(self, record: RoundRecord, params: Params) -> Judgement:
        found: list[Violation] = []
        for iid in record.plan.instances:
            history = record.histories.get(iid, ())
            found.extend(actors_match(iid, history, record, "step"))
            for e in history:
                if e.data.get("n") != e.version - 1:
                    found.append(
                        Violation(
                            LOST_UPDATE,
                            f"instance {iid!r}: counter is {e.data.get('n')!r} after "
                            f"{e.version - 1} step(s): a step was decided on a stale read",
                            e.version,
                        )
                    )
        return Judgement(False, tuple(found))


class Hot(_Steps):
    """N callers x M must-apply read-modify-write steps on ONE instance: the worst contention."""

    name = "hot"
    summary = "N callers x M must-apply read-modify-write steps on one instance"
    floor: Floor = "locked"

    def instances(self, params: Params) -> int:
        return 1


class Spread(_Steps):
    """N callers x M steps over 10 N instances (1,000 for 100 callers): low conflict."""

    name = "spread"
    summary = "N callers x M steps over 10 N instances (low conflict)"
    floor: Floor = "cas"
    # Thousands of calls a second: enough of them for a throughput that holds still.
    default_ops = 60

    def instances(self, params: Params) -> int:
        return 10 * params.workers


class Cluster(_Steps):
    """The same steps from P OS processes sharing N instances.

    Callers in different processes collide on the same instances.
    """

    name = "cluster"
    summary = "P OS processes x N/P callers x M steps over N shared instances"
    multiprocess = True
    floor: Floor = "cas"
    default_ops = 40

    def instances(self, params: Params) -> int:
        return params.workers
