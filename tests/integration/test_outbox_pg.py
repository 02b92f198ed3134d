"""The outbox on PostgreSQL: what only a real server shows.

Every commit path writes its messages in the statement of its compare-and-swap (optimistic,
pessimistic, distributed on Redis and on advisory locks, adaptive; batching on and off;
commit_many; the caller's own transaction, where a rollback leaves none), one NOTIFY per
transaction wakes the dispatchers of every engine on the schema, and an idle store sends
nothing but its LISTEN. Claims on many connections at once are in tests/integration/
test_outbox_claims_pg.py; the behaviour every store shares is in
tests/contract/test_outbox_store.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from datetime import timedelta
from typing import Any

import asyncpg
import pytest

import flowlock
import pg_budget
from flowlock.core.models import HistoryEntry, Instance
from flowlock.core.outbox import Emit
from flowlock.locks import MemoryLocks
from flowlock.locks.base import LockBackend
from flowlock.stores.postgres import PostgresStore
from flowlock.stores.postgres.listen import POLL
from flowlock.stores.postgres.outbox_sql import outbox_channel
from lock_probes import wait_until
from outbox_store_kit import BOUND, QUIET, WF, emitting, order

pytestmark = pytest.mark.postgres

TIMED = "timed_order"
INSTANCES = 12
NOTES = 8


def _reserve(inst: Instance, payload: Mapping[str, Any], actor: str | None) -> list[Emit]:
    return [Emit("reserve", {"order": inst.id}), Emit("notify", {"v": inst.version})]


def _note(inst: Instance, payload: Mapping[str, Any], actor: str | None) -> flowlock.Step:
    return flowlock.Step(dict(inst.data), emit=[Emit("notify", {"v": inst.version + 1})])


def timed_order() -> flowlock.Workflow:
    """An order whose `reserve` enters a state with a deadline and emits two messages (its
    timers and messages in one statement), whose `note` stays and emits one, and whose `touch`
    emits none."""
    return flowlock.Workflow(
        TIMED,
        states=["new", "reserved", "expired"],
        initial="new",
        transitions=[
            flowlock.Transition("reserve", source="new", target="reserved", emit=_reserve),
            flowlock.Transition("note", source="reserved", target="reserved", effect=_note),
            flowlock.Transition("touch", source="new", target="new"),
            flowlock.Transition(
                "expire", source="reserved", target="expired", after=timedelta(hours=1)
            ),
        ],
    )


EXPECTED = {"reserve": ["reserve", "notify"], "note": ["notify"]}  # the kinds, in order


def expected_messages(history: list[HistoryEntry]) -> list[tuple[str, str, int | None]]:
    """The (key, kind, fencing token) of the messages `history` must have written."""
    out: list[tuple[str, str, int | None]] = []
    for row in history:
        for n, kind in enumerate(EXPECTED.get(row.event, [])):
            out.append((f"{row.instance_id}:{row.version}:{n}", kind, row.fencing_token))
    return out


async def rows_in_outbox(url: str, schema: str) -> list[tuple[str, str, int | None]]:
    """Every message row of the schema, read with plain SQL: (key, kind, fencing token)."""
    conn = await pg_budget.connect(url)
    try:
        rows = await conn.fetch(
            f"SELECT instance_id || ':' || version || ':' || n AS key, kind, fencing_token "
            f'FROM "{schema}".flowlock_outbox'
        )
    finally:
        await conn.close()
    return sorted((r["key"], r["kind"], r["fencing_token"]) for r in rows)


def store_of(engine: flowlock.Engine) -> PostgresStore:
    assert isinstance(engine.store, PostgresStore)
    return engine.store


MakeEngine = Callable[..., Awaitable[flowlock.Engine]]


@pytest.fixture
async def engines(
    request: pytest.FixtureRequest, pg_url: str, pg_schema: str
) -> AsyncIterator[MakeEngine]:
    """Opens engines on this test's schema (locks: "memory", "redis" or "advisory"); closes
    them at the end, and deletes the test's Redis keys."""
    opened: list[flowlock.Engine] = []
    namespace = f"t_{uuid.uuid4().hex[:12]}"
    redis_urls: list[str] = []

    async def make(
        locks: str = "memory", *, batching: bool = True, pool_size: int = 8, **store: Any
    ) -> flowlock.Engine:
        built = PostgresStore(
            pg_url, schema=pg_schema, pool_size=pool_size, pipeline=batching, **store
        )
        backend: LockBackend
        if locks == "redis":
            from flowlock.locks.redis import RedisLocks

            redis_url: str = request.getfixturevalue("redis_url")  # a plain fixture
            redis_urls.append(redis_url)
            backend = RedisLocks(redis_url, namespace=namespace, fence_floor=built.fencing_floor)
        elif locks == "advisory":
            from flowlock.locks.advisory import AdvisoryLocks

            backend = AdvisoryLocks(pg_url, namespace=f"n{uuid.uuid4().hex[:8]}", schema=pg_schema)
        else:
            backend = MemoryLocks()
        engine = await flowlock.Engine(built, locks=backend, batching=batching, timers=False).open()
        opened.append(engine)
        await engine.register(timed_order())
        await engine.register(order())
        return engine

    yield make
    for engine in opened:
        await engine.aclose()
    if redis_urls:  # the lock keys of this test's namespace
        import redis.asyncio

        client = redis.asyncio.from_url(redis_urls[0])
        try:
            found = [k async for k in client.scan_iter(match=f"flowlock:{namespace}:*")]
            if found:
                await client.delete(*found)
        finally:
            await client.aclose()


