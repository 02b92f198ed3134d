"""What is particular to the PostgreSQL advisory-lock backend (the lock contract suite covers the
rest): the server enforces the ttl, waiters wait in PostgreSQL's lock queue, fencing tokens are
durable and never handed out twice, waits are bounded by the server, connections go back clean,
and concurrent holders never overlap.

Nothing here depends on how fast the machine is: leases that must stay held live 30 s, leases
meant to run out 2 s (a stall of a second cannot end one early), a wait that is the promise is
asserted ``bound <= took < bound + 5``, and the test waits for a cause (a session queued in
pg_locks, a lock gone) by polling it with a generous deadline.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import asyncpg
import pytest

import flowlock
import pg_budget
from flowlock.locks import Lease, LockBackend
from flowlock.locks.advisory import AdvisoryLocks, advisory_lock_id
from lock_probes import Session, advisory_sessions, wait_until

pytestmark = pytest.mark.postgres

HELD = 30.0  # a lease that must stay held for the whole test
EXPIRING = 2.0  # a lease meant to run out: a stall of a second cannot end it early
BOUND = 1.0  # a wait meant to end at its bound
LATE = 5.0  # how far past a bound an answer may come on a loaded machine
MS = 0.01  # PostgreSQL counts its timeouts in milliseconds on its own clock

Factory = Callable[..., Awaitable[AdvisoryLocks]]


@pytest.fixture(params=[True, False], ids=["bulk", "solo"])
async def make(
    pg_url: str, pg_schema: str, request: pytest.FixtureRequest
) -> AsyncIterator[Factory]:
    """Opens advisory backends on this test's schema and namespace; closes them afterwards.
    Each test runs with shared holder sessions (bulk) and with a session per lease (solo)."""
    namespace = f"t_{uuid.uuid4().hex[:8]}"
    opened: list[AdvisoryLocks] = []

    async def factory(**options: object) -> AdvisoryLocks:
        options.setdefault("namespace", namespace)
        options.setdefault("bulk", request.param)
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


@pytest.fixture
async def probe(pg_url: str) -> AsyncIterator[asyncpg.Connection]:
    """A plain connection of the test's own, to look at pg_locks and pg_stat_activity."""
    conn = await pg_budget.connect(pg_url)
    yield conn
    await conn.close()


async def queued(
    probe: asyncpg.Connection, locks: AdvisoryLocks, key: str, count: int
) -> list[Session]:
    """Until ``count`` sessions wait for ``key`` in PostgreSQL's lock queue; those sessions."""
    waiting: list[Session] = []

    async def all_there() -> bool:
        nonlocal waiting
        waiting = [s for s in await advisory_sessions(probe, locks.lock_id(key)) if not s.granted]
        return len(waiting) == count

    await wait_until(all_there, what=f"{count} sessions queueing for {key!r}")
    return waiting


async def dropped(locks: AdvisoryLocks, key: str, within: float) -> None:
    """Until nobody holds ``key`` (the server ended its holder's session)."""

    async def gone() -> bool:
        return not await locks.locked(key)

    await wait_until(gone, within=within, what=f"the end of the lock on {key!r}")


async def holder_pid(probe: asyncpg.Connection, locks: AdvisoryLocks, key: str) -> int | None:
    """The server pid holding ``key``'s advisory lock, read from pg_locks."""
    held = [s.pid for s in await advisory_sessions(probe, locks.lock_id(key)) if s.granted]
    return held[0] if held else None


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


@pytest.mark.slow
async def test_server_enforces_the_ttl(make: Factory, probe: asyncpg.Connection) -> None:
    """A holder that stops talking loses the lock at its ttl, not before: PostgreSQL ends its
    idle session, and a waiter in the server's lock queue (another backend, as another process
    would be) is granted the lock then, with a higher fencing token; the stale holder's extend
    and release are LockNotOwned."""
    a, b = await make(), await make()
    started = time.monotonic()
    stale = await a.acquire("k", ttl=EXPIRING)  # no renewal: nothing is sent on its session
    waiter = asyncio.create_task(_acquire(b, "k", ttl=HELD, wait=HELD))
    await queued(probe, b, "k", 1)
    fresh = await asyncio.wait_for(waiter, EXPIRING + LATE)
    took = time.monotonic() - started
    assert EXPIRING - MS <= took < EXPIRING + LATE, took
    assert fresh.fencing > stale.fencing
    assert not await a.owned(stale)
    with pytest.raises(flowlock.LockNotOwned):
        await a.extend(stale)
    with pytest.raises(flowlock.LockNotOwned):
        await a.release(stale)
    assert await b.owned(fresh)
    await b.release(fresh)


