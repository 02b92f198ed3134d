"""A worker process for the multi-process tests, and the start gate every multi-process test
shares.

Run as ``python proc_worker.py CONFIG_JSON``, it fires events at one shared instance and prints
one JSON line per call.

The gate (imported by the tests and by their worker processes): each worker, once it is ready,
writes ``ready-<n>`` into the gate directory and waits for the parent's ``go`` file; it then
records ``time.monotonic()`` at the start and at the end of its contended phase into
``phase-<n>.json``. CLOCK_MONOTONIC is one clock for the whole machine on Linux, so the phases of
different processes compare, and :meth:`Gate.assert_overlapped` fails unless every process's
phase had started before any of them ended (``max(starts) < min(ends)``): a process that ran
after the others cannot pass for "at once".

A storm worker also waits at :func:`all_started`, at the start of its phase, until every worker
has started its own: on a loaded machine one process may be scheduled tens of milliseconds
late, and a storm of a few milliseconds would otherwise be over before it began.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

GATE_TIMEOUT = 60.0  # seconds a worker waits for the go signal, the parent for every "ready"
_POLL = 0.002  # how often a waiting worker looks for the go file: the spread of the start


# -- the gate: the worker's side -------------------------------------------------------------


async def ready_and_wait(gate: str | Path, proc: int, within: float = GATE_TIMEOUT) -> float:
    """Say this worker is ready, wait for the parent's go signal, and return the monotonic time
    the parent gave it (a common origin for schedules). TimeoutError if no go comes in time."""
    gate = Path(gate)
    (gate / f"ready-{proc}").touch()
    go = gate / "go"
    deadline = time.monotonic() + within
    while not go.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker {proc}: no go signal in {gate} within {within} s")
        await asyncio.sleep(_POLL)
    return float(go.read_text())


async def all_started(gate: str | Path, proc: int, within: float = GATE_TIMEOUT) -> None:
    """Say this worker's contended phase has begun, and wait until every worker's has: no
    worker sends its first call before all of them are in their phase, so the phases overlap
    however late the machine schedules one of them. TimeoutError if one never starts."""
    gate = Path(gate)
    (gate / f"started-{proc}").touch()
    workers = int((gate / "workers").read_text())
    deadline = time.monotonic() + within
    while sum((gate / f"started-{p}").exists() for p in range(workers)) < workers:
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker {proc}: not every worker started within {within} s")
        await asyncio.sleep(_POLL)


def record_phase(gate: str | Path, proc: int, start: float, end: float) -> None:
    """Write this worker's contended phase (two ``time.monotonic()`` readings)."""
    path = Path(gate) / f"phase-{proc}.json"
    path.write_text(json.dumps({"proc": proc, "start": start, "end": end}))


# -- the gate: the parent's side -------------------------------------------------------------


class Phase(NamedTuple):
    """One worker's contended phase, on the machine's monotonic clock."""

    proc: int
    start: float
    end: float


class Gate:
    """The parent's side of the start gate for ``processes`` workers, in directory ``path``."""

    def __init__(self, path: Path, processes: int) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.processes = processes
        (path / "workers").write_text(str(processes))  # read by all_started

    def __str__(self) -> str:
        return str(self.path)

    async def open_when_ready(
        self, procs: Sequence[asyncio.subprocess.Process], within: float = GATE_TIMEOUT
    ) -> float:
        """Wait until every worker has said it is ready, then give the go signal (the file
        appears whole: written aside, then renamed). Fails at once, with its stderr, if a worker
        exits before it is ready. Returns the go time on the monotonic clock."""
        deadline = time.monotonic() + within
        while True:
            ready = sum((self.path / f"ready-{p}").exists() for p in range(self.processes))
            if ready == self.processes:
                break
            for proc in procs:
                if proc.returncode is not None:
                    err = b"" if proc.stderr is None else await proc.stderr.read()
                    raise AssertionError(
                        f"a worker exited ({proc.returncode}) before it was ready: "
                        f"{err.decode()[-3000:]}"
                    )
            if time.monotonic() > deadline:
                raise AssertionError(f"{ready} of {self.processes} workers ready in {within} s")
            await asyncio.sleep(0.01)
        go_at = time.monotonic()
        aside = self.path / "go.tmp"
        aside.write_text(repr(go_at))
        os.replace(aside, self.path / "go")
        return go_at

    def phases(self) -> list[Phase]:
        """Every worker's recorded phase (AssertionError if one is missing)."""
        found = []
        for p in range(self.processes):
            path = self.path / f"phase-{p}.json"
            assert path.exists(), f"worker {p} recorded no contended phase"
            raw = json.loads(path.read_text())
            found.append(Phase(raw["proc"], raw["start"], raw["end"]))
        return found

    def assert_overlapped(self) -> list[Phase]:
        """Every worker's contended phase began before any of them ended: they ran at once."""
        phases = self.phases()
        latest_start = max(p.start for p in phases)
        earliest_end = min(p.end for p in phases)
        assert latest_start < earliest_end, (
            f"the processes did not overlap: the last started {latest_start - earliest_end:.3f}"
            f" s after the first had ended; phases={phases}"
        )
        return phases


# -- the storm worker ------------------------------------------------------------------------


async def main(cfg: dict[str, Any]) -> None:
    # Imported here: the gate above is imported by workers that need nothing else.
    import flowlock
    from flowlock import examples
    from flowlock.stores.postgres import PostgresStore

    # Why a pool smaller than the callers: 4 processes must fit a busy server (about 30
    # connections for a test, tests/pg_budget.py); callers queue for a connection (bounded by
    # acquire_timeout), as in production.
    pool_size = cfg.get("pool_size", 6)
    store = PostgresStore(cfg["url"], schema=cfg["schema"], pool_size=pool_size)
    async with flowlock.Engine(
        store, strategies=[flowlock.Optimistic(max_attempts=cfg.get("max_attempts", 3))]
    ) as engine:
        for wf in (examples.approval(), examples.countersign(cfg["quorum"]), examples.inventory()):
            await engine.register(wf)
        # Warm the pool so that the contended phase measures the calls, not the connecting.
        await asyncio.gather(*[engine.get(cfg["instance"]) for _ in range(pool_size)])

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

        await ready_and_wait(cfg["gate"], cfg["proc"])
        start = time.monotonic()
        await all_started(cfg["gate"], cfg["proc"])
        results = await asyncio.gather(*[one(i) for i in range(cfg["callers"])])
        record_phase(cfg["gate"], cfg["proc"], start, time.monotonic())
    for r in results:
        print(json.dumps(r))


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
