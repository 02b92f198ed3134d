"""The README's promises that no other test holds, each tested as a user would meet it.

- ``Engine.connect`` with a ``postgresql://`` URL (the README's example, run on PostgreSQL),
  ``pool_size`` (connections under load never above it), ``schema`` (tables there, not in
  ``public``), ``redis_url=`` and ``locks="advisory"`` (the distributed step leases from Redis /
  holds a PostgreSQL advisory lock while it runs);
- ``request_id`` unique per instance, not per engine;
- the metrics ``flowlock_conflicts_total``, ``flowlock_lock_hold_seconds``,
  ``flowlock_escalations_total``, ``flowlock_deescalations_total`` and
  ``flowlock_leases_lost_total``, each compared before and after a scenario that causes it;
- adaptive escalating to pessimistic or distributed, and stepping back down;
- the escalation, step-down and lost-lease log lines on the ``flowlock`` logger;
- a distributed transition that takes longer than its lease's ttl, kept alive by renewal.

Slowing a transition down: guards and effects are pure and synchronous, and the distributed
strategy runs them on the event loop, where a blocking sleep would also stop the lease's
watchdog. What takes time in a real transition is its I/O, so the tests hold back the store's
read or commit (:class:`GatedStore`), or the database row, until the test has seen what it
checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis.asyncio

import flowlock
import pg_budget
from flowlock import examples
from flowlock.checker import check, check_many
from flowlock.core.models import HistoryEntry, Instance, Snapshot
from flowlock.locks import MemoryLocks
from flowlock.locks.advisory import AdvisoryLocks, advisory_lock_id
from flowlock.locks.base import LockBackend
from flowlock.locks.redis import RedisLocks
from flowlock.metrics import Metrics
from flowlock.stores import MemoryStore
from flowlock.stores.base import entries_of
from flowlock.stores.postgres import PostgresStore
from flowlock.strategies.monitor import ConflictMonitor

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


# -- helpers ---------------------------------------------------------------------------------


async def wait_until(
    cond: Callable[[], bool | Awaitable[bool]], what: str, within: float = 10.0
) -> None:
    """Poll ``cond`` until it is true; fail naming ``what`` after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        got = cond()
        if not isinstance(got, bool):
            got = await got
        if got:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"not within {within} s: {what}")
        await asyncio.sleep(0.02)


def sample(metrics: Metrics, name: str, labels: dict[str, str] | None = None) -> float:
    """A sample's value, 0.0 while the labelled series does not exist yet."""
    value = metrics.registry.get_sample_value(name, labels or {})
    return 0.0 if value is None else value


class Gate:
    """Holds one store call back: ``entered`` is set when the call arrives, and the call goes on
    once ``release`` is set."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def pass_through(self) -> None:
        self.entered.set()
        await self.release.wait()


class GatedStore(MemoryStore):
    """The memory store, whose next ``read`` or ``commit`` can be held back by a :class:`Gate`
    (a slow database, as far as the strategy can tell)."""

    def __init__(self) -> None:
        super().__init__()
        self._gates: dict[str, Gate] = {}

    def hold(self, call: str) -> Gate:
        gate = self._gates[call] = Gate()
        return gate

    async def read(self, instance_id: str, request_ids: Sequence[str]) -> Snapshot:
        gate = self._gates.pop("read", None)
        if gate is not None:
            await gate.pass_through()
        return await super().read(instance_id, request_ids)

    async def commit(self, entries: Sequence[HistoryEntry]) -> Instance | None:
        gate = self._gates.pop("commit", None)
        if gate is not None:
            await gate.pass_through()
        return await super().commit(entries)


class ContendedStore(MemoryStore):
    """The memory store with a rival: while ``rivals`` is above zero, each compare-and-swap is
    preceded by a real ``restock`` of the same instance through another engine on this store,
    so the compare-and-swap finds the version moved and loses (a deterministic conflict)."""

    def __init__(self) -> None:
        super().__init__()
        self.rivals = 0
        self.rival: flowlock.Engine | None = None
        self._in_rival = False

    async def commit(self, entries: Sequence[HistoryEntry]) -> Instance | None:
        if self.rivals > 0 and not self._in_rival and self.rival is not None:
            self.rivals -= 1
            self._in_rival = True
            try:
                instance_id = entries_of(entries)[0].instance_id
                await self.rival.fire(instance_id, "restock", strategy="optimistic")
            finally:
                self._in_rival = False
        return await super().commit(entries)


@contextlib.asynccontextmanager
async def contended(**options: Any) -> AsyncIterator[tuple[flowlock.Engine, ContendedStore]]:
    """An engine on a :class:`ContendedStore` (inventory registered) and its rival engine."""
    store = ContendedStore()
    async with contextlib.AsyncExitStack() as stack:
        rival = await stack.enter_async_context(flowlock.Engine(store))
        await rival.register(examples.inventory())
        store.rival = rival
        engine = await stack.enter_async_context(flowlock.Engine(store, **options))
        await engine.register(examples.inventory())
        yield engine, store


@pytest.fixture
async def fresh_db(pg_url: str) -> AsyncIterator[str]:
    """The URL of a database created for this test (nothing else connects to it), dropped
    afterwards: what it holds and which connections reach it are this test's alone."""
    name = f"flowlock_t_{uuid.uuid4().hex[:12]}"
    admin = await pg_budget.connect(pg_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}" TEMPLATE template0')
    finally:
        await admin.close()
    parts = urlsplit(pg_url)
    yield urlunsplit(parts._replace(path=f"/{name}"))
    admin = await pg_budget.connect(pg_url)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


