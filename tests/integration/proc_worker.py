"""A worker process for the multi-process tests: fires events at shared instances and prints
one JSON line per call. Run as ``python proc_worker.py CONFIG_JSON``."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import flowlock
from flowlock import examples
from flowlock.stores.postgres import PostgresStore


async def main(cfg: dict[str, Any]) -> None:
    # Why a pool smaller than the callers: 4 processes must fit a stock max_connections=100
    # server; callers queue for a connection (bounded by acquire_timeout), as in production.
    store = PostgresStore(cfg["url"], schema=cfg["schema"], pool_size=cfg.get("pool_size", 10))
    async with flowlock.Engine(
        store, strategies=[flowlock.Optimistic(max_attempts=cfg.get("max_attempts", 3))]
    ) as engine:
        for wf in (examples.approval(), examples.countersign(cfg["quorum"]), examples.inventory()):
            await engine.register(wf)
        # Warm the pool so that every process is ready before the common start time.
        await asyncio.gather(*[engine.get(cfg["instance"]) for _ in range(10)])
        await asyncio.sleep(max(0.0, cfg["start_at"] - time.time()))

        async def one(i: int) -> dict[str, Any]:
            actor = f"p{cfg['proc']}-c{i}"
            try:
                out = await engine.fire(
                    cfg["instance"],
                    cfg["event"],
                    actor=actor,
                    strategy=cfg["strategy"],
                    request_id=cfg.get("request_id"),
                )
            except flowlock.FlowlockError as exc:
                return {"actor": actor, "error": type(exc).__name__}
            return {
                "actor": actor,
                "applied": out.applied,
                "idempotent": out.idempotent,
                "state": out.instance.state,
                "version": out.instance.version,
            }

        results = await asyncio.gather(*[one(i) for i in range(cfg["callers"])])
    for r in results:
        print(json.dumps(r))


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
