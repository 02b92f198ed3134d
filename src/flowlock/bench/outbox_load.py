"""The outbox section's idle cost: what an engine with a handler sends while nothing is pending.

Measured as the timers' idle cost is (`flowlock.bench.idle`), in a database of its own: it is
migrated, messages are emitted and delivered there by an engine of this process (so the outbox
holds done messages, and none pending), and it is vacuumed. Then one engine with the sink's
handler registered (its dispatcher running, `spread-outbox`'s session) opens in a worker
process, settles, and is watched. docs/benchmarks.md, "The outbox section", says what each
figure means.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from flowlock.backends import build_postgres_store
from flowlock.bench.config import Target
from flowlock.bench.idle import OUTBOX_TABLE, IdleWatch, method, watch_idle
from flowlock.bench.outbox_results import OutboxIdle, OutboxSection
from flowlock.bench.pairs import Run
from flowlock.bench.scenarios import SCENARIOS
from flowlock.bench.scenarios.outbox import (
    WORKFLOW,
    emitting_counter,
    expected_keys,
    settle,
    sink_of,
)
from flowlock.bench.servers import OWN_APPLICATION_NAME
from flowlock.bench.session import prepare_schema
from flowlock.bench.timer_load import open_engines, schema_connection
from flowlock.bench.timer_sql import VACUUM
from flowlock.core.errors import FlowlockError
from flowlock.core.models import HistoryEntry
from flowlock.engine import Engine

__all__ = [
    "FULL",
    "IDLE_SCENARIO",
    "QUICK",
    "OutboxLoad",
    "deliver",
    "measure_outbox",
    "outbox_idle",
]

IDLE_SCENARIO = "spread-outbox"
"""Whose session the idle engine opens: its workflow and its handler, the dispatcher running."""
_INSTANCES = 100  # the counters the done messages are spread over
_PREPARE_POOL = 10


@dataclass(frozen=True, slots=True)
class OutboxLoad:
    """The sizes and times of the idle measurement (messages, seconds)."""

    done: int
    """Messages emitted and delivered before the idle engine opens (none left pending)."""
    settle_s: float
    """How long the idle engine runs before it is watched: longer than the 10 s PostgreSQL may
    hold back a connection's counts, so that the startup's are in before the window opens."""
    window_s: float
    scans: bool = True

    @property
    def watch(self) -> IdleWatch:
        return IdleWatch(self.settle_s, self.window_s, self.scans)


FULL = OutboxLoad(done=10_000, settle_s=11.0, window_s=10.0)
QUICK = OutboxLoad(done=200, settle_s=0.3, window_s=1.0, scans=False)


async def deliver(engine: Engine, prefix: str, count: int) -> int:
    """Emit `count` messages through `engine` (on `_INSTANCES` counters, a step each) and wait
    until its handler got them all and none is pending; how many it got."""
    instances = min(_INSTANCES, count)
    ids = [f"{prefix}{i}" for i in range(instances)]
    await asyncio.gather(*(engine.create(WORKFLOW, instance_id=i, data={"n": 0}) for i in ids))
    # Exactly `count` in all, as even a share as can be.
    steps = [count // instances + (1 if i < count % instances else 0) for i in range(instances)]

    async def walk(iid: str, n: int) -> None:
        for _ in range(n):
            await engine.fire(iid, "step", actor="bench-outbox")

    await asyncio.gather(*(walk(iid, n) for iid, n in zip(ids, steps, strict=True)))
    histories: dict[str, list[HistoryEntry]] = {iid: await engine.history(iid) for iid in ids}
    want = expected_keys(histories)
    left = await settle(engine, want)
    got = {d.key for d in sink_of(engine).deliveries} & want
    if len(got) != len(want) or any(left.values()):
        raise FlowlockError(
            f"the outbox's idle database was not ready: {len(got)} of {len(want)} messages "
            f"delivered, left {left}; the dispatcher did not drain within the bound"
        )
    return len(got)


async def _prepare(url: str, target: Target, load: OutboxLoad) -> None:
    """Migrate the database, deliver `load.done` messages there, vacuum and analyse it."""
    await prepare_schema(url, target.schema, [SCENARIOS[IDLE_SCENARIO]])
    store = build_postgres_store(
        url,
        schema=target.schema,
        pool_size=_PREPARE_POOL,
        auto_migrate=False,
        application_name=OWN_APPLICATION_NAME,  # never counted by the watch
    )
    engine = Engine(store, timers=False)
    sink_of(engine)
    async with engine:
        await engine.register(emitting_counter())
        await deliver(engine, "idle-", load.done)
    conn = await schema_connection(url, target.schema)
    try:
        await conn.execute(VACUUM)  # so that autovacuum has nothing to do there meanwhile
    finally:
        await conn.close()


async def outbox_idle(run: Run, load: OutboxLoad, notes: list[str]) -> OutboxIdle | None:
    """The idle cost of one engine with a handler and `load.done` messages done, none pending.

    None, with a note saying why, when the server refuses a database of the bench's own.
    """

    async def prepare(url: str, target: Target) -> None:
        await _prepare(url, target, load)

    async def engine(target: Target) -> None:
        await open_engines(run, target, 1, "idle", timers=True, scenario=IDLE_SCENARIO)

    how = load.watch
    watched = await watch_idle(
        run, "outbox_idle", how, prepare, engine, notes, "the outbox's idle cost"
    )
    if watched is None:
        return None
    return OutboxIdle(
        engines=1,
        done=load.done,
        window_s=watched.span,
        statements_per_s=watched.per_second(),
        scans_per_s=watched.scans_per_second(),
        database="dedicated",
        method=method(how),
        others_seen=watched.others,
        table=OUTBOX_TABLE,
    )


async def measure_outbox(run: Run) -> OutboxSection | None:
    """The outbox section's idle cost, when the run has an emitting scenario; else None."""
    if not any(SCENARIOS[n].emits for n in run.config.scenario_names()):
        return None
    load = QUICK if run.config.quick else FULL
    run.progress.status(
        f"outbox: the idle cost of one engine with a handler, {load.done:,} messages done"
    )
    notes: list[str] = []
    idle = await outbox_idle(run, load, notes)
    return OutboxSection(idle, tuple(notes))
