"""The Redis lock backend through a Redis Sentinel failover and a Redis Cluster node's death,
under load from the engine's distributed strategy on PostgreSQL.

Every server is this module's own, on 127.0.0.1 ephemeral ports (``flowlock.embedded.
redis_ha``): a primary with two replicas watched by three sentinels, and a cluster of three
primaries with a replica each. Each test stops every process and removes every directory,
whatever happens.

What a failover may cost: leases acknowledged by the dead primary but not yet replicated are
lost, and calls fail while the new primary is chosen. What it must not cost, and is asserted:
an error that is not one of flowlock's lock errors; a call stuck past its bound; a fencing token
handed out twice or going down (a new epoch is taken on the new primary, see
``flowlock.locks.redis.fence``); a stale holder's write accepted; a transition applied twice or
lost (the checker); a lease or a connection left behind; calls still failing once the new
primary is up. The unavailability window (seconds without a successful call) is printed
(``pytest -s``).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import redis

import flowlock
from flowlock import examples
from flowlock.checker import check
from flowlock.embedded import EmbeddedRedis
from flowlock.engine import connect
from flowlock.locks.base import Lease
from flowlock.locks.redis import RedisLocks
from flowlock.stores.postgres import PostgresStore
from flowlock_lab.redis_ha import (
    EmbeddedRedisCluster,
    EmbeddedRedisSentinel,
    redis_cli,
    sentinel_command,
)
from flowlock_lab.unavailability import Availability
from lock_probes import Sleepers, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

CLIENT = "flowlock-ha-test"  # the client name of every connection the tests' engines open
TTL = 2.0  # the leases' ttl: a lease whose release failed is gone this long after
WAIT = 3.0  # how long a call waits for a lease
SOCKET_TIMEOUT = 2.0  # RedisLocks' default bound on one Redis call
LATE = 10.0  # how far past its bound a call may end on a loaded two-core machine
RECOVERY = 30.0  # the bound on calls succeeding again after the fault
TYPED = (flowlock.LockUnavailable, flowlock.LockLost, flowlock.LockTimeout, flowlock.LockBusy)


def _need(tool: object, what: str) -> None:
    if tool is None:
        pytest.skip(f"{what} is not installed (apt-get install redis-server redis-tools)")


@pytest.fixture
def sentinel() -> Iterator[EmbeddedRedisSentinel]:
    """A primary, two replicas and three sentinels of this test's own."""
    _need(sentinel_command(), "redis-sentinel / redis-server")
    with EmbeddedRedisSentinel(replicas=2, sentinels=3, down_after=1.0) as ha:
        yield ha


@pytest.fixture
def cluster() -> Iterator[EmbeddedRedisCluster]:
    """Three primaries with a replica each, of this test's own."""
    _need(EmbeddedRedis.find_executable(), "redis-server")
    _need(redis_cli(), "redis-cli")
    with EmbeddedRedisCluster(primaries=3, replicas=1, node_timeout=1.0) as ha:
        yield ha


# --- the load ---------------------------------------------------------------------------------


@dataclass
class Load:
    """What the callers saw: per instance, the request ids applied; every error; how long each
    call took; when calls succeeded (for the unavailability window)."""

    applied: dict[str, int] = field(default_factory=Counter)
    errors: list[BaseException] = field(default_factory=list)
    longest: float = 0.0
    calls: int = 0
    seen: Availability = field(default_factory=Availability)
    # The instances whose keys live on the server killed (in a cluster, the others' calls go
    # on meanwhile), and what their calls saw.
    hit: frozenset[str] = frozenset()
    hit_seen: Availability = field(default_factory=Availability)


