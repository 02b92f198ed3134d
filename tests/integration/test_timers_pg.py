"""Timers on PostgreSQL: what only a real server shows.

Timers armed in the application's own transaction exist once it commits and not at all if it
rolls back, and so does their NOTIFY; the LISTEN of each engine hears its own schema only, and
comes back after its connection is killed; an engine asleep is woken by another engine's
commit; two engines racing callers fire each deadline once; the migration adds the stay
without rewriting the instances. The behaviour every store shares is in
tests/contract/test_timer_store.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
import pytest

import flowlock
import pg_budget
from flowlock._pg import migrations as pg_migrations
from flowlock.checker import check
from flowlock.core import migrations
from flowlock.core.models import TIMER_ACTOR
from flowlock.locks import MemoryLocks
from flowlock.stores.postgres import PostgresStore
from flowlock.stores.postgres.timer_sql import CLAIM, NEXT_DUE, channel
from lock_probes import wait_until
from timer_steps import BOUND, QUIET, WF, deadline

pytestmark = pytest.mark.postgres

SqlHistory = Callable[..., Awaitable[Any]]


@contextlib.asynccontextmanager
async def engine_on(
    url: str, schema: str, *, timers: bool = False, after: float = 60.0, **store: Any
) -> AsyncIterator[flowlock.Engine]:
    """An engine on `schema` with the deadline workflow (no reminder; `after` as given)."""
    built = PostgresStore(url, schema=schema, pool_size=4, **store)
    async with flowlock.Engine(built, locks=MemoryLocks(), timers=timers) as engine:
        await engine.register(deadline(after=after, every=None))
        yield engine


def store_of(engine: flowlock.Engine) -> PostgresStore:
    assert isinstance(engine.store, PostgresStore)
    return engine.store


async def listeners(url: str, name: str) -> list[int]:
    """The backends of the LISTEN connections of stores named `name` (application_name)."""
    conn = await pg_budget.connect(url)
    try:
        rows = await conn.fetch(
            "SELECT pid FROM pg_stat_activity WHERE application_name = $1"
            " AND query LIKE 'LISTEN %'",
            f"{name}-timers",
        )
    finally:
        await conn.close()
    return [r["pid"] for r in rows]


async def listening(url: str, name: str, other_than: int | None = None) -> int:
    """Wait until a store named `name` listens (on a backend other than `other_than`)."""
    found: list[int] = []

    async def up() -> bool:
        found[:] = [pid for pid in await listeners(url, name) if pid != other_than]
        return bool(found)

    await wait_until(up, within=BOUND, what=f"{name} listens")
    return found[0]


async def heard(armed: asyncio.Event) -> None:
    """Wait until `armed` is set, then clear it (for the next wait)."""
    async with asyncio.timeout(BOUND):
        await armed.wait()
    armed.clear()


async def stays_unset(event: asyncio.Event) -> bool:
    """Whether `event` stays unset for QUIET seconds."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), QUIET)
    return not event.is_set()


@pytest.mark.parametrize("commit", [True, False], ids=["commit", "rollback"])
async def test_timers_armed_in_the_callers_transaction_exist_only_once_it_commits(
    pg_url: str, pg_schema: str, commit: bool
) -> None:
    """A create and a transition entering a timed state inside the application's transaction
    arm their timers there: none is visible, and no NOTIFY is heard, before it commits; a
    commit arms them and wakes the listeners, a rollback leaves nothing and wakes nobody."""
    name = f"tx-{uuid.uuid4().hex[:8]}"
    async with engine_on(pg_url, pg_schema, application_name=name) as engine:
        store = store_of(engine)
        await engine.create(WF, instance_id="a")
        await engine.fire("a", "hold")
        async with store.armed() as armed:
            await heard(armed)  # set once LISTEN is up
            conn = await pg_budget.connect(pg_url)
            try:
                tx = conn.transaction()
                await tx.start()
                await engine.create(WF, instance_id="b", connection=conn)
                resumed = await engine.fire("a", "resume", connection=conn)
                assert resumed.instance.stay_version == 3
                assert await store.count_timers() == 0  # not committed yet
                assert await stays_unset(armed)
                await (tx.commit() if commit else tx.rollback())
            finally:
                await conn.close()
            if commit:
                async with asyncio.timeout(BOUND):
                    await armed.wait()
            else:
                assert await stays_unset(armed)
        timers = await store.timers("a")
        assert [(t.event, t.stay) for t in timers] == ([("expire", 3)] if commit else [])
        assert await store.count_timers() == (2 if commit else 0)
        assert (await engine.get("a")).stay_version == (3 if commit else 2)


