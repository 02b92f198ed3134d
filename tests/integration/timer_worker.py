"""A worker process of the timer race across processes: an engine with its timer service, plus
callers that approve their share of the instances at the moment each one's deadline falls due.

Run as ``python timer_worker.py CONFIG_JSON``. It opens its engine (the service starts and
sleeps: nothing is armed yet), says it is ready through the gate (proc_worker's), and once the
parent gives the go it reads the plan the parent wrote (each instance's due time, on the
server's clock) and approves every ``processes``-th instance from its ``proc``-th, each from 5 ms
before to 30 ms after its due time. Meanwhile its timer service fires whatever deadline it
claims. It waits until no instance is pending and no timer is armed, closes its engine (firings
in flight end first) and prints one JSON object: the callers' answers, the service's firings by
outcome, its claim owner, and when its deadline effects ran (``time.monotonic()``: one clock
for the whole machine).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: timer_kit

from proc_worker import all_started, ready_and_wait, record_phase

from timer_kit import deadline, firings

BOUND = 60.0  # the most a worker waits for every instance to be resolved


def _plan(path: str) -> dict[str, float]:
    """Each instance's due time, seconds since the epoch on the server's clock."""
    plan: dict[str, float] = json.loads(Path(path).read_text())
    return plan


async def main(cfg: dict[str, Any]) -> None:
    import flowlock
    from flowlock.metrics import Metrics
    from flowlock.stores.base import TimerStore
    from flowlock.stores.postgres import PostgresStore

    fired_at: list[float] = []
    metrics = Metrics()
    store = PostgresStore(cfg["url"], schema=cfg["schema"], pool_size=cfg.get("pool_size", 4))
    answers: dict[str, str] = {}
    async with flowlock.Engine(store, metrics=metrics) as engine:
        await engine.register(
            deadline(after=cfg["after"], on_expire=lambda _: fired_at.append(time.monotonic()))
        )
        service = engine.timer_service
        assert service is not None
        await ready_and_wait(cfg["gate"], cfg["proc"])
        plan = _plan(cfg["plan"])
        mine = sorted(plan)[cfg["proc"] :: cfg["processes"]]
        rng = random.Random(cfg["proc"])
        start = time.monotonic()
        await all_started(cfg["gate"], cfg["proc"])

        async def approve(iid: str) -> None:
            await asyncio.sleep(max(0.0, plan[iid] + rng.uniform(-0.005, 0.03) - time.time()))
            try:
                out = await engine.fire(iid, "approve", actor=f"p{cfg['proc']}")
            except flowlock.TransitionNotAllowed:
                answers[iid] = "refused"
            except flowlock.FlowlockError as exc:
                answers[iid] = type(exc).__name__
            else:
                answers[iid] = "applied" if out.applied else "idempotent"

        await asyncio.gather(*[approve(iid) for iid in mine])
        record_phase(cfg["gate"], cfg["proc"], start, time.monotonic())
        assert isinstance(store, TimerStore)
        deadline_at = time.monotonic() + BOUND
        while await engine.count("deadline", state="pending") or await store.count_timers():
            if time.monotonic() > deadline_at:
                raise TimeoutError(f"worker {cfg['proc']}: instances unresolved after {BOUND} s")
            await asyncio.sleep(0.05)
        owner = service.owner
    print(
        json.dumps(
            {
                "proc": cfg["proc"],
                "answers": answers,
                "firings": firings(metrics),
                "owner": owner,
                "fired_at": fired_at,
            }
        )
    )


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
