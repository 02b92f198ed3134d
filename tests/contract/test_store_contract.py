"""One store-level contract for every store (memory, SQLite, PostgreSQL; the ``store_factory``
fixture is parametrised): the fencing clause of the compare-and-swap, a closed store, and a store
closed while calls are in flight.

What a write left behind is counted without the store's code where the store has a database
(plain ``sqlite3`` for SQLite, plain SQL for PostgreSQL); the memory store's dicts are its
database and are read directly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from typing import Any

import pytest

import pg_budget
from flowlock.core.errors import EngineClosed, InstanceNotFound, InvalidInput
from flowlock.core.models import Escalation, HistoryEntry, Instance, InstanceQuery, Snapshot
from flowlock.stores import MemoryStore, Store
from flowlock.stores.base import EscalationBoard, LockedResult, RowLock
from flowlock.stores.postgres import PostgresStore
from flowlock.stores.sqlite import SqliteStore

StoreFactory = Callable[..., Store]
OnDisk = Callable[[Store, str], Awaitable[tuple[int, int]]]

# Every wait in these tests is bounded by this (seconds): generous, so a loaded machine only
# makes a test slower, while a hang still fails it.
BOUND = 60.0


@pytest.fixture
def backend(request: pytest.FixtureRequest, store_factory: StoreFactory) -> str:
    """The store backend this test runs on: "memory", "sqlite" or "postgres"."""
    kind: str = request.node.callspec.params["store_factory"]
    return kind


@pytest.fixture
def on_disk(request: pytest.FixtureRequest, backend: str) -> OnDisk:
    """``await on_disk(store, iid)``: (history rows, version) of the instance as the database
    holds them, counted without the store's code."""
    if backend == "postgres":
        sql_history = request.getfixturevalue("sql_history")

        async def pg(store: Store, iid: str) -> tuple[int, int]:
            counted = await sql_history()
            return counted.rows.get(iid, 0), counted.versions[iid]

        return pg
    if backend == "sqlite":

        async def lite(store: Store, iid: str) -> tuple[int, int]:
            assert isinstance(store, SqliteStore)
            conn = sqlite3.connect(store.path)
            try:
                [(rows,)] = conn.execute(
                    "SELECT count(*) FROM flowlock_history WHERE instance_id = ?", (iid,)
                ).fetchall()
                [(version,)] = conn.execute(
                    "SELECT version FROM flowlock_instances WHERE id = ?", (iid,)
                ).fetchall()
            finally:
                conn.close()
            return int(rows), int(version)

        return lite

    async def memory(store: Store, iid: str) -> tuple[int, int]:
        assert isinstance(store, MemoryStore)
        return len(store._history[iid]), store._instances[iid].version

    return memory


def new(iid: str = "i") -> Instance:
    return Instance(id=iid, workflow="w", state="a", version=1, data={"n": 0})


def entry(
    inst: Instance, *, token: int | None = None, request_id: str | None = None
) -> HistoryEntry:
    """The next transition of ``inst`` (at its version + 1), carrying ``token``."""
    return HistoryEntry(
        instance_id=inst.id,
        version=inst.version + 1,
        event="go",
        from_state=inst.state,
        to_state="b" if inst.state == "a" else "a",
        actor="tester",
        request_id=request_id,
        strategy="distributed" if token is not None else "optimistic",
        data={"n": int(inst.data["n"]) + 1},
        fencing_token=token,
    )


@asynccontextmanager
async def opened(*stores: Store) -> AsyncIterator[None]:
    for store in stores:
        await store.open()
    try:
        yield
    finally:
        for store in stores:
            await store.aclose()


async def wait_until(condition: Callable[[], bool]) -> None:
    """Poll ``condition`` until it holds; fail after BOUND seconds."""
    deadline = time.monotonic() + BOUND
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def closing_began(store: Store) -> bool:
    """Whether ``aclose`` has begun on ``store`` (it refuses new calls from then on)."""
    if isinstance(store, MemoryStore):
        return not store._open
    assert isinstance(store, SqliteStore | PostgresStore)
    return store._pool is None


# -- fencing -----------------------------------------------------------------------------------