async def count_rows(url: str, sql: str, *args: Any) -> int:
    conn = await pg_budget.connect(url)
    try:
        found = await conn.fetchval(sql, *args)
    finally:
        await conn.close()
    return int(found)


# -- Engine.connect on PostgreSQL: the URL, pool_size, schema --------------------------------


async def test_the_readme_example_runs_on_a_postgresql_url(fresh_db: str, tmp_path: Path) -> None:
    """ "Any postgresql://user@host/db URL works the same way": the README's example with its
    SQLite URL replaced by a PostgreSQL one runs as written, prints the refusal, and leaves
    req-1 approved (version 2, one history row) in that database's public schema."""
    code = re.search(r"```python\n(.*?)```", README, re.S)
    assert code is not None
    example = code.group(1)
    assert 'f"sqlite:///{directory}/demo.db"' in example
    example = example.replace('f"sqlite:///{directory}/demo.db"', repr(fresh_db))
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        example,
        cwd=tmp_path,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONWARNINGS": "error"},
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert out.decode().strip() == "approved ()"
    conn = await pg_budget.connect(fresh_db)
    try:
        row = await conn.fetchrow(
            "SELECT state, version FROM public.flowlock_instances WHERE id = 'req-1'"
        )
        rows = await conn.fetchval(
            "SELECT count(*) FROM public.flowlock_history WHERE instance_id = 'req-1'"
        )
    finally:
        await conn.close()
    assert row is not None and (row["state"], row["version"]) == ("approved", 2)
    assert rows == 1
    assert not await asyncio.to_thread(os.listdir, tmp_path)  # nothing went to SQLite


