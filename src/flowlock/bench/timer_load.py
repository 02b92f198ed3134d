"""The timers section of `flowlock bench`: the firing lag and the idle cost, on PostgreSQL.

Both run once per run, after the `deadline` pairs, on the run's worker processes: each engine
is a process of its own, as in production. The timers are armed with one SQL statement
(`flowlock.bench.timer_sql.ARM`, written as the store's create writes them), then the engines
fire them and everything is read back from the server. docs/benchmarks.md, "The timers
section", says what each figure means.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, replace

import asyncpg

from flowlock._pg.rows import read_history, read_instances, timer_from_row
from flowlock.bench.config import Target
from flowlock.bench.pairs import Run
from flowlock.bench.procs import Close, Closed, Open, Opened
from flowlock.bench.scenarios import SCENARIOS
from flowlock.bench.scenarios.deadline import LAG_AFTER, LAG_WORKFLOW, entry_violations
from flowlock.bench.servers import DRIVER_ERRORS, connect, drop_schema, store_error
from flowlock.bench.session import prepare_schema
from flowlock.bench.timer_results import LagFigures, Quantiles
from flowlock.bench.timer_sql import ARM, FIRED, LAGS, NOW, TIMERS_OF
from flowlock.checker import LOST_UPDATE, Violation, check
from flowlock.core.models import Timer

__all__ = [
    "FULL",
    "QUICK",
    "STRATEGY",
    "TimerLoad",
    "arm",
    "close_engines",
    "measure_lag",
    "open_engines",
    "schema_connection",
]

STRATEGY = "optimistic"
"""What the lag and idle engines fire timers with: the engine's own default."""


@dataclass(frozen=True, slots=True)
class TimerLoad:
    """The sizes and times of the lag and idle measurements (seconds, timers)."""

    armed: int
    """Timers armed beyond the measured window, so at least this many stay armed throughout."""
    due_per_s: float
    lead_s: float
    """From the start of arming to the first due time (the engines are running already)."""
    warmup_s: float
    """Timers fall due at the full rate this long before the measured window opens."""
    window_s: float
    drain_s: float
    """After the window closes, how long the engines go on before they stop."""
    idle_armed: int
    idle_settle_s: float
    """How long the idle engine runs before it is watched: longer than the 10 s PostgreSQL may
    hold back a connection's counts, so that the startup's are in before the window opens."""
    idle_window_s: float
    idle_scans: bool = True
    """Whether the idle cost counts table scans: only after a settle long enough for the
    startup's counts to be in (see `flowlock.bench.idle`)."""


FULL = TimerLoad(
    armed=100_000,
    due_per_s=1000.0,
    lead_s=2.0,
    warmup_s=2.0,
    window_s=10.0,
    drain_s=2.0,
    idle_armed=100_000,
    idle_settle_s=11.0,
    idle_window_s=10.0,
)
QUICK = TimerLoad(
    armed=2_000,
    due_per_s=1000.0,
    lead_s=0.5,
    warmup_s=0.2,
    window_s=0.5,
    drain_s=0.3,
    idle_armed=2_000,
    idle_settle_s=0.3,
    idle_window_s=1.0,
    idle_scans=False,
)


async def schema_connection(url: str, schema: str) -> asyncpg.Connection:
    conn = await connect(url)
    try:
        await conn.execute(f'SET search_path TO "{schema}"')
    except BaseException:
        await conn.close()
        raise
    return conn


async def arm(
    conn: asyncpg.Connection, prefix: str, count: int, lead: float, per_second: float
) -> tuple[float, float]:
    """Arm `count` lag-workflow timers in one transaction, the first due `lead` seconds after it
    starts, then `per_second` a second. Returns the first due time and the commit time (epoch
    seconds on the server's clock)."""
    async with conn.transaction():
        began = float(await conn.fetchval(NOW))
        await conn.execute(ARM, prefix, count, lead, per_second, LAG_WORKFLOW, LAG_AFTER)
    committed = float(await conn.fetchval(NOW))
    return began + lead, committed


def _per_process(target: Target, count: int) -> int:
    return max(1, math.ceil(target.pool_size / count))


