"""Advisory leases in bulk (shared holder sessions): concurrent calls on different keys share
statements, and every lock property still holds per key. The lock contract suite runs over this
path too (tests/contract/test_lock_contract.py, the "advisory" harness); this file covers what
is particular to it: round trips counted, bulk calls with busy keys, the server ending a holder
whose process stalls, a dead process's keys freed at once, and many tasks in several backends
never overlapping on a key.

Leases that must stay held live 30 s, leases meant to run out 2 s; the tests wait for a cause by
polling it with a generous deadline.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable

import asyncpg
import pytest

from flowlock.core.errors import InvalidInput, LockBusy, LockNotOwned, LockUnavailable
from flowlock.locks.advisory import AdvisoryLocks
from flowlock.locks.advisory.bulk import GRACE
from flowlock.locks.base import BulkLockBackend, Lease
from lock_probes import wait_until

pytestmark = pytest.mark.postgres

HELD = 30.0
EXPIRING = 2.0
LATE = 5.0
MS = 0.01

Factory = Callable[..., Awaitable[AdvisoryLocks]]


@pytest.fixture
async def make(pg_url: str, pg_schema: str) -> AsyncIterator[Factory]:
    """Opens advisory backends (bulk by default) on this test's schema and namespace."""
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


def statements(locks: AdvisoryLocks) -> int:
    """Holder statements sent so far: one round trip each."""
    assert locks._bulk is not None, "the bulk path is off"
    return locks._bulk.statements


async def test_is_a_bulk_lock_backend_either_way(make: Factory) -> None:
    """Both paths answer the BulkLockBackend calls, with the same results."""
    for bulk in (True, False):
        locks = await make(bulk=bulk)
        assert isinstance(locks, BulkLockBackend)
        assert (locks._bulk is not None) is bulk
        taken = await locks.try_acquire_many([f"{bulk}-a", f"{bulk}-b"], ttl=HELD)
        assert [lease is not None for lease in taken] == [True, True]
        leases = [lease for lease in taken if lease is not None]
        renewed = await locks.extend_many(leases, HELD)
        pairs = zip(renewed, leases, strict=True)
        assert all(r is not None and r.token == lease.token for r, lease in pairs)
        assert await locks.release_many(leases) == [True, True]
        assert await locks.release_many(leases) == [False, False]
        assert await locks.extend_many(leases, HELD) == [None, None]


async def test_concurrent_calls_on_different_keys_share_round_trips(make: Factory) -> None:
    """120 acquires on different keys at once go in a handful of statements, not 120; each key
    is held once with its own first fencing token; 120 renewals and 120 releases are batched
    the same way, and every key is free afterwards."""
    locks = await make(pool_size=20)
    keys = [f"k{i}" for i in range(120)]
    before = statements(locks)
    leases = await asyncio.gather(*(locks.acquire(key, ttl=HELD) for key in keys))
    taking = statements(locks) - before
    assert taking <= 120 // 4, taking
    assert [lease.key for lease in leases] == keys
    assert {lease.fencing for lease in leases} == {1}
    assert len({lease.token for lease in leases}) == 120
    for key in keys[:5]:
        assert await locks.locked(key)
    with pytest.raises(LockBusy):
        await locks.acquire("k7", ttl=HELD)

    before = statements(locks)
    renewed = await asyncio.gather(*(locks.extend(lease, HELD) for lease in leases))
    assert statements(locks) - before <= 120 // 4
    assert all(r.expires_at >= lease.expires_at for r, lease in zip(renewed, leases, strict=True))

    before = statements(locks)
    await asyncio.gather(*(locks.release(lease) for lease in renewed))
    assert statements(locks) - before <= 120 // 4
    for key in keys[:5]:
        assert not await locks.locked(key)
    again = await locks.acquire("k0", ttl=HELD)
    assert again.fencing == 2
    await locks.release(again)