async def test_a_notification_says_when_its_earliest_timer_is_due(
    pg_url: str, pg_schema: str
) -> None:
    """The NOTIFY of a commit carries the earliest due time it armed, on the server's clock;
    armed() turns it into a time on the event loop's clock (ArmedSignal.earliest), so a service
    already waking sooner sleeps on."""
    async with (
        engine_on(pg_url, pg_schema, after=60.0) as engine,
        store_of(engine).armed() as armed,
    ):
        await heard(armed)  # set once LISTEN is up (due time unknown)
        loop = asyncio.get_running_loop()
        before = loop.time()
        await engine.create(WF, instance_id="a")
        after = loop.time()
        async with asyncio.timeout(BOUND):
            await armed.wait()
        assert armed.earliest is not None
        assert before + 60.0 - 0.5 <= armed.earliest <= after + 60.0 + 0.5


async def test_only_a_commit_arming_its_workflows_earliest_timer_notifies(
    pg_url: str, pg_schema: str
) -> None:
    """Commits that notify are serialized by PostgreSQL, so a commit arming a timer due after
    an unclaimed one of its workflow (due more than a second from now) sends no NOTIFY: every
    service already wakes by then. The first timer notifies; so does one armed earlier than all."""
    async with engine_on(pg_url, pg_schema, after=60.0) as engine:
        async with store_of(engine).armed() as armed:
            await heard(armed)  # set once LISTEN is up
            await engine.create(WF, instance_id="a")
            await heard(armed)
            await engine.create(WF, instance_id="b")
            assert await stays_unset(armed)
        async with (
            engine_on(pg_url, pg_schema, after=30.0) as sooner,
            store_of(sooner).armed() as armed,
        ):
            await heard(armed)
            await sooner.create(WF, instance_id="c")
            async with asyncio.timeout(BOUND):
                await armed.wait()


async def _drop_schema(pg_url: str, schema: str) -> None:
    """Drop a schema a test made beside its own (the fixture drops only its own)."""
    conn = await pg_budget.connect(pg_url)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()


async def test_engines_on_two_schemas_do_not_wake_each_other(pg_url: str, pg_schema: str) -> None:
    """The NOTIFY channel names the schema: a commit arming a timer in another schema of the
    same database does not wake this store's listeners; one in its own schema does."""
    other = f"{pg_schema}_b"
    name = f"sc-{uuid.uuid4().hex[:8]}"
    try:
        async with (
            engine_on(pg_url, pg_schema, application_name=name) as mine,
            engine_on(pg_url, other) as theirs,
            store_of(mine).armed() as armed,
        ):
            await heard(armed)  # set once LISTEN is up
            await theirs.create(WF, instance_id="x")
            assert await stays_unset(armed)
            await mine.create(WF, instance_id="x")
            async with asyncio.timeout(BOUND):
                await armed.wait()
    finally:
        await _drop_schema(pg_url, other)


async def test_a_schema_name_too_long_for_a_channel_is_heard_by_its_md5(
    pg_url: str, pg_schema: str
) -> None:
    """A schema whose name would make the channel longer than PostgreSQL takes (63 bytes):
    the trigger and the listener both name the channel by the schema's md5, and meet."""
    long = f"{pg_schema}_{'x' * (60 - len(pg_schema))}"
    assert channel(long) != f"flowlock_timers.{long}" and len(channel(long)) <= 63
    try:
        async with engine_on(pg_url, long) as engine, store_of(engine).armed() as armed:
            await heard(armed)  # set once LISTEN is up
            await engine.create(WF, instance_id="a")
            async with asyncio.timeout(BOUND):
                await armed.wait()
    finally:
        await _drop_schema(pg_url, long)