@contextlib.asynccontextmanager
async def notifications(url: str, schema: str) -> AsyncIterator[list[str]]:
    """The notifications of the schema's outbox channel, heard on a connection of the test's
    own, for the length of the `async with`."""
    heard: list[str] = []
    conn = await pg_budget.connect(url)
    try:
        await conn.add_listener(outbox_channel(schema), lambda *args: heard.append(args[3]))
        yield heard
    finally:
        await conn.close()


async def settled() -> None:
    """Give notifications sent by a commit that just returned time to arrive."""
    await asyncio.sleep(QUIET)


# -- every commit path writes its messages -----------------------------------------------------


PATHS = [
    pytest.param("optimistic", "memory", id="optimistic"),
    pytest.param("pessimistic", "memory", id="pessimistic"),
    pytest.param("adaptive", "memory", id="adaptive"),
    pytest.param("distributed", "advisory", id="distributed-advisory"),
    pytest.param("distributed", "redis", id="distributed-redis", marks=pytest.mark.redis),
]


@pytest.mark.parametrize("batching", [True, False], ids=["batching-on", "batching-off"])
@pytest.mark.parametrize(("strategy", "locks"), PATHS)
async def test_every_commit_path_writes_exactly_the_messages_of_its_history(
    engines: MakeEngine, pg_url: str, pg_schema: str, strategy: str, locks: str, batching: bool
) -> None:
    """Concurrent calls on many instances (pipelined: one statement or one transaction for
    several) and on one instance (batched: one compare-and-swap for several entries), entering
    a timed state or staying: the outbox holds exactly the messages of the applied transitions,
    each with its entry's fencing token; a repeated request id and a refused call add none."""
    engine = await engines(locks, batching=batching)
    ids = [f"o{i}" for i in range(INSTANCES)]
    for iid in ids:
        await engine.create(TIMED, instance_id=iid)
    reserved = await asyncio.gather(
        *(engine.fire(iid, "reserve", strategy=strategy, request_id=f"r-{iid}") for iid in ids)
    )
    assert all(out.applied for out in reserved)
    if batching:  # one instance's calls decided together: one compare-and-swap for several
        notes = [engine.fire("o0", "note", strategy=strategy) for _ in range(NOTES)]
        noted = await asyncio.gather(*notes)
    else:  # one by one (concurrent optimistic calls would only race each other here)
        noted = [await engine.fire("o0", "note", strategy=strategy) for _ in range(NOTES)]
    assert all(out.applied for out in noted)
    again = await engine.fire("o1", "reserve", strategy=strategy, request_id="r-o1")
    assert again.idempotent
    with pytest.raises(flowlock.TransitionNotAllowed):
        await engine.fire("o2", "touch", strategy=strategy)
    histories = [await engine.history(iid) for iid in ids]
    expected = sorted(m for history in histories for m in expected_messages(history))
    assert len(expected) == 2 * INSTANCES + NOTES
    assert await rows_in_outbox(pg_url, pg_schema) == expected
    if strategy == "distributed":
        assert all(token is not None for _, _, token in expected)
    timers = [t.event for iid in ids for t in await store_of(engine).timers(iid)]
    assert timers == ["expire"] * INSTANCES  # armed by the same statements