async def test_busy_keys_in_a_bulk_call_are_none_and_not_disturbed(make: Factory) -> None:
    """Keys held by another backend (another process, to the server) or by this one come back
    None from try_acquire_many; their holders keep them with their tokens, and the fencing
    counter of a key that was busy did not move. A key named twice is taken once."""
    a, b = await make(), await make()
    theirs = await b.acquire("busy", ttl=HELD)
    mine = await a.acquire("mine", ttl=HELD)
    got = await a.try_acquire_many(["free", "busy", "mine", "free2", "free"], ttl=HELD)
    assert [lease is not None for lease in got] == [True, False, False, True, False]
    assert await b.owned(theirs)
    assert await a.owned(mine)
    assert await a.fence_floor("busy") == theirs.fencing
    assert await a.fence_floor("free") == 1
    taken = [lease for lease in got if lease is not None]
    assert await a.release_many([*taken, mine]) == [True, True, True]
    await b.release(theirs)
    with pytest.raises(LockNotOwned):
        await a.release(mine)


@pytest.mark.slow  # waits out a ttl and the server's grace
async def test_the_server_ends_a_holder_whose_process_stalls(make: Factory) -> None:
    """With nothing sent on a holder (its process stalled: here its reaper is stopped), the
    server ends the quiet session at the earliest lease deadline plus GRACE, not before the
    ttl; another backend gets every key then, with higher tokens, and the stalled backend's
    leases are not owned any more."""
    a, b = await make(), await make()
    started = time.monotonic()
    stale = await a.try_acquire_many(["s1", "s2", "s3"], ttl=EXPIRING)
    assert a._bulk is not None
    for holder in a._bulk._holders:
        assert holder.reaper is not None
        holder.reaper.cancel()  # the process stalls: no reaper, no renewal, no statement
    fresh = await b.acquire("s2", ttl=HELD, wait=HELD)
    took = time.monotonic() - started
    assert EXPIRING - MS <= took < EXPIRING + GRACE + LATE, took
    first = [lease for lease in stale if lease is not None]
    assert fresh.fencing > first[1].fencing
    for key in ("s1", "s3"):
        lease = await b.acquire(key, ttl=HELD, wait=LATE)
        await b.release(lease)
    assert await a.release_many(first) == [False, False, False]
    await b.release(fresh)


