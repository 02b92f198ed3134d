"""A wall clock changed by an hour either way, on real servers: a Redis or advisory lease is
neither expired nor extended by it (the servers count the ttl, the client counts its deadline on
the monotonic clock), and an escalation shared through PostgreSQL ends after its cool-down on
every engine (it is counted on the database server's clock), not an hour early or late.

The wall clock is :class:`lock_probes.WallClock` in place of ``time.time``; at the end of each
test no flowlock module has read it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest

import flowlock
from flowlock.locks.advisory import AdvisoryLocks
from flowlock.locks.base import LockBackend
from flowlock.locks.redis import RedisLocks
from flowlock.stores.postgres import PostgresStore
from flowlock.strategies.monitor import ConflictMonitor, EscalationSync
from lock_probes import Monotonic, WallClock, wait_until

HOUR = 3600.0
TTL = 1.0


@pytest.fixture(params=["redis", "advisory"])
async def backend(
    request: pytest.FixtureRequest,
    pg_url: str,
    pg_schema: str,
    redis_url: str,
    redis_namespace: str,
) -> AsyncIterator[LockBackend]:
    """A Redis or advisory lock backend, on a monotonic clock the test holds."""
    mono = Monotonic()
    locks: LockBackend
    if request.param == "redis":
        locks = RedisLocks(redis_url, namespace=redis_namespace, clock=mono)
    else:
        locks = AdvisoryLocks(pg_url, schema=pg_schema, pool_size=4, clock=mono)
    await locks.open()
    yield locks
    await locks.aclose()


@pytest.mark.parametrize("jump", [HOUR, -HOUR], ids=["forward", "back"])
async def test_a_wall_clock_jump_neither_expires_nor_extends_a_server_lease(
    backend: LockBackend, wall: WallClock, jump: float
) -> None:
    """A lease of 1 s, the wall clock moved an hour: still held (another caller is refused,
    extend works and counts from now); left alone, the key is free again once its ttl has
    passed on the server, not an hour later."""
    lease = await backend.acquire("k", ttl=TTL)
    wall.jump(jump)
    assert await backend.owned(lease)
    with pytest.raises(flowlock.LockBusy):
        await backend.acquire("k", ttl=TTL)
    # Before the extend is sent: the server counts the ttl from when it gets it, later still.
    started = time.monotonic()
    lease = await backend.extend(lease)
    assert 0 < lease.remaining() <= TTL
    wall.jump(-jump / 2)
    await wait_until(lambda: _free(backend), within=TTL + 10, what="the key's ttl ending")
    # Not ended by the jump: by the ttl (a little grace for the servers' millisecond clocks).
    assert time.monotonic() - started >= TTL - 0.05
    taken = await backend.acquire("k", ttl=TTL)
    assert taken.fencing > lease.fencing
    await backend.release(taken)


async def _free(backend: LockBackend) -> bool:
    return not await backend.locked("k")


@pytest.mark.slow
@pytest.mark.parametrize("jump", [HOUR, -HOUR], ids=["forward", "back"])
async def test_an_escalation_shared_through_postgresql_ignores_a_host_clock_jump(
    pg_url: str, pg_schema: str, wall: WallClock, jump: float
) -> None:
    """One engine escalates an instance, its host's wall clock an hour off; another engine on
    the same database adopts the escalation (it is not already over), and both step down once
    the cool-down has passed (it is not an hour longer); the board then lists nothing."""
    cooldown = 1.5
    a_store = PostgresStore(pg_url, schema=pg_schema, pool_size=2)
    b_store = PostgresStore(pg_url, schema=pg_schema, pool_size=2, auto_migrate=False)
    await a_store.open()
    await b_store.open()
    try:
        a = ConflictMonitor(min_samples=2, cooldown=cooldown)
        b = ConflictMonitor(min_samples=2, cooldown=cooldown)
        sync_a, sync_b = EscalationSync(a_store, a), EscalationSync(b_store, b)
        wall.jump(jump)
        started = time.monotonic()  # before the escalation: its cool-down counts from later
        for _ in range(3):
            a.record("hot", conflict=True)
        assert a.escalated("hot") is not None
        await sync_a.tick()
        await sync_b.tick()
        assert b.escalated("hot") is not None, "adopted"

        async def both_down() -> bool:
            await sync_a.tick()
            await sync_b.tick()
            return a.escalated("hot") is None and b.escalated("hot") is None

        await wait_until(both_down, within=cooldown + 10, what="both engines stepping down")
        # b counts the cool-down from the board's copy, whose clock it reads a round trip late:
        # a little grace below, none of it an hour.
        assert time.monotonic() - started >= cooldown - 0.5

        async def board_empty() -> bool:
            return await a_store.active(await a_store.now()) == []

        # The board's copy ends at its own deadline, on the database's clock: a round trip
        # after the engines' (however long that is on a loaded machine), not an hour off.
        await wait_until(board_empty, within=10, what="the board's copy of the escalation ending")
    finally:
        await a_store.aclose()
        await b_store.aclose()