async def test_a_lower_fencing_token_is_refused_by_the_fencing_clause(
    store_factory: StoreFactory, on_disk: OnDisk
) -> None:
    """A commit at the current version with a new request id, refused only because its fencing
    token is lower than the last one written, returns None and writes nothing; the same entry
    with the last token, then a higher one, is accepted and raises the floor; a write without a
    token is not fenced and leaves the floor where it was."""
    holder, zombie = store_factory(), store_factory()  # two processes on one database
    async with opened(holder, zombie):
        created = await holder.create(new())
        first = await holder.commit((entry(created, token=5, request_id="r5"),))
        assert first is not None and first.version == 2
        assert await zombie.fencing_floor("i") == 5
        before = await zombie.history("i")

        # Version current, request id new: only the fencing clause can refuse this one.
        stale = entry(first, token=4, request_id="stale")
        assert await zombie.commit((stale,)) is None
        assert await zombie.get("i") == first
        assert await zombie.history("i") == before
        assert await zombie.fencing_floor("i") == 5
        assert await on_disk(zombie, "i") == (1, 2)

        # The very same entry with only the token changed goes through: nothing of the refused
        # write was kept (its request id is still new).
        equal = await zombie.commit((dataclasses.replace(stale, fencing_token=5),))
        assert equal is not None and equal.version == 3
        higher = await zombie.commit((entry(equal, token=9, request_id="r9"),))
        assert higher is not None and higher.version == 4
        assert await holder.fencing_floor("i") == 9
        assert await holder.commit((entry(higher, token=5, request_id="late"),)) is None
        unfenced = await holder.commit((entry(higher, request_id="plain"),))
        assert unfenced is not None and unfenced.version == 5
        assert await holder.fencing_floor("i") == 9

        history = await holder.history("i")
        assert [(h.version, h.request_id, h.fencing_token) for h in history] == [
            (2, "r5", 5),
            (3, "stale", 5),
            (4, "r9", 9),
            (5, "plain", None),
        ]
        assert await on_disk(holder, "i") == (4, 5)


# -- history pages -------------------------------------------------------------------------------


async def test_history_is_read_a_page_at_a_time(store_factory: StoreFactory) -> None:
    """`history(after=, limit=)` returns the entries of versions above `after`, oldest first, at
    most `limit`; None is no limit; past the end is empty; a missing instance is
    InstanceNotFound, also for a page."""
    store = store_factory()
    async with opened(store):
        inst = await store.create(new())
        for k in range(7):
            written = await store.commit((entry(inst, request_id=f"r{k}"),))
            assert written is not None
            inst = written
        versions = [h.version for h in await store.history("i")]
        assert versions == list(range(2, 9))
        assert [h.version for h in await store.history("i", after=3, limit=2)] == [4, 5]
        assert [h.version for h in await store.history("i", after=6)] == [7, 8]
        assert [h.request_id for h in await store.history("i", limit=1)] == ["r0"]
        assert await store.history("i", after=8, limit=5) == []
        with pytest.raises(InstanceNotFound):
            await store.history("nope", after=1, limit=1)


# -- a closed store ------------------------------------------------------------------------------


Call = Callable[[], Coroutine[Any, Any, Any]]


def every_operation(store: Store, inst: Instance) -> dict[str, Call]:
    """Each operation of the Store port (and of the escalation board, for the stores that are
    one), as a call to make."""

    def plan(snap: Snapshot) -> tuple[HistoryEntry, ...]:
        return (entry(snap.instance, request_id="locked"),)

    calls: dict[str, Call] = {
        "migrate": store.migrate,
        "create": lambda: store.create(new("other")),
        "get": lambda: store.get(inst.id),
        "read": lambda: store.read(inst.id, ("r",)),
        "commit": lambda: store.commit((entry(inst, request_id="closed"),)),
        "commit_many": lambda: store.commit_many([(entry(inst, request_id="closed"),)]),
        "commit_many []": lambda: store.commit_many([]),
        "apply_locked": lambda: store.apply_locked(inst.id, (), plan, RowLock(timeout=5)),
        "history": lambda: store.history(inst.id),
        "fencing_floor": lambda: store.fencing_floor(inst.id),
        "list_instances": lambda: store.list_instances(InstanceQuery(), after=None, limit=10),
        "count_instances": lambda: store.count_instances(InstanceQuery()),
    }
    if isinstance(store, EscalationBoard):
        board = store
        calls["publish"] = lambda: board.publish(Escalation(inst.id, "pessimistic", 1e12, "x"))
        calls["active"] = lambda: board.active(0.0)
        calls["now"] = lambda: board.now()
    return calls


