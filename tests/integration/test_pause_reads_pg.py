"""Every PostgreSQL read a decision is made on carries the workflow's pause: the unlocked read
(without, with one and with several request ids), the pipelined reads of several calls
(READ_MANY), the row lock (waiting and NOWAIT), the pipelined row locks (LOCK_SKIP), a read
inside a caller's transaction, and get and list. And what a commit's statement answers keeps
the instance's own pause."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest

import flowlock
from flowlock.core.admin import PAUSE_EVENT
from flowlock.core.models import HistoryEntry, Instance, InstanceQuery, Snapshot
from flowlock.stores.base import RowLock
from flowlock.stores.postgres import PostgresStore

pytestmark = pytest.mark.postgres

IDS = [f"r-{i:02d}" for i in range(12)]


@pytest.fixture(params=[True, False], ids=["pipelined", "alone"])
async def store(
    request: pytest.FixtureRequest, pg_url: str, pg_schema: str
) -> AsyncIterator[PostgresStore]:
    opened = PostgresStore(pg_url, schema=pg_schema, pipeline=request.param)
    await opened.open()
    try:
        for iid in IDS:
            await opened.create(Instance(iid, "approval", "pending", 1, {}))
        yield opened
    finally:
        await opened.aclose()


def _seen(found: list[Snapshot]) -> list[bool]:
    return [snap.instance.workflow_paused for snap in found]


async def _all_reads(store: PostgresStore, pg_url: str, pg_schema: str) -> set[bool]:
    """workflow_paused as every read path answers it for the instances of IDS."""
    seen: list[bool] = []
    seen += _seen([await store.read(IDS[0], [])])
    seen += _seen([await store.read(IDS[0], ["rid-1"])])
    seen += _seen([await store.read(IDS[0], ["rid-1", "rid-2"])])
    # Concurrent one-id reads: the pipelined store sends them together (READ_MANY).
    seen += _seen(list(await asyncio.gather(*(store.read(i, ["x"]) for i in IDS))))
    seen.append((await store.get(IDS[1])).workflow_paused)
    page = await store.list_instances(InstanceQuery(workflow="approval"), after=None, limit=100)
    seen += [i.workflow_paused for i in page]
    planned: list[Snapshot] = []

    def plan(snap: Snapshot) -> None:
        planned.append(snap)

    await store.apply_locked(IDS[2], [], plan, RowLock())
    await store.apply_locked(IDS[3], ["k"], plan, RowLock(nowait=True))
    # Concurrent row locks: the pipelined store takes them together (LOCK_SKIP).
    await asyncio.gather(*(store.apply_locked(i, ["k"], plan, RowLock()) for i in IDS))
    seen += _seen(planned)
    conn = await asyncpg.connect(pg_url)
    try:
        async with conn.transaction(), store.in_transaction(conn) as joined:
            seen += _seen([await joined.read(IDS[4], [])])
            await joined.apply_locked(IDS[5], [], plan, RowLock())
            seen += _seen(planned[-1:])
    finally:
        await conn.close()
    assert len(seen) == 3 + 2 * len(IDS) + 1 + 2 + len(IDS) + 2
    return set(seen)


async def test_every_read_carries_the_workflow_pause(
    store: PostgresStore, pg_url: str, pg_schema: str
) -> None:
    assert await _all_reads(store, pg_url, pg_schema) == {False}
    await store.pause_workflow("approval", "freeze", "ops")
    assert await _all_reads(store, pg_url, pg_schema) == {True}
    assert await store.resume_workflow("approval") is not None
    assert await _all_reads(store, pg_url, pg_schema) == {False}


async def test_a_commit_sets_and_answers_the_instance_pause(store: PostgresStore) -> None:
    row = HistoryEntry(
        IDS[6], 2, PAUSE_EVENT, "pending", "pending", "ops", None, "optimistic", {},
        payload={"reason": "r"},
    )  # fmt: skip
    committed = await store.commit([row])
    assert committed is not None and committed.paused
    assert (await store.get(IDS[6])).paused and (await store.read(IDS[6], [])).instance.paused
    fired = HistoryEntry(IDS[7], 2, "approve", "pending", "approved", None, None, "o", {})
    await store.pause_workflow("approval", "freeze", None)
    assert await store.commit([fired]) is None  # a fired event is not written while paused
    forced = HistoryEntry(
        IDS[7], 2, flowlock.FORCE_EVENT, "pending", "approved", "ops", None, "o", {},
        payload={"reason": "r", "state": "approved"},
    )  # fmt: skip
    assert await store.commit([forced]) is not None  # a repair is