async def test_commit_many_writes_each_winners_messages_and_no_losers(
    engines: MakeEngine, pg_url: str, pg_schema: str
) -> None:
    """One commit_many statement for several instances, batches of several entries each: the
    winners' messages are written under their versions, a loser's none."""
    engine = await engines()
    made = [await engine.create(WF, instance_id=f"m{i}") for i in range(4)]
    await engine.fire("m3", "touch")  # m3 moved on: its batch loses
    batches = [
        [
            emitting(inst, "x", [Emit("notify", {"i": 0}), Emit("charge")], fencing_token=5),
            emitting(inst, "y", [Emit("notify", {"i": 1})], offset=2, fencing_token=6),
        ]
        for inst in made
    ]
    answers = await engine.store.commit_many(batches)
    assert [a is not None for a in answers] == [True, True, True, False]
    assert await rows_in_outbox(pg_url, pg_schema) == sorted(
        (key, kind, token)
        for i in range(3)
        for key, kind, token in (
            (f"m{i}:2:0", "notify", 5),
            (f"m{i}:2:1", "charge", 5),
            (f"m{i}:3:0", "notify", 6),
        )
    )


async def test_a_batch_that_arms_a_timer_and_emits_writes_both_in_one_statement(
    engines: MakeEngine, pg_url: str, pg_schema: str
) -> None:
    """One compare-and-swap for several entries, the first entering a timed state (its timers
    armed) and both emitting: the timers' CTEs and the outbox's share the statement, each
    reading its own parameters."""
    engine = await engines()
    made = await engine.create(TIMED, instance_id="t")
    reserve = emitting(made, "reserve", [Emit("reserve", {"k": 1}), Emit("notify")])
    note = emitting(made, "note", [Emit("notify", {"k": 2})], offset=2)
    batch = [
        dataclasses.replace(
            reserve, to_state="reserved", arm=timed_order().timers("reserved"), fencing_token=3
        ),
        dataclasses.replace(note, from_state="reserved", to_state="reserved", fencing_token=4),
    ]
    moved = await engine.store.commit(batch)
    assert moved is not None and (moved.version, moved.stay_version) == (3, 2)
    assert [(t.event, t.stay) for t in await store_of(engine).timers("t")] == [("expire", 2)]
    assert await rows_in_outbox(pg_url, pg_schema) == [
        ("t:2:0", "reserve", 3),
        ("t:2:1", "notify", 3),
        ("t:3:0", "notify", 4),
    ]
    assert made.version == 1


@pytest.mark.parametrize("strategy", ["optimistic", "pessimistic", "adaptive"])
@pytest.mark.parametrize("commit", [True, False], ids=["commit", "rollback"])
async def test_the_callers_transaction_writes_its_messages_only_if_it_commits(
    engines: MakeEngine, pg_url: str, pg_schema: str, strategy: str, commit: bool
) -> None:
    """fire(connection=conn) writes the messages in the caller's transaction: invisible until
    it commits, then there with one NOTIFY for the whole transaction; a rollback leaves no
    message and notifies nobody."""
    engine = await engines()
    await engine.create(WF, instance_id="a")
    await engine.create(WF, instance_id="b")
    async with notifications(pg_url, pg_schema) as heard:
        conn = await pg_budget.connect(pg_url)
        try:
            tx = conn.transaction()
            await tx.start()
            assert (await engine.fire("a", "reserve", strategy=strategy, connection=conn)).applied
            assert (await engine.fire("a", "note", strategy=strategy, connection=conn)).applied
            assert (await engine.fire("b", "reserve", strategy=strategy, connection=conn)).applied
            assert await store_of(engine).messages("a") == []  # not committed yet
            await (tx.commit() if commit else tx.rollback())
        finally:
            await conn.close()
        await settled()
    keys = [key for key, _, _ in await rows_in_outbox(pg_url, pg_schema)]
    if commit:
        assert keys == ["a:2:0", "a:2:1", "a:3:0", "b:2:0", "b:2:1"]
        assert heard == [""]
    else:
        assert keys == [] and heard == []


async def test_one_notification_per_commit_and_none_for_a_lost_one(
    engines: MakeEngine, pg_url: str, pg_schema: str
) -> None:
    """A statement that writes several instances' messages notifies once; a compare-and-swap
    that lost (its statement wrote no message) and a commit that emits nothing notify nobody."""
    engine = await engines()
    made = [await engine.create(WF, instance_id=f"n{i}") for i in range(5)]
    async with notifications(pg_url, pg_schema) as heard:
        await engine.store.commit_many(
            [[emitting(inst, "x", [Emit("notify"), Emit("charge")])] for inst in made]
        )
        await settled()
        assert heard == [""]
        assert await engine.store.commit([emitting(made[0], "x", [Emit("notify")])]) is None
        await engine.store.commit([emitting(await engine.get("n1"), "y", [])])
        await settled()
        assert heard == [""]