async def _caller(
    engine: flowlock.Engine, instances: list[str], load: Load, stop: asyncio.Event, seed: int
) -> None:
    """Until ``stop``: a transition on an instance, fired by two callers at once with one
    request id (the storm: one applies it, the other is answered idempotent)."""
    rng = random.Random(seed)
    for n in itertools.count():
        if stop.is_set():
            return
        iid = rng.choice(instances)
        request = f"{seed}-{n}"

        async def fire(iid: str = iid, request: str = request) -> None:
            began = time.monotonic()
            try:
                outcome = await engine.fire(
                    iid, "reserve", request_id=request, strategy="distributed"
                )
            except TYPED as exc:
                load.errors.append(exc)
            except Exception as exc:  # asserted on below: no other kind may escape
                load.errors.append(exc)
            else:
                if outcome.applied:
                    # Applied: it took a lease. (An idempotent answer may come from the
                    # database alone, and would end the window while Redis is still down.)
                    load.seen.ok(began)
                    if iid in load.hit:
                        load.hit_seen.ok(began)
                    load.applied[iid] += 1
            finally:
                load.calls += 1
                load.longest = max(load.longest, time.monotonic() - began)

        await asyncio.gather(fire(), fire())
        if load.errors and isinstance(load.errors[-1], flowlock.LockUnavailable):
            await asyncio.sleep(0.01)  # no hot loop against a Redis that is down


async def _under_load(
    engine: flowlock.Engine,
    instances: list[str],
    fault: Any,
    *,
    hit: frozenset[str] | None = None,
    callers: int = 12,
) -> Load:
    """Run the load, cause ``fault()`` (in a thread) once calls succeed, and go on until calls
    on the instances ``hit`` (all, by default) have succeeded again, and a second more."""
    load = Load(hit=frozenset(instances) if hit is None else hit)
    stop = asyncio.Event()
    tasks = [
        asyncio.create_task(_caller(engine, instances, load, stop, seed)) for seed in range(callers)
    ]
    try:
        await wait_until(lambda: load.seen.successes >= 50, within=30, what="50 calls")
        await asyncio.to_thread(fault)
        # Marked once the server is dead: a call that began before may still have taken its
        # lease from it, and would end the window early.
        load.seen.fault()
        load.hit_seen.fault()
        await wait_until(load.hit_seen.recovered, within=RECOVERY, what="calls succeeding again")
        await asyncio.sleep(1.0)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    return load


def _assert_calls(load: Load, what: str) -> None:
    untyped = [e for e in load.errors if not isinstance(e, TYPED)]
    assert not untyped, untyped[:5]
    kinds = Counter(type(e).__name__ for e in load.errors)
    window, hit = load.seen.window(), load.hit_seen.window()
    print(
        f"\n{what}: {load.calls} calls, {sum(load.applied.values())} applied, errors {dict(kinds)}"
        f", no call applied for {window:.2f} s, none on the failed server's keys for {hit:.2f} s"
        f", longest call {load.longest:.2f} s"
    )
    assert hit < RECOVERY
    # No call outlived its bounds: the lease wait, then a Redis call's bound for the attempt and
    # for the release, the PostgreSQL round trips (quick here), with room for a loaded machine.
    assert load.longest < WAIT + 2 * SOCKET_TIMEOUT + LATE, load.longest


async def _assert_history(engine: flowlock.Engine, load: Load, instances: list[str]) -> int:
    """The checker is clean for every instance, each applied call is one row, and the fencing
    tokens strictly increase (one lease per row: batching is off). The highest token seen."""
    top = 0
    for iid in instances:
        history = await engine.history(iid)
        verdict = check(await engine.get(iid), history, expected_applied=load.applied[iid])
        assert verdict.ok, (iid, verdict.violations)
        tokens = [h.fencing_token or 0 for h in history]
        assert all(h.fencing_token is not None for h in history), iid
        assert tokens == sorted(set(tokens)), (iid, tokens)  # never repeated, never going down
        top = max(top, *tokens, 0)
    return top


async def _assert_stale_write_refused(engine: flowlock.Engine, iid: str) -> None:
    """A write at the current version with a token from before the failover is refused: the
    database's fencing holds whatever Redis lost."""
    history = await engine.history(iid)
    first, last = history[0], history[-1]
    assert first.fencing_token is not None and last.fencing_token is not None
    assert first.fencing_token < last.fencing_token
    stale = replace(
        last, version=last.version + 1, request_id=f"stale-{uuid.uuid4().hex}",
        fencing_token=first.fencing_token, data={**last.data, "stock": -1},
    )  # fmt: skip
    assert await engine.store.commit((stale,)) is None
    assert await engine.history(iid) == history