async def test_an_applications_pool_listens_on_a_connection_of_its_own(
    pg_url: str, pg_schema: str
) -> None:
    """On an application's pool (pool=, no schema= given: its search_path names the schema),
    LISTEN runs on a connection built as the pool builds its own but never part of it (the
    pool keeps its size), on the channel of the schema where its search_path finds the
    timers."""
    conn = await pg_budget.connect(pg_url)
    try:
        await conn.execute(f'CREATE SCHEMA "{pg_schema}"')
    finally:
        await conn.close()
    pool = await pg_budget.create_pool(
        pg_url, min_size=1, max_size=2, server_settings={"search_path": pg_schema}
    )
    try:
        store = PostgresStore(pool=pool)
        async with flowlock.Engine(store, locks=MemoryLocks(), timers=False) as engine:
            await engine.register(deadline(every=None))
            async with store.armed() as armed:
                await heard(armed)  # set once LISTEN is up
                await engine.create(WF, instance_id="a")
                async with asyncio.timeout(BOUND):
                    await armed.wait()
                assert pool.get_size() <= 2
            assert [t.event for t in await store.timers("a")] == ["expire"]
    finally:
        await pool.close()


async def test_the_listen_connection_comes_back_after_it_was_killed(
    pg_url: str, pg_schema: str
) -> None:
    """LISTEN runs on a connection of its own next to the pool; killed, it is opened again,
    the event is set (a notification may have been missed meanwhile), and the new connection
    hears the next commit."""
    name = f"re-{uuid.uuid4().hex[:8]}"
    async with engine_on(pg_url, pg_schema, application_name=name) as engine:
        store = store_of(engine)
        async with store.armed() as armed:
            await heard(armed)  # set once LISTEN is up
            first = await listening(pg_url, name)
            killer = await pg_budget.connect(pg_url)
            try:
                assert await killer.fetchval("SELECT pg_terminate_backend($1)", first)
            finally:
                await killer.close()
            await heard(armed)  # set when it was killed, and once LISTEN is up again
            await listening(pg_url, name, other_than=first)
            await heard(armed)
            await engine.create(WF, instance_id="a")
            async with asyncio.timeout(BOUND):
                await armed.wait()
    assert await listeners(pg_url, name) == []  # closed with the `async with`


async def test_an_engine_asleep_is_woken_by_another_engines_commit(
    pg_url: str, pg_schema: str
) -> None:
    """An engine whose timer service found nothing armed sleeps (up to IDLE_BOUND, 300 s);
    another engine's commit arming a timer wakes it by NOTIFY, and it fires the timer when due,
    long before it would have looked again by itself."""
    name = f"wk-{uuid.uuid4().hex[:8]}"
    async with (
        engine_on(pg_url, pg_schema, timers=True, after=0.1, application_name=name) as sleeper,
        engine_on(pg_url, pg_schema, after=0.1) as caller,
    ):
        await listening(pg_url, name)
        await asyncio.sleep(QUIET)  # the service has looked, found nothing, and sleeps
        await caller.create(WF, instance_id="a")

        async def fired() -> bool:
            return (await caller.get("a")).state == "rejected"

        await wait_until(fired, within=BOUND, what="the sleeping engine fired the deadline")
        [entry] = await caller.history("a")
        assert (entry.event, entry.actor) == ("expire", TIMER_ACTOR)
        assert entry.request_id == "timer:1:expire:0"
        service = sleeper.timer_service
        assert service is not None and service.fired == 1


