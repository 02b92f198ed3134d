"""A worker process that fires `bump` at random meter instances while a bulk run goes on
(tests/integration/test_bulk_pg.py).

Run as ``python bulk_worker.py CONFIG_JSON`` (url, schema, ids, callers, tag, stop: a file whose
existence ends the run). Each caller fires with its own request ids; the worker prints one JSON
line per applied call ({"id", "rid"}) and a last line {"done": calls, "errors": [...]}.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: bulk_kit

import flowlock
from bulk_kit import meter
from flowlock.stores.postgres import PostgresStore

BOUND = 120.0  # the most a worker runs without its stop file


async def main(conf: dict[str, Any]) -> None:
    ids: list[str] = conf["ids"]
    stop = Path(conf["stop"])
    store = PostgresStore(conf["url"], schema=conf["schema"], pool_size=4)
    applied: list[tuple[str, str]] = []
    errors: list[str] = []
    calls = 0
    async with flowlock.Engine(store) as engine:
        await engine.register(meter())
        Path(conf["ready"]).touch()  # noqa: ASYNC240 (a local file, nothing to wait on)
        deadline = time.monotonic() + BOUND

        async def caller(k: int) -> None:
            nonlocal calls
            rng = random.Random(f"{conf['tag']}-{k}")
            j = 0
            while not stop.exists() and time.monotonic() < deadline:  # noqa: ASYNC240
                iid = rng.choice(ids)
                rid = f"{conf['tag']}-{k}-{j}"
                j += 1
                calls += 1
                try:
                    outcome = await engine.fire(iid, "bump", request_id=rid, actor="proc")
                except flowlock.FlowlockError as exc:
                    errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                if outcome.applied and not outcome.replayed:
                    applied.append((iid, rid))

        await asyncio.gather(*(caller(k) for k in range(conf["callers"])))
    for iid, rid in applied:
        print(json.dumps({"id": iid, "rid": rid}))
    print(json.dumps({"done": calls, "errors": errors[:20]}))


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
