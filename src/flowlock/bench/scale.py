"""`flowlock bench --scale`: what a call costs as the tables grow.

Each size (10^4, 10^5 and 10^6 instances by default, with ten history rows each and one long
history: 10^7 rows at the top) gets a scratch schema of its own, loaded once. Then the sizes are
measured in turn, round after round, and each figure is the median of its rounds: a busy moment
on a shared machine then falls on every size alike, instead of on one size's only measurement.
The slope says how much costlier each figure is at the largest size than at the smallest.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
import statistics
import time
from typing import Final

import flowlock
from flowlock.backends import build_postgres_store
from flowlock.bench.config import BenchConfig, redact
from flowlock.bench.host import cores
from flowlock.bench.logs import collect_logs
from flowlock.bench.progress import NullProgress, Progress
from flowlock.bench.scale_load import load_to, relation_sizes, scale_workflow, sizes_of
from flowlock.bench.scale_measure import FULL, QUICK, Effort, measure_at
from flowlock.bench.scale_results import ScaleConfig, ScaleReport
from flowlock.bench.servers import connect, drop_schema, postgres_server
from flowlock.engine import Engine

__all__ = ["run", "run_scale"]

_TABLES: Final = ("flowlock_instances", "flowlock_history")
_POOL: Final = 20


async def _load(url: str, schema: str, size: int) -> float:
    """Migrate `schema` and load `size` instances into it; the seconds the load took."""
    admin = build_postgres_store(url, schema=schema, pool_size=1)
    await admin.open()  # migrates
    await admin.aclose()
    conn = await connect(url)
    try:
        await conn.execute(f'SET search_path = "{schema}"')
        began = time.perf_counter()
        await load_to(conn, 0, size)
        return time.perf_counter() - began
    finally:
        await conn.close()


async def _measure(
    url: str, schema: str, size: int, effort: Effort, rng: random.Random
) -> dict[str, float]:
    """One round at one size, on a fresh engine and pool."""
    store = build_postgres_store(url, schema=schema, pool_size=_POOL)
    async with Engine(store, strategy="optimistic", timers=False) as engine:
        await engine.register(scale_workflow())
        return await measure_at(engine, size, effort, rng)


async def _sizes(url: str, schema: str) -> dict[str, float]:
    conn = await connect(url)
    try:
        await conn.execute(f'SET search_path = "{schema}"')
        return {k: float(v) for k, v in (await relation_sizes(conn, _TABLES)).items()}
    finally:
        await conn.close()


def _medians(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}


async def run_scale(config: ScaleConfig, progress: Progress | None = None) -> ScaleReport:
    """Load a scratch schema per size, measure the sizes in interleaved rounds, and drop the
    schemas at the end (also on an error)."""
    shown: Progress = progress or NullProgress()
    seed = config.seed if config.seed is not None else secrets.randbits(32)
    rng = random.Random(seed)
    effort = QUICK if config.quick else FULL
    base = f"flowlock_bench_{secrets.token_hex(5)}"
    schemas = [f"{base}_{i}" for i in range(len(config.sizes))]
    started = time.perf_counter()
    bench = BenchConfig(database_url=config.database_url, quick=config.quick, workers=_POOL)
    async with contextlib.AsyncExitStack() as stack:
        # The engine's startup warning (optimistic on a must-apply step) is expected here:
        # the calls land on random instances among many, so they rarely meet.
        logged = stack.enter_context(collect_logs())
        server = await stack.enter_async_context(postgres_server(bench, shown))
        for schema in schemas:
            stack.push_async_callback(drop_schema, server.url, schema)
        loads: list[float] = []
        for schema, size in zip(schemas, config.sizes, strict=True):
            shown.status(f"loading {size:,} instances, {sizes_of(size):,} history rows")
            loads.append(await _load(server.url, schema, size))
        rounds: list[list[dict[str, float]]] = [[] for _ in config.sizes]
        for k in range(effort.rounds):
            for i, (schema, size) in enumerate(zip(schemas, config.sizes, strict=True)):
                shown.status(f"round {k + 1} of {effort.rounds}: {size:,} instances")
                rounds[i].append(await _measure(server.url, schema, size, effort, rng))
        figures = []
        for schema, per_size in zip(schemas, rounds, strict=True):
            figures.append({**_medians(per_size), **await _sizes(server.url, schema)})
        conn = await connect(server.url)
        try:
            version = str(await conn.fetchval("SHOW server_version"))
        finally:
            await conn.close()
        args = {
            "sizes": list(config.sizes),
            "quick": config.quick,
            "seed": seed,
            "database_url": None if config.database_url is None else redact(config.database_url),
            "schemas": schemas,
            "pool_size": _POOL,
            "rounds": effort.rounds,
            "fires": effort.fires,
            "spread_callers": effort.workers,
            "spread_steps": effort.steps,
            "query_repeats": effort.repeats,
        }
        kind = server.kind
        log = logged.lines()
    return ScaleReport(
        sizes=config.sizes,
        history_rows=tuple(sizes_of(s) for s in config.sizes),
        figures=tuple(figures),
        load_s=tuple(loads),
        flowlock_version=flowlock.__version__,
        postgres_version=version,
        cores=cores(),
        database=kind,
        seed=seed,
        quick=config.quick,
        duration_s=time.perf_counter() - started,
        args=args,
        log=log,
        rounds=tuple(tuple(r) for r in rounds),
    )


def run(config: ScaleConfig, progress: Progress | None = None) -> ScaleReport:
    """`run_scale` on a new event loop."""
    return asyncio.run(run_scale(config, progress))