async def test_a_closed_store_refuses_every_operation(
    backend: str, store_factory: StoreFactory, on_disk: OnDisk
) -> None:
    """Before open and after aclose every operation (the escalation board's too) raises
    EngineClosed and writes nothing; aclose is idempotent; reopened, the store has what was
    committed before it closed."""
    store = store_factory()
    refused: dict[str, list[str]] = {"before open": [], "after close": []}
    for name, call in every_operation(store, new().evolve(version=1)).items():
        with pytest.raises(EngineClosed):
            await call()
        refused["before open"].append(name)

    await store.open()
    committed = await store.commit((entry(await store.create(new()), request_id="kept"),))
    assert committed is not None
    await store.aclose()
    await store.aclose()
    for name, call in every_operation(store, committed).items():
        with pytest.raises(EngineClosed):
            await call()
        refused["after close"].append(name)
    expected = {"migrate", "create", "get", "read", "commit", "commit_many", "commit_many []"}
    expected |= {"apply_locked", "history"}
    expected |= {"fencing_floor", "list_instances", "count_instances"}
    expected |= {"publish", "active", "now"} if backend != "sqlite" else set()
    assert set(refused["before open"]) == set(refused["after close"]) == expected

    async with opened(store):
        assert await store.get("i") == committed
        assert [h.request_id for h in await store.history("i")] == ["kept"]
        with pytest.raises(InstanceNotFound):  # the create refused while closed left nothing
            await store.get("other")
        assert await on_disk(store, "i") == (1, 2)


# -- closing while calls are in flight -----------------------------------------------------------


async def test_closing_while_a_pessimistic_call_holds_the_row_lock(
    backend: str, store_factory: StoreFactory, on_disk: OnDisk
) -> None:
    """aclose while a pessimistic call holds the instance's lock (one connection in the pool,
    and a pessimistic call and a read queued behind the holder): the holder commits whole and
    close waits for it; a call made once close began raises EngineClosed; the queued calls end
    with EngineClosed on the SQL stores, never a driver error, while the memory store (which has
    no connections to wait for) lets them finish; no transition is half applied; nothing
    hangs."""
    # One connection (SQLite: and a writer queue bounded by busy_timeout, not 5 s).
    store = (
        store_factory(pool_size=1, busy_timeout=BOUND)
        if backend == "sqlite"
        else (store_factory(pool_size=1))
    )
    await store.open()
    closed = False
    try:
        await store.create(new())
        loop = asyncio.get_running_loop()
        tasks: dict[str, asyncio.Task[Any]] = {}

        def queued_plan(snap: Snapshot) -> tuple[HistoryEntry, ...]:
            return (entry(snap.instance, request_id="queued"),)

        def start_queued_call_and_close() -> None:
            # In this order: the queued call is waiting (for the lock or a connection) before
            # close begins.
            tasks["queued"] = loop.create_task(
                store.apply_locked("i", ("queued",), queued_plan, RowLock(timeout=BOUND))
            )
            tasks["queued read"] = loop.create_task(store.read("i", ()))
            tasks["close"] = loop.create_task(store.aclose())

        async def start_and_wait() -> None:
            start_queued_call_and_close()
            await wait_until(lambda: closing_began(store))

        def holder_plan(snap: Snapshot) -> tuple[HistoryEntry, ...]:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                # SQLite runs the plan on its connection's thread, the write lock held: wait
                # there until close has begun.
                asyncio.run_coroutine_threadsafe(start_and_wait(), loop).result(BOUND)
            else:
                # The memory and PostgreSQL stores run it on the event loop, the row lock held:
                # the two tasks run as soon as the holder next awaits, before it commits.
                start_queued_call_and_close()
            return (entry(snap.instance, request_id="holder"),)

        async with asyncio.timeout(BOUND):
            held = await store.apply_locked("i", ("holder",), holder_plan, RowLock(timeout=BOUND))
            assert closing_began(store)  # close began before the holder returned
            with pytest.raises(EngineClosed):
                await store.get("i")
            await tasks["close"]
            closed = True
            queued = await asyncio.gather(
                tasks["queued"], tasks["queued read"], return_exceptions=True
            )
        assert held.committed is not None and held.committed.version == 2
        if backend == "memory":
            finished, read = queued
            assert isinstance(finished, LockedResult)
            assert finished.committed is not None and finished.committed.version == 3
            assert isinstance(read, Snapshot)
            assert await on_disk(store, "i") == (2, 3)
        else:
            assert [type(outcome) for outcome in queued] == [EngineClosed, EngineClosed], queued
            assert await on_disk(store, "i") == (1, 2)
    finally:
        if not closed:
            await store.aclose()


