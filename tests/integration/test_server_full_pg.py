"""A PostgreSQL server with no free connection slot: flowlock says so, with TooManyConnections
(a StoreBusy: nothing was written, back off and retry), when a pool opens and when it must grow,
for the store and for the advisory locks alike; and its pools open only the connections they
need up front.

The server is made full for one role of the test's own: past a role's CONNECTION LIMIT,
PostgreSQL refuses a connection with the same error (SQLSTATE 53300, "too many connections")
as past max_connections, without filling a server that other clients share.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

import flowlock
import pg_budget
from flowlock import examples
from flowlock.locks import AdvisoryLocks
from flowlock.stores.postgres import PostgresStore
from lock_probes import wait_until

pytestmark = pytest.mark.postgres

LIMIT = 3  # the role's connections


@dataclass
class Role:
    """A login role of the test's own, limited to LIMIT connections."""

    name: str
    url: str
    admin: asyncpg.Connection
    held: list[asyncpg.Connection]

    async def sessions(self) -> int:
        count: int = await self.admin.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE usename = $1", self.name
        )
        return count

    async def settled(self, count: int, what: str) -> None:
        """Until the role has ``count`` sessions (others may still be on their way out)."""

        async def reached() -> bool:
            return await self.sessions() == count

        await wait_until(reached, what=what)

    async def fill(self) -> None:
        """Open the role's connections until it has LIMIT: the server is full for it."""
        while await self.sessions() < LIMIT:
            self.held.append(await pg_budget.connect(self.url))


@pytest.fixture
async def role(pg_url: str, pg_schema: str) -> AsyncIterator[Role]:
    """The role, allowed to create the test's schema; dropped at the end with what it owns."""
    name = f"full_{uuid.uuid4().hex[:10]}"
    admin = await pg_budget.connect(pg_url)
    database = await admin.fetchval("SELECT current_database()")
    await admin.execute(f'CREATE ROLE "{name}" LOGIN CONNECTION LIMIT {LIMIT}')
    await admin.execute(f'GRANT CONNECT, CREATE ON DATABASE "{database}" TO "{name}"')
    parts = urlsplit(pg_url)
    url = urlunsplit(parts._replace(netloc=f"{name}@{parts.netloc.rpartition('@')[2]}"))
    found = Role(name, url, admin, [])
    try:
        yield found
    finally:
        for conn in found.held:
            await conn.close()
        await admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", name
        )
        await admin.execute(f'DROP OWNED BY "{name}"')
        await admin.execute(f'DROP ROLE "{name}"')
        await admin.close()


async def test_a_store_cannot_open_on_a_full_server_and_says_why(
    role: Role, pg_schema: str
) -> None:
    """Opening a store when the server has no slot for it: TooManyConnections naming the host,
    saying that max_connections is in use and what to do (not "check the URL")."""
    await role.fill()
    engine = flowlock.Engine(PostgresStore(role.url, schema=pg_schema))
    with pytest.raises(flowlock.TooManyConnections) as caught:
        await engine.open()
    message = str(caught.value)
    assert isinstance(caught.value, flowlock.StoreBusy)
    assert str(urlsplit(role.url).hostname) in message and "max_connections" in message
    assert "check the URL" not in message


async def test_a_store_that_cannot_grow_its_pool_says_why_and_writes_nothing(
    role: Role, pg_schema: str
) -> None:
    """A store opens one connection up front; when a call needs a second one and the server is
    full, the call raises TooManyConnections with the pool's bound and writes nothing; once a
    connection is free again, calls go on."""
    async with flowlock.Engine(PostgresStore(role.url, schema=pg_schema, pool_size=5)) as engine:
        await engine.register(examples.approval())
        await engine.create("approval", instance_id="req-1")
        # Only min_size connections are kept open up front (the schema's and the migrations'
        # have gone).
        await role.settled(1, "the store's one connection")
        await role.fill()
        store = engine.store
        assert isinstance(store, PostgresStore)
        async with store.pool.acquire():  # the pool's one connection, busy
            with pytest.raises(flowlock.TooManyConnections) as caught:
                await engine.fire("req-1", "approve", actor="a")
        assert caught.value.size == 5 and "pool of 5" in str(caught.value)
        assert await engine.history("req-1") == []
        out = await engine.fire("req-1", "approve", actor="a")
        assert out.applied


async def test_advisory_locks_on_a_full_server_say_why(role: Role, pg_schema: str) -> None:
    """The advisory lock backend opens one connection per pool up front; an acquire that needs
    another on a full server raises TooManyConnections (not "unreachable"), and the held lease
    is unaffected. With a session per lease (bulk=False) a second lease needs one; in bulk the
    leases share a holder, and a waiting acquire needs one."""
    async with AdvisoryLocks(role.url, schema=pg_schema, pool_size=4, bulk=False) as locks:
        await role.settled(2, "one connection per pool")
        await role.fill()
        held = await locks.acquire("a", ttl=30)  # on the lease pool's open connection
        with pytest.raises(flowlock.TooManyConnections) as caught:
            await locks.acquire("b", ttl=30)
        assert "unreachable" not in str(caught.value)
        assert await locks.owned(held)
        await locks.release(held)
        assert not await locks.locked("b")
    for conn in role.held:
        await conn.close()
    role.held.clear()
    await role.settled(0, "every session of the first backend closed")
    async with AdvisoryLocks(role.url, schema=pg_schema, pool_size=4) as locks:
        await role.settled(2, "one connection per pool")
        await role.fill()
        held = await locks.acquire("a", ttl=30)  # the holder: the lease pool's open connection
        other = await locks.acquire("b", ttl=30)  # on the same holder: no new connection
        with pytest.raises(flowlock.TooManyConnections) as caught:
            await locks.acquire("a", ttl=30, wait=1)  # waits on a session of its own
        assert "unreachable" not in str(caught.value)
        assert await locks.owned(held) and await locks.owned(other)
        assert await locks.release_many([held, other]) == [True, True]
