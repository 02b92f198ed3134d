"""A scheduled job run by every process at each tick: exactly once per tick."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

import asyncpg

from flowlock import examples
from flowlock.bench.results import CallSpec, Judgement, Params, RoundPlan, RoundRecord
from flowlock.bench.scenarios.base import Fired, Floor, Scenario, Session, results_for
from flowlock.checker import DOUBLE_APPLY, LOST_UPDATE, Violation
from flowlock.core.definition import Workflow
from flowlock.core.models import HistoryEntry, Instance
from flowlock.engine import Engine

__all__ = ["Singleton"]


_RUNS_TABLE = "flowlock_bench_runs"
_CLAIMS_TABLE = "flowlock_bench_claims"


class Singleton(Scenario):
    """P processes (N callers) run the same scheduled job at each tick.

    Correct when the job ran once per tick, by the one caller told it ran it.
    Runs go to `flowlock_bench_runs`, which has no unique constraint, so a double run shows.
    The distributed strategies use [`flowlock.jobs.RunOnce`][flowlock.jobs.RunOnce].
    The others claim the tick with `approve` on a per-tick instance.
    Raw inserts the (job, tick) claim row.
    """

    name = "singleton"
    summary = "P OS processes run the same scheduled job each tick; exactly once per tick"
    default_rounds = 10
    quick_rounds = 2
    multiprocess = True
    floor: Floor = "claim"

    def workflows(self, params: Params) -> Sequence[Workflow]:
        return [examples.approval()]

    async def prepare(self, pool: asyncpg.Pool) -> None:
        await pool.execute(
            f"""
            CREATE TABLE IF NOT EXISTS {_RUNS_TABLE} (
                job text NOT NULL, tick bigint NOT NULL, runner text NOT NULL,
                at timestamptz NOT NULL DEFAULT clock_timestamp());
            CREATE TABLE IF NOT EXISTS {_CLAIMS_TABLE} (
                job text NOT NULL, tick bigint NOT NULL, PRIMARY KEY (job, tick));
            """
        )

    async def setup(
        self, engine: Engine, key: str, params: Params, rng: random.Random
    ) -> RoundPlan:
        # The tick is the round's instance: its id is the job, created pending ("due").
        inst = await engine.create("approval", instance_id=key)
        tick = rng.getrandbits(40)  # the job id is unique to the round; the tick is any number
        calls = tuple(
            CallSpec(inst.id, "approve", actor=f"runner-{i}", payload={"tick": tick})
            for i in range(params.workers)
        )
        return RoundPlan({inst.id: inst.state}, calls)

    async def fire(self, session: Session, call: CallSpec) -> Fired:
        payload = call.payload or {}
        tick = int(payload["tick"])
        pool = session.pool
        runner = str(call.actor)

        async def job() -> None:
            await pool.execute(
                f"INSERT INTO {_RUNS_TABLE} (job, tick, runner) VALUES ($1, $2, $3)",
                call.instance_id,
                tick,
                runner,
            )

        ran = await session.run_once(call.instance_id, tick, job)
        if ran is not None:
            return Fired("applied" if ran else "idempotent")
        # No runner of its own: claim the tick with the strategy (applied = ours to run).
        claimed = await session.fire(call)
        if claimed.kind == "applied":
            await job()
        return claimed

    async def readback(
        self, session: Session, plan: RoundPlan
    ) -> tuple[dict[str, Instance], dict[str, list[HistoryEntry]], dict[str, Any]]:
        runs: dict[str, list[str]] = {}
        for job in plan.instances:
            rows = await session.pool.fetch(
                f"SELECT runner FROM {_RUNS_TABLE} WHERE job = $1 ORDER BY at", job
            )
            runs[job] = [r["runner"] for r in rows]
        return {}, {}, {"runs": runs}

    def checked(self) -> bool:
        # RunOnce and the raw claim keep their own records; the per-tick instance only has a
        # history under the engine strategies, so the judge below is the whole check.
        return False

    def judge(self, record: RoundRecord, params: Params) -> Judgement:
        found: list[Violation] = []
        double = False
        runs: Mapping[str, list[str]] = record.extra.get("runs", {})
        for job in record.plan.instances:
            ran = runs.get(job, [])
            told = sorted(str(r.call.actor) for r in results_for(record, job, "applied"))
            if len(ran) > 1:
                double = True
                found.append(
                    Violation(
                        DOUBLE_APPLY,
                        f"job {job!r}: ran {len(ran)} times in one tick (by {', '.join(ran[:5])})",
                    )
                )
            if sorted(ran) != told:
                found.append(
                    Violation(
                        DOUBLE_APPLY if len(told) > len(ran) else LOST_UPDATE,
                        f"job {job!r}: callers told they ran it: {told[:5] or 'none'}; "
                        f"runs recorded: {ran[:5] or 'none'}",
                    )
                )
            failed = results_for(record, job, "failed")
            if not ran and not failed:
                found.append(
                    Violation(
                        LOST_UPDATE,
                        f"job {job!r}: nobody ran the tick although no caller failed",
                    )
                )
        return Judgement(double, tuple(found))