@asynccontextmanager
async def writer_elsewhere(
    backend: str, store: Store, pg_url: str | None
) -> AsyncIterator[Callable[[], Awaitable[None]]]:
    """Another connection holding the instance "i" for writing (the row lock on PostgreSQL,
    the database's write lock on SQLite); yields the coroutine function that lets it go."""
    if isinstance(store, PostgresStore):
        assert pg_url is not None
        conn = await pg_budget.connect(pg_url)
        await conn.execute(f'SET search_path TO "{store.schema}"')
        await conn.execute("BEGIN")
        await conn.execute("SELECT 1 FROM flowlock_instances WHERE id = 'i' FOR UPDATE")

        async def release_pg() -> None:
            await conn.execute("ROLLBACK")

        try:
            yield release_pg
        finally:
            await conn.close()
    else:
        assert isinstance(store, SqliteStore)
        lite = sqlite3.connect(store.path, isolation_level=None)
        lite.execute("BEGIN IMMEDIATE")

        async def release_sqlite() -> None:
            if lite.in_transaction:
                lite.execute("ROLLBACK")

        try:
            yield release_sqlite
        finally:
            await release_sqlite()
            lite.close()


async def waiting_on_a_lock(store: Store, pg_url: str | None) -> bool:
    """Whether ``store``'s commit is waiting for the other writer's lock (in the database)."""
    if isinstance(store, PostgresStore):
        assert pg_url is not None
        conn = await pg_budget.connect(pg_url)
        try:
            waiting = await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE application_name = $1 AND wait_event_type = 'Lock'",
                store.application_name,
            )
        finally:
            await conn.close()
        return bool(waiting)
    assert isinstance(store, SqliteStore)
    pool = store._pool
    # The commit holds the store's writer queue and its only connection, on which SQLite's busy
    # handler waits for the other writer.
    return pool is not None and pool.write_lock.locked() and pool.idle.empty()


async def test_closing_while_an_optimistic_commit_is_in_flight(
    request: pytest.FixtureRequest, backend: str, store_factory: StoreFactory, on_disk: OnDisk
) -> None:
    """aclose while a commit's compare-and-swap is in flight (on the SQL stores, waiting for
    another connection's lock): the commit finishes and its row is written whole, close waits
    for it, a call made once close began raises EngineClosed; nothing hangs."""
    pg_url: str | None = request.getfixturevalue("pg_url") if backend == "postgres" else None
    if backend == "postgres":
        app = f"flowlock-close-{uuid.uuid4().hex[:8]}"
        store = store_factory(pool_size=1, lock_timeout=BOUND, application_name=app)
    elif backend == "sqlite":
        store = store_factory(pool_size=1, busy_timeout=BOUND)
    else:
        store = store_factory()
    await store.open()
    closed = False
    try:
        created = await store.create(new())
        async with asyncio.timeout(BOUND):
            if backend == "memory":
                # Its commit yields once (as a database round trip would) before it writes:
                # close begins right there.
                commit = asyncio.create_task(store.commit((entry(created, request_id="c"),)))
                await asyncio.sleep(0)  # the commit checked that the store is open, and yielded
                assert not commit.done()
                await store.aclose()  # closes at once, without yielding to the commit
                assert closing_began(store) and not commit.done()
                closing = asyncio.create_task(store.aclose())  # idempotent; awaited below
            else:
                async with writer_elsewhere(backend, store, pg_url) as let_go:
                    commit = asyncio.create_task(store.commit((entry(created, request_id="c"),)))
                    deadline = time.monotonic() + BOUND
                    while not await waiting_on_a_lock(store, pg_url):
                        assert time.monotonic() < deadline, "the commit never waited"
                        await asyncio.sleep(0.01)
                    closing = asyncio.create_task(store.aclose())
                    await wait_until(lambda: closing_began(store))
                    assert not commit.done() and not closing.done()
                    await let_go()
            with pytest.raises(EngineClosed):
                await store.get("i")
            committed = await commit
            await closing
            closed = True
        assert committed is not None and committed.version == 2
        assert await on_disk(store, "i") == (1, 2)
    finally:
        if not closed:
            await store.aclose()


