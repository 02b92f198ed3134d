"""What is particular to the PostgreSQL advisory-lock backend (the lock contract suite covers the
rest): the server enforces the ttl, fencing tokens are durable and never handed out twice, waits
are bounded by the server, connections go back clean, and concurrent holders never overlap."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import asyncpg
import pytest

import flowlock
from flowlock.locks import LockBackend
from flowlock.locks.advisory import AdvisoryLocks, advisory_lock_id
from lock_probes import wait_until

pytestmark = pytest.mark.postgres

Factory = Callable[..., Awaitable[AdvisoryLocks]]


@pytest.fixture
async def make(pg_url: str, pg_schema: str) -> AsyncIterator[Factory]:
    """Opens advisory backends on this test's schema and namespace; closes them afterwards."""
    namespace = f"t_{uuid.uuid4().hex[:8]}"
    opened: list[AdvisoryLocks] = []

    async def factory(**options: object) -> AdvisoryLocks:
        options.setdefault("namespace", namespace)
        locks = AdvisoryLocks(pg_url, schema=pg_schema, **options)  # type: ignore[arg-type]
        await locks.open()
        opened.append(locks)
        return locks

    yield factory
    for locks in opened:
        await locks.aclose()


@pytest.fixture
async def locks(make: Factory) -> AdvisoryLocks:
    """One open advisory backend."""
    return await make()


async def holder_pid(pg_url: str, locks: AdvisoryLocks, key: str) -> int | None:
    """The server pid holding ``key``'s advisory lock, read from pg_locks."""
    unsigned = locks.lock_id(key) & 0xFFFF_FFFF_FFFF_FFFF
    conn = await asyncpg.connect(pg_url)
    try:
        pid: int | None = await conn.fetchval(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND classid = $1::bigint::oid AND objid = $2::bigint::oid AND objsubid = 1",
            unsigned >> 32,
            unsigned & 0xFFFF_FFFF,
        )
    finally:
        await conn.close()
    return pid


async def test_is_a_lock_backend(locks: AdvisoryLocks) -> None:
    """AdvisoryLocks satisfies the LockBackend port and names itself 'advisory'."""
    assert isinstance(locks, LockBackend)
    assert locks.name == "advisory"
    lease = await locks.acquire("k", ttl=5)
    assert lease.backend == "advisory"
    await locks.release(lease)


def test_lock_id_is_stable() -> None:
    """The lock number of (schema, namespace, key) never changes between versions."""
    assert advisory_lock_id("public", "default", "order-1") == -4766491580092268461
    assert advisory_lock_id("s", "ns", "k") == 3257828171207801208
    assert advisory_lock_id("s", "ns", "k") != advisory_lock_id("s", "ns2", "k")
    assert advisory_lock_id("a", "b:c", "d") != advisory_lock_id("a", "b", "c:d")


async def test_server_enforces_the_ttl(make: Factory) -> None:
    """A holder that stops talking loses the lock after ttl; its stale release is LockNotOwned."""
    a, b = await make(), await make()
    stale = await a.acquire("k", ttl=0.3)
    await asyncio.sleep(0.8)  # no renewal: PostgreSQL ends the idle-in-transaction session
    fresh = await b.acquire("k", ttl=5, wait=0)
    assert fresh.fencing > stale.fencing
    assert not await a.owned(stale)
    with pytest.raises(flowlock.LockNotOwned):
        await a.extend(stale)
    with pytest.raises(flowlock.LockNotOwned):
        await a.release(stale)
    assert await b.owned(fresh)
    await b.release(fresh)


async def test_waiter_gets_a_stalled_holders_lock_after_its_ttl(make: Factory) -> None:
    """A waiter is granted the lock about ttl after a holder went silent, not before."""
    a, b = await make(), await make()
    await a.acquire("k", ttl=0.5)
    started = time.monotonic()
    lease = await b.acquire("k", ttl=5, wait=5)
    waited = time.monotonic() - started
    assert 0.4 <= waited < 2.5, waited
    await b.release(lease)


async def test_renewed_lease_outlives_its_ttl(make: Factory) -> None:
    """A held lease renewed by the watchdog is kept for 4x its ttl; others stay out."""
    a, b = await make(), await make()
    async with a.acquire("k", ttl=0.3) as held:
        for _ in range(4):
            await asyncio.sleep(0.3)
            with pytest.raises(flowlock.LockBusy):
                await b.acquire("k", ttl=1)
        held.check()
        assert await a.owned(held.lease)
    assert not await b.locked("k")


async def test_extend_sets_a_new_server_ttl(locks: AdvisoryLocks) -> None:
    """extend(ttl=...) moves the server's deadline too: the lease survives its first ttl."""
    lease = await locks.acquire("k", ttl=0.3)
    before = time.monotonic()
    longer = await locks.extend(lease, ttl=3)
    assert longer.ttl == 3 and longer.expires_at >= before + 3 - 0.01
    assert longer.fencing == lease.fencing and longer.token == lease.token
    await asyncio.sleep(0.8)
    assert await locks.owned(longer)
    await locks.release(longer)