# -- waking the dispatchers --------------------------------------------------------------------


async def heard_once(event: asyncio.Event) -> None:
    """Wait until `event` is set, then clear it."""
    async with asyncio.timeout(BOUND):
        await event.wait()
    event.clear()


async def stays_unset(event: asyncio.Event) -> bool:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), QUIET)
    return not event.is_set()


async def listeners(url: str, name: str) -> list[int]:
    """The backends of the outbox LISTEN connections of stores named `name`."""
    conn = await pg_budget.connect(url)
    try:
        rows = await conn.fetch(
            "SELECT pid FROM pg_stat_activity WHERE application_name = $1"
            " AND query LIKE 'LISTEN %'",
            f"{name}-outbox",
        )
    finally:
        await conn.close()
    return [r["pid"] for r in rows]


async def test_another_engines_commit_retry_drop_and_release_wake_a_listener(
    engines: MakeEngine, pg_url: str, pg_schema: str
) -> None:
    """pending() of one engine is set by NOTIFY when another engine (its own pool) commits a
    message, retries a dead one, drops one or gives a claim back; a commit that emits nothing,
    a claim, a failure and a release by someone who does not hold the claim leave it unset."""
    listener = await engines(pool_size=2)
    other = await engines(pool_size=2)
    await other.create(WF, instance_id="a")
    store = store_of(other)
    async with store_of(listener).pending() as event:
        await heard_once(event)  # set once LISTEN is up
        await other.fire("a", "touch")
        assert await stays_unset(event)
        await other.fire("a", "reserve")
        await heard_once(event)
        [m] = await store.claim_messages({"reserve": 1}, lease=30, owner="x")
        assert await store.fail_message(m, "x", "boom", None)
        assert await stays_unset(event)
        assert (await store.retry_message(m.key) or m).status == "pending"
        await heard_once(event)
        assert await store.drop_message(m.key)
        await heard_once(event)
        [n] = await store.claim_messages({"notify": 1}, lease=30, owner="x")
        assert await stays_unset(event)
        await store.release_message(n, "someone else")
        assert await stays_unset(event)
        await store.release_message(n, "x")
        await heard_once(event)


async def test_engines_on_two_schemas_do_not_wake_each_other(
    engines: MakeEngine, pg_url: str, pg_schema: str
) -> None:
    """The channel names the schema: a message written in another schema of the database does
    not wake this store's listener; one in its own does."""
    other_schema = f"{pg_schema}_b"
    mine = await engines(pool_size=2)
    try:
        theirs = PostgresStore(pg_url, schema=other_schema, pool_size=2)
        async with flowlock.Engine(theirs, locks=MemoryLocks(), timers=False) as other:
            await other.register(order())
            await other.create(WF, instance_id="a")
            await mine.create(WF, instance_id="a")
            async with store_of(mine).pending() as event:
                await heard_once(event)
                await other.fire("a", "reserve")
                assert await stays_unset(event)
                await mine.fire("a", "reserve")
                await heard_once(event)
    finally:
        conn = await pg_budget.connect(pg_url)
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{other_schema}" CASCADE')
        finally:
            await conn.close()


async def test_a_schema_name_too_long_for_a_channel_is_heard_by_its_md5(pg_url: str) -> None:
    """A schema whose name would make the channel longer than PostgreSQL takes: the insert
    trigger, the wake function (an operator's retry) and the listener all name the channel by
    the schema's md5, and meet."""
    long = f"t_{uuid.uuid4().hex[:12]}_{'x' * 40}"
    assert len(outbox_channel(long)) <= 63 and long not in outbox_channel(long)
    try:
        store = PostgresStore(pg_url, schema=long, pool_size=2)
        async with flowlock.Engine(store, locks=MemoryLocks(), timers=False) as engine:
            await engine.register(order())
            await engine.create(WF, instance_id="a")
            async with store.pending() as event:
                await heard_once(event)  # set once LISTEN is up
                await engine.fire("a", "reserve")
                await heard_once(event)
                [m] = await store.claim_messages({"reserve": 1}, lease=30, owner="x")
                await store.fail_message(m, "x", "boom", None)
                assert await stays_unset(event)
                await store.retry_message(m.key)
                await heard_once(event)
    finally:
        conn = await pg_budget.connect(pg_url)
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{long}" CASCADE')
        finally:
            await conn.close()