async def test_pool_size_bounds_the_engines_connections_under_load(fresh_db: str) -> None:
    """Engine.connect(url, pool_size=4): twelve pessimistic callers queued behind a held row
    lock fill the pool (four connections waiting on the lock) and never open a fifth; once the
    row is free all twelve apply, exactly once each. Batching is off: with it on, calls on one
    instance queue in the engine behind one transaction and would never ask for a second
    connection, so nothing would press on the bound."""
    pool_size, callers = 4, 12
    async with flowlock.Engine.connect(fresh_db, max_size=pool_size, batching=False) as engine:
        assert isinstance(engine.store, PostgresStore)
        assert engine.store.pool.get_max_size() == pool_size
        await engine.register(examples.inventory())
        await engine.create("inventory", instance_id="sku-1", data={"stock": callers})

        watcher = await pg_budget.connect(fresh_db)
        holder = await pg_budget.connect(fresh_db)
        seen: list[tuple[int, int]] = []

        async def connections() -> tuple[int, int]:
            # (open, waiting for a lock): the engine's connections to this test's database.
            row = await watcher.fetchrow(
                "SELECT count(*) AS open, count(*) FILTER (WHERE wait_event_type = 'Lock')"
                " AS waiting FROM pg_stat_activity"
                " WHERE datname = current_database() AND application_name = 'flowlock'"
            )
            assert row is not None
            seen.append((row["open"], row["waiting"]))
            return seen[-1]

        async def saturated() -> bool:
            return await connections() == (pool_size, pool_size)

        try:
            tx = holder.transaction()
            await tx.start()
            await holder.execute("SELECT 1 FROM flowlock_instances WHERE id = 'sku-1' FOR UPDATE")
            slow = flowlock.Pessimistic(lock_timeout=60)
            calls = [
                asyncio.create_task(engine.fire("sku-1", "reserve", strategy=slow))
                for _ in range(callers)
            ]
            await wait_until(saturated, "every pooled connection waiting on the row lock")
            for _ in range(10):  # the queued callers do not get a fifth connection
                await connections()
            assert not any(c.done() for c in calls)
            await tx.rollback()
            while not all(c.done() for c in calls):
                await connections()
            outcomes = await asyncio.gather(*calls)
        finally:
            await holder.close()
            await watcher.close()
        assert max(opened for opened, _ in seen) == pool_size, seen
        assert all(o.applied for o in outcomes)
        final = await engine.get("sku-1")
        assert final.data == {"stock": 0, "reserved": callers}
        history = await engine.history("sku-1")
        assert check(final, history, expected_applied=callers)
    rows = await count_rows(
        fresh_db, "SELECT count(*) FROM flowlock_history WHERE instance_id = 'sku-1'"
    )
    assert rows == callers and final.version == callers + 1


async def test_schema_puts_every_table_in_that_schema(fresh_db: str) -> None:
    """Engine.connect(url, schema="flowlock_app") creates the schema and every flowlock table
    in it, none in public, and its instances and history live there."""
    async with flowlock.Engine.connect(fresh_db, schema="flowlock_app") as engine:
        await engine.register(examples.approval())
        await engine.create("approval", instance_id="req-1")
        await engine.fire("req-1", "approve")
    conn = await pg_budget.connect(fresh_db)
    try:
        tables = await conn.fetch(
            "SELECT table_schema, table_name FROM information_schema.tables"
            " WHERE table_name LIKE 'flowlock%'"
        )
        state = await conn.fetchval(
            "SELECT state FROM flowlock_app.flowlock_instances WHERE id = 'req-1'"
        )
        rows = await conn.fetchval("SELECT count(*) FROM flowlock_app.flowlock_history")
    finally:
        await conn.close()
    by_schema = {(r["table_schema"], r["table_name"]) for r in tables}
    assert {s for s, _ in by_schema} == {"flowlock_app"}, by_schema
    assert {t for _, t in by_schema} >= {
        "flowlock_instances",
        "flowlock_history",
        "flowlock_schema_migrations",
        "flowlock_fences",
        "flowlock_escalations",
    }
    assert state == "approved" and rows == 1


# -- Engine.connect's lock backends: redis_url= and locks="advisory" --------------------------


@contextlib.asynccontextmanager
async def row_held(url: str, schema: str, instance_id: str) -> AsyncIterator[None]:
    """The instance's row locked FOR UPDATE by another connection until the block ends: a
    transition's compare-and-swap waits for it (the unlocked read does not)."""
    conn = await pg_budget.connect(url, server_settings={"search_path": schema})
    try:
        async with conn.transaction():
            await conn.execute(
                "SELECT 1 FROM flowlock_instances WHERE id = $1 FOR UPDATE", instance_id
            )
            yield
    finally:
        await conn.close()