@pytest.mark.parametrize("call", ["extend", "release"])
async def test_a_lease_whose_session_the_server_ended_is_not_owned(
    pg_url: str, locks: AdvisoryLocks, call: str
) -> None:
    """extend and release of a lease whose session the server has ended (terminated here; a ttl
    running out sends the same kind of FATAL message) raise LockNotOwned, never a driver error:
    also when they are sent while asyncpg is still reading that message, before it has seen the
    connection close (a third of the tries or so, here)."""
    probe = await asyncpg.connect(pg_url)
    try:
        for round_ in range(20):
            key = f"k{round_}"
            lease = await locks.acquire(key, ttl=30)
            pid = await holder_pid(pg_url, locks, key)
            assert await probe.fetchval("SELECT pg_terminate_backend($1)", pid)

            async def gone(key: str = key) -> bool:
                return not await locks.locked(key)

            await wait_until(gone, what="the end of the lease's session")
            ending = locks.extend(lease) if call == "extend" else locks.release(lease)
            with pytest.raises(flowlock.LockNotOwned):
                await ending
    finally:
        await probe.close()


async def test_fencing_is_durable_across_backend_restarts(make: Factory) -> None:
    """Tokens keep increasing across new backend objects, and fence_floor reports the highest."""
    first = await make()
    seen = []
    for _ in range(3):
        lease = await first.acquire("k", ttl=5)
        seen.append(lease.fencing)
        await first.release(lease)
    await first.aclose()
    again = await make()
    lease = await again.acquire("k", ttl=5)
    seen.append(lease.fencing)
    await again.release(lease)
    assert seen == [1, 2, 3, 4]
    assert await again.fence_floor("k") == 4
    assert await again.fence_floor("never-taken") == 0


async def test_a_dead_holders_token_is_never_handed_out_again(pg_url: str, make: Factory) -> None:
    """The token of a holder whose session died was committed: the next holder's is higher."""
    a, b = await make(), await make()
    dead = await a.acquire("k", ttl=30)
    pid = await holder_pid(pg_url, a, "k")
    assert pid is not None
    conn = await asyncpg.connect(pg_url)
    try:
        assert await conn.fetchval("SELECT pg_terminate_backend($1)", pid)
    finally:
        await conn.close()
    lease = await b.acquire("k", ttl=5, wait=5)
    assert lease.fencing > dead.fencing
    assert await b.fence_floor("k") == lease.fencing
    with pytest.raises(flowlock.LockNotOwned):
        await a.release(dead)
    await b.release(lease)


async def test_wait_bound_is_respected(make: Factory) -> None:
    """An acquire behind a holder gives up with LockTimeout after about `wait` seconds."""
    a, b = await make(), await make()
    held = await a.acquire("k", ttl=30)
    started = time.monotonic()
    with pytest.raises(flowlock.LockTimeout) as caught:
        await b.acquire("k", ttl=5, wait=0.4)
    elapsed = time.monotonic() - started
    assert 0.39 <= elapsed < 1.2, elapsed
    assert 0.39 <= caught.value.waited < 1.2
    await a.release(held)


async def test_lock_busy_at_wait_zero(make: Factory) -> None:
    """wait=0 tries once: LockBusy at once while another backend holds the key."""
    a, b = await make(), await make()
    held = await a.acquire("k", ttl=30)
    started = time.monotonic()
    with pytest.raises(flowlock.LockBusy):
        await b.acquire("k", ttl=5)
    assert time.monotonic() - started < 0.5
    assert await b.locked("k")
    await a.release(held)
    assert not await b.locked("k")


async def test_connections_are_returned_clean(pg_url: str, make: Factory) -> None:
    """After busy, timed-out, cancelled, stale and normal leases: no open transaction, no lock."""
    app = f"flowlock-t-{uuid.uuid4().hex[:8]}"
    a = await make(application_name=app, pool_size=4)
    other = await make()
    lease = await a.acquire("k", ttl=5)
    await a.release(lease)
    blocker = await other.acquire("k", ttl=30)
    with pytest.raises(flowlock.LockBusy):
        await a.acquire("k", ttl=5)
    with pytest.raises(flowlock.LockTimeout):
        await a.acquire("k", ttl=5, wait=0.1)
    waiter = asyncio.ensure_future(_acquire(a, "k", ttl=5, wait=10))
    await asyncio.sleep(0.2)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await other.release(blocker)
    stale = await a.acquire("k", ttl=0.2)
    await asyncio.sleep(0.5)
    with pytest.raises(flowlock.LockNotOwned):
        await a.release(stale)
    async with a.acquire("k", ttl=1):
        pass
    await asyncio.sleep(0.1)  # let a terminated session finish leaving
    conn = await asyncpg.connect(pg_url)
    try:
        rows = await conn.fetch(
            "SELECT a.state, count(l.*) AS locks FROM pg_stat_activity a"
            " LEFT JOIN pg_locks l ON l.pid = a.pid AND l.locktype = 'advisory'"
            " WHERE a.application_name = $1 GROUP BY a.pid, a.state",
            app,
        )
    finally:
        await conn.close()
    assert rows, "the backend's connections should be visible"
    assert len(rows) <= a.pool_size + a.side_pool_size
    assert {r["state"] for r in rows} == {"idle"}
    assert sum(r["locks"] for r in rows) == 0
    assert not await a.locked("k")