async def test_the_listen_connection_comes_back_after_it_was_killed(
    engines: MakeEngine, pg_url: str
) -> None:
    """The outbox's LISTEN (the timers' machinery, its own connection named `...-outbox`),
    killed, is opened again, sets the event (a notification may have been missed), and hears
    the next commit; it is closed with the `async with`."""
    name = f"ob-{uuid.uuid4().hex[:8]}"
    engine = await engines(pool_size=2, application_name=name)
    await engine.create(WF, instance_id="a")
    async with store_of(engine).pending() as event:
        await heard_once(event)
        [first] = await listeners(pg_url, name)
        killer = await pg_budget.connect(pg_url)
        try:
            assert await killer.fetchval("SELECT pg_terminate_backend($1)", first)
        finally:
            await killer.close()
        await heard_once(event)  # set when it was killed, and once LISTEN is up again

        async def back() -> bool:
            return [pid for pid in await listeners(pg_url, name) if pid != first] != []

        await wait_until(back, within=BOUND, what="LISTEN opened again")
        event.clear()
        await engine.fire("a", "reserve")
        await heard_once(event)
    assert await listeners(pg_url, name) == []


async def test_an_idle_store_sends_nothing_but_its_listen(pg_url: str, pg_schema: str) -> None:
    """While nothing is written, a store whose pending() is open sends no statement: its pool's
    connections stay silent, and the LISTEN connection's last statement stays its LISTEN
    (sampled in pg_stat_activity; its keepalive comes every 30 s, past the window). The store
    alone: an engine adds its own periodic reads (the adaptive strategy's escalations)."""
    name = f"idle-{uuid.uuid4().hex[:8]}"
    store = PostgresStore(pg_url, schema=pg_schema, pool_size=2, application_name=name)
    await store.open()
    admin = await pg_budget.connect(pg_url)
    sql = (
        "SELECT pid, application_name AS app, query, query_start FROM pg_stat_activity"
        " WHERE application_name IN ($1, $2) AND pid <> pg_backend_pid()"
    )
    try:
        async with store.pending() as event:
            await heard_once(event)
            await wait_until(
                lambda: _listens(admin, sql, name), within=BOUND, what="the store listens"
            )
            rows = await admin.fetch(sql, name, f"{name}-outbox")
            before = {(r["pid"], r["query_start"]) for r in rows}
            seen: set[tuple[int, Any]] = set()
            loop = asyncio.get_running_loop()
            until = loop.time() + 2.0
            while loop.time() < until:
                for r in await admin.fetch(sql, name, f"{name}-outbox"):
                    seen.add((r["pid"], r["query_start"]))
                    if r["app"] == f"{name}-outbox":
                        assert r["query"].startswith("LISTEN"), r["query"]
                await asyncio.sleep(0.01)
            assert seen <= before, seen - before
            assert not event.is_set()
    finally:
        await admin.close()
        await store.aclose()


async def _listens(admin: asyncpg.Connection, sql: str, name: str) -> bool:
    rows = await admin.fetch(sql, name, f"{name}-outbox")
    return any(r["app"] == f"{name}-outbox" and r["query"].startswith("LISTEN") for r in rows)


async def test_behind_a_transaction_pooler_the_statements_name_the_schema_and_pending_polls(
    engines: MakeEngine,
) -> None:
    """With pooling="transaction" (no search_path on the connections, no LISTEN) every outbox
    statement names its tables and the wake function with the schema, and pending() is set
    about every POLL seconds instead of by NOTIFY."""
    engine = await engines(pool_size=2, pooling="transaction")
    store = store_of(engine)
    await engine.create(WF, instance_id="a")
    await engine.fire("a", "reserve")
    await engine.fire("a", "note")
    assert [m.key for m in await store.messages("a")] == ["a:2:0", "a:2:1", "a:3:0"]
    [m] = await store.claim_messages({"reserve": 5, "notify": 5}, lease=30, owner="x")
    assert await store.next_message_due(["notify"]) == 0.0
    assert await store.fail_message(m, "x", "boom", None)
    assert (await store.retry_message(m.key) or m).attempts == 0
    assert await store.finish_messages([m.key]) == 1
    assert [x.key for x in await store.find_messages(status="pending")] == ["a:2:1", "a:3:0"]
    assert await store.drop_message("a:3:0")
    assert dict(await store.count_messages())["done"] == 1
    assert await store.purge_messages(0, 10) == 1
    async with store.pending() as event:
        await heard_once(event)
        async with asyncio.timeout(POLL * 5):
            await event.wait()