async def test_redis_url_leases_the_distributed_step_from_redis(
    pg_url: str,
    pg_schema: str,
    redis_url: str,
    redis_namespace: str,
    sql_history: Callable[..., Awaitable[Any]],
) -> None:
    """Engine.connect(url, redis_url=...): while a distributed transition runs, its lease is a
    key in Redis under the namespace (flowlock:<ns>:{<instance>}); the transition is written
    with the fencing token Redis counted for that key, and the key is gone once it returns."""
    key = f"flowlock:{redis_namespace}:{{req-1}}"
    client = redis.asyncio.from_url(redis_url)

    async def leased() -> bool:
        return bool(await client.exists(key))

    engine = flowlock.Engine.connect(
        pg_url, schema=pg_schema, redis_url=redis_url, namespace=redis_namespace
    )
    try:
        async with engine:
            assert isinstance(engine.locks, RedisLocks)
            await engine.register(examples.approval())
            await engine.create("approval", instance_id="req-1")
            async with row_held(pg_url, pg_schema, "req-1"):
                call = asyncio.create_task(engine.fire("req-1", "approve", strategy="distributed"))
                await wait_until(leased, f"the lease key {key} in Redis")
                owner = await client.get(key)
                assert owner is not None and len(owner) == 32  # a 128-bit token, in hex
                assert not call.done()
            outcome = await call
            fence = await client.get(key + ":fence")
            assert not await client.exists(key)
            history = await engine.history("req-1")
    finally:
        await client.aclose()
    assert outcome.applied and outcome.strategy == "distributed"
    assert fence is not None and [h.fencing_token for h in history] == [int(fence)]
    assert check(outcome.instance, history, expected_applied=1)
    (await sql_history()).assert_matches({"req-1": history})


async def test_advisory_locks_hold_a_postgresql_advisory_lock_while_the_step_runs(
    pg_url: str, pg_schema: str, sql_history: Callable[..., Awaitable[Any]]
) -> None:
    """Engine.connect(url, locks="advisory"): while a distributed transition runs, the
    instance's advisory lock is granted in pg_locks to a flowlock-advisory session; the
    transition is written with the fencing token recorded in flowlock_fences, and the lock is
    gone once it returns."""
    number = advisory_lock_id(pg_schema, "default", "req-1") & 0xFFFF_FFFF_FFFF_FFFF
    classid, objid = number >> 32, number & 0xFFFF_FFFF
    watcher = await pg_budget.connect(pg_url)

    async def holders() -> list[str]:
        rows = await watcher.fetch(
            "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
            " WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1"
            " AND l.classid = $1::bigint::oid AND l.objid = $2::bigint::oid",
            classid,
            objid,
        )
        return [r["application_name"] for r in rows]

    async def held() -> bool:
        return bool(await holders())

    try:
        async with flowlock.Engine.connect(pg_url, schema=pg_schema, locks="advisory") as engine:
            assert isinstance(engine.locks, AdvisoryLocks)
            await engine.register(examples.approval())
            await engine.create("approval", instance_id="req-1")
            async with row_held(pg_url, pg_schema, "req-1"):
                call = asyncio.create_task(engine.fire("req-1", "approve", strategy="distributed"))
                await wait_until(held, "the instance's advisory lock in pg_locks")
                assert await holders() == ["flowlock-advisory"]
                assert not call.done()
            outcome = await call
            assert await holders() == []
            history = await engine.history("req-1")
        fence = await watcher.fetchval(
            f'SELECT token FROM "{pg_schema}".flowlock_fences WHERE key = $1', "req-1"
        )
    finally:
        await watcher.close()
    assert outcome.applied and outcome.strategy == "distributed"
    assert [h.fencing_token for h in history] == [fence]
    assert check(outcome.instance, history, expected_applied=1)
    (await sql_history()).assert_matches({"req-1": history})


# -- request_id ------------------------------------------------------------------------------


async def test_a_request_id_is_unique_per_instance(
    engine: flowlock.Engine, request: pytest.FixtureRequest
) -> None:
    """The same request_id fired at two instances at once applies on both; fired again at
    either it answers idempotent with the first outcome's version, and each instance holds
    exactly one history row for it."""
    for iid in ("order-a", "order-b"):
        await engine.create("approval", instance_id=iid)
    first = await asyncio.gather(
        *(engine.fire(iid, "approve", request_id="http-7f3a") for iid in ("order-a", "order-b"))
    )
    assert [(o.applied, o.instance.id, o.instance.version) for o in first] == [
        (True, "order-a", 2),
        (True, "order-b", 2),
    ]
    again = await asyncio.gather(
        *(engine.fire(iid, "approve", request_id="http-7f3a") for iid in ("order-a", "order-b"))
    )
    assert [(o.idempotent, o.instance.id, o.instance.version) for o in again] == [
        (True, "order-a", 2),
        (True, "order-b", 2),
    ]
    histories = {iid: await engine.history(iid) for iid in ("order-a", "order-b")}
    for entries in histories.values():
        assert [h.request_id for h in entries] == ["http-7f3a"]
    pairs = [(await engine.get(iid), entries) for iid, entries in histories.items()]
    assert check_many(pairs, expected_applied=1)
    if isinstance(engine.store, PostgresStore):
        counted = await request.getfixturevalue("sql_history")()
        counted.assert_matches(histories)
        assert counted.per_request == {("order-a", "http-7f3a"): 1, ("order-b", "http-7f3a"): 1}


