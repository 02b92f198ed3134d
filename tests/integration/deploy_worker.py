"""A process of a rolling deploy (tests/integration/test_migrate_pg.py): it registers the
`case` versions it is told to (1 only: an old process; 1 and 2: a new one) and fires at random
instances until its time is up, while the test migrates them to version 2.

Run as ``python deploy_worker.py CONFIG_JSON`` (url, schema, instances: how many of
migrate_kit.case_ids, versions, callers, seconds, gate, proc). It waits at the start gate
(proc_worker.Gate), records its phase, and prints one JSON line: {"proc", "calls",
"applied": {event: n}, "errors": {type: n}, "samples": {...}}.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: migrate_kit

from proc_worker import ready_and_wait, record_phase

import flowlock
from flowlock.stores.postgres import PostgresStore
from migrate_kit import case_ids, ticket_v1, ticket_v2

# What an old process fires, and what a new one fires (reopen exists in version 2 only):
# mostly bumps, a close now and then (a closed instance takes no more events).
EVENTS = {1: ("bump", "hold", "close"), 2: ("bump", "hold", "reopen", "close")}
WEIGHTS = {1: (89, 10, 1), 2: (80, 10, 9, 1)}


async def main(conf: dict[str, Any]) -> None:
    ids = case_ids(conf["instances"])
    versions: list[int] = conf["versions"]
    events, weights = EVENTS[max(versions)], WEIGHTS[max(versions)]
    applied: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    samples: dict[str, str] = {}
    calls = 0
    store = PostgresStore(conf["url"], schema=conf["schema"], pool_size=4)
    async with flowlock.Engine(store) as engine:
        for version in versions:
            registered = await engine.register(ticket_v1() if version == 1 else ticket_v2())
            assert registered == version, (registered, version)
        await ready_and_wait(conf["gate"], conf["proc"])
        start = time.monotonic()
        deadline = start + conf["seconds"]

        async def caller(k: int) -> None:
            nonlocal calls
            rng = random.Random(f"{conf['proc']}-{k}")
            while time.monotonic() < deadline:
                iid = rng.choice(ids)
                (event,) = rng.choices(events, weights)
                calls += 1
                try:
                    outcome = await engine.fire(iid, event, actor=f"p{conf['proc']}")
                except flowlock.FlowlockError as exc:
                    name = type(exc).__name__
                    errors[name] += 1
                    samples.setdefault(name, str(exc)[:300])
                    continue
                if outcome.applied:
                    applied[event] += 1

        await asyncio.gather(*(caller(k) for k in range(conf["callers"])))
        record_phase(conf["gate"], conf["proc"], start, time.monotonic())
    print(json.dumps({"proc": conf["proc"], "calls": calls, "applied": applied,
                      "errors": errors, "samples": samples}))  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
