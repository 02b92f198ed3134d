"""Fencing tokens that never repeat across Redis data losses (issue 10, item 2): a key's tokens
strictly increase however many times Redis comes back empty, whether or not a holder ever wrote
anything through the engine, because each time the counter is found missing the key's epoch in
PostgreSQL is bumped (committed) and the counter is started above it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

import flowlock
from flowlock.embedded import EmbeddedRedis
from flowlock.locks.base import LockBackend


@pytest.fixture
def server() -> Iterator[EmbeddedRedis]:
    """A Redis of this test's own, to restart empty."""
    with EmbeddedRedis() as embedded:
        yield embedded


async def _token(locks: LockBackend, key: str) -> int:
    lease = await locks.acquire(key, ttl=5, wait=5)
    await locks.release(lease)
    return lease.fencing


@pytest.mark.slow
async def test_restart_redis_empty_twice_with_no_write_between(
    server: EmbeddedRedis, pg_url: str, pg_schema: str
) -> None:
    """An engine's Redis locks, a key nobody ever wrote through the engine: Redis restarted
    empty twice, one acquire before, between and after: each token is above every earlier one
    (before the fix the second and third repeated the first: floor 0 plus the gap each time)."""
    async with flowlock.Engine.connect(pg_url, schema=pg_schema, redis_url=server.url) as engine:
        locks = engine.locks
        assert locks is not None
        tokens = [await _token(locks, "never-written")]
        for _ in range(2):
            await asyncio.to_thread(server.restart, flush=True)
            tokens.append(await _token(locks, "never-written"))
        assert tokens == sorted(set(tokens)), tokens
