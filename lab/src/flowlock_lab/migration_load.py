"""What an online migration costs the traffic it runs under (issue 27's Performance section).

    python -m flowlock_lab.migration_load --database-url postgresql://... --instances 100000

It creates N instances of a counter workflow under version 1, then runs a spread load
(`--callers` tasks, each firing `bump` at random instances, one call at a time) twice: for
`--seconds` alone, then while `engine.migrate` moves every instance to version 2 (which renames
the state `open` to `active`). It prints the p50 and p99 of the fires in both phases, their
ratio, and the migration's instances per second; `--json` prints them as one JSON object.
Afterwards it runs the exactly-once checker (definition versions included) over a sample.

The load and the migration have an engine (and a connection pool) each, as an application
and an operator's command would. Everything runs in a schema of its own, dropped at the end
unless `--keep`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import flowlock
from flowlock import Step, Transition, Workflow
from flowlock.checker import check_many

__all__ = ["Phase", "counter", "main", "run"]

WORKFLOW = "meter"


def _bump(inst: flowlock.Instance, payload: Mapping[str, Any], actor: str | None) -> Step:
    return Step(data={**inst.data, "n": int(inst.data.get("n", 0)) + 1}, target=inst.state)


def counter(version: int) -> Workflow:
    """Version 1 counts `bump`s in state `open`; version 2 calls that state `active`."""
    live = "open" if version == 1 else "active"
    return Workflow(
        WORKFLOW,
        # bump stays in its state and must apply: adaptive, as the engine advises.
        strategy="adaptive",
        states=[live, "closed"],
        initial=live,
        transitions=[
            Transition("bump", source=live, target=live, effect=_bump),
            Transition("close", source=live, target="closed"),
        ],
    )


@dataclass
class Phase:
    """The fires of one phase: their latencies in seconds, and the errors by type."""

    name: str
    latencies: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def quantile(self, q: float) -> float:
        if len(self.latencies) < 2:
            return self.latencies[0] if self.latencies else 0.0
        return statistics.quantiles(self.latencies, n=1000, method="inclusive")[int(q * 1000) - 1]

    def summary(self) -> dict[str, Any]:
        return {
            "phase": self.name,
            "fires": len(self.latencies),
            "fires_per_s": round(len(self.latencies) / self.seconds, 1) if self.seconds else 0,
            "p50_ms": round(self.quantile(0.5) * 1000, 2),
            "p99_ms": round(self.quantile(0.99) * 1000, 2),
            "errors": dict(self.errors),
        }


async def _create(engine: flowlock.Engine, ids: Sequence[str], concurrency: int = 64) -> None:
    gate = asyncio.Semaphore(concurrency)

    async def one(iid: str) -> None:
        async with gate:
            await engine.create(WORKFLOW, instance_id=iid, data={"n": 0}, version=1)

    for start in range(0, len(ids), 5000):
        await asyncio.gather(*(one(i) for i in ids[start : start + 5000]))


async def _load(
    engine: flowlock.Engine, ids: Sequence[str], callers: int, phase: Phase, stop: asyncio.Event
) -> None:
    async def caller(k: int) -> None:
        rng = random.Random(k)
        while not stop.is_set():
            iid = rng.choice(ids)
            began = time.perf_counter()
            try:
                await engine.fire(iid, "bump", actor=f"caller-{k}")
            except flowlock.FlowlockError as exc:
                name = type(exc).__name__
                phase.errors[name] = phase.errors.get(name, 0) + 1
                continue
            phase.latencies.append(time.perf_counter() - began)

    began = time.perf_counter()
    await asyncio.gather(*(caller(k) for k in range(callers)))
    phase.seconds = time.perf_counter() - began


async def run(
    database_url: str,
    *,
    instances: int,
    callers: int = 50,
    seconds: float = 10.0,
    batch: int = 500,
    concurrency: int = 16,
    schema: str | None = None,
    keep: bool = False,
    check_sample: int = 2000,
) -> dict[str, Any]:
    """Both phases and the migration; the figures as a JSON-ready dict."""
    schema = schema or f"migload_{uuid.uuid4().hex[:8]}"
    app = flowlock.Engine.connect(database_url, schema=schema, max_size=max(10, callers // 2))
    ops = flowlock.Engine.connect(database_url, schema=schema, max_size=max(4, concurrency))
    async with app, ops:
        for engine in (app, ops):
            await engine.register(counter(1))
            await engine.register(counter(2))
        ids = [f"m-{i:07d}" for i in range(instances)]
        made = time.perf_counter()
        await _create(app, ids)
        created = time.perf_counter() - made

        alone = Phase("without migration")
        stop = asyncio.Event()
        load = asyncio.create_task(_load(app, ids, callers, alone, stop))
        await asyncio.sleep(seconds)
        stop.set()
        await load

        during = Phase("during migration")
        stop = asyncio.Event()
        load = asyncio.create_task(_load(app, ids, callers, during, stop))
        await asyncio.sleep(0.5)  # the load at full speed before the migration starts
        report = await ops.migrate(
            WORKFLOW, 2, state_map={"open": "active"}, batch=batch, concurrency=concurrency,
            actor="lab",
        )  # fmt: skip
        stop.set()
        await load

        sample = random.Random(0).sample(ids, min(check_sample, len(ids)))
        pairs = [(await app.get(i), await app.history(i)) for i in sample]
        # Each row held to the stored rules of the version it records, too.
        forms = {d.version: d.definition for d in await app.definitions(WORKFLOW)}
        verdict = check_many(pairs, definitions={WORKFLOW: forms})
        migrated = sum(1 for _, rows in pairs if sum(r.migrated for r in rows) == 1)
        if not keep:
            await _drop(app, schema)
    base, under = alone.summary(), during.summary()
    return {
        "instances": instances,
        "callers": callers,
        "created_s": round(created, 1),
        "without": base,
        "during": under,
        "p99_ratio": round(under["p99_ms"] / base["p99_ms"], 2) if base["p99_ms"] else None,
        "migration": {
            **{k: v for k, v in report.summary().items() if k not in ("moves", "failed")},
            "failed": len(report.failed),
            "instances_per_s": round(report.rate, 1),
        },
        "checked": {
            "instances": len(pairs),
            "migrated_once": migrated,
            "violations": [str(v) for v in verdict.violations[:10]],
        },
    }


async def _drop(engine: flowlock.Engine, schema: str) -> None:
    """Drop the run's schema through the engine's own pool (PostgreSQL only)."""
    pool = getattr(engine.store, "pool", None)
    if pool is None:
        return
    async with pool.acquire() as conn:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def _print(result: Mapping[str, Any]) -> None:
    mig = result["migration"]
    print(
        f"{result['instances']} instances, {result['callers']} callers "
        f"(created in {result['created_s']} s)"
    )
    for key in ("without", "during"):
        p = result[key]
        print(
            f"  {p['phase']:<18} {p['fires']:>7} fires ({p['fires_per_s']:>8}/s)  "
            f"p50 {p['p50_ms']:>7} ms  p99 {p['p99_ms']:>7} ms  errors {p['errors']}"
        )
    print(f"  p99 during / without: {result['p99_ratio']}")
    print(
        f"  migration: {mig['applied']} migrated in {mig['seconds']} s "
        f"({mig['instances_per_s']} instances/s), {mig['failed']} failed"
    )
    c = result["checked"]
    print(
        f"  checker over {c['instances']} instances: {len(c['violations'])} violation(s); "
        f"{c['migrated_once']} with exactly one migrated row"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flowlock_lab.migration_load")
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--instances", type=int, default=100_000)
    parser.add_argument("--callers", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=10.0, help="the baseline phase")
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=16, help="the migration's calls")
    parser.add_argument("--schema", default=None)
    parser.add_argument("--keep", action="store_true", help="keep the schema afterwards")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = asyncio.run(
        run(
            args.database_url, instances=args.instances, callers=args.callers,
            seconds=args.seconds, batch=args.batch, concurrency=args.concurrency,
            schema=args.schema, keep=args.keep,
        )
    )  # fmt: skip
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print(result)


if __name__ == "__main__":
    main()
