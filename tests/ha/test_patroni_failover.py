"""PostgreSQL failover under load, on a real Patroni cluster (etcd and two PostgreSQL nodes, started
by the test; see patroni_cluster.py): a switch-over, and the leader killed whole (Patroni,
postmaster and backends, SIGKILL, as if its machine died), with and without Patroni's
``synchronous_mode``.

One engine connects with a libpq multi-host URL listing both nodes and
``target_session_attrs=read-write``; signer tasks fire at four documents, every call with a
request id, and retry a typed failure with the same request id (failover_load.py). Each test
then holds:

- every error a call raised was a typed, retryable flowlock error (never asyncpg's);
- calls resumed on the new primary within a bound, and the engine's connections are to it;
- the checker is clean on every document (versions contiguous, no request applied twice) and,
  where the cluster promises it (a switch-over; a kill with ``synchronous_mode``), every
  acknowledged signature is there; with asynchronous replication the acknowledged signatures
  lost by a kill are counted and reported, which is all that mode promises;
- once the engine is closed its pool is closed and no node shows a session of its
  ``application_name``; once the cluster is stopped none of its processes is left.

The unavailability window (seconds without a successful call) is printed: run with ``-s``.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from failover_load import RETRYABLE, Load, unavailability
from patroni_cluster import TTL, PatroniCluster, missing

import flowlock
import pg_budget
from flowlock import examples
from flowlock.stores.postgres import PostgresStore
from lock_probes import wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.postgres,
    pytest.mark.skipif(missing() is not None, reason=missing() or ""),
    # Two cluster starts and a kill that waits out the leader key's ttl fit well inside it; a
    # loaded machine gets the rest. Past it the cluster is still stopped (finally blocks).
    pytest.mark.timeout(240),
]

QUORUM = 100_000  # never reached: every document stays pending, every signature a transition
DOCS = [f"doc-{i}" for i in range(4)]
WARM = 40  # signatures acknowledged before the fault
AFTER = 40  # ... and after calls resumed
RESUME_BOUND = 60.0  # seconds calls may take to resume after a switch-over
KILL_BOUND = TTL + 60.0  # ... after a kill: the leader key must expire first


@asynccontextmanager
async def cluster_of(*, synchronous: bool) -> AsyncIterator[PatroniCluster]:
    """A started cluster; stopped on the way out, asserting none of its processes is left."""
    cluster = PatroniCluster(synchronous=synchronous)
    await asyncio.to_thread(cluster.start)
    try:
        yield cluster
    finally:
        left = await asyncio.to_thread(cluster.stop)
        assert not left, f"processes of the cluster left running: {sorted(left)}"


@asynccontextmanager
async def engine_on(cluster: PatroniCluster, app: str) -> AsyncIterator[flowlock.Engine]:
    """One engine on every node through the multi-host URL; on the way out, closed, its pool
    closed, and no session named ``app`` left on any live node."""
    engine = flowlock.Engine.connect(
        cluster.url(),
        application_name=app,
        max_size=6,
        connect_timeout=5,
        command_timeout=5,
        lock_timeout=2,
        acquire_timeout=10,
        strategies=[flowlock.Optimistic(max_attempts=20, backoff_cap=0.05)],
    )
    async with engine:
        await engine.register(examples.countersign(QUORUM))
        pool = store_of(engine).pool
        yield engine
    assert pool.is_closing() and pool.get_size() == 0
    for node in cluster.nodes:
        if not node.killed:
            await wait_until(functools.partial(no_sessions, node.url, app), what=f"{app} gone")


def store_of(engine: flowlock.Engine) -> PostgresStore:
    store = engine.store
    assert isinstance(store, PostgresStore)
    return store


async def no_sessions(url: str, app: str) -> bool:
    conn = await pg_budget.connect(url, timeout=10)
    try:
        found = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", app
        )
    finally:
        await conn.close()
    return bool(found == 0)


async def synchronous_standby(cluster: PatroniCluster) -> bool:
    """Whether the leader is replicating synchronously (a commit waits for the standby)."""
    leader = cluster.leader()
    if leader is None:
        return False
    conn = await pg_budget.connect(cluster.node(leader).url, timeout=10)
    try:
        found = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'"
        )
    finally:
        await conn.close()
    return bool(found == 1)


async def primary_port(engine: flowlock.Engine) -> int:
    """The port of the server the engine's pool writes to now."""
    async with store_of(engine).pool.acquire() as conn:
        port = await conn.fetchval("SELECT inet_server_port()")
    assert isinstance(port, int)
    return port