HOLDER_PROCESS = """
import asyncio, sys
from flowlock.locks.advisory import AdvisoryLocks

async def main():
    locks = AdvisoryLocks(sys.argv[1], schema=sys.argv[2], namespace=sys.argv[3], pool_size=8)
    await locks.open()
    leases = await locks.try_acquire_many([f"p{i}" for i in range(20)], ttl=30)
    assert all(leases), leases
    print("held", flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


async def test_a_dead_process_frees_its_keys_at_once(
    make: Factory, pg_url: str, pg_schema: str
) -> None:
    """A process holding 20 keys on a holder is killed: the server frees every key as soon as
    the socket closes (long before the 30 s ttl), and the next tokens are higher."""
    locks = await make()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        HOLDER_PROCESS,
        pg_url,
        pg_schema,
        locks.namespace,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert line.strip() == b"held"
        assert await locks.locked("p0")
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
    killed = time.monotonic()
    taken = await asyncio.gather(*(locks.acquire(f"p{i}", ttl=HELD, wait=LATE) for i in range(20)))
    assert time.monotonic() - killed < LATE
    assert {lease.fencing for lease in taken} == {2}
    await locks.release_many(taken)


async def test_many_tasks_in_several_backends_never_overlap_on_a_key(make: Factory) -> None:
    """Three backends (three sets of sessions, as three processes would have), 90 tasks, 6
    keys, waits and wait=0 tries mixed: never two holders of a key at once, and each key's
    tokens rise in the order its holders got it."""
    backends = [await make(pool_size=8) for _ in range(3)]  # 30 connections in all
    inside: dict[str, int] = defaultdict(int)
    order: dict[str, list[int]] = defaultdict(list)
    overlaps = 0
    busy = 0

    async def worker(n: int) -> None:
        nonlocal overlaps, busy
        locks = backends[n % 3]
        for turn in range(6):
            key = f"hot{(n + turn) % 6}"
            try:
                lease: Lease = await locks.acquire(key, ttl=HELD, wait=0 if turn % 2 else HELD)
            except LockBusy:
                busy += 1
                continue
            inside[key] += 1
            overlaps += inside[key] > 1
            order[key].append(lease.fencing)
            await asyncio.sleep(0.001)
            inside[key] -= 1
            await locks.release(lease)

    await asyncio.gather(*(worker(n) for n in range(90)))
    assert overlaps == 0
    for key, tokens in order.items():
        assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens), key
    assert sum(len(t) for t in order.values()) + busy == 90 * 6
    for key in order:
        assert not await backends[0].locked(key)


async def take(locks: AdvisoryLocks, key: str) -> Lease:
    return await locks.acquire(key, ttl=HELD)


async def test_a_cancelled_acquire_leaves_no_key_behind(make: Factory) -> None:
    """Acquires cancelled while their batch is in flight do not keep their keys: each key is
    free long before its 30 s ttl (a lease taken for a caller that left is given back)."""
    locks = await make()
    keys = [f"c{i}" for i in range(40)]
    for depth in range(4):
        tasks = [asyncio.create_task(take(locks, key)) for key in keys]
        for _ in range(depth):
            await asyncio.sleep(0)
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for result in results:
            if isinstance(result, Lease):
                await locks.release(result)

        async def all_free() -> bool:
            return not any([await locks.locked(key) for key in keys])

        await wait_until(all_free, within=LATE, what=f"every key free (cancelled {depth} in)")


@pytest.fixture
async def row_blocker(
    pg_url: str, pg_schema: str
) -> AsyncIterator[Callable[..., Awaitable[asyncpg.Connection]]]:
    """Opens sessions that hold an uncommitted fencing row of a key, so that a holder statement
    taking that key waits for it (what a stale holder's increment does), until rolled back."""
    opened: list[asyncpg.Connection] = []

    async def block(namespace: str, *keys: str) -> asyncpg.Connection:
        conn = await asyncpg.connect(pg_url)
        opened.append(conn)
        await conn.execute("BEGIN")
        for key in keys:
            await conn.execute(
                f'INSERT INTO "{pg_schema}".flowlock_fences (namespace, key, token) '
                "VALUES ($1, $2, 1)",
                namespace,
                key,
            )
        return conn

    yield block
    for conn in opened:
        await conn.close()


Blocker = Callable[..., Awaitable[asyncpg.Connection]]


async def grab(locks: AdvisoryLocks, key: str, wait: float = 0.0) -> Lease:
    return await locks.acquire(key, ttl=HELD, wait=wait)


async def test_a_busy_holder_serves_while_the_pool_is_full(
    make: Factory, row_blocker: Blocker
) -> None:
    """Waiting acquires fill the lease pool and the one holder is busy (its statement waits
    for a fencing row): an acquire of another key queues on that holder and gets its key when
    the statement ends, instead of waiting for a second holder's connection and failing with
    StoreBusy after pool_timeout."""
    other = await make()
    hot = await other.acquire("hot", ttl=HELD)
    locks = await make(pool_size=8, pool_timeout=0.5, io_timeout=5.0)  # two holders allowed
    first = await locks.acquire("x", ttl=HELD)
    assert locks._bulk is not None and len(locks._bulk._holders) == 1
    waiting: list[asyncio.Task[Lease]] = []
    for _ in range(7):  # the rest of the pool: one connection each, waiting for "hot"
        waiting.append(asyncio.create_task(grab(locks, "hot", wait=HELD)))
        await wait_until(lambda: len(locks._pending) == len(waiting), within=LATE, what="a waiter")
    try:
        blocker = await row_blocker(locks.namespace, "f")
        stuck = asyncio.create_task(grab(locks, "f"))
        holder = locks._bulk._holders[0]
        await wait_until(lambda: holder.busy > 0, within=LATE, what="a busy holder")
        await asyncio.sleep(0.1)
        queued = asyncio.create_task(grab(locks, "y"))
        await asyncio.sleep(1.0)  # twice pool_timeout
        await blocker.execute("ROLLBACK")
        taken = [await queued, await stuck]
        assert [lease.key for lease in taken] == ["y", "f"]
        await locks.release_many([first, *taken])
    finally:
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        await other.release(hot)


async def test_a_cancelled_try_acquire_many_leaves_no_key_behind(
    make: Factory, row_blocker: Blocker
) -> None:
    """A try_acquire_many cancelled while its statement is in flight (waiting for a fencing
    row) does not keep the keys the statement takes: they are given back long before the ttl."""
    locks = await make()
    keys = [f"m{i}" for i in range(10)]
    blocker = await row_blocker(locks.namespace, "m0")
    task = asyncio.create_task(locks.try_acquire_many(keys, ttl=HELD))
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await blocker.execute("ROLLBACK")

    async def all_free() -> bool:
        return not any([await locks.locked(key) for key in keys])

    await wait_until(all_free, within=LATE, what="every key of the cancelled call free")
    leases = await locks.try_acquire_many(keys, ttl=HELD)
    assert all(leases)
    await locks.release_many([lease for lease in leases if lease is not None])


async def test_the_first_try_is_bounded_by_wait_and_io_timeout(
    make: Factory, row_blocker: Blocker
) -> None:
    """An acquire queued behind a slow holder statement, whose own statement is slow too, fails
    within wait + io_timeout (not twice io_timeout), and the key is not kept."""
    io_timeout = 1.5
    locks = await make(pool_size=4, io_timeout=io_timeout)  # one holder
    first = await row_blocker(locks.namespace, "a")
    second = await row_blocker(locks.namespace, "b")
    ahead = asyncio.create_task(grab(locks, "a"))
    await asyncio.sleep(0.2)

    async def let_a_through() -> None:
        await asyncio.sleep(1.0)
        await first.execute("ROLLBACK")

    letting = asyncio.create_task(let_a_through())
    started = time.monotonic()
    with pytest.raises(LockUnavailable):
        await locks.acquire("b", ttl=HELD)  # behind "a" for 1 s, then waits for its own row
    took = time.monotonic() - started
    await second.execute("ROLLBACK")  # before the holder's own timeout, which would end it
    await letting
    assert took < io_timeout + 0.5, took
    lease = await ahead
    assert locks._bulk is not None and locks._bulk.kept(lease.token) is not None

    async def b_free() -> bool:
        return not await locks.locked("b")

    # "b" was taken on the server while its statement waited: the late lease is given back.
    await wait_until(b_free, within=LATE, what="the late lease of the caller that left freed")
    assert len(locks._bulk) == 1
    await locks.release(lease)


async def test_bulk_input_is_checked_before_anything_is_sent(make: Factory) -> None:
    """A string is not a list of keys; an empty list opens no holder and sends nothing."""
    locks = await make()
    with pytest.raises(InvalidInput):
        await locks.try_acquire_many("abc", ttl=HELD)
    with pytest.raises(InvalidInput):
        await locks.try_acquire_many([], ttl=-1)
    assert await locks.try_acquire_many([], ttl=HELD) == []
    assert locks._bulk is not None and not locks._bulk._holders
    assert statements(locks) == 0


async def test_holders_ended_by_the_server_are_replaced_and_their_connections_given_back(
    make: Factory, pg_url: str
) -> None:
    """The server ends the holder sessions (a restart, pg_terminate_backend) more times than the
    lease pool has connections: each lost holder's connection goes back to the pool, so the
    backend keeps taking keys, and once quiet only the live holders' connections are out."""
    locks = await make(pool_size=4)
    admin = await asyncpg.connect(pg_url)
    try:
        for round_ in range(6):
            taken = await locks.try_acquire_many([f"r{round_}-{i}" for i in range(8)], ttl=HELD)
            assert all(lease is not None for lease in taken), round_
            assert locks._bulk is not None
            pids = [holder.pid for holder in locks._bulk._holders]
            assert pids
            for pid in pids:
                await admin.execute("SELECT pg_terminate_backend($1)", pid)
            # The lost holders' leases are gone; the next round opens a fresh holder.
            leases = [lease for lease in taken if lease is not None]
            with pytest.raises(LockNotOwned):
                await locks.release(leases[0])
        leases_pool, _ = locks._pools()
        bulk = locks._bulk
        assert bulk is not None

        def back() -> bool:
            out = leases_pool.get_size() - leases_pool.get_idle_size()
            return out == sum(not holder.dead for holder in bulk._holders)

        await wait_until(back, within=LATE, what="only the live holders' connections out")
    finally:
        await admin.close()
