"""A worker process for the namespaced-hosts tests, run inside one host's network namespace
(``ip netns exec NAME python host_worker.py CONFIG_JSON``). It prints one JSON line.

Its engine is adaptive, with a monitor quick to escalate (10 attempts) and slow to step down (a
minute), sharing escalations every 0.1 s through the PostgreSQL board, without batching (so
concurrent calls in this one process do race each other's compare-and-swap).

- ``role: "escalate"``: fires bursts of concurrent ``step`` calls at ``instance`` until this
  engine's monitor escalates it, then waits until the board holds that escalation;
- ``role: "observe"``: fires nothing until its engine sees ``instance`` escalated (it can only
  learn that from the board: this host has made no call on it), then makes ``calls`` calls one
  after another and reports the strategy each ran under.

Both report the client address the server saw for their connection (``inet_client_addr()``), the
monitor's counts and how many of their calls applied.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from flowlock.bench.scenarios import counter
from flowlock.engine import Engine
from flowlock.stores.postgres import PostgresStore
from flowlock.strategies.monitor import ConflictMonitor

WAIT = 30.0  # seconds an observer waits for the escalation, the escalator for the board
BURST = 40  # concurrent calls of one escalating burst
BURSTS = 25  # at most, before the escalator gives up


async def _escalate(engine: Engine, store: PostgresStore, iid: str) -> dict[str, Any]:
    applied = 0
    for _ in range(BURSTS):
        outs = await asyncio.gather(
            *(engine.fire(iid, "step", actor="h-up", strategy="adaptive") for _ in range(BURST))
        )
        applied += sum(o.applied for o in outs)
        if engine.monitor.escalated(iid) is not None:
            break
    escalation = engine.monitor.escalated(iid)

    async def on_board() -> bool:
        return any(e.key == iid for e in await store.active(await store.now()))

    shared = escalation is not None and await _until(on_board)
    return {
        "applied": applied,
        "reason": None if escalation is None else escalation.reason,
        "on_board": shared,
    }


async def _until(holds: Callable[[], Awaitable[bool]]) -> bool:
    """Whether ``holds()`` came true within :data:`WAIT` seconds (looked at every 20 ms)."""
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        if await holds():
            return True
        await asyncio.sleep(0.02)
    return False


async def _observe(engine: Engine, iid: str, calls: int) -> dict[str, Any]:
    async def escalated() -> bool:
        return engine.monitor.escalated(iid) is not None

    await _until(escalated)
    escalation = engine.monitor.escalated(iid)
    strategies: list[str] = []
    applied = 0
    if escalation is not None:
        for _ in range(calls):
            out = await engine.fire(iid, "step", actor="h-observe", strategy="adaptive")
            strategies.append(out.strategy)
            applied += out.applied
    return {
        "applied": applied,
        "reason": None if escalation is None else escalation.reason,
        "strategies": strategies,
    }


async def main(conf: dict[str, Any]) -> dict[str, Any]:
    store = PostgresStore(conf["url"], schema=conf["schema"], pool_size=10, auto_migrate=False)
    monitor = ConflictMonitor(min_samples=10, cooldown=60.0)
    engine = Engine(
        store, strategy="adaptive", monitor=monitor, escalation_sync=0.1, batching=False
    )
    async with engine:
        await engine.register(counter())
        seen_as = await store.pool.fetchval("SELECT host(inet_client_addr())")
        iid = conf["instance"]
        if conf["role"] == "escalate":
            found = await _escalate(engine, store, iid)
        else:
            found = await _observe(engine, iid, int(conf.get("calls", 5)))
        return {
            **found,
            "seen_as": seen_as,
            "escalations": monitor.escalations,
            "adopted": monitor.adopted,
        }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(json.loads(sys.argv[1])))), flush=True)