# -- metrics and log lines -------------------------------------------------------------------


async def test_conflicts_total_counts_every_lost_compare_and_swap() -> None:
    """flowlock_conflicts_total{workflow,strategy} grows by one for a call that lost one
    compare-and-swap and then applied (attempts 2), and by two for a call that lost both of
    its two attempts (ConflictRetriesExhausted); no series carries the instance id."""
    metrics = Metrics()
    labels = {"workflow": "inventory", "strategy": "optimistic"}
    retrying = flowlock.Optimistic(max_attempts=2, backoff_cap=0.0)
    async with contended(metrics=metrics, strategies=[retrying]) as (engine, store):
        await engine.create("inventory", instance_id="sku-1", data={"stock": 5})
        before = sample(metrics, "flowlock_conflicts_total", labels)
        store.rivals = 1
        # Named: the inventory example's own strategy is pessimistic.
        won = await engine.fire("sku-1", "reserve", strategy="optimistic")
        assert (won.applied, won.attempts) == (True, 2)
        assert sample(metrics, "flowlock_conflicts_total", labels) == before + 1
        store.rivals = 2
        with pytest.raises(flowlock.ConflictRetriesExhausted):
            await engine.fire("sku-1", "reserve", strategy="optimistic")
        assert sample(metrics, "flowlock_conflicts_total", labels) == before + 3
        final, history = await engine.get("sku-1"), await engine.history("sku-1")
        series = [one for family in metrics.registry.collect() for one in family.samples]
    # No instance id as a label: one time series per instance would grow without bound.
    assert series and not [x for x in series if "sku-1" in x.labels.values()]
    # Three rival restocks and one reserve: stock 5 + 3 - 1.
    assert [h.event for h in history] == ["restock", "reserve", "restock", "restock"]
    assert final.data == {"stock": 7, "reserved": 1}
    assert check(final, history)


async def test_lock_hold_seconds_records_how_long_the_lease_was_held() -> None:
    """flowlock_lock_hold_seconds{strategy="distributed"} gains one observation per
    distributed call, at least as long as the test kept that call's commit waiting under the
    lease; a pessimistic call adds one observation under its own label."""
    metrics, store = Metrics(), GatedStore()
    dist = {"strategy": "distributed"}
    pess = {"strategy": "pessimistic"}
    async with flowlock.Engine(store, locks=MemoryLocks(), metrics=metrics) as engine:
        await engine.register(examples.approval())
        for iid in ("req-1", "req-2"):
            await engine.create("approval", instance_id=iid)
        count, total = (
            sample(metrics, "flowlock_lock_hold_seconds_count", dist),
            sample(metrics, "flowlock_lock_hold_seconds_sum", dist),
        )
        pess_count = sample(metrics, "flowlock_lock_hold_seconds_count", pess)
        gate = store.hold("commit")
        call = asyncio.create_task(engine.fire("req-1", "approve", strategy="distributed"))
        await asyncio.wait_for(gate.entered.wait(), 10)
        held_from = time.monotonic()
        await asyncio.sleep(0.3)  # how long the lease is held: a duration, not an ordering
        held_for = time.monotonic() - held_from
        gate.release.set()
        outcome = await call
        assert outcome.applied
        assert sample(metrics, "flowlock_lock_hold_seconds_count", dist) == count + 1
        assert sample(metrics, "flowlock_lock_hold_seconds_sum", dist) - total >= held_for
        await engine.fire("req-2", "approve", strategy="pessimistic")
        assert sample(metrics, "flowlock_lock_hold_seconds_count", pess) == pess_count + 1
        assert sample(metrics, "flowlock_lock_hold_seconds_count", dist) == count + 1