def _leases(ports: list[int], namespace: str) -> list[str]:
    """The lock keys of ``namespace`` on the servers on ``ports`` (fencing counters aside)."""
    found: list[str] = []
    for port in ports:
        with redis.Redis(port=port, decode_responses=True, socket_timeout=2) as client:
            found += [k for k in client.scan_iter(match=f"flowlock:{namespace}:*}}") if k]
    return found


def _connections(ports: list[int]) -> list[str]:
    """The connections named CLIENT on the servers (and sentinels) on ``ports``."""
    found = []
    for port in ports:
        with redis.Redis(port=port, decode_responses=True, socket_timeout=2) as client:
            found += [f"{port}: {c}" for c in client.client_list() if c.get("name") == CLIENT]
    return found


async def _assert_woken_by_release(locks: RedisLocks, monkeypatch: pytest.MonkeyPatch) -> None:
    """After the fault, the pub/sub subscription is back and a waiter is woken by a release
    (the holder's ttl and the waiter's bound are 30 s away)."""
    await wait_until(lambda: locks.listening, within=RECOVERY, what="the subscription")
    sleepers = Sleepers(monkeypatch)
    holder = await locks.acquire("wake", ttl=30)

    async def take() -> Lease:
        return await locks.acquire("wake", ttl=30, wait=30)

    waiter = asyncio.create_task(take())
    await sleepers.settled(1, waiter)
    await locks.release(holder)
    await locks.release(await asyncio.wait_for(waiter, LATE))


@dataclass
class Setup:
    engine: flowlock.Engine
    locks: RedisLocks
    instances: list[str]
    namespace: str


@pytest.fixture
async def opened(request: pytest.FixtureRequest, pg_url: str, pg_schema: str) -> AsyncIterator[Any]:
    """Opens an engine on a Redis URL (batching off: one lease per history row), with
    instances of stock enough for the whole test; closes it at the end."""
    engines: list[flowlock.Engine] = []

    async def make(redis_url: str, count: int) -> Setup:
        namespace = f"t_{uuid.uuid4().hex[:8]}"
        engine = connect(
            pg_url, redis_url=f"{redis_url}?client_name={CLIENT}", schema=pg_schema,
            namespace=namespace, batching=False, max_size=30,
            strategies=[flowlock.Distributed(ttl=TTL, wait=WAIT)],
        )  # fmt: skip
        engines.append(engine)
        await engine.open()
        await engine.register(examples.inventory())
        instances = [f"sku-{n}" for n in range(count)]
        for iid in instances:
            await engine.create("inventory", instance_id=iid, data={"stock": 10**6})
        assert isinstance(engine.locks, RedisLocks)
        return Setup(engine, engine.locks, instances, namespace)

    yield make
    for engine in engines:
        await engine.aclose()


# --- Sentinel ---------------------------------------------------------------------------------


