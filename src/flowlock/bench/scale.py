"""`flowlock bench --scale`: what a call costs as the tables grow.

One scratch schema is grown from the smallest size to the largest (10^4, 10^5 and 10^6
instances by default, with ten history rows each and one long history: 10^7 rows at the top).
At each size the same calls are measured through an engine (`scale_measure`), with the tables'
sizes. The slope says how much costlier each figure is at the largest size than at the smallest.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
import time
from typing import Final

import flowlock
from flowlock.backends import build_postgres_store
from flowlock.bench.config import BenchConfig, redact
from flowlock.bench.host import cores
from flowlock.bench.logs import collect_logs
from flowlock.bench.progress import NullProgress, Progress
from flowlock.bench.scale_load import load_to, relation_sizes, scale_workflow, sizes_of
from flowlock.bench.scale_measure import FULL, QUICK, measure_at
from flowlock.bench.scale_results import ScaleConfig, ScaleReport
from flowlock.bench.servers import connect, drop_schema, postgres_server
from flowlock.engine import Engine

__all__ = ["run", "run_scale"]

_TABLES: Final = ("flowlock_instances", "flowlock_history")
_POOL: Final = 20


async def run_scale(config: ScaleConfig, progress: Progress | None = None) -> ScaleReport:
    """Grow a scratch schema through `config.sizes`, measuring at each; drop it at the end."""
    shown: Progress = progress or NullProgress()
    seed = config.seed if config.seed is not None else secrets.randbits(32)
    rng = random.Random(seed)
    effort = QUICK if config.quick else FULL
    schema = f"flowlock_bench_{secrets.token_hex(6)}"
    started = time.perf_counter()
    figures: list[dict[str, float]] = []
    loads: list[float] = []
    bench = BenchConfig(database_url=config.database_url, quick=config.quick, workers=_POOL)
    async with contextlib.AsyncExitStack() as stack:
        # The engine's startup warning (optimistic on a must-apply step) is expected here:
        # the calls land on random instances among many, so they rarely meet.
        logged = stack.enter_context(collect_logs())
        server = await stack.enter_async_context(postgres_server(bench, shown))
        stack.push_async_callback(drop_schema, server.url, schema)
        store = build_postgres_store(server.url, schema=schema, pool_size=_POOL)
        engine = Engine(store, strategy="optimistic", timers=False)
        await stack.enter_async_context(engine)  # migrates the scratch schema
        await engine.register(scale_workflow())
        conn = await connect(server.url)
        stack.push_async_callback(conn.close)
        await conn.execute(f'SET search_path = "{schema}"')
        version = str(await conn.fetchval("SHOW server_version"))
        loaded = 0
        for size in config.sizes:
            shown.status(f"loading {size:,} instances, {sizes_of(size):,} history rows")
            began = time.perf_counter()
            await load_to(conn, loaded, size)
            loads.append(time.perf_counter() - began)
            loaded = size
            shown.status(f"measuring at {size:,} instances")
            found = await measure_at(engine, size, effort, rng)
            found.update({k: float(v) for k, v in (await relation_sizes(conn, _TABLES)).items()})
            figures.append(found)
        args = {
            "sizes": list(config.sizes),
            "quick": config.quick,
            "seed": seed,
            "database_url": None if config.database_url is None else redact(config.database_url),
            "schema": schema,
            "pool_size": _POOL,
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
    )


def run(config: ScaleConfig, progress: Progress | None = None) -> ScaleReport:
    """`run_scale` on a new event loop."""
    return asyncio.run(run_scale(config, progress))
