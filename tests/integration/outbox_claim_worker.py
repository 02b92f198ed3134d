"""A worker process of the outbox claim race (tests/integration/test_outbox_claims_pg.py): a
PostgreSQL store of its own that claims messages and delivers each into a sink table (unique
on the message key) until none is left.

Run as ``python outbox_claim_worker.py CONFIG_JSON``. It opens its store, says it is ready
through the gate (proc_worker's), and once the parent gives the go it claims (``batch`` of each
kind at a time), inserts each message it claimed into the sink (a duplicate key is counted, not
raised), then marks them done, until a claim finds nothing and no message is pending or running.
It prints one JSON object: how many it delivered and how many duplicates it met.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: proc_worker

from proc_worker import ready_and_wait, record_phase

BOUND = 120.0  # the most a worker works before it gives up

SINK = """
INSERT INTO claim_sink (key, instance_id, version, n, owner)
SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[], $4::int[], $5::text[])
ON CONFLICT (key) DO NOTHING
"""


async def main(cfg: dict[str, Any]) -> None:
    import asyncpg

    from flowlock.stores.postgres import PostgresStore

    owner = f"proc-{cfg['proc']}"
    store = PostgresStore(cfg["url"], schema=cfg["schema"], pool_size=2, auto_migrate=False)
    await store.open()
    sink = await asyncpg.connect(cfg["url"], server_settings={"search_path": cfg["schema"]})
    delivered = duplicates = 0
    try:
        await ready_and_wait(cfg["gate"], cfg["proc"])
        start = time.monotonic()
        kinds = dict.fromkeys(cfg["kinds"], cfg["batch"])
        while time.monotonic() - start < BOUND:
            claimed = await store.claim_messages(kinds, lease=60.0, owner=owner)
            if not claimed:
                counts = await store.count_messages()
                if counts["pending"] + counts["running"] == 0:
                    break
                await asyncio.sleep(0.002)
                continue
            rows = [
                [m.key for m in claimed],
                [m.instance_id for m in claimed],
                [m.version for m in claimed],
                [m.n for m in claimed],
                [owner] * len(claimed),
            ]
            tag = await sink.execute(SINK, *rows)
            inserted = int(tag.rsplit(" ", 1)[-1])
            duplicates += len(claimed) - inserted
            delivered += inserted
            await store.finish_messages([m.key for m in claimed])
        record_phase(cfg["gate"], cfg["proc"], start, time.monotonic())
    finally:
        await sink.close()
        await store.aclose()
    print(json.dumps({"proc": cfg["proc"], "delivered": delivered, "duplicates": duplicates}))


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
