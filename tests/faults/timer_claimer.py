"""A timer claimer that hangs in the middle of its firings, to be killed with SIGKILL.

Run as ``python timer_claimer.py CONFIG_JSON``. It opens an engine whose timer service claims
the due deadlines (a short ``timer_lease``), writes its claim owner to ``owner``, and the
first deadline effect it runs writes ``firing`` and then blocks the whole process (a bounded
sleep): every deadline it claimed is mid-firing, read and not written, when the parent kills it.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: timer_kit

from timer_kit import deadline

HANG = 120.0  # how long the firing hangs if nobody kills it (then it fails loudly)


async def main(cfg: dict[str, Any]) -> None:
    import flowlock
    from flowlock.stores.postgres import PostgresStore

    here = Path(cfg["dir"])

    def hang(inst: flowlock.Instance) -> None:
        (here / "firing").write_text(inst.id)
        time.sleep(HANG)  # blocks the event loop: nothing else of this process runs
        raise SystemExit(f"timer_claimer: not killed within {HANG} s")

    store = PostgresStore(
        cfg["url"], schema=cfg["schema"], pool_size=2, application_name=cfg["app"]
    )
    engine = flowlock.Engine(store, strategy=cfg["strategy"], timer_lease=cfg["lease"])
    async with engine:
        service = engine.timer_service
        assert service is not None
        (here / "owner").write_text(service.owner)
        await engine.register(deadline(after=cfg["after"], on_expire=hang))
        await asyncio.sleep(HANG)
    raise SystemExit(f"timer_claimer: never fired a deadline within {HANG} s")


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