async def test_a_waiter_waits_in_postgresqls_lock_queue(
    make: Factory, probe: asyncpg.Connection
) -> None:
    """A waiter waits in PostgreSQL's lock queue, not in a client retrying (a try-lock never
    shows as waiting): its session is in pg_locks with granted = false, waiting on a Lock, and
    is the session granted the lock as soon as the holder commits (its bound and the holder's
    ttl are 30 s away)."""
    a, b = await make(), await make()
    held = await a.acquire("k", ttl=HELD)
    waiter = asyncio.create_task(_acquire(b, "k", ttl=HELD, wait=HELD))
    [waiting] = await queued(probe, b, "k", 1)
    assert waiting.wait_event_type == "Lock"
    [holder] = [s for s in await advisory_sessions(probe, b.lock_id("k")) if s.granted]
    assert holder.pid != waiting.pid
    released = time.monotonic()
    await a.release(held)
    lease = await asyncio.wait_for(waiter, LATE)
    assert time.monotonic() - released < LATE
    assert await holder_pid(probe, b, "k") == waiting.pid
    assert lease.fencing > held.fencing
    await b.release(lease)


@pytest.mark.slow  # holds a lease past twice a ttl of seconds
async def test_renewed_lease_outlives_its_ttl(make: Factory, probe: asyncpg.Connection) -> None:
    """A held lease renewed by the watchdog is kept past twice its ttl by the same session,
    and another backend (as another process would be) is refused it all along."""
    a, b = await make(), await make()
    ttl = 2.0  # a stall of up to 2/3 of it between two renewals loses nothing
    async with a.acquire("k", ttl=ttl) as held:
        pid = await holder_pid(probe, a, "k")
        until = time.monotonic() + 2.25 * ttl
        while time.monotonic() < until:
            with pytest.raises(flowlock.LockBusy):
                await b.acquire("k", ttl=HELD)
            assert await holder_pid(probe, a, "k") == pid
            await asyncio.sleep(ttl / 4)
        held.check()
        assert await a.owned(held.lease)
    assert not await b.locked("k")


@pytest.mark.slow
async def test_extend_sets_a_new_server_ttl(locks: AdvisoryLocks) -> None:
    """extend(ttl=...) sets the server's deadline too: the session outlives its first ttl and
    PostgreSQL ends it at the new one, counted from the extend."""
    lease = await locks.acquire("k", ttl=EXPIRING)
    new_ttl = EXPIRING + 1.0
    before = time.monotonic()
    longer = await locks.extend(lease, ttl=new_ttl)
    assert longer.ttl == new_ttl and longer.expires_at >= before + new_ttl
    assert longer.fencing == lease.fencing and longer.token == lease.token
    await dropped(locks, "k", within=new_ttl + LATE)
    took = time.monotonic() - before
    assert new_ttl - MS <= took < new_ttl + LATE, took
    assert not await locks.owned(longer)


@pytest.mark.parametrize("call", ["extend", "release"])
async def test_a_lease_whose_session_the_server_ended_is_not_owned(
    locks: AdvisoryLocks, probe: asyncpg.Connection, call: str
) -> None:
    """extend and release of a lease whose session the server has ended (terminated here; a ttl
    running out sends the same kind of FATAL message) raise LockNotOwned, never a driver error:
    also when they are sent while asyncpg is still reading that message, before it has seen the
    connection close (a third of the tries or so, here)."""
    for round_ in range(20):
        key = f"k{round_}"
        lease = await locks.acquire(key, ttl=HELD)
        pid = await holder_pid(probe, locks, key)
        assert await probe.fetchval("SELECT pg_terminate_backend($1)", pid)
        await dropped(locks, key, within=LATE)
        ending = locks.extend(lease) if call == "extend" else locks.release(lease)
        with pytest.raises(flowlock.LockNotOwned):
            await ending


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


async def test_a_dead_holders_token_is_never_handed_out_again(
    make: Factory, probe: asyncpg.Connection
) -> None:
    """The token of a holder whose session died was committed: the next holder's is higher."""
    a, b = await make(), await make()
    dead = await a.acquire("k", ttl=HELD)
    pid = await holder_pid(probe, a, "k")
    assert pid is not None
    assert await probe.fetchval("SELECT pg_terminate_backend($1)", pid)
    lease = await b.acquire("k", ttl=HELD, wait=LATE)
    assert lease.fencing > dead.fencing
    assert await b.fence_floor("k") == lease.fencing
    with pytest.raises(flowlock.LockNotOwned):
        await a.release(dead)
    await b.release(lease)