@pytest.mark.parametrize("escalate_to", ["pessimistic", "distributed"])
async def test_escalation_and_step_down_are_counted_and_logged(
    escalate_to: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Adaptive on an instance whose every optimistic compare-and-swap loses: after five
    conflicts in its window it escalates to the monitor's strategy, pessimistic or distributed
    (one WARNING naming the instance, the strategy and the rate; the call says why; the
    escalated writes are recorded under that strategy; flowlock_escalations_total{to} +1);
    once calm for the cool-down (an injected clock) it steps back down to optimistic (one INFO
    line; flowlock_deescalations_total +1)."""
    caplog.set_level(logging.INFO, logger="flowlock")
    now = [1000.0]
    monitor = ConflictMonitor(
        min_samples=5, cooldown=5.0, escalate_to=escalate_to, clock=lambda: now[0]
    )
    metrics, to = Metrics(), {"to": escalate_to}
    fast = flowlock.Optimistic(backoff_cap=0.0)
    options = {"monitor": monitor, "metrics": metrics, "strategies": [fast]}
    async with contended(**options, locks=MemoryLocks(), escalation_sync=0.05) as (
        engine,
        store,
    ):
        await engine.create("inventory", instance_id="hot-1", data={"stock": 10})
        caplog.clear()  # register()'s own warning (a must-apply transition) is not under test
        up = sample(metrics, "flowlock_escalations_total", to)
        down = sample(metrics, "flowlock_deescalations_total")

        # Calls 1 and 2 each lose their two optimistic attempts (one retry before the lock,
        # Adaptive's retries_before_lock) and finish locked; call 3's first loss is the fifth
        # conflict in the window, and it finishes under the escalation.
        for _ in range(3):
            store.rivals = 2
            done = await engine.fire("hot-1", "reserve", strategy="adaptive")
            assert done.applied and done.strategy == escalate_to
        assert done.reason == (
            f"adaptive: escalated to {escalate_to}: conflict rate 100.0% over the last 5 "
            "attempts exceeds 5%"
        )
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert [(r.name, r.getMessage()) for r in warnings] == [
            (
                "flowlock",
                f"flowlock: escalating 'hot-1' to {escalate_to}: conflict rate 100.0% over the "
                "last 5 attempts exceeds 5%",
            )
        ]
        await wait_until(
            lambda: sample(metrics, "flowlock_escalations_total", to) > up,
            "the escalation recorded by the sync",
        )
        assert sample(metrics, "flowlock_escalations_total", to) == up + 1
        assert sample(metrics, "flowlock_escalated_keys") == 1

        now[0] += 5.0  # calm for the whole cool-down
        calm = await engine.fire("hot-1", "reserve", strategy="adaptive")
        assert calm.strategy == "optimistic"
        assert calm.reason == "adaptive: optimistic (instance not escalated)"
        await wait_until(
            lambda: sample(metrics, "flowlock_deescalations_total") > down,
            "the step-down recorded by the sync",
        )
        assert sample(metrics, "flowlock_deescalations_total") == down + 1
        await wait_until(
            lambda: sample(metrics, "flowlock_escalated_keys") == 0, "no key escalated"
        )
        final, history = await engine.get("hot-1"), await engine.history("hot-1")
    steps = [r.getMessage() for r in caplog.records if "steps back down" in r.getMessage()]
    assert steps == ["flowlock: 'hot-1' steps back down to optimistic: no contention for 5.0 s"]
    reserves = [h.strategy for h in history if h.event == "reserve"]
    assert reserves == [escalate_to, escalate_to, escalate_to, "optimistic"]
    assert [h.event for h in history].count("restock") == 6
    assert final.data == {"stock": 12, "reserved": 4}
    assert check(final, history)


async def test_a_lost_lease_is_logged_counted_and_writes_nothing(
    redis_url: str, redis_namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A distributed transition whose Redis key vanishes while it runs (an expiry, a failover):
    the next renewal finds no lease and logs one WARNING naming the instance; the call raises
    LockLost, flowlock_leases_lost_total{strategy="distributed"} grows by one, and nothing is
    written."""
    caplog.set_level(logging.WARNING, logger="flowlock")
    metrics, store = Metrics(), GatedStore()
    locks = RedisLocks(redis_url, namespace=redis_namespace)
    labels = {"strategy": "distributed"}
    key = f"flowlock:{redis_namespace}:{{req-1}}"
    expected = (
        "flowlock: lost the lease on 'req-1': a renewal found another owner (the lease had expired)"
    )
    client = redis.asyncio.from_url(redis_url)
    try:
        async with flowlock.Engine(
            store, locks=locks, metrics=metrics, strategies=[flowlock.Distributed(ttl=3)]
        ) as engine:
            await engine.register(examples.approval())
            await engine.create("approval", instance_id="req-1")
            lost = sample(metrics, "flowlock_leases_lost_total", labels)
            gate = store.hold("read")
            call = asyncio.create_task(engine.fire("req-1", "approve", strategy="distributed"))
            await asyncio.wait_for(gate.entered.wait(), 10)
            assert await client.delete(key) == 1  # the lease's key is gone
            await wait_until(
                lambda: any(r.getMessage() == expected for r in caplog.records),
                "the lost-lease log line",
            )
            gate.release.set()
            with pytest.raises(flowlock.LockLost):
                await call
            assert sample(metrics, "flowlock_leases_lost_total", labels) == lost + 1
            instance, history = await engine.get("req-1"), await engine.history("req-1")
    finally:
        await client.aclose()
    assert [(r.name, r.levelname) for r in caplog.records if r.getMessage() == expected] == [
        ("flowlock", "WARNING")
    ]
    assert (instance.state, instance.version, history) == ("pending", 1, [])


# -- a transition longer than its lease's ttl ------------------------------------------------


async def outlives_its_ttl(locks: LockBackend) -> None:
    """A distributed transition (ttl 3 s) on ``locks`` whose read is held back past ttl +
    ttl/3: the lease is renewed meanwhile (still held, a second acquirer is refused LockBusy),
    the call applies with its fencing token, and the lease is released after."""
    ttl = 3.0
    store = GatedStore()
    async with flowlock.Engine(
        store, locks=locks, strategies=[flowlock.Distributed(ttl=ttl, wait=5)]
    ) as engine:
        await engine.register(examples.approval())
        await engine.create("approval", instance_id="req-1")
        gate = store.hold("read")
        call = asyncio.create_task(engine.fire("req-1", "approve", strategy="distributed"))
        await asyncio.wait_for(gate.entered.wait(), 10)
        since = time.monotonic()  # the lease was taken before the read began
        while time.monotonic() - since < ttl + ttl / 3 + 0.2:
            assert await locks.locked("req-1")
            assert not call.done()
            await asyncio.sleep(0.2)  # the transition's duration, not an ordering
        with pytest.raises(flowlock.LockBusy):
            await locks.acquire("req-1", ttl=ttl, wait=0)
        gate.release.set()
        outcome = await call
        assert not await locks.locked("req-1")
        history = await engine.history("req-1")
    assert outcome.applied and outcome.strategy == "distributed"
    assert len(history) == 1 and history[0].fencing_token is not None
    assert check(outcome.instance, history, expected_applied=1)


@pytest.mark.slow
async def test_a_transition_outlives_its_redis_lease_ttl_through_renewal(
    redis_url: str, redis_namespace: str
) -> None:
    """A distributed transition longer than its Redis lease's ttl keeps the lease by renewal
    and applies (see :func:`outlives_its_ttl`)."""
    await outlives_its_ttl(RedisLocks(redis_url, namespace=redis_namespace))


@pytest.mark.slow
async def test_a_transition_outlives_its_advisory_lease_ttl_through_renewal(
    pg_url: str, pg_schema: str
) -> None:
    """A distributed transition longer than its advisory lease's ttl (which the server
    enforces) keeps the lease by renewal and applies (see :func:`outlives_its_ttl`)."""
    await outlives_its_ttl(AdvisoryLocks(pg_url, schema=pg_schema))