# -- batches: k entries of one instance with one compare-and-swap ---------------------------------


def chain(
    inst: Instance,
    request_ids: Sequence[str | None],
    *,
    token: int | None = None,
    actor: str = "tester",
) -> list[HistoryEntry]:
    """len(request_ids) transitions of ``inst`` in a row (versions v + 1 ... v + k), each with
    its own event, actor, data and payload, carrying ``token``."""
    out: list[HistoryEntry] = []
    state, n = inst.state, int(inst.data["n"])
    for i, rid in enumerate(request_ids):
        to_state = "b" if state == "a" else "a"
        n += 1
        out.append(
            HistoryEntry(
                instance_id=inst.id,
                version=inst.version + 1 + i,
                event=f"go{i}",
                from_state=state,
                to_state=to_state,
                actor=f"{actor}{i}",
                request_id=rid,
                strategy="distributed" if token is not None else "optimistic",
                data={"n": n},
                fencing_token=token,
                payload={"call": i},
            )
        )
        state = to_state
    return out


def fields(entries: Sequence[HistoryEntry]) -> list[HistoryEntry]:
    """What the history rows hold, but ``at`` (the store's clock)."""
    return [dataclasses.replace(e, at=None) for e in entries]


async def unchanged(
    store: Store, on_disk: OnDisk, inst: Instance, history: Sequence[HistoryEntry]
) -> None:
    """The instance and its history are as they were: nothing of a refused write was kept."""
    assert await store.get(inst.id) == inst
    assert await store.history(inst.id) == list(history)
    assert await on_disk(store, inst.id) == (len(history), inst.version)


async def test_a_batch_moves_the_instance_by_k_versions_and_appends_k_rows(
    store_factory: StoreFactory, on_disk: OnDisk
) -> None:
    """One commit of three entries from version 1: the instance is at version 4 with the last
    entry's state, data and event; the three rows each keep their own fields (event, actor,
    request id, data, payload, fencing token) and share one ``at``; the answer is the instance
    as stored."""
    store = store_factory()
    async with opened(store):
        created = await store.create(new())
        batch = chain(created, ["r1", None, "r3"], token=3)
        committed = await store.commit(batch)
        assert committed is not None
        assert (committed.version, committed.state, committed.last_event) == (4, "b", "go2")
        assert committed.data == {"n": 3}
        assert await store.get("i") == committed
        history = await store.history("i")
        assert fields(history) == fields(batch)
        assert len({h.at for h in history}) == 1 and history[0].at is not None
        assert await store.fencing_floor("i") == 3
        assert await on_disk(store, "i") == (3, 4)

        # A one-entry sequence is a batch of one; a plain entry still works as before.
        one = await store.commit(chain(committed, ["r4"]))
        assert one is not None and one.version == 5
        plain = await store.commit((chain(one, ["r5"])[0],))
        assert plain is not None and plain.version == 6
        assert await on_disk(store, "i") == (5, 6)


async def test_a_batch_from_a_stale_version_writes_nothing(
    store_factory: StoreFactory, on_disk: OnDisk
) -> None:
    """A batch decided on version 1 after another writer moved the instance to 2: None, and
    none of its entries is written (its request ids stay new)."""
    store = store_factory()
    async with opened(store):
        created = await store.create(new())
        rival = await store.commit(chain(created, ["rival"]))
        assert rival is not None
        before = await store.history("i")
        late = chain(created, ["a", "b", "c"])
        assert await store.commit(late) is None
        await unchanged(store, on_disk, rival, before)
        snap = await store.read("i", ["a", "b", "c"])
        assert snap.priors == {}
        # The same calls decided again on the current version go through.
        again = await store.commit(chain(rival, ["a", "b", "c"]))
        assert again is not None and again.version == 5


