"""The distributed strategy on the in-memory store and lock backend: leases, fencing, loss."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import pytest

import flowlock
from flowlock import examples
from flowlock.checker import check
from flowlock.core.models import Instance
from flowlock.locks import MemoryLocks
from flowlock.stores import MemoryStore

# Leases of 30 s: a scheduling stall on a loaded machine cannot make one expire mid-call. The
# wait for a held lease is short, since one test waits it out.
TTL, WAIT = 30.0, 1.0


@pytest.fixture
async def setup() -> AsyncIterator[tuple[flowlock.Engine, MemoryStore, MemoryLocks]]:
    store, locks = MemoryStore(), MemoryLocks()
    async with flowlock.Engine(
        store, locks=locks, strategies=[flowlock.Distributed(ttl=TTL, wait=WAIT)]
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


def record_leases(locks: MemoryLocks) -> list[flowlock.locks.Lease]:
    """Every lease ``locks`` hands out from now on, in the order they were handed out."""
    taken: list[flowlock.locks.Lease] = []
    acquire = locks._acquire

    async def recording(key: str, ttl: float, wait: float) -> flowlock.locks.Lease:
        lease = await acquire(key, ttl, wait)
        taken.append(lease)
        return lease

    locks._acquire = recording  # type: ignore[method-assign]
    return taken


async def test_storm_under_leases_is_exactly_once(
    setup: tuple[flowlock.Engine, MemoryStore, MemoryLocks],
) -> None:
    """100 concurrent distributed approvals: one applied, 99 idempotent, one history row that
    carries the token of a lease taken during the storm, tokens increasing from lease to
    lease."""
    eng, _, locks = setup
    taken = record_leases(locks)
    # A Distributed given per call without a backend leases from the engine's.
    strategy = flowlock.Distributed(ttl=TTL, wait=30.0)
    outs = await asyncio.gather(*[eng.fire("r", "approve", strategy=strategy) for _ in range(100)])
    assert sum(o.applied for o in outs) == 1
    assert sum(o.idempotent for o in outs) == 99
    assert {(o.instance.state, o.instance.version) for o in outs} == {("approved", 2)}
    tokens = [lease.fencing for lease in taken]
    assert tokens and all(a < b for a, b in itertools.pairwise(tokens)), tokens
    [row] = await eng.history("r")
    assert row.fencing_token in tokens
    verdict = check(await eng.get("r"), [row], expected_applied=1)
    assert verdict.ok, verdict.violations


async def test_tokens_increase_along_the_history(
    setup: tuple[flowlock.Engine, MemoryStore, MemoryLocks],
) -> None:
    """Twenty concurrent distributed reservations each take a lease and write once: the history
    rows carry strictly increasing fencing tokens, the tokens of the leases handed out."""
    eng, store, locks = setup
    taken = record_leases(locks)
    await eng.create("inventory", instance_id="s", data={"stock": 20})
    strategy = flowlock.Distributed(ttl=TTL, wait=30.0)
    outs = await asyncio.gather(
        *[eng.fire("s", "reserve", request_id=f"q{i}", strategy=strategy) for i in range(20)]
    )
    assert all(o.applied for o in outs)
    history = await eng.history("s")
    tokens = [h.fencing_token for h in history if h.fencing_token is not None]
    assert len(tokens) == len(history) == 20
    assert tokens == [lease.fencing for lease in taken]
    assert all(a < b for a, b in itertools.pairwise(tokens)), tokens
    assert await store.fencing_floor("s") == tokens[-1]
    final = await eng.get("s")
    assert dict(final.data) == {"stock": 0, "reserved": 20}
    verdict = check(final, history, initial_state="open", expected_applied=20)
    assert verdict.ok, verdict.violations


async def test_held_lock_times_out(setup: tuple[flowlock.Engine, MemoryStore, MemoryLocks]) -> None:
    """A lease held elsewhere makes the call wait the strategy's wait (not less), then
    LockTimeout, nothing written."""
    eng, _, locks = setup
    lease = await locks.acquire("r", ttl=TTL)
    started = time.monotonic()
    with pytest.raises(flowlock.LockTimeout):
        await eng.fire("r", "approve", strategy="distributed")
    took = time.monotonic() - started
    assert WAIT <= took < WAIT + 5
    assert (await eng.get("r")).version == 1
    assert await eng.history("r") == []
    await locks.release(lease)


async def test_stale_fencing_token_is_refused(
    setup: tuple[flowlock.Engine, MemoryStore, MemoryLocks],
) -> None:
    """A write carrying a fencing token lower than the last one written changes nothing."""
    eng, store, _ = setup
    await eng.create("inventory", instance_id="s", data={"stock": 5})
    await eng.fire("s", "reserve", strategy="distributed")  # writes token 1
    await eng.fire("s", "reserve", strategy="distributed")  # writes token 2
    snap = await store.read("s", ())
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
    assert await store.commit((stale,)) is None
    assert await store.commit((dataclasses.replace(stale, fencing_token=2),)) is not None
    assert await store.fencing_floor("s") == 2


async def test_lost_lease_does_not_write(
    setup: tuple[flowlock.Engine, MemoryStore, MemoryLocks],
) -> None:
    """A step that outlives its lease (renewal impossible) raises LockLost and writes nothing."""
    eng, _, locks = setup
    # A short lease here, and a read that sleeps past it: the lease is over when the step
    # would commit, however the machine schedules the two (the sleep is at least the ttl).
    short = flowlock.Distributed(ttl=0.3, wait=WAIT)

    # Make renewal impossible: another owner takes the key as soon as it expires.
    real_extend = locks.extend

    async def failing_extend(lease: flowlock.locks.Lease, ttl: float | None = None) -> Any:
        raise flowlock.LockNotOwned(lease.key, "extend")

    locks.extend = failing_extend  # type: ignore[method-assign]
    original_read = eng.store.read

    async def slow_read(instance_id: str, request_ids: Sequence[str]) -> Any:
        await asyncio.sleep(0.4)  # longer than the 0.3 s ttl
        return await original_read(instance_id, request_ids)

    eng.store.read = slow_read  # type: ignore[method-assign]
    try:
        with pytest.raises(flowlock.LockLost):
            await eng.fire("r", "approve", strategy=short)
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