async def _acquire(locks: AdvisoryLocks, key: str, *, ttl: float, wait: float) -> object:
    return await locks.acquire(key, ttl=ttl, wait=wait)


async def test_twenty_tasks_on_one_key_never_overlap(make: Factory) -> None:
    """20 tasks x 5 turns on one key: never two inside at once; tokens rise in turn order."""
    locks = await make(pool_size=20)
    inside = 0
    most = 0
    order: list[int] = []

    async def worker() -> None:
        nonlocal inside, most
        for _ in range(5):
            async with locks.acquire("hot", ttl=5, wait=30) as held:
                inside += 1
                most = max(most, inside)
                order.append(held.lease.fencing)
                await asyncio.sleep(0.001)
                inside -= 1

    await asyncio.gather(*[worker() for _ in range(20)])
    assert most == 1
    assert order == sorted(order) and len(set(order)) == 100
    assert await locks.fence_floor("hot") == order[-1]


async def test_exhausted_pool_is_store_busy(make: Factory) -> None:
    """With every lease connection in use, an acquire fails with StoreBusy, not LockBusy."""
    locks = await make(pool_size=1, pool_timeout=0.2)
    held = await locks.acquire("a", ttl=5)
    with pytest.raises(flowlock.StoreBusy):
        await locks.acquire("b", ttl=5)
    await locks.release(held)
    await locks.release(await locks.acquire("b", ttl=5))


async def test_schemas_do_not_share_locks(pg_url: str, pg_schema: str, make: Factory) -> None:
    """The same namespace and key in two schemas are two locks (each schema has its fences)."""
    here = await make()
    there_schema = f"{pg_schema}_b"
    there = AdvisoryLocks(pg_url, schema=there_schema, namespace=here.namespace)
    await there.open()
    try:
        a = await here.acquire("k", ttl=5)
        b = await there.acquire("k", ttl=5)
        assert (a.fencing, b.fencing) == (1, 1)
        await here.release(a)
        await there.release(b)
    finally:
        await there.aclose()
        conn = await asyncpg.connect(pg_url)
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{there_schema}" CASCADE')
        finally:
            await conn.close()


async def test_aclose_frees_held_locks_and_refuses_use(make: Factory) -> None:
    """Closing ends held leases on the server at once; a closed backend raises EngineClosed."""
    a, b = await make(), await make()
    lease = await a.acquire("k", ttl=30)
    await a.aclose()
    await a.aclose()
    taken = await b.acquire("k", ttl=5, wait=5)
    await b.release(taken)
    with pytest.raises(flowlock.EngineClosed):
        await a.acquire("k", ttl=5)
    with pytest.raises(flowlock.LockNotOwned):
        await a.release(lease)


async def test_unreachable_server_is_lock_unavailable() -> None:
    """A server that is not there fails open() with LockUnavailable, migrating or not."""
    for auto_migrate in (True, False):
        locks = AdvisoryLocks(
            "postgresql://nobody@127.0.0.1:1/none", auto_migrate=auto_migrate, connect_timeout=2
        )
        with pytest.raises(flowlock.LockUnavailable):
            await locks.open()


def test_bad_arguments_are_refused() -> None:
    """Schema names are identifiers, namespaces non-empty, pools at least one connection."""
    url = "postgresql://x@localhost/db"
    with pytest.raises(flowlock.InvalidInput):
        AdvisoryLocks(url, schema='x"; DROP SCHEMA public; --')
    with pytest.raises(flowlock.InvalidInput):
        AdvisoryLocks(url, namespace="")
    with pytest.raises(flowlock.InvalidInput):
        AdvisoryLocks(url, pool_size=0)


async def test_aclose_ends_waiting_acquires_at_once(make: Factory) -> None:
    """Closing a backend with an acquire waiting for a lock fails that acquire, promptly."""
    a, b = await make(), await make()
    held = await a.acquire("k", ttl=30)
    waiter = asyncio.ensure_future(_acquire(b, "k", ttl=5, wait=20))
    await asyncio.sleep(0.2)
    started = time.monotonic()
    await b.aclose()
    with pytest.raises((flowlock.LockUnavailable, flowlock.EngineClosed)):
        await waiter
    assert time.monotonic() - started < 2
    await a.release(held)
