"""A legal hold racing a purge batch on PostgreSQL: whichever takes the instance's row first, the
caller of `engine.hold` learns the truth. Either the purge sees the hold and keeps the instance,
or the purge deleted it first and the hold reports `instance_found=False`; never a hold that
says the instance was there while the purge deletes it.

The purge batch is stopped in its `before_commit` (where the archive's write and fsync run,
the rows locked), or the hold's transaction is held open by hand, to order the two for sure.
The one that comes second is seen waiting on the row lock in pg_stat_activity (its engine's
connections carry an application_name of their own) before the first is let go.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import asyncpg

import flowlock
from age_kit import backdate
from flowlock.core.retention import PurgeSelection
from flowlock.stores.base import RetentionStore
from lock_probes import wait_until


async def _engine(factory: Callable[..., Any]) -> tuple[flowlock.Engine, str]:
    """An engine whose connections are named, so a test can see them wait on a lock."""
    name = f"hold-race-{uuid.uuid4().hex[:8]}"
    return await factory(pool_size=4, application_name=name), name


async def _waits_on_a_lock(pg_url: str, name: str) -> None:
    """Until a connection named `name` waits on a lock (a row lock: the other side has it)."""
    conn = await asyncpg.connect(pg_url)
    try:

        async def waiting() -> bool:
            found = await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE application_name = $1 AND wait_event_type = 'Lock'",
                name,
            )
            return bool(found)

        await wait_until(waiting, what=f"a wait on a row lock by {name}")
    finally:
        await conn.close()


async def _aged_approved(engine: flowlock.Engine, iid: str) -> int:
    await engine.create("approval", instance_id=iid, request_id=f"mk-{iid}")
    await engine.fire(iid, "approve", actor="t", request_id=f"a-{iid}")
    store = engine._store
    await backdate(store, [iid])
    assert isinstance(store, RetentionStore)
    found = await store.purge_candidates(
        PurgeSelection("approval", ("approved",), 600.0), after=None, limit=10
    )
    assert [f.instance.id for f in found] == [iid]
    return found[0].instance.version


async def _exists(engine: flowlock.Engine, iid: str) -> bool:
    try:
        await engine.get(iid)
    except flowlock.InstanceNotFound:
        return False
    return True


async def test_a_hold_during_a_batch_waits_for_it_and_says_the_instance_is_gone(
    pg_engine_factory: Callable[..., Any], pg_url: str
) -> None:
    engine, name = await _engine(pg_engine_factory)
    version = await _aged_approved(engine, "race-late")
    store = engine._store
    assert isinstance(store, RetentionStore)
    entered, gate = threading.Event(), threading.Event()

    def before(ids: Sequence[str]) -> None:  # the archive's write, rows locked
        entered.set()
        gate.wait(10)

    batch = asyncio.create_task(store.purge_batch([("race-late", version)], before))
    assert await asyncio.to_thread(entered.wait, 10)
    hold = asyncio.create_task(engine.hold("race-late", reason="legal"))
    await _waits_on_a_lock(pg_url, name)
    assert not hold.done(), "the hold must wait for the batch holding the instance's row"
    gate.set()
    assert await batch == ["race-late"]
    placed = await asyncio.wait_for(hold, 5)
    assert placed.instance_found is False  # too late: the caller is told
    assert not await _exists(engine, "race-late")
    assert [h.instance_id for h in await engine.holds()] == ["race-late"]


async def test_a_hold_during_a_batch_that_rolls_back_finds_the_instance(
    pg_engine_factory: Callable[..., Any], pg_url: str
) -> None:
    engine, name = await _engine(pg_engine_factory)
    version = await _aged_approved(engine, "race-back")
    store = engine._store
    assert isinstance(store, RetentionStore)
    entered, gate = threading.Event(), threading.Event()

    def before(ids: Sequence[str]) -> None:
        entered.set()
        gate.wait(10)
        raise RuntimeError("archive refused")  # the archive failed: the batch rolls back

    batch = asyncio.create_task(store.purge_batch([("race-back", version)], before))
    assert await asyncio.to_thread(entered.wait, 10)
    hold = asyncio.create_task(engine.hold("race-back", reason="legal"))
    await _waits_on_a_lock(pg_url, name)
    assert not hold.done()
    gate.set()
    try:
        await batch
    except RuntimeError:
        pass
    else:
        raise AssertionError("the batch should have failed with its before_commit")
    placed = await asyncio.wait_for(hold, 5)
    assert placed.instance_found is True
    # The hold stands now: a purge of the same version keeps the instance.
    assert await store.purge_batch([("race-back", version)]) == []
    assert await _exists(engine, "race-back")


async def test_a_purge_waiting_on_a_holds_row_lock_sees_the_hold(
    pg_engine_factory: Callable[..., Any], pg_url: str, pg_schema: str
) -> None:
    """The other order: the hold's transaction has the row (as place_hold takes it) when the
    purge batch starts; the batch waits, and once the hold commits it must see it."""
    engine, name = await _engine(pg_engine_factory)
    version = await _aged_approved(engine, "race-first")
    store = engine._store
    assert isinstance(store, RetentionStore)
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute(f'SET search_path TO "{pg_schema}"')
        tx = conn.transaction()
        await tx.start()
        # place_hold's two statements (stores/postgres/retention.py), its commit held back.
        got = await conn.fetchval(
            "SELECT id FROM flowlock_instances WHERE id = $1 FOR KEY SHARE", "race-first"
        )
        assert got == "race-first"
        await conn.execute(
            "INSERT INTO flowlock_holds (instance_id, reason) VALUES ($1, 'legal')", "race-first"
        )
        batch = asyncio.create_task(store.purge_batch([("race-first", version)]))
        await _waits_on_a_lock(pg_url, name)
        assert not batch.done(), "the batch must wait for the hold's row lock"
        await tx.commit()
        assert await asyncio.wait_for(batch, 10) == []
    finally:
        await conn.close()
    assert await _exists(engine, "race-first")
    # And the engine's own hold, placed now, finds it.
    assert (await engine.hold("race-first")).instance_found is True