async def test_two_engines_and_racing_callers_apply_each_deadline_once(
    pg_url: str, pg_schema: str, sql_history: SqlHistory
) -> None:
    """40 instances whose deadlines come due while callers approve them: two engines run their
    timer services, a third takes the approvals, spread around the due times (and, for the last
    ten, sent once the deadline applied: refused). Every instance ends approved or rejected,
    once; each expiry was fired by a timer in the stay that armed it; the checker finds every
    history whole and the table agrees."""
    racing = [f"r{i:02}" for i in range(30)]
    late = [f"z{i:02}" for i in range(10)]
    async with (
        engine_on(pg_url, pg_schema, timers=True, after=0.3) as one,
        engine_on(pg_url, pg_schema, timers=True, after=0.3) as two,
        engine_on(pg_url, pg_schema, after=0.3) as caller,
    ):
        await asyncio.gather(*(caller.create(WF, instance_id=iid) for iid in racing + late))

        async def approve(iid: str, wait: float) -> None:
            await asyncio.sleep(wait)
            with contextlib.suppress(flowlock.TransitionNotAllowed):
                await caller.fire(iid, "approve", request_id=f"ok-{iid}")

        async def rejected(iid: str) -> bool:
            return (await caller.get(iid)).state == "rejected"

        # From 0.15 s to 0.45 s after the creates, around their due time (0.3 s).
        await asyncio.gather(*(approve(iid, 0.15 + 0.01 * n) for n, iid in enumerate(racing)))
        for iid in late:
            await wait_until(functools.partial(rejected, iid), within=BOUND, what=f"{iid} expired")
            with pytest.raises(flowlock.TransitionNotAllowed):
                await caller.fire(iid, "approve")

        async def settled() -> bool:
            states = [(await caller.get(iid)).state for iid in racing]
            return "pending" not in states and await store_of(caller).count_timers() == 0

        await wait_until(settled, within=BOUND, what="every instance settled, no timer left")
        histories = {iid: await caller.history(iid) for iid in racing + late}
        for iid, history in histories.items():
            assert len(history) == 1, history
            [entry] = history
            if entry.event == "expire":
                assert (entry.actor, entry.request_id) == (TIMER_ACTOR, "timer:1:expire:0")
            verdict = check(await caller.get(iid), history, initial_state="pending")
            assert verdict.ok, verdict
        # Every expiry applied was a firing of one engine or the other; firings that lost to an
        # approval applied nothing.
        fired = sum(e.timer_service.fired for e in (one, two) if e.timer_service is not None)
        expired = sum(h[0].event == "expire" for h in histories.values())
        assert len(late) <= expired <= fired
        (await sql_history()).assert_matches(histories)


@pytest.mark.parametrize("strategy", ["optimistic", "pessimistic"])
async def test_pipelined_calls_on_many_instances_move_their_stays(
    pg_url: str, pg_schema: str, strategy: str, sql_history: SqlHistory
) -> None:
    """Calls on 20 instances at once (their writes pipelined: one statement for many
    instances, or one transaction for a pessimistic group) void and arm each instance's timers
    with its own compare-and-swap: each ends in its own new stay, with its own timers."""
    ids = [f"p{i:02}" for i in range(20)]
    async with engine_on(pg_url, pg_schema) as engine:
        store = store_of(engine)
        for iid in ids:
            await engine.create(WF, instance_id=iid)
        for event in ("hold", "resume"):
            done = await asyncio.gather(*(engine.fire(i, event, strategy=strategy) for i in ids))
            assert all(o.applied for o in done)
        for iid in ids:
            assert [(t.event, t.stay) for t in await store.timers(iid)] == [("expire", 3)]
            assert (await engine.get(iid)).stay_version == 3
        histories = {iid: await engine.history(iid) for iid in ids}
        (await sql_history()).assert_matches(histories)


