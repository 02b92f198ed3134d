"""A worker process of the outbox crash matrix (tests/integration/test_outbox_crash_pg.py).

Run as ``python outbox_worker.py CONFIG_JSON``. It opens an engine on the shared schema, with
the order workflow's handlers when it dispatches, fires `submit` at its share of the orders, and
dies where its `crash` says:

- ``before-commit``: one of its calls asks the guard to SIGKILL the process inside the step;
- ``after-commit``: no dispatcher; once every submit has committed, it SIGKILLs itself;
- ``in-handler``: the charge handler SIGKILLs the process before recording some keys (each at
  most once: a marker file per key);
- ``before-done``: the store SIGKILLs the process when the dispatcher marks some keys done,
  after their handler (and its Then) ran;
- ``none``: it dispatches until no order is left unpaid, then prints a JSON report.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: outbox_kit

import asyncpg

from outbox_kit import DELIVERED, RECORD, order

BOUND = 90.0  # the most a clean worker waits for every order to be paid


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _picked(key: str, every: int) -> bool:
    return zlib.crc32(key.encode()) % every == 0


def _first_time(markers: Path, point: str, key: str) -> bool:
    """True once per crash point and key (the marker is written before the process dies)."""
    marker = markers / f"{point}-{key.replace(':', '_')}"
    if marker.exists():
        return False
    marker.touch()
    return True


async def main(cfg: dict[str, Any]) -> None:  # noqa: C901 - one worker, every crash point
    import flowlock
    from flowlock.stores.postgres import PostgresStore

    crash: str = cfg["crash"]
    markers = Path(cfg["markers"])

    class Store(PostgresStore):
        async def finish_messages(self, keys: Sequence[str]) -> int:
            if crash == "before-done":
                for key in keys:
                    if _picked(key, 7) and _first_time(markers, "before-done", key):
                        _die()
            return await super().finish_messages(keys)

    store = Store(cfg["url"], schema=cfg["schema"], pool_size=4)
    sink = await asyncpg.create_pool(
        cfg["url"], min_size=1, max_size=3, server_settings={"search_path": cfg["schema"]}
    )
    dispatching = crash != "after-commit" and crash != "before-commit"
    engine = flowlock.Engine(
        store,
        batching=cfg["batching"],
        strategy=cfg["strategy"],
        outbox=dispatching,
        outbox_lease=2.0,
    )

    async def record(message: flowlock.Message) -> None:
        async with sink.acquire() as conn, conn.transaction():
            await conn.execute(RECORD, message.key, message.kind)
            await conn.execute(DELIVERED, message.key, os.getpid(), time.monotonic())

    async def charge(message: flowlock.Message) -> flowlock.Then:
        picked = crash == "in-handler" and _picked(message.key, 7)
        if picked and _first_time(markers, "in-handler", message.key):
            _die()
        await record(message)
        return flowlock.Then("paid")

    async def ship(message: flowlock.Message) -> None:
        await record(message)

    if dispatching:
        engine.on_emit("charge", charge, concurrency=8, timeout=1.0)
        engine.on_emit("ship", ship, concurrency=8, timeout=1.0)
    async with engine:
        await engine.register(order())
        ids: list[str] = cfg["ids"]
        victim = cfg.get("victim")

        async def submit(iid: str) -> None:
            payload = {"amount": 1, "die": True} if iid == victim else {"amount": 1}
            with contextlib.suppress(flowlock.TransitionNotAllowed):  # submitted earlier
                await engine.fire(iid, "submit", payload=payload, actor=f"w{cfg['proc']}")

        lanes = asyncio.Semaphore(16)

        async def one(iid: str) -> None:
            async with lanes:
                await submit(iid)

        await asyncio.gather(*(one(i) for i in ids))
        if crash == "after-commit":
            _die()
        if crash == "none":
            deadline = time.monotonic() + BOUND
            while await engine.count("order", state="placed") or await engine.count(
                "order", state="submitted"
            ):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"worker {cfg['proc']}: orders unpaid after {BOUND} s")
                await asyncio.sleep(0.1)
            pending = await engine.find_messages(status="pending", limit=10)
            running = await engine.find_messages(status="running", limit=10)
            deadline = time.monotonic() + BOUND
            while pending or running:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"worker {cfg['proc']}: messages undelivered: {pending}")
                await asyncio.sleep(0.1)
                pending = await engine.find_messages(status="pending", limit=10)
                running = await engine.find_messages(status="running", limit=10)
        else:
            # A crashing dispatcher runs until its crash comes, or the parent stops it.
            await asyncio.sleep(cfg.get("linger", 0.0))
    await sink.close()
    print(json.dumps({"proc": cfg["proc"], "crash": crash, "pid": os.getpid()}))


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
