"""OpenTelemetry spans on real PostgreSQL: the pessimistic strategy's row-lock wait and locked
write, the optimistic compare-and-swap, an error span for a refused call, and spans that add up
when concurrent calls are batched."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import asyncpg
import pytest
from opentelemetry.trace import StatusCode

import flowlock
import pg_budget
from flowlock import tracing
from lock_probes import wait_until
from span_probes import Spans, attrs, end_of, recording, start_of, within

pytestmark = pytest.mark.postgres

HELD = 0.2  # seconds the holder keeps the row lock once the call is seen waiting for it


@pytest.fixture
def spans() -> Iterator[Spans]:
    with recording() as found:
        yield found


@pytest.fixture
async def engine(pg_engine_factory: Callable[..., Any]) -> flowlock.Engine:
    eng: flowlock.Engine = await pg_engine_factory(pool_size=4)
    await eng.create("approval", instance_id="req")
    await eng.create("countersign", instance_id="doc")
    return eng


@pytest.fixture
async def holder(pg_url: str, pg_schema: str) -> AsyncIterator[asyncpg.Connection]:
    """A connection of the test's own, for holding the instance's row lock."""
    conn = await pg_budget.connect(pg_url, server_settings={"search_path": pg_schema})
    try:
        yield conn
    finally:
        await conn.close()


@pytest.mark.parametrize("strategy", ["optimistic", "pessimistic"])
async def test_an_applied_fire_and_its_children(
    engine: flowlock.Engine, spans: Spans, strategy: str
) -> None:
    await engine.fire("req", "approve", strategy=strategy)
    fire = spans.one(tracing.FIRE)
    assert attrs(fire) == {
        "flowlock.instance_id": "req",
        "flowlock.event": "approve",
        "flowlock.workflow": "approval",
        "flowlock.strategy": strategy,
        "flowlock.attempts": 1,
        "flowlock.outcome": "applied",
        "flowlock.batch_size": 1,
    }
    children = spans.children(fire)
    expected = [tracing.COMMIT] if strategy == "optimistic" else [tracing.LOCK_WAIT, tracing.COMMIT]
    assert [c.name for c in children] == expected
    assert all(within(c, fire) for c in children)
    assert attrs(children[-1])["flowlock.entries"] == 1


@pytest.mark.parametrize("strategy", ["optimistic", "pessimistic"])
async def test_a_refused_fire_is_an_error_span(
    engine: flowlock.Engine, spans: Spans, strategy: str
) -> None:
    await engine.fire("req", "approve", strategy=strategy)
    spans.clear()
    with pytest.raises(flowlock.TransitionNotAllowed):
        await engine.fire("req", "reject", strategy=strategy)
    fire = spans.one(tracing.FIRE)
    assert attrs(fire)["flowlock.outcome"] == "refused"
    assert attrs(fire)["flowlock.workflow"] == "approval"
    assert fire.status.status_code is StatusCode.ERROR
    assert [e.name for e in fire.events] == ["exception"]
    assert tracing.COMMIT not in [c.name for c in spans.children(fire)]


async def _waiting_on(holder: asyncpg.Connection) -> bool:
    """Whether a session is waiting for a lock ``holder`` holds."""
    count = await holder.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
        await holder.fetchval("SELECT pg_backend_pid()"),
    )
    return bool(count)


async def test_the_lock_wait_span_covers_the_wait_for_a_held_row(
    engine: flowlock.Engine, spans: Spans, holder: asyncpg.Connection
) -> None:
    async with holder.transaction():
        await holder.execute("SELECT 1 FROM flowlock_instances WHERE id = 'req' FOR UPDATE")
        call = asyncio.create_task(engine.fire("req", "approve", strategy="pessimistic"))
        await wait_until(lambda: _waiting_on(holder), what="the call waiting for the row lock")
        await asyncio.sleep(HELD)
    # The holder has committed: the call takes the lock and writes.
    outcome = await asyncio.wait_for(call, 30)
    assert outcome.applied
    wait, commit = spans.children(spans.one(tracing.FIRE))
    assert wait.name == tracing.LOCK_WAIT
    assert attrs(wait) == {"flowlock.lock": "row", "flowlock.lock.acquired": True}
    assert end_of(wait) - start_of(wait) >= HELD * 1e9  # it was waiting before the holder slept
    assert end_of(wait) == start_of(commit)


async def test_a_busy_row_is_an_error_lock_wait(
    engine: flowlock.Engine, spans: Spans, holder: asyncpg.Connection
) -> None:
    async with holder.transaction():
        await holder.execute("SELECT 1 FROM flowlock_instances WHERE id = 'req' FOR UPDATE")
        with pytest.raises(flowlock.LockBusy):
            await engine.fire("req", "approve", strategy=flowlock.Pessimistic(nowait=True))
    fire = spans.one(tracing.FIRE)
    assert attrs(fire)["flowlock.outcome"] == "lock_error"
    (wait,) = spans.children(fire)
    assert attrs(wait) == {"flowlock.lock": "row", "flowlock.lock.acquired": False}
    assert wait.status.status_code is StatusCode.ERROR


@pytest.mark.parametrize("strategy", ["optimistic", "pessimistic"])
async def test_concurrent_calls_add_up_across_fire_and_batch_spans(
    engine: flowlock.Engine, spans: Spans, strategy: str
) -> None:
    """However the calls were batched: every call has its fire span, every batch span links
    the fire spans of the calls it served besides its parent, and the commits wrote one row per
    call."""
    signers = [f"s{i}" for i in range(12)]
    await asyncio.gather(*(engine.fire("doc", "sign", actor=s, strategy=strategy) for s in signers))
    fires = spans.named(tracing.FIRE)
    assert len(fires) == len(signers)
    assert {attrs(f)["flowlock.outcome"] for f in fires} == {"applied"}
    for batch in spans.named(tracing.BATCH):
        assert len(batch.links) + 1 == attrs(batch)["flowlock.batch_size"]
    written = [c for c in spans.named(tracing.COMMIT) if not attrs(c)["flowlock.conflict"]]
    assert sum(attrs(c)["flowlock.entries"] for c in written) == len(signers)


@pytest.mark.parametrize("strategy", ["optimistic", "pessimistic"])
async def test_a_fire_inside_the_callers_transaction_is_traced_the_same_way(
    engine: flowlock.Engine, spans: Spans, holder: asyncpg.Connection, strategy: str
) -> None:
    app = spans.provider.get_tracer("app")
    with app.start_as_current_span("place order") as request:
        async with holder.transaction():
            await engine.fire("req", "approve", strategy=strategy, connection=holder)
    fire = spans.one(tracing.FIRE)
    assert fire.parent is not None
    assert fire.parent.span_id == request.get_span_context().span_id
    assert attrs(fire)["flowlock.strategy"] == strategy
    assert attrs(fire)["flowlock.outcome"] == "applied"
    assert spans.children(fire)[-1].name == tracing.COMMIT