async def test_wait_bound_is_respected(make: Factory) -> None:
    """An acquire behind a holder gives up with LockTimeout at its wait (PostgreSQL's
    lock_timeout), not before, and says how long it waited."""
    a, b = await make(), await make()
    held = await a.acquire("k", ttl=HELD)
    started = time.monotonic()
    with pytest.raises(flowlock.LockTimeout) as caught:
        await b.acquire("k", ttl=HELD, wait=BOUND)
    took = time.monotonic() - started
    assert BOUND <= took < BOUND + LATE, took
    assert BOUND <= caught.value.waited <= took
    assert await a.owned(held)
    await a.release(held)


async def test_lock_busy_at_wait_zero(make: Factory) -> None:
    """wait=0 tries once: LockBusy at once (it does not wait for a holder with 30 s to run)
    while another backend holds the key."""
    a, b = await make(), await make()
    held = await a.acquire("k", ttl=HELD)
    started = time.monotonic()
    with pytest.raises(flowlock.LockBusy):
        await b.acquire("k", ttl=HELD)
    assert time.monotonic() - started < LATE
    assert await b.locked("k")
    await a.release(held)
    assert not await b.locked("k")


@pytest.mark.slow
async def test_connections_are_returned_clean(
    pg_url: str, make: Factory, probe: asyncpg.Connection
) -> None:
    """After busy, timed-out, cancelled, stale and normal leases: no open transaction, no lock."""
    app = f"flowlock-t-{uuid.uuid4().hex[:8]}"
    a = await make(application_name=app, pool_size=4)
    other = await make()
    lease = await a.acquire("k", ttl=HELD)
    await a.release(lease)
    blocker = await other.acquire("k", ttl=HELD)
    with pytest.raises(flowlock.LockBusy):
        await a.acquire("k", ttl=HELD)
    with pytest.raises(flowlock.LockTimeout):
        await a.acquire("k", ttl=HELD, wait=0.1)
    waiter = asyncio.ensure_future(_acquire(a, "k", ttl=HELD, wait=HELD))
    await queued(probe, a, "k", 1)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await other.release(blocker)
    # The cancelled waiter's session may be granted the lock for the instant before the server
    # notices it was closed: wait for the key to be free rather than assume it.
    await dropped(a, "k", within=LATE)
    stale = await a.acquire("k", ttl=EXPIRING)
    await dropped(a, "k", within=EXPIRING + LATE)  # the server ended the idle session
    with pytest.raises(flowlock.LockNotOwned):
        await a.release(stale)
    async with a.acquire("k", ttl=HELD):
        pass

    async def all_clean() -> bool:
        # Sessions ended by the server or by the backend take a moment to leave pg_stat_activity.
        rows = await probe.fetch(
            "SELECT a.state, count(l.*) AS locks FROM pg_stat_activity a"
            " LEFT JOIN pg_locks l ON l.pid = a.pid AND l.locktype = 'advisory'"
            " WHERE a.application_name = $1 GROUP BY a.pid, a.state",
            app,
        )
        assert rows, "the backend's connections should be visible"
        assert len(rows) <= a.pool_size + a.side_pool_size
        return {r["state"] for r in rows} == {"idle"} and sum(r["locks"] for r in rows) == 0

    await wait_until(all_clean, what="every connection idle and holding no lock")
    assert not await a.locked("k")


async def _acquire(locks: AdvisoryLocks, key: str, *, ttl: float, wait: float) -> Lease:
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
            async with locks.acquire("hot", ttl=HELD, wait=HELD) as held:
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
        conn = await pg_budget.connect(pg_url)
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


async def test_aclose_ends_waiting_acquires_at_once(
    make: Factory, probe: asyncpg.Connection
) -> None:
    """Closing a backend with an acquire waiting for a lock ends that wait on the server at once
    (long before its 30 s bound): the acquire fails with LockUnavailable (its session is gone)."""
    a, b = await make(), await make()
    held = await a.acquire("k", ttl=HELD)
    waiter = asyncio.ensure_future(_acquire(b, "k", ttl=HELD, wait=HELD))
    await queued(probe, b, "k", 1)
    started = time.monotonic()
    await b.aclose()
    with pytest.raises(flowlock.LockUnavailable):
        await waiter
    assert time.monotonic() - started < LATE
    await a.release(held)