async def test_the_migration_leaves_existing_instances_without_a_stay(
    pg_url: str, pg_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A schema migrated up to before 010, holding instances, migrates without rewriting them
    (same row versions): their stay_version is NULL; a write that keeps the state keeps it
    NULL, one that changes it sets it, and timers arm and void from then on; an INSERT made
    afterwards that does not name the column gets 1."""
    before = [m for m in migrations.load("postgres") if m.name < "010_timers"]
    with monkeypatch.context() as patched:
        patched.setattr(pg_migrations, "load", lambda dialect: before)
        old = PostgresStore(pg_url, schema=pg_schema)
        await old.open()
        await old.aclose()
    conn = await pg_budget.connect(pg_url)
    rows = "SELECT id, xmin::text, ctid::text FROM flowlock_instances ORDER BY id"
    try:
        await conn.execute(f'SET search_path TO "{pg_schema}"')
        await conn.execute(
            "INSERT INTO flowlock_instances (id, workflow, state, version, data)"
            " VALUES ('one', $1, 'pending', 1, '{}'), ('four', $1, 'pending', 4, '{}')",
            WF,
        )
        unmigrated = [tuple(r) for r in await conn.fetch(rows)]
        async with engine_on(pg_url, pg_schema) as engine:
            assert [tuple(r) for r in await conn.fetch(rows)] == unmigrated  # not rewritten
            assert [(await engine.get(i)).stay_version for i in ("one", "four")] == [None, None]
            store = store_of(engine)
            assert await store.timers("four") == []
            noted = await engine.fire("four", "note")
            assert (noted.instance.version, noted.instance.stay_version) == (5, None)
            assert (await engine.get("four")).stay_version is None
            await engine.fire("four", "hold")
            assert (await engine.get("four")).stay_version == 6
            await engine.fire("four", "resume")
            assert [(t.event, t.stay) for t in await store.timers("four")] == [("expire", 7)]
            assert (await engine.get("four")).stay_version == 7
            assert (await engine.create(WF, instance_id="new")).stay_version == 1
            await conn.execute(
                "INSERT INTO flowlock_instances (id, workflow, state, version, data)"
                " VALUES ('later', $1, 'pending', 1, '{}')",
                WF,
            )
            assert (await engine.get("later")).stay_version == 1
    finally:
        await conn.close()


async def test_the_timer_statements_read_the_due_index(pg_url: str, pg_schema: str) -> None:
    """Claiming and next_due find due timers through the (workflow, due_at) index, not by
    reading every armed timer (checked on the plans, with sequential scans off)."""
    async with engine_on(pg_url, pg_schema) as engine:
        await engine.create(WF, instance_id="a")
        conn: asyncpg.Connection = await pg_budget.connect(pg_url)
        try:
            await conn.execute(f'SET search_path TO "{pg_schema}"; SET enable_seqscan = off')
            async with conn.transaction():
                claim = await conn.fetch("EXPLAIN " + CLAIM, [WF], 10, 30.0, "me")
                due = await conn.fetch("EXPLAIN " + NEXT_DUE, [WF])
        finally:
            await conn.close()
        for plan in (claim, due):
            text = "\n".join(r[0] for r in plan)
            assert "flowlock_timers_due" in text, text


def _timer_rows_read(node: dict[str, Any]) -> int:
    """The rows the scans of flowlock_timers under an EXPLAIN ANALYZE plan node read: the rows
    they returned and the rows their filter removed, over all their loops."""
    own = 0
    if node.get("Relation Name") == "flowlock_timers" and node["Node Type"] != "ModifyTable":
        assert node["Node Type"] == "Index Scan", node["Node Type"]  # never a Seq Scan
        per_loop = node["Actual Rows"] + node.get("Rows Removed by Filter", 0)
        own = round(per_loop * node["Actual Loops"])
    return own + sum(_timer_rows_read(child) for child in node.get("Plans", ()))


async def test_a_claim_over_several_workflows_reads_only_their_earliest_rows(
    pg_url: str, pg_schema: str
) -> None:
    """With 30,000 overdue timers over 3 workflows, a claim of 64 walks each workflow's part of
    the due index and reads about 64 rows per workflow (plus the 64 it updates), never every
    due row (EXPLAIN ANALYZE, in a transaction rolled back)."""
    due, limit, workflows = 30_000, 64, ["w0", "w1", "w2"]
    async with engine_on(pg_url, pg_schema):
        pass  # migrated
    conn: asyncpg.Connection = await pg_budget.connect(pg_url)
    try:
        await conn.execute(f'SET search_path TO "{pg_schema}"')
        await conn.execute(
            "INSERT INTO flowlock_instances (id, workflow, state, version, data)"
            " SELECT 'i' || g, 'w' || g % 3, 'pending', 1, '{}' FROM generate_series(1, $1) g",
            due,
        )
        await conn.execute(
            "INSERT INTO flowlock_timers (instance_id, stay, event, workflow, due_at)"
            " SELECT 'i' || g, 1, 'expire', 'w' || g % 3,"
            "        now() - interval '1 hour' + g * interval '1 ms'"
            "   FROM generate_series(1, $1) g",
            due,
        )
        await conn.execute("ANALYZE flowlock_timers")
        tx = conn.transaction()
        await tx.start()
        try:
            [(plan,)] = await conn.fetch(
                "EXPLAIN (ANALYZE, FORMAT JSON) " + CLAIM, workflows, limit, 30.0, "me"
            )
        finally:
            await tx.rollback()
    finally:
        await conn.close()
    [top] = json.loads(plan) if isinstance(plan, str) else plan
    read = _timer_rows_read(top["Plan"])
    # Measured: 64 per workflow walked in due order, and 64 rows found by their key to claim.
    assert limit <= read <= 2 * limit * (len(workflows) + 1), read
