"""Connections of the Redis lock backend killed under it (``CLIENT KILL``, as a Redis restart, a
failover or a proxy dropping connections does): every call that fails raises a typed flowlock
error (LockUnavailable, or LockNotOwned / LockLost / LockTimeout / LockBusy where the lease
protocol says so), never one of redis-py's; redis-py drops the dead connections, so the calls
after recover.

The backend's connections carry a client name of the test's own, so ``CLIENT LIST`` finds them
and no other client of the server is touched.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ReadOnlyError, RedisError

import flowlock
from flowlock.embedded import EmbeddedRedis
from flowlock.locks.redis import RedisLocks
from flowlock.locks.redis.connection import connect
from lock_probes import wait_until

pytestmark = pytest.mark.redis

TTL = 2.0  # renewed every ttl/3; a key whose release failed is free again after it
WAIT = 3.0  # longer than TTL: a waiter outlasts a key left behind by a failed release


@pytest.fixture
def name() -> str:
    """The client name of this test's backend connections."""
    return f"flowlock-t-{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def admin(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """A client of the test's own, to list and kill the backend's connections."""
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    await client.aclose()


@pytest.fixture
async def locks(redis_url: str, redis_namespace: str, name: str) -> AsyncIterator[RedisLocks]:
    """A Redis backend on a client configured as the backend's own (bounded pool, no retries),
    whose connections carry the client name ``name``."""
    client = connect(redis_url, max_connections=50, connect_timeout=2.0)
    client.connection_pool.connection_kwargs["client_name"] = name
    backend = RedisLocks.from_client(client, namespace=redis_namespace)
    await backend.open()
    yield backend
    await backend.aclose()
    await client.aclose()


async def kill(admin: aioredis.Redis, name: str) -> int:
    """Kill every connection named ``name``; how many were killed."""
    killed = 0
    for client in await admin.client_list():
        if client.get("name") == name:
            try:
                await admin.client_kill_filter(_id=client["id"])
            except RedisError:  # gone by itself meanwhile
                continue
            killed += 1
    return killed


def assert_typed(exc: BaseException) -> None:
    """A flowlock lock error, never redis-py's or the OS's; a LockUnavailable keeps the
    driver's error as its cause."""
    assert isinstance(exc, flowlock.LockError), f"untyped: {type(exc).__module__}.{exc!r}"
    assert type(exc).__module__.startswith("flowlock."), repr(exc)
    if type(exc) is flowlock.LockUnavailable:
        assert isinstance(exc.__cause__, RedisError | OSError), repr(exc.__cause__)


async def use(locks: RedisLocks, key: str) -> None:
    """Every call of the backend on ``key``: acquire (renewed, released), extend, owned,
    locked, wait_released."""
    async with locks.acquire(key, ttl=TTL, wait=WAIT) as held:
        await locks.extend(held.lease)
        assert await locks.owned(held.lease)
        assert await locks.locked(key)
        held.check()
    await locks.wait_released(key, 0.1)


@pytest.mark.slow
async def test_connections_killed_mid_use_raise_typed_errors_only(
    locks: RedisLocks, admin: aioredis.Redis, name: str
) -> None:
    """Twelve tasks use the backend while another keeps killing its connections: every error
    any call raised is a typed lock error; once the kills stop, every call succeeds."""
    rng = random.Random(7)
    seen: list[BaseException] = []
    using = asyncio.Event()
    killed: list[int] = []

    async def user(task: int) -> None:
        for n in range(15):
            try:
                await use(locks, f"k{(task + n) % 3}")
            except Exception as exc:  # every one is asserted on below
                seen.append(exc)
            using.set()

    async def killer() -> None:
        # Paced fault injection (not ordering): kill, let the calls run on, again.
        await using.wait()
        for _ in range(300):
            killed.append(await kill(admin, name))
            await asyncio.sleep(rng.uniform(0.01, 0.05))

    chaos = asyncio.create_task(killer())
    try:
        await asyncio.gather(*(user(t) for t in range(12)))
    finally:
        chaos.cancel()
        await asyncio.gather(chaos, return_exceptions=True)

    assert sum(killed) > 0
    for exc in seen:
        assert_typed(exc)
    assert any(type(e) is flowlock.LockUnavailable for e in seen), "no call met a killed one"

    # Left alone, the backend recovers: a call may still meet a connection killed last (redis-py
    # finds it dead when it uses it, and drops it), then every call succeeds.
    async def recovered() -> bool:
        try:
            await use(locks, "after")
        except flowlock.LockUnavailable as exc:
            assert_typed(exc)
            return False
        return True

    await wait_until(recovered, what="a call succeeding after the kills")
    await asyncio.gather(*(use(locks, f"k{t % 3}") for t in range(12)))
    await wait_until(lambda: locks.listening, what="the pub/sub subscription coming back")


async def test_a_killed_connection_under_a_held_lease_is_typed(
    locks: RedisLocks, admin: aioredis.Redis, name: str
) -> None:
    """Every connection killed while a lease is held: extend and release raise LockUnavailable
    (or, retried, succeed), never a redis-py error; the lease is then released and the key
    free."""
    lease = await locks.acquire("k", ttl=TTL)
    assert await kill(admin, name) >= 1
    for call in (locks.extend, locks.release):
        for _ in range(5):
            try:
                await call(lease)
            except flowlock.LockUnavailable as exc:
                assert_typed(exc)
                continue
            break
        else:
            raise AssertionError(f"{call.__name__} never succeeded")
    assert not await locks.locked("k")


async def test_a_read_only_replica_is_lock_unavailable_and_its_promotion_recovers() -> None:
    """A Redis that turned into a read-only replica under the backend (a failover that went the
    wrong way, a stale primary address) answers READONLY: acquire and extend raise
    LockUnavailable from redis-py's ReadOnlyError, never the error itself; promoted back, the
    same backend takes and releases the lock."""
    async with EmbeddedRedis() as server, RedisLocks(server.url, namespace="ro") as locks:
        admin = aioredis.Redis.from_url(server.url, decode_responses=True)
        try:
            lease = await locks.acquire("k", ttl=TTL)
            # A primary nobody answers on: the server stays a replica, read-only, and keeps
            # its data (the lease's key) while it tries to connect.
            await admin.replicaof("127.0.0.1", 1)
            for call in (
                lambda: locks.acquire("other", ttl=TTL),
                lambda: locks.extend(lease),
                lambda: locks.release(lease),
            ):
                with pytest.raises(flowlock.LockUnavailable) as caught:
                    await call()
                assert_typed(caught.value)
                assert isinstance(caught.value.__cause__, ReadOnlyError), caught.value.__cause__
            await admin.replicaof("NO", "ONE")
            async with locks.acquire("other", ttl=TTL):
                assert await locks.locked("other")
        finally:
            await admin.aclose()
