"""How long `engine.check_definition` takes over many histories on PostgreSQL:
`python -m flowlock_lab.replay_load postgresql://... [--instances 100000]`.

It migrates a scratch schema, writes N instances with three transitions each straight into the
tables (one INSERT ... SELECT per table: the same rows three `fire` calls write, without the
hours of firing them one by one), then replays them all through the recorded definition (no
divergence) and through a changed one (every row diverges). It prints the seconds and the rows
replayed per second of each, and drops the schema (unless --keep).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import Mapping
from typing import Any

import asyncpg

from flowlock import Transition, Workflow
from flowlock.engine import Engine
from flowlock.stores.postgres import PostgresStore

__all__ = ["main", "run", "workflow"]

_EVENTS = (("one", "a", "b"), ("two", "b", "c"), ("three", "c", "d"))


def workflow(step: int = 1) -> Workflow:
    """a -one-> b -two-> c -three-> d, each effect adding `step` to n (1: the recorded one)."""

    def bump(inst: Any, payload: Mapping[str, Any], actor: str | None) -> dict[str, Any]:
        return {**inst.data, "n": int(inst.data.get("n", 0)) + step}

    return Workflow(
        "replayload",
        states=["a", "b", "c", "d"],
        initial="a",
        transitions=[Transition(e, source=s, target=t, effect=bump) for e, s, t in _EVENTS],
    )


# $1 the number of instances. Ids in code point order of their number (zero-padded).
_INSTANCES = """
INSERT INTO flowlock_instances (id, workflow, state, version, data, last_event, stay_version,
                                initial_data)
SELECT 'r' || lpad(g::text, 9, '0'), 'replayload', 'd', 4, '{"n": 3}', 'three', 4, '{"n": 0}'
  FROM generate_series(1, $1) AS g
"""
_HISTORY = """
INSERT INTO flowlock_history (instance_id, version, event, from_state, to_state, actor,
                              request_id, strategy, data, payload)
SELECT 'r' || lpad(g::text, 9, '0'), v + 1, (ARRAY['one', 'two', 'three'])[v],
       (ARRAY['a', 'b', 'c'])[v], (ARRAY['b', 'c', 'd'])[v], NULL, NULL, 'optimistic',
       jsonb_build_object('n', v), '{}'
  FROM generate_series(1, $1) AS g, generate_series(1, 3) AS v
"""


async def _seed(url: str, schema: str, instances: int) -> float:
    started = time.perf_counter()
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(f'SET search_path TO "{schema}"')
        await conn.execute(_INSTANCES, instances)
        await conn.execute(_HISTORY, instances)
        await conn.execute("ANALYZE flowlock_instances; ANALYZE flowlock_history")
    finally:
        await conn.close()
    return time.perf_counter() - started


async def run(url: str, *, instances: int, keep: bool = False) -> dict[str, Any]:
    """Seed, replay twice, drop; the figures as a dict."""
    schema = f"flowlock_replay_load_{os.getpid()}"
    store = PostgresStore(url, schema=schema, pool_size=4)
    result: dict[str, Any] = {"instances": instances, "rows": instances * 3, "schema": schema}
    try:
        async with Engine(store) as engine:
            result["seed_seconds"] = round(await _seed(url, schema, instances), 2)
            for name, step in (("clean", 1), ("changed", 2)):
                report = await engine.check_definition(workflow(step))
                assert report.checked_instances == instances, report.checked_instances
                result[name] = {
                    "seconds": round(report.seconds, 2),
                    "rows_per_second": round(report.checked_transitions / report.seconds),
                    "instances_per_second": round(report.checked_instances / report.seconds),
                    "divergences": len(report.divergences),
                }
    finally:
        if not keep:
            conn = await asyncpg.connect(url)
            try:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            finally:
                await conn.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m flowlock_lab.replay_load")
    parser.add_argument("database_url", help="postgresql://user@host:5432/db")
    parser.add_argument("--instances", type=int, default=100_000)
    parser.add_argument("--keep", action="store_true", help="Keep the scratch schema.")
    args = parser.parse_args()
    figures = asyncio.run(run(args.database_url, instances=args.instances, keep=args.keep))
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