async def under_load(engine: flowlock.Engine) -> Load:
    for doc in DOCS:
        await engine.create("countersign", instance_id=doc)
    load = Load(engine, DOCS)
    load.start()
    await wait_until(lambda: len(load.successes) >= WARM, within=60, what="the warm-up")
    return load


async def resumed(load: Load, since: float, bound: float) -> None:
    """Until ``AFTER`` calls have succeeded since ``since`` (within ``bound`` seconds), then
    stop the load."""
    try:
        await wait_until(
            lambda: load.acks_since(since) >= AFTER, within=bound, what="calls to resume"
        )
        await load.stop()
    except BaseException:
        await load.cancel()
        raise


def report(what: str, load: Load, window: float, lost: int = 0) -> None:
    kinds = sorted({type(e).__name__ for e in load.errors})
    print(
        f"\n{what}: unavailable for {window:.2f} s; {len(load.acked)} signatures acknowledged "
        f"({len(load.replayed)} answered idempotently on retry), {lost} lost; "
        f"{len(load.errors)} typed errors retried: {', '.join(kinds) or 'none'}"
    )


def assert_typed(load: Load) -> None:
    for exc in load.errors:
        assert isinstance(exc, RETRYABLE), repr(exc)
        assert type(exc).__module__.startswith("flowlock."), repr(exc)


async def test_a_switchover_under_load_loses_nothing_and_applies_nothing_twice() -> None:
    """Patroni switches the primary over while twelve signers fire: calls in flight end typed
    (ConnectionLost, or OutcomeUnknown for a write in flight) and, retried with their request
    ids, every signature is applied exactly once; the pool reconnects to the new primary
    (the old one, first in the URL, is now a standby that target_session_attrs refuses)."""
    app = f"flowlock-ha-{uuid.uuid4().hex[:8]}"
    async with cluster_of(synchronous=True) as cluster, engine_on(cluster, app) as engine:
        await wait_until(lambda: synchronous_standby(cluster), within=30, what="sync standby")
        assert await primary_port(engine) == cluster.nodes[0].pg_port
        load = await under_load(engine)
        fault = time.monotonic()
        try:
            old, new = await asyncio.to_thread(cluster.switchover)
        except BaseException:
            await load.cancel()
            raise
        await resumed(load, time.monotonic(), RESUME_BOUND)
        assert (old, new) == ("node0", "node1")
        assert await primary_port(engine) == cluster.node(new).pg_port
        window = unavailability(load.successes, fault)
        assert_typed(load)
        await load.verify(lossless=True)
        report("switch-over", load, window)
        # The old primary back as a standby, so that the leak check below can look at it too.
        await asyncio.to_thread(cluster.wait_healthy, RESUME_BOUND)


@pytest.mark.parametrize(
    "synchronous", [True, False], ids=["synchronous-mode", "asynchronous-replication"]
)
async def test_the_leader_killed_under_load(synchronous: bool) -> None:
    """The leader's machine dies under load (Patroni and PostgreSQL killed at once): calls end
    typed while there is no primary, until the leader key expires (ttl) and Patroni promotes
    the standby; the engine then writes to it through the same URL. The checker is clean. With
    synchronous_mode no acknowledged signature is lost (each commit waited for the standby); with
    asynchronous replication the acknowledged signatures lost are counted, not asserted."""
    app = f"flowlock-ha-{uuid.uuid4().hex[:8]}"
    async with cluster_of(synchronous=synchronous) as cluster, engine_on(cluster, app) as engine:
        if synchronous:
            await wait_until(lambda: synchronous_standby(cluster), within=30, what="sync standby")
        leader = cluster.leader()
        assert leader is not None
        load = await under_load(engine)
        fault = time.monotonic()
        try:
            await asyncio.to_thread(cluster.kill, leader)
            new = await asyncio.to_thread(cluster.leader_within, KILL_BOUND, not_name=leader)
        except BaseException:
            await load.cancel()
            raise
        await resumed(load, time.monotonic(), KILL_BOUND)
        assert await primary_port(engine) == cluster.node(new).pg_port
        window = unavailability(load.successes, fault)
        assert_typed(load)
        lost = await load.verify(lossless=synchronous)
        what = "kill, synchronous_mode" if synchronous else "kill, asynchronous"
        report(what, load, window, len(lost))
