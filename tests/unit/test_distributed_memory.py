"""The distributed strategy on the in-memory store and lock backend: leases, fencing, loss."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest

import flowlock
from flowlock import examples
from flowlock.checker import check
from flowlock.locks import MemoryLocks
from flowlock.models import Instance
from flowlock.stores import MemoryStore


@pytest.fixture
async def setup() -> AsyncIterator[tuple[flowlock.Engine, MemoryStore, MemoryLocks]]:
    store, locks = MemoryStore(), MemoryLocks()
    async with flowlock.Engine(
        store, locks=locks, strategies=[flowlock.Distributed(ttl=0.3, wait=0.2)]
    ) as eng:
        await eng.register(examples.approval())
        await eng.register(examples.inventory())
        await eng.create("approval", instance_id="r")
        yield eng, store, locks


async def test_distributed_applies_and_records_the_fencing_token(
    setup: tuple[flowlock.Engine, MemoryStore, MemoryLocks],
) -> None:
    """A distributed fire records the lease's fencing token in its history row."""
    eng, _, locks = setup
    out = await eng.fire("r", "approve", strategy="distributed")
    assert out.applied and out.strategy == "distributed"
    [entry] = await eng.history("r")
    assert entry.fencing_token == 1 and entry.strategy == "distributed"
    assert not await locks.locked("r")  # released after the call


async def test_step_sees_the_fencing_token(
    setup: tuple[flowlock.Engine, MemoryStore, MemoryLocks],
) -> None:
    """flowlock.fencing_token() inside an effect is the lease's token; None outside."""
    eng, _, _ = setup
    seen: list[int | None] = []

    def effect(inst: Instance, payload: Mapping[str, Any], actor: str | None) -> dict[str, Any]:
        seen.append(flowlock.fencing_token())
        return dict(inst.data)

    await eng.register(
        flowlock.Workflow(
            "fx",
            states=["a", "b"],
            initial="a",
            transitions=[flowlock.Transition("go", source="a", target="b", effect=effect)],
        )
    )
    await eng.create("fx", instance_id="f")
    await eng.fire("f", "go", strategy="distributed")
    assert seen == [1]
    assert flowlock.fencing_token() is None


async def test_storm_under_leases_is_exactly_once(
    setup: tuple[flowlock.Engine, MemoryStore, MemoryLocks],
) -> None:
    """100 concurrent distributed approvals: one applied, 99 idempotent, tokens increasing."""
    eng, _, _ = setup
    # A Distributed given per call without a backend leases from the engine's.
    strategy = flowlock.Distributed(ttl=1.0, wait=5.0)
    outs = await asyncio.gather(*[eng.fire("r", "approve", strategy=strategy) for _ in range(100)])
    assert sum(o.applied for o in outs) == 1
    assert check(await eng.get("r"), await eng.history("r"), expected_applied=1).ok


async def test_held_lock_times_out(setup: tuple[flowlock.Engine, MemoryStore, MemoryLocks]) -> None:
    """A lease held elsewhere makes the call wait lease_wait, then LockTimeout, nothing written."""
    eng, _, locks = setup
    lease = await locks.acquire("r", ttl=5)
    with pytest.raises(flowlock.LockTimeout):
        await eng.fire("r", "approve", strategy="distributed")
    assert (await eng.get("r")).version == 1
    await locks.release(lease)


async def test_stale_fencing_token_is_refused(
    setup: tuple[flowlock.Engine, MemoryStore, MemoryLocks],
) -> None:
    """A write carrying a fencing token lower than the last one written changes nothing."""
    eng, store, _ = setup
    await eng.create("inventory", instance_id="s", data={"stock": 5})
    await eng.fire("s", "reserve", strategy="distributed")  # writes token 1
    await eng.fire("s", "reserve", strategy="distributed")  # writes token 2
    snap = await store.read("s", None)
    stale = flowlock.HistoryEntry(
        instance_id="s",
        version=snap.instance.version + 1,
        event="reserve",
        from_state="open",
        to_state="open",
        actor="zombie",
        request_id=None,
        strategy="distributed",
        data={"stock": 0},
        fencing_token=1,
    )
    assert await store.commit(stale) is None
    assert await store.commit(dataclasses.replace(stale, fencing_token=2)) is not None
    assert await store.fencing_floor("s") == 2


async def test_lost_lease_does_not_write(
    setup: tuple[flowlock.Engine, MemoryStore, MemoryLocks],
) -> None:
    """A step that outlives its lease (renewal impossible) raises LockLost and writes nothing."""
    eng, _, locks = setup

    # Make renewal impossible: another owner takes the key as soon as it expires.
    real_extend = locks.extend

    async def failing_extend(lease: flowlock.locks.Lease, ttl: float | None = None) -> Any:
        raise flowlock.LockNotOwned(lease.key, "extend")

    locks.extend = failing_extend  # type: ignore[method-assign]
    original_read = eng.store.read

    async def slow_read(instance_id: str, request_id: str | None) -> Any:
        await asyncio.sleep(0.4)  # longer than the 0.3 s ttl
        return await original_read(instance_id, request_id)

    eng.store.read = slow_read  # type: ignore[method-assign]
    try:
        with pytest.raises(flowlock.LockLost):
            await eng.fire("r", "approve", strategy="distributed")
    finally:
        locks.extend = real_extend  # type: ignore[method-assign]
        eng.store.read = original_read  # type: ignore[method-assign]
    assert (await eng.get("r")).version == 1
    assert await eng.history("r") == []


async def test_release_failure_after_commit_is_reported_not_raised(
    setup: tuple[flowlock.Engine, MemoryStore, MemoryLocks], caplog: pytest.LogCaptureFixture
) -> None:
    """If releasing fails after the commit, the call still succeeds and a warning is logged."""
    eng, _, locks = setup

    async def broken_release(lease: flowlock.locks.Lease) -> None:
        raise flowlock.LockUnavailable("memory", "connection refused")

    real = locks.release
    locks.release = broken_release  # type: ignore[method-assign]
    try:
        with caplog.at_level(logging.WARNING, logger="flowlock"):
            out = await eng.fire("r", "approve", strategy="distributed")
    finally:
        locks.release = real  # type: ignore[method-assign]
    assert out.applied
    assert any("releasing its lease failed" in r.message for r in caplog.records)


async def test_distributed_needs_a_lock_backend() -> None:
    """Without a lock backend, strategy='distributed' is a clear InvalidInput."""
    async with flowlock.Engine(MemoryStore()) as eng:
        await eng.register(examples.approval())
        await eng.create("approval", instance_id="r")
        with pytest.raises(flowlock.InvalidInput, match="redis_url"):
            await eng.fire("r", "approve", strategy="distributed")