async def test_a_batch_with_a_lower_fencing_token_is_refused(
    store_factory: StoreFactory, on_disk: OnDisk
) -> None:
    """A batch at the current version with new request ids whose token is below the floor: None
    and nothing written; with the floor's token it goes through and every row keeps its
    token."""
    holder, zombie = store_factory(), store_factory()
    async with opened(holder, zombie):
        created = await holder.create(new())
        first = await holder.commit(chain(created, ["h1", "h2"], token=7))
        assert first is not None and first.version == 3
        before = await zombie.history("i")
        assert await zombie.commit(chain(first, ["z1", "z2", "z3"], token=6)) is None
        await unchanged(zombie, on_disk, first, before)
        assert await zombie.fencing_floor("i") == 7
        equal = await zombie.commit(chain(first, ["z1", "z2", "z3"], token=7))
        assert equal is not None and equal.version == 6
        history = await holder.history("i")
        assert [(h.version, h.fencing_token) for h in history] == [(v, 7) for v in range(2, 7)]


async def test_a_batch_with_a_request_id_already_applied_writes_nothing(
    store_factory: StoreFactory, on_disk: OnDisk
) -> None:
    """A batch at the current version whose middle entry carries a request id already in the
    history: None, and neither that entry nor the others around it is written."""
    store = store_factory()
    async with opened(store):
        created = await store.create(new())
        done = await store.commit(chain(created, ["old"]))
        assert done is not None
        before = await store.history("i")
        assert await store.commit(chain(done, ["new1", "old", "new2"])) is None
        await unchanged(store, on_disk, done, before)
        assert (await store.read("i", ["new1", "new2"])).priors == {}


async def test_a_malformed_batch_is_invalid_input_and_writes_nothing(
    store_factory: StoreFactory, on_disk: OnDisk
) -> None:
    """commit, commit_many and a plan of apply_locked refuse a batch that is empty (commit),
    spans two instances, skips a version, or carries one request id twice: InvalidInput, and
    nothing is written, not even the well-formed part."""
    store = store_factory()
    async with opened(store):
        inst = await store.create(new())
        other = await store.create(new("j"))
        good = chain(inst, ["g1", "g2", "g3"])
        bad: dict[str, list[HistoryEntry]] = {
            "two instances": [good[0], chain(other, ["j1"])[0]],
            "a version skipped": [good[0], good[2]],
            "out of order": [good[1], good[0]],
            "a request id twice": [good[0], dataclasses.replace(good[1], request_id="g1")],
        }
        with pytest.raises(InvalidInput):
            await store.commit([])
        for batch in bad.values():
            with pytest.raises(InvalidInput):
                await store.commit(batch)
            with pytest.raises(InvalidInput):
                await store.commit_many([chain(other, ["j1"]), batch])

            def plan(snap: Snapshot, batch: list[HistoryEntry] = batch) -> list[HistoryEntry]:
                return batch

            with pytest.raises(InvalidInput):
                await store.apply_locked("i", (), plan, RowLock(timeout=BOUND))
            for created in (inst, other):
                await unchanged(store, on_disk, created, [])
        assert await store.commit(good) is not None


async def test_read_with_several_request_ids_returns_exactly_the_found_priors(
    store_factory: StoreFactory,
) -> None:
    """A read for a sequence of request ids is one snapshot: the instance and, in ``priors``,
    the entry of each id applied on this instance (an id applied on another instance, or
    never, is absent). One id reads as a batch of one; no id, as an empty sequence."""
    store = store_factory()
    async with opened(store):
        inst = await store.create(new())
        other = await store.create(new("j"))
        committed = await store.commit(chain(inst, ["a", None, "c"]))
        assert committed is not None
        assert await store.commit(chain(other, ["elsewhere"])) is not None
        history = await store.history("i")

        snap = await store.read("i", ["c", "missing", "a", "elsewhere", "a"])
        assert snap.instance == committed
        assert snap.priors == {"a": history[0], "c": history[2]}
        assert (await store.read("i", [])).priors == {}
        assert (await store.read("i", ("missing",))).priors == {}

        single = await store.read("i", ("c",))
        assert single.priors == {"c": history[2]}
        bare = await store.read("i", ())
        assert bare.priors == {} and bare.instance == committed


