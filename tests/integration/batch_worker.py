"""The batching tests' scenarios and engines, shared by the tests (one process) and by this file
run as a worker process (several processes on one instance).

Run as ``python batch_worker.py CONFIG_JSON``, it builds an engine as the tests do, waits at the
start gate of :mod:`proc_worker`, fires ``callers`` calls of one scenario at one shared instance
at once, and prints one JSON line per call (its :func:`answer`).

The scenarios (100 callers on one instance):

- ``storm``: everyone approves one request (no request ids: the two-admins rule); one applies.
- ``countersign``: a quorum of QUORUM signatures, each caller its own actor and request id; the
  first QUORUM apply, the rest find the document approved (idempotent).
- ``inventory``: STOCK units, everyone reserves one; STOCK apply, the rest are refused.
- ``hot``: everyone restocks one unit, each with its own request id; every call must apply, so
  the versions run 1 to callers + 1.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

import flowlock
from flowlock import examples
from flowlock.options import DEFAULT_MAX_BATCH

QUORUM = 60
STOCK = 50
# Seconds a write may wait for a row lock or a lease: generous, so a loaded machine only makes a
# test slower; a call is never refused for waiting behind 99 others.
WAIT = 30.0
# Optimistic must apply every call the state allows (countersign, inventory, hot), also across
# processes where batches race: room to retry, with a short backoff.
MAX_ATTEMPTS = 200


@dataclass(frozen=True)
class Scenario:
    """What every caller of a scenario fires, and at which kind of instance."""

    name: str
    workflow: str
    event: str
    data: dict[str, Any] | None = None
    payload: dict[str, Any] | None = None
    request_ids: bool = True
    initial_state: str = "pending"


SCENARIOS = {
    "storm": Scenario("storm", "approval", "approve", request_ids=False),
    "countersign": Scenario("countersign", "countersign", "sign"),
    "inventory": Scenario(
        "inventory", "inventory", "reserve", data={"stock": STOCK}, initial_state="open"
    ),
    "hot": Scenario(
        "hot", "inventory", "restock", data={"stock": 0}, payload={"qty": 1}, initial_state="open"
    ),
}


def connect(
    url: str,
    schema: str,
    *,
    batching: bool,
    redis_url: str | None = None,
    namespace: str = "default",
    app: str | None = None,
    pool_size: int = 20,
    max_batch: int = DEFAULT_MAX_BATCH,
) -> flowlock.Engine:
    """An engine (not yet opened) on ``schema`` with every strategy the tests run: the
    distributed one leases from Redis when ``redis_url`` is given. Its sessions show in
    pg_stat_activity as ``app``."""
    return flowlock.Engine.connect(
        url,
        schema=schema,
        redis_url=redis_url,
        namespace=namespace,
        application_name=app,
        max_size=pool_size,
        lock_timeout=WAIT,
        lease_wait=WAIT if redis_url is not None else None,
        strategies=[flowlock.Optimistic(max_attempts=MAX_ATTEMPTS, backoff_cap=0.05)],
        batching=batching,
        max_batch=max_batch,
    )


async def register(engine: flowlock.Engine) -> None:
    for wf in (examples.approval(), examples.countersign(QUORUM), examples.inventory()):
        await engine.register(wf)


def request_id(scenario: Scenario, actor: str) -> str | None:
    return f"{scenario.name}-{actor}" if scenario.request_ids else None


async def answer(
    engine: flowlock.Engine, scenario: Scenario, iid: str, strategy: str, actor: str
) -> dict[str, Any]:
    """One caller's call, as a JSON-ready record: its outcome, or its error (typed: a
    FlowlockError; untyped: anything else, which the tests fail on)."""
    rid = request_id(scenario, actor)
    record: dict[str, Any] = {"actor": actor, "request_id": rid}
    try:
        out = await engine.fire(
            iid,
            scenario.event,
            actor=actor,
            request_id=rid,
            payload=scenario.payload,
            strategy=strategy,
        )
    except flowlock.FlowlockError as exc:
        return {**record, "error": type(exc).__name__, "typed": True, "message": str(exc)}
    except Exception as exc:  # reported, and failed on, by the test
        return {**record, "error": repr(exc), "typed": False, "message": str(exc)}
    return {
        **record,
        "applied": out.applied,
        "idempotent": out.idempotent,
        "batch_size": out.batch_size,
        "version": out.instance.version,
        "state": out.instance.state,
        "data": dict(out.instance.data),
    }


async def main(cfg: dict[str, Any]) -> None:
    # Imported here: the tests import this module without needing the gate's worker side.
    from proc_worker import all_started, ready_and_wait, record_phase

    scenario = SCENARIOS[cfg["scenario"]]
    engine = connect(
        cfg["url"],
        cfg["schema"],
        batching=cfg["batching"],
        redis_url=cfg.get("redis_url"),
        namespace=cfg.get("namespace", "default"),
        # 4 processes x 6 stay well inside a busy server's connections (tests/pg_budget.py).
        pool_size=cfg.get("pool_size", 6),
    )
    async with engine:
        await register(engine)
        # Warm the pool so that the contended phase measures the calls, not the connecting.
        await asyncio.gather(*[engine.get(cfg["instance"]) for _ in range(5)])
        await ready_and_wait(cfg["gate"], cfg["proc"])
        start = time.monotonic()
        await all_started(cfg["gate"], cfg["proc"])
        async with asyncio.timeout(cfg.get("within", 120.0)):
            results = await asyncio.gather(
                *[
                    answer(
                        engine, scenario, cfg["instance"], cfg["strategy"], f"p{cfg['proc']}-c{i}"
                    )
                    for i in range(cfg["callers"])
                ]
            )
        record_phase(cfg["gate"], cfg["proc"], start, time.monotonic())
    for r in results:
        print(json.dumps(r))


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