async def open_engines(
    run: Run, target: Target, count: int, name: str, *, timers: bool, scenario: str = "deadline"
) -> None:
    """Open one engine in each of the first `count` worker processes, on `target`, with the
    workflows of `scenario` registered (and what it attaches: the outbox's handler)."""
    workers = run.workers
    if not workers.started:
        run.progress.status(f"starting {workers.count} worker processes")
        await workers.start()
    params = run.config.params_for(SCENARIOS[scenario])
    section = "timers" if scenario == "deadline" else scenario
    opens = [
        Open(
            target,
            _per_process(target, workers.count),
            scenario,
            STRATEGY,
            params,
            f"{run.seed}/{section}/{name}/p{p}",
            batching=run.config.batching,
            timers=timers,
        )
        for p in range(count)
    ]
    await workers.ask(opens, Opened)


async def close_engines(run: Run, count: int) -> tuple[int, ...]:
    """Close the engines of the first `count` workers; how many timers each fired."""
    closed = await run.workers.ask([Close()] * count, Closed)
    return tuple(c.fired for c in closed)


async def _sleep_until(server_at: float, offset: float) -> None:
    """Sleep until `server_at` on the server's clock (`offset`: server minus ours)."""
    wait = server_at - offset - time.time()
    if wait > 0:
        await asyncio.sleep(wait)


async def _check_fired(conn: asyncpg.Connection) -> tuple[int, list[Violation]]:
    """The checker on every fired instance: one expiry row, written by its timer, and no timer
    left armed from its ended stay."""
    ids = [r["id"] for r in await conn.fetch(FIRED, LAG_WORKFLOW)]
    finals = await read_instances(conn, ids)
    histories = await read_history(conn, ids)
    armed: dict[str, list[Timer]] = {}
    for row in await conn.fetch(TIMERS_OF, ids):
        armed.setdefault(row["instance_id"], []).append(timer_from_row(row))
    found: list[Violation] = []
    for iid in ids:
        final, rows = finals[iid], histories.get(iid, [])
        verdict = check(
            final, rows, initial_state="pending", expected_applied=1, timers=armed.get(iid, ())
        )
        found.extend(verdict.violations)
        found.extend(entry_violations(iid, final, rows, None))
        if final.state != "rejected":
            found.append(Violation(LOST_UPDATE, f"instance {iid!r}: {final.state}, not expired"))
    return len(ids), found


async def measure_lag(run: Run, engines: int, load: TimerLoad) -> LagFigures:
    """The firing lag with `engines` engines, in a scratch schema of its own."""
    schema = f"{run.target.schema}_lag{engines}"
    target = replace(run.target, schema=schema)
    url = target.url
    await prepare_schema(url, schema, [SCENARIOS["deadline"]])
    try:
        conn = await schema_connection(url, schema)
        try:
            before = time.time()
            offset = float(await conn.fetchval(NOW)) - (before + time.time()) / 2
            await open_engines(run, target, engines, f"lag{engines}", timers=True)
            try:
                total = load.armed + int(load.due_per_s * (load.warmup_s + load.window_s))
                first, committed = await arm(
                    conn, f"lag{engines}-", total, load.lead_s, load.due_per_s
                )
                start = max(first + load.warmup_s, committed + 0.5)
                end = start + load.window_s
                await _sleep_until(end + load.drain_s, offset)
            finally:
                fired = await close_engines(run, engines)
            lags = [r["lag"] for r in await conn.fetch(LAGS, LAG_WORKFLOW, LAG_AFTER, start, end)]
            applied, violations = await _check_fired(conn)
        finally:
            await conn.close()
    except DRIVER_ERRORS as exc:
        raise store_error(exc, url, "the timers' lag measurement failed") from exc
    finally:
        await drop_schema(url, schema)
    done = [lag for lag in lags if lag is not None]
    return LagFigures(
        engines=engines,
        armed=load.armed,
        due_per_s=load.due_per_s,
        window_s=end - start,
        lag=Quantiles.of(done),
        missed=len(lags) - len(done),
        fired_total=applied,
        firings_by_engine=fired,
        checker_ok=not violations,
        violations=len(violations),
        strategy=STRATEGY,
    )