async def test_apply_locked_writes_a_planned_batch_or_nothing(
    store_factory: StoreFactory, on_disk: OnDisk
) -> None:
    """apply_locked reads the priors of several request ids under the lock and writes the batch
    the plan returns with one compare-and-swap; a plan that returns an empty sequence (or None)
    writes nothing; a planned batch that cannot apply (a request id already applied) is the
    plan's bug: InvalidInput, nothing written."""
    store = store_factory()
    async with opened(store):
        inst = await store.create(new())
        seen: list[Snapshot] = []

        def batch_plan(snap: Snapshot) -> list[HistoryEntry]:
            seen.append(snap)
            return chain(snap.instance, ["p1", "p2"])

        result = await store.apply_locked("i", ["p1", "p2"], batch_plan, RowLock(timeout=BOUND))
        assert seen == [result.snapshot] and result.snapshot.priors == {}
        assert result.snapshot.instance == inst
        assert result.committed is not None and result.committed.version == 3
        assert await store.get("i") == result.committed
        history = await store.history("i")
        assert [h.request_id for h in history] == ["p1", "p2"]
        assert await on_disk(store, "i") == (2, 3)

        def nothing(snap: Snapshot) -> list[HistoryEntry]:
            seen.append(snap)
            return []

        empty = await store.apply_locked("i", ["p2", "p3"], nothing, RowLock(timeout=BOUND))
        assert empty.committed is None
        assert empty.snapshot.priors == {"p2": history[1]}
        none = await store.apply_locked("i", ["p1"], lambda s: None, RowLock(timeout=BOUND))
        assert none.committed is None and none.snapshot.priors == {"p1": history[0]}
        await unchanged(store, on_disk, result.committed, history)

        def replays(snap: Snapshot) -> list[HistoryEntry]:
            return chain(snap.instance, ["p3", "p1"])

        with pytest.raises(InvalidInput):
            await store.apply_locked("i", ["p3", "p1"], replays, RowLock(timeout=BOUND))
        await unchanged(store, on_disk, result.committed, history)


async def test_commit_many_commits_the_winners_and_writes_nothing_of_the_losers(
    store_factory: StoreFactory, on_disk: OnDisk
) -> None:
    """commit_many with four instances: two batches at their current version commit; one from a
    stale version and one carrying an applied request id lose (None at their places, nothing of
    theirs written); the answers come in input order; an empty call answers []."""
    store = store_factory()
    async with opened(store):
        made = {iid: await store.create(new(iid)) for iid in ("w1", "stale", "w2", "replay")}
        moved = await store.commit(chain(made["stale"], ["moved"]))
        applied = await store.commit(chain(made["replay"], ["once"]))
        assert moved is not None and applied is not None
        before = {iid: await store.history(iid) for iid in ("stale", "replay")}

        answers = await store.commit_many(
            [
                chain(made["w1"], ["a", "b"]),
                chain(made["stale"], ["s1", "s2"]),  # decided on version 1; it is at 2
                (chain(made["w2"], ["c"])[0],),  # a plain entry is a batch of one
                chain(applied, ["fresh", "once"]),
            ]
        )
        w1, lost_stale, w2, lost_replay = answers
        assert lost_stale is None and lost_replay is None
        assert isinstance(w1, Instance) and (w1.id, w1.version, w1.data) == ("w1", 3, {"n": 2})
        assert isinstance(w2, Instance) and (w2.id, w2.version) == ("w2", 2)
        assert await store.get("w1") == w1 and await store.get("w2") == w2
        assert [h.request_id for h in await store.history("w1")] == ["a", "b"]
        assert await on_disk(store, "w1") == (2, 3)
        assert await on_disk(store, "w2") == (1, 2)
        await unchanged(store, on_disk, moved, before["stale"])
        await unchanged(store, on_disk, applied, before["replay"])
        assert await store.commit_many([]) == []


async def test_commit_many_refuses_an_instance_twice(
    store_factory: StoreFactory, on_disk: OnDisk
) -> None:
    """Two batches of one instance in one commit_many: InvalidInput before anything is written,
    the other instance's well-formed batch included."""
    store = store_factory()
    async with opened(store):
        inst = await store.create(new())
        other = await store.create(new("j"))
        first, second = chain(inst, ["x", "y"])
        with pytest.raises(InvalidInput):
            await store.commit_many([[first], chain(other, ["j1"]), [second]])
        await unchanged(store, on_disk, inst, [])
        await unchanged(store, on_disk, other, [])