async def test_sentinel_failover_under_load(
    sentinel: EmbeddedRedisSentinel, opened: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The primary SIGKILLed while leases are held under load: calls fail typed or succeed,
    succeed again through the new primary, the checker is clean, tokens strictly increase per
    instance, a stale token's write is refused, and nothing is left held or connected."""
    setup: Setup = await opened(sentinel.url, 12)
    old = sentinel.primary_port()
    load = await _under_load(setup.engine, setup.instances, sentinel.kill_primary)
    new = await asyncio.to_thread(sentinel.wait_failover, old)
    assert new.port != old
    _assert_calls(load, "Sentinel failover")
    await _assert_woken_by_release(setup.locks, monkeypatch)
    await _assert_history(setup.engine, load, setup.instances)
    await _assert_stale_write_refused(setup.engine, setup.instances[0])

    await setup.engine.aclose()
    servers = [s.port for s in sentinel.servers if s.running]
    await wait_until(
        lambda: not _leases(servers, setup.namespace), within=TTL + LATE, what="no lease held"
    )
    assert not _connections([*servers, *sentinel.sentinel_ports])


async def test_a_lease_lost_in_a_sentinel_failover_is_never_handed_out_again(
    sentinel: EmbeddedRedisSentinel, pg_url: str, pg_schema: str
) -> None:
    """A lease whose fencing counter never reached a replica (the replicas' links cut just
    before it was taken, the primary killed just after): the promoted replica's counter is
    behind it, yet the next lease on the key gets a token above it (the counter's stamp is the
    dead primary's, so a new epoch is taken), and the lost lease is no one's."""
    store = PostgresStore(pg_url, schema=pg_schema, pool_size=4)
    await store.open()
    try:
        locks = RedisLocks(sentinel.url, namespace="lost", fence_epochs=store.fence_epochs)
        async with locks:
            for _ in range(3):
                await locks.release(await locks.acquire("k", ttl=30))
            primary = sentinel.primary
            replicas = [s for s in sentinel.servers if s.running and s is not primary]
            # Replicas frozen, their links cut: the next write reaches no replica.
            for replica in replicas:
                replica.pause()
            try:
                with redis.Redis(port=primary.port) as admin:
                    admin.execute_command("CLIENT", "KILL", "TYPE", "replica")
                lost = await locks.acquire("k", ttl=30)
                primary.kill()
            finally:
                for replica in replicas:
                    replica.resume()
            await asyncio.to_thread(sentinel.wait_failover, primary.port)
            with redis.Redis(port=sentinel.primary.port, decode_responses=True) as admin:
                behind = int(admin.get(locks.fence_key("k")) or 0)
            assert behind < lost.fencing  # the new primary never saw the lost lease's token

            async def next_lease() -> Lease | None:
                try:
                    return await locks.acquire("k", ttl=30)
                except flowlock.LockUnavailable:
                    return None  # connections to the dead primary still being dropped

            fresh = None
            deadline = time.monotonic() + RECOVERY
            while fresh is None and time.monotonic() < deadline:
                fresh = await next_lease()
            assert fresh is not None
            assert fresh.fencing > lost.fencing, (fresh.fencing, lost.fencing)
            assert not await locks.owned(lost)
            with pytest.raises(flowlock.LockNotOwned):
                await locks.extend(lost)
            await locks.release(fresh)
    finally:
        await store.aclose()


# --- Cluster ----------------------------------------------------------------------------------


async def test_cluster_primary_killed_under_load(
    cluster: EmbeddedRedisCluster, opened: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One of three primaries SIGKILLed under load on instances spread over every primary: its
    replica takes over, calls fail typed or succeed and succeed again, the checker is clean,
    tokens strictly increase per instance, a stale write is refused, and nothing is left held
    or connected."""
    setup: Setup = await opened(cluster.url, 24)
    slots = _slots_by_port(cluster)
    owners = Counter(_owner(slots, setup.locks.redis_key(iid)) for iid in setup.instances)
    assert len(owners) == 3, owners  # the instances live on every primary
    victim = next(s for s in cluster.primaries() if owners[s.port])
    hit = frozenset(
        i for i in setup.instances if _owner(slots, setup.locks.redis_key(i)) == victim.port
    )
    load = await _under_load(setup.engine, setup.instances, lambda: cluster.kill(victim), hit=hit)
    await asyncio.to_thread(cluster.wait_failover, victim.port)
    _assert_calls(load, "Cluster primary killed")
    await _assert_woken_by_release(setup.locks, monkeypatch)
    await _assert_history(setup.engine, load, setup.instances)
    # The hit instance written most often: one whose history spans leases from before and
    # after the failover (a quieter one may hold a single entry, or one batch under one lease).
    lengths = {iid: len(await setup.engine.history(iid)) for iid in sorted(hit)}
    await _assert_stale_write_refused(setup.engine, max(lengths, key=lengths.__getitem__))

    await setup.engine.aclose()
    running = [s.port for s in cluster.servers if s.running]
    await wait_until(
        lambda: not _leases(running, setup.namespace), within=TTL + LATE, what="no lease held"
    )
    assert not _connections(running)


def _slots_by_port(cluster: EmbeddedRedisCluster) -> dict[int, int]:
    """The port of the primary owning each slot, now."""
    owners: dict[int, int] = {}
    port = cluster.primaries()[0].port
    with redis.Redis(port=port, decode_responses=True) as admin:
        for start, end, primary, *_ in admin.execute_command("CLUSTER", "SLOTS"):
            for slot in range(int(start), int(end) + 1):
                owners[slot] = int(primary[1])
    return owners


def _owner(slots: dict[int, int], key: str) -> int:
    from redis.crc import key_slot

    return slots[key_slot(key.encode())]
