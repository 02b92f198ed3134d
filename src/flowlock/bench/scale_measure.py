"""What `flowlock bench --scale` measures at each size, through a flowlock engine.

Every figure is the engine's own call, as a user makes it: `fire`, `list`, `count`, `history`.
Latencies are wall-clock milliseconds on this process's clock.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Final

from flowlock.bench.scale_load import LONG_ID, WORKFLOW, instance_id, is_open, long_length
from flowlock.core.query import cursor_after
from flowlock.engine import Engine

__all__ = ["Effort", "measure_at"]


@dataclass(frozen=True, slots=True)
class Effort:
    """How many calls each measurement makes."""

    fires: int
    """Sequential fires for p50 / p99."""
    workers: int
    """Concurrent callers of the spread measurement."""
    steps: int
    """Steps each spread caller makes."""
    repeats: int
    """Runs of each query per round (the median is kept)."""
    rounds: int
    """Rounds over every size, in turn (each figure is the median of its rounds)."""


FULL: Final = Effort(fires=500, workers=32, steps=40, repeats=9, rounds=3)
QUICK: Final = Effort(fires=30, workers=8, steps=5, repeats=2, rounds=2)
_PAGE: Final = 100
"""A history page's entries."""
_LIST: Final = 50
"""A list page's instances: 10^4 instances have 100 held, 50 of them past the middle, so the
middle page is a full page at every default size."""


def _ms(seconds: float) -> float:
    return seconds * 1000.0


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _open_id(rng: random.Random, size: int) -> str:
    """A random open instance among the first `size`."""
    while True:
        n = rng.randint(1, size)
        if is_open(n):
            return instance_id(n)


async def _median(repeats: int, call: Callable[[], Awaitable[object]]) -> float:
    """The median wall time of `repeats` runs of `call`, in ms, after one untimed run."""
    await call()
    times: list[float] = []
    for _ in range(repeats):
        started = time.perf_counter()
        await call()
        times.append(_ms(time.perf_counter() - started))
    return statistics.median(times)


async def _fires(engine: Engine, size: int, effort: Effort, rng: random.Random) -> list[float]:
    times: list[float] = []
    for _ in range(effort.fires):
        iid = _open_id(rng, size)
        started = time.perf_counter()
        await engine.fire(iid, "step", actor="scale")
        times.append(_ms(time.perf_counter() - started))
    return times


async def _spread(engine: Engine, size: int, effort: Effort, rng: random.Random) -> float:
    """Applied steps per second: `workers` callers, each `steps` steps on random instances."""
    plans = [[_open_id(rng, size) for _ in range(effort.steps)] for _ in range(effort.workers)]
    gate = asyncio.Event()
    applied = 0

    async def caller(ids: list[str]) -> None:
        nonlocal applied
        await gate.wait()
        for iid in ids:
            outcome = await engine.fire(iid, "step", actor="scale")
            applied += outcome.applied

    tasks = [asyncio.create_task(caller(ids)) for ids in plans]
    await asyncio.sleep(0)
    started = time.perf_counter()
    gate.set()
    await asyncio.gather(*tasks)
    return applied / (time.perf_counter() - started)


async def measure_at(
    engine: Engine, size: int, effort: Effort, rng: random.Random
) -> dict[str, float]:
    """Every figure at `size` loaded instances, by metric name (see `METRICS`)."""
    # Untimed: a few calls so that the pool's connections and prepared statements are ready.
    for _ in range(10):
        await engine.fire(_open_id(rng, size), "step", actor="scale")
    fires = await _fires(engine, size, effort, rng)
    figures = {
        "fire p50": statistics.median(fires),
        "fire p99": _quantile(fires, 0.99),
        "spread applied/s": await _spread(engine, size, effort, rng),
    }
    recent = datetime.now(UTC) - timedelta(hours=1)
    middle = cursor_after(instance_id(size // 2))
    deep = long_length(size) + 1 - _PAGE
    r = effort.repeats
    queries: dict[str, Callable[[], Awaitable[object]]] = {
        "list held, first page": lambda: engine.list(WORKFLOW, "held", limit=_LIST),
        "list held, middle page": lambda: engine.list(WORKFLOW, "held", limit=_LIST, after=middle),
        "list done+held": lambda: engine.list(WORKFLOW, ["done", "held"], limit=_LIST),
        "list updated < 1 h": lambda: engine.list(updated_after=recent, limit=_LIST),
        "count held": lambda: engine.count(WORKFLOW, "held"),
        "count done": lambda: engine.count(WORKFLOW, "done"),
        "count updated < 1 h": lambda: engine.count(WORKFLOW, updated_after=recent),
        "history page, deep": lambda: engine.history(LONG_ID, after=deep, limit=_PAGE),
    }
    for name, call in queries.items():
        figures[name] = await _median(r, call)
    return figures
