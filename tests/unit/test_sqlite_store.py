"""SQLite-specific tests for flowlock.stores.sqlite.SqliteStore (the shared contract suite
covers what every store must do; these cover threads, WAL, busy timeouts and migrations)."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC
from pathlib import Path
from typing import Any

import pytest

from flowlock.core import migrations
from flowlock.core.errors import (
    EngineClosed,
    InstanceExists,
    InstanceNotFound,
    InvalidInput,
    LockBusy,
    LockTimeout,
    MigrationError,
    StoreBusy,
    StoreError,
)
from flowlock.core.models import HistoryEntry, Instance, Snapshot
from flowlock.stores.base import RowLock, Store
from flowlock.stores.sqlite import SqliteStore


def new_instance(instance_id: str = "i-1", **data: Any) -> Instance:
    return Instance(id=instance_id, workflow="order", state="new", version=0, data=data)


def step(
    inst: Instance,
    *,
    to_state: str | None = None,
    request_id: str | None = None,
    data: dict[str, Any] | None = None,
    version: int | None = None,
) -> HistoryEntry:
    return HistoryEntry(
        instance_id=inst.id,
        version=inst.version + 1 if version is None else version,
        event="go",
        from_state=inst.state,
        to_state=to_state or inst.state,
        actor="tester",
        request_id=request_id,
        strategy="optimistic",
        data=dict(inst.data) if data is None else data,
    )


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "flowlock.db"


@pytest.fixture
async def store(db_path: Path) -> AsyncIterator[SqliteStore]:
    s = SqliteStore(db_path)
    await s.open()
    yield s
    await s.aclose()


@pytest.fixture
def write_lock_holder(db_path: Path, store: SqliteStore) -> Iterator[sqlite3.Connection]:
    """A plain sqlite3 connection holding the database's write lock (BEGIN IMMEDIATE)."""
    conn = sqlite3.connect(db_path, isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    yield conn
    conn.execute("ROLLBACK")
    conn.close()


def raw_rows(path: Path, sql: str) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


async def test_satisfies_store_protocol(store: SqliteStore) -> None:
    """SqliteStore is a Store."""
    assert isinstance(store, Store)


async def test_connection_pragmas(db_path: Path, store: SqliteStore) -> None:
    """The database file is in WAL mode after open."""
    assert raw_rows(db_path, "PRAGMA journal_mode") == [("wal",)]


async def test_create_and_get(store: SqliteStore) -> None:
    """create stores version 1 with aware UTC timestamps; get returns the same."""
    created = await store.create(new_instance(n=1, text="é"))
    assert created.version == 1
    assert created.data == {"n": 1, "text": "é"}
    assert created.created_at is not None
    assert created.created_at.tzinfo is not None
    assert created.created_at.utcoffset() == UTC.utcoffset(None)
    assert created.created_at == created.updated_at
    assert await store.get("i-1") == created


async def test_data_is_compact_json_text(db_path: Path, store: SqliteStore) -> None:
    """data is stored as compact, non-ASCII-escaped JSON text."""
    await store.create(new_instance(a=[1, 2], t="é"))
    assert raw_rows(db_path, "SELECT data FROM flowlock_instances") == [('{"a":[1,2],"t":"é"}',)]


async def test_create_existing_raises(store: SqliteStore) -> None:
    """A second create with the same id raises InstanceExists."""
    await store.create(new_instance())
    with pytest.raises(InstanceExists):
        await store.create(new_instance())


async def test_create_non_json_data_raises_invalid_input(store: SqliteStore) -> None:
    """Data that is not JSON is refused before anything is written."""
    with pytest.raises(InvalidInput):
        await store.create(new_instance(bad={1, 2}))
    with pytest.raises(InstanceNotFound):
        await store.get("i-1")


async def test_missing_instance_raises_not_found(store: SqliteStore) -> None:
    """get, read, history and apply_locked raise InstanceNotFound for an unknown id."""
    with pytest.raises(InstanceNotFound):
        await store.get("nope")
    with pytest.raises(InstanceNotFound):
        await store.read("nope", ())
    with pytest.raises(InstanceNotFound):
        await store.history("nope")
    with pytest.raises(InstanceNotFound):
        await store.apply_locked("nope", (), lambda snap: None, RowLock())


async def test_commit_cas_success(store: SqliteStore) -> None:
    """commit moves the instance to the entry and appends it to history."""
    inst = await store.create(new_instance(n=0))
    committed = await store.commit((step(inst, to_state="paid", request_id="r1", data={"n": 1}),))
    assert committed is not None
    assert (committed.version, committed.state, committed.last_event) == (2, "paid", "go")
    assert committed.data == {"n": 1}
    assert committed.created_at == inst.created_at
    assert await store.get(inst.id) == committed
    [entry] = await store.history(inst.id)
    assert (entry.version, entry.request_id, entry.to_state) == (2, "r1", "paid")
    assert entry.at == committed.updated_at


async def test_commit_stale_version_returns_none(store: SqliteStore) -> None:
    """A commit from a stale version returns None and writes nothing."""
    inst = await store.create(new_instance(n=0))
    assert await store.commit((step(inst, data={"n": 1}),)) is not None
    assert await store.commit((step(inst, data={"n": 99}, request_id="late"),)) is None
    current = await store.get(inst.id)
    assert (current.version, current.data) == (2, {"n": 1})
    assert [e.version for e in await store.history(inst.id)] == [2]


async def test_commit_duplicate_request_id_returns_none(store: SqliteStore) -> None:
    """A commit whose request_id was already applied returns None and writes nothing."""
    inst = await store.create(new_instance(n=0))
    first = await store.commit((step(inst, request_id="r1", data={"n": 1}),))
    assert first is not None
    assert await store.commit((step(first, request_id="r1", data={"n": 2}),)) is None
    current = await store.get(inst.id)
    assert (current.version, current.data) == (2, {"n": 1})
    assert len(await store.history(inst.id)) == 1


async def test_commit_unknown_instance_raises(store: SqliteStore) -> None:
    """A commit for an instance that does not exist raises InstanceNotFound."""
    ghost = new_instance("ghost").evolve(version=1)
    with pytest.raises(InstanceNotFound):
        await store.commit((step(ghost),))


async def test_read_returns_prior_entry_for_request_id(store: SqliteStore) -> None:
    """read returns the history entry of an applied request_id, nothing for a new one."""
    inst = await store.create(new_instance())
    committed = await store.commit((step(inst, request_id="r1"),))
    snap = await store.read(inst.id, ("r1",))
    assert snap.instance == committed
    assert list(snap.priors) == ["r1"]
    assert snap.priors["r1"].request_id == "r1"
    assert (await store.read(inst.id, ("r2",))).priors == {}
    assert (await store.read(inst.id, ())).priors == {}


async def test_read_finds_the_priors_of_many_request_ids(store: SqliteStore) -> None:
    """A read for more request ids than one SELECT binds (1,200, looked up in chunks) is still
    one snapshot with every one found."""
    inst = await store.create(new_instance(n=0))
    batch = [
        step(inst, version=inst.version + 1 + i, request_id=f"r{i}", data={"n": i})
        for i in range(1200)
    ]
    assert await store.commit(batch) is not None
    wanted = [f"r{i}" for i in range(0, 2400, 2)]  # every other one applied
    snap = await store.read(inst.id, wanted)
    assert sorted(snap.priors) == sorted(f"r{i}" for i in range(0, 1200, 2))
    assert all(snap.priors[rid].request_id == rid for rid in snap.priors)


async def test_commit_many_on_a_missing_instance_writes_nothing(
    db_path: Path, store: SqliteStore
) -> None:
    """One batch of commit_many names an instance that does not exist: InstanceNotFound, and
    the whole transaction rolled back (the other batch, at its current version, left no row)."""
    inst = await store.create(new_instance())
    ghost = step(new_instance("ghost"), version=2)
    with pytest.raises(InstanceNotFound):
        await store.commit_many([(step(inst, request_id="a"),), (ghost,)])
    assert raw_rows(db_path, "SELECT count(*) FROM flowlock_history") == [(0,)]
    assert raw_rows(db_path, "SELECT version FROM flowlock_instances") == [(1,)]


async def test_apply_locked_writes_plan_entry(store: SqliteStore) -> None:
    """apply_locked runs the plan on what it read and commits the entry it returns."""
    inst = await store.create(new_instance(n=0))
    seen: list[Snapshot] = []

    def plan(snap: Snapshot) -> tuple[HistoryEntry, ...]:
        seen.append(snap)
        return (step(snap.instance, to_state="paid", request_id="r1", data={"n": 1}),)

    result = await store.apply_locked(inst.id, ("r1",), plan, RowLock())
    assert seen == [result.snapshot]
    assert result.snapshot.instance == inst
    assert result.snapshot.priors == {}
    assert result.committed is not None
    assert result.committed.version == 2
    assert await store.get(inst.id) == result.committed
    again = await store.apply_locked(inst.id, ("r1",), lambda snap: None, RowLock())
    assert again.committed is None
    assert list(again.snapshot.priors) == ["r1"]
    assert again.snapshot.priors["r1"].version == 2


async def test_apply_locked_plan_raising_rolls_back(store: SqliteStore) -> None:
    """When the plan raises, nothing is written and the exception propagates."""
    inst = await store.create(new_instance(n=0))

    def plan(snap: Snapshot) -> tuple[HistoryEntry, ...]:
        raise RuntimeError("guard blew up")

    with pytest.raises(RuntimeError, match="guard blew up"):
        await store.apply_locked(inst.id, (), plan, RowLock())
    assert await store.get(inst.id) == inst
    assert await store.history(inst.id) == []
    # The connection is usable afterwards: the transaction did not stay open.
    ok = await store.apply_locked(inst.id, (), lambda s: (step(s.instance),), RowLock())
    assert ok.committed is not None
    assert ok.committed.version == 2


async def test_apply_locked_bad_plan_entry_rolls_back(store: SqliteStore) -> None:
    """A plan returning the wrong version is refused as InvalidInput and nothing is written."""
    inst = await store.create(new_instance())
    with pytest.raises(InvalidInput, match="version 7"):
        await store.apply_locked(inst.id, (), lambda s: (step(s.instance, version=7),), RowLock())
    assert await store.history(inst.id) == []


async def test_apply_locked_nowait_raises_lock_busy(
    store: SqliteStore, write_lock_holder: sqlite3.Connection
) -> None:
    """With the write lock held by another connection, nowait raises LockBusy without waiting
    for it (the busy timeout is 5 s; the bound below leaves a loaded machine room)."""
    started = time.monotonic()
    with pytest.raises(LockBusy):
        await store.apply_locked("i-1", (), lambda s: None, RowLock(nowait=True))
    assert time.monotonic() - started < store.busy_timeout


async def test_apply_locked_timeout_raises_lock_timeout(
    store: SqliteStore, write_lock_holder: sqlite3.Connection
) -> None:
    """With the write lock held by another connection, LockTimeout comes after the bound (not
    before; SQLite counts its busy timeout in whole milliseconds)."""
    bound = 1.0
    started = time.monotonic()
    with pytest.raises(LockTimeout) as caught:
        await store.apply_locked("i-1", (), lambda s: None, RowLock(timeout=bound))
    took = time.monotonic() - started
    assert bound - 0.001 <= took < bound + 5
    assert bound - 0.001 <= caught.value.waited <= took


async def test_busy_timeout_restored_after_bounded_transaction(
    db_path: Path, store: SqliteStore
) -> None:
    """After a nowait failure the connection waits for the full busy_timeout again."""
    holder = sqlite3.connect(db_path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(LockBusy):
            await store.apply_locked("i-1", (), lambda s: None, RowLock(nowait=True))
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    await store.create(new_instance())

    def busy_timeout(conn: sqlite3.Connection) -> int:
        value: int = conn.execute("PRAGMA busy_timeout").fetchone()[0]
        return value

    pool = store._pool
    assert pool is not None
    for worker in pool.workers:
        got = await asyncio.wrap_future(worker.executor.submit(busy_timeout, worker.conn))
        assert got == 5000


async def wait_until(condition: Callable[[], bool], within: float = 30.0) -> None:
    """Poll ``condition`` until it holds; fail after ``within`` seconds."""
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def writing(store: SqliteStore) -> bool:
    """Whether one of ``store``'s writes is running on a connection (its writer queue taken
    and a connection out of the pool)."""
    pool = store._pool
    return pool is not None and pool.write_lock.locked() and pool.idle.qsize() < len(pool.workers)


async def test_commit_waits_for_external_writer(db_path: Path) -> None:
    """A commit waits (on the busy timeout) for a writer in another connection, still waiting
    while that writer holds on, then succeeds once it lets go."""
    async with SqliteStore(db_path, busy_timeout=30) as store:
        inst = await store.create(new_instance())
        holder = sqlite3.connect(db_path, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        try:
            commit = asyncio.create_task(store.commit((step(inst),)))
            await wait_until(lambda: writing(store))
            done, _ = await asyncio.wait({commit}, timeout=0.5)
            assert not done  # waiting for the holder, not failed
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        committed = await asyncio.wait_for(commit, 30)
    assert committed is not None
    assert committed.version == 2


async def test_commit_gives_up_after_busy_timeout(db_path: Path) -> None:
    """A commit whose database another connection keeps write-locked raises LockTimeout after
    busy_timeout (not before, not much later) and writes nothing."""
    bound = 1.0
    async with SqliteStore(db_path, busy_timeout=bound) as store:
        inst = await store.create(new_instance())
        holder = sqlite3.connect(db_path, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        started = time.monotonic()
        try:
            with pytest.raises(LockTimeout) as caught:
                await store.commit((step(inst, request_id="late"),))
            took = time.monotonic() - started
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        assert bound - 0.001 <= took < bound + 5
        assert caught.value.key == inst.id
        assert await store.get(inst.id) == inst
    assert raw_rows(db_path, "SELECT count(*) FROM flowlock_history") == [(0,)]


@pytest.mark.slow
async def test_acquire_timeout_bounds_the_wait_for_a_connection(db_path: Path) -> None:
    """With the store's only connection taken by a write that waits for another connection's
    write lock, a read waits acquire_timeout for a connection (not less, not much more), then
    raises StoreBusy; the waiting write still lands whole once the other writer lets go, and
    nothing else is written."""
    bound = 2.0
    store = SqliteStore(db_path, pool_size=1, acquire_timeout=bound, busy_timeout=60)
    async with store:
        inst = await store.create(new_instance())
        holder = sqlite3.connect(db_path, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        try:
            commit = asyncio.create_task(store.commit((step(inst, request_id="waiting"),)))
            await wait_until(lambda: writing(store))
            started = time.monotonic()
            with pytest.raises(StoreBusy) as caught:
                await store.get(inst.id)
            took = time.monotonic() - started
            assert not commit.done()
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        assert bound <= took < bound + 5
        assert (caught.value.size, caught.value.waited >= bound) == (1, True)
        committed = await asyncio.wait_for(commit, 60)
        assert committed is not None and committed.version == 2
    assert raw_rows(db_path, "SELECT request_id FROM flowlock_history") == [("waiting",)]
    assert raw_rows(db_path, "SELECT version FROM flowlock_instances") == [(2,)]


async def test_readers_not_blocked_by_external_writer(
    store: SqliteStore, write_lock_holder: sqlite3.Connection
) -> None:
    """WAL: reads succeed while another connection holds the write lock (a read waiting for
    it would fail with a busy StoreError after busy_timeout, not InstanceNotFound)."""
    with pytest.raises(InstanceNotFound):
        await asyncio.wait_for(store.get("i-1"), 30)
    assert write_lock_holder.in_transaction


async def test_migrate_is_idempotent(db_path: Path) -> None:
    """migrate applies every migration once and records it; a second run applies nothing."""
    store = SqliteStore(db_path, auto_migrate=False)
    await store.open()
    try:
        names = [m.name for m in migrations.load("sqlite")]
        assert await store.migrate() == names
        assert await store.migrate() == []
    finally:
        await store.aclose()
    recorded = raw_rows(db_path, "SELECT name FROM flowlock_schema_migrations ORDER BY name")
    assert [r[0] for r in recorded] == names
    async with SqliteStore(db_path) as reopened:
        assert await reopened.migrate() == []


async def test_concurrent_migrations_both_succeed(db_path: Path) -> None:
    """Two stores migrating one fresh file at once: one applies, the other finds it done."""
    a = SqliteStore(db_path, auto_migrate=False)
    b = SqliteStore(db_path, auto_migrate=False)
    await asyncio.gather(a.open(), b.open())
    try:
        results = await asyncio.gather(a.migrate(), b.migrate())
        assert sorted(results) == [[], [m.name for m in migrations.load("sqlite")]]
    finally:
        await asyncio.gather(a.aclose(), b.aclose())


async def test_open_of_a_fresh_file_waits_for_its_writer(db_path: Path) -> None:
    """Opening a fresh file whose write lock another connection holds waits for that writer
    (within busy_timeout) instead of failing at once, then opens in WAL mode and works."""
    # Why this is the race of two stores opening one new file together: switching the file to
    # WAL upgrades a read lock to a write lock, and SQLite refuses that upgrade at once when
    # another connection writes (its busy handler is not called), so the store must retry.
    holder = sqlite3.connect(db_path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    store = SqliteStore(db_path, busy_timeout=30)
    opening = asyncio.create_task(store.open())
    try:
        done, _ = await asyncio.wait({opening}, timeout=1.0)
        assert not done, opening.exception()  # still waiting for the holder, not failed
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    await asyncio.wait_for(opening, 30)
    try:
        assert raw_rows(db_path, "PRAGMA journal_mode") == [("wal",)]
        assert (await store.create(new_instance())).version == 1
    finally:
        await store.aclose()


async def test_open_gives_up_after_busy_timeout(db_path: Path) -> None:
    """A writer that keeps a fresh file locked makes open raise StoreError after busy_timeout
    (not before, not much later); the store stays closed."""
    holder = sqlite3.connect(db_path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    bound = 1.0
    store = SqliteStore(db_path, busy_timeout=bound)
    started = time.monotonic()
    try:
        with pytest.raises(StoreError, match="longer than busy_timeout") as caught:
            await store.open()
        took = time.monotonic() - started
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert bound <= took < bound + 5
    assert isinstance(caught.value.__cause__, sqlite3.OperationalError)
    with pytest.raises(EngineClosed):
        await store.get("i-1")


async def test_concurrent_auto_migrating_opens(db_path: Path) -> None:
    """Two auto-migrating stores opening one fresh file at once both become usable."""
    a = SqliteStore(db_path)
    b = SqliteStore(db_path)
    await asyncio.gather(a.open(), b.open())
    try:
        await a.create(new_instance())
        assert (await b.get("i-1")).version == 1
    finally:
        await asyncio.gather(a.aclose(), b.aclose())


async def test_failing_migration_rolls_back_everything(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A migration that fails raises MigrationError and leaves no migration applied."""
    broken = [*migrations.load("sqlite"), migrations.Migration("999_broken", "CREATE TABLE (;")]
    monkeypatch.setattr(migrations, "load", lambda dialect: broken)
    store = SqliteStore(db_path)
    with pytest.raises(MigrationError):
        await store.open()
    with pytest.raises(EngineClosed):
        await store.get("i-1")
    tables = raw_rows(db_path, "SELECT name FROM sqlite_master WHERE type = 'table'")
    assert ("flowlock_instances",) not in tables
    assert ("flowlock_schema_migrations",) not in tables


async def test_unmigrated_database_raises_store_error(db_path: Path) -> None:
    """Without the schema, operations raise StoreError saying to migrate."""
    async with SqliteStore(db_path, auto_migrate=False) as store:
        with pytest.raises(StoreError, match="migrate") as caught:
            await store.get("i-1")
    assert isinstance(caught.value.__cause__, sqlite3.Error)


async def test_closed_store_raises_engine_closed(db_path: Path) -> None:
    """Every operation before open or after aclose raises EngineClosed; open/aclose idempotent."""
    store = SqliteStore(db_path)
    with pytest.raises(EngineClosed):
        await store.get("i-1")
    await store.open()
    await store.open()
    inst = await store.create(new_instance())
    await store.aclose()
    await store.aclose()
    calls = [
        store.get("i-1"),
        store.read("i-1", ()),
        store.history("i-1"),
        store.create(new_instance("i-2")),
        store.commit((step(inst),)),
        store.apply_locked("i-1", (), lambda s: None, RowLock()),
        store.migrate(),
    ]
    for call in calls:
        with pytest.raises(EngineClosed):
            await call
    await store.open()  # reopening works and sees the committed data
    try:
        assert await store.get("i-1") == inst
    finally:
        await store.aclose()


async def test_aclose_waits_for_operations_in_flight(db_path: Path) -> None:
    """aclose lets a running transaction finish; an operation queued behind it then sees
    EngineClosed; nothing but the running transaction is written."""
    store = SqliteStore(db_path, busy_timeout=60)
    await store.open()
    inst = await store.create(new_instance())
    running, release = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()

    def slow_plan(snap: Snapshot) -> tuple[HistoryEntry, ...]:
        # On the connection's thread, inside the transaction: tell the test, wait for it.
        loop.call_soon_threadsafe(running.set)
        asyncio.run_coroutine_threadsafe(release.wait(), loop).result(60)
        return (step(snap.instance),)

    async with asyncio.timeout(60):
        locked = asyncio.create_task(store.apply_locked(inst.id, (), slow_plan, RowLock()))
        await running.wait()
        queued = asyncio.create_task(store.commit((step(inst, request_id="queued"),)))
        await asyncio.sleep(0)  # one step: the queued commit now waits for the writer queue
        assert not queued.done()
        closing = asyncio.create_task(store.aclose())
        await wait_until(lambda: store._pool is None)  # close has begun
        assert not locked.done() and not closing.done()
        release.set()
        result = await locked
        assert result.committed is not None and result.committed.version == 2
        with pytest.raises(EngineClosed):
            await queued
        await closing
    assert raw_rows(db_path, "SELECT version, request_id FROM flowlock_history") == [(2, None)]


def test_from_url_forms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """from_url accepts relative, absolute and :memory: forms and rejects the rest."""
    monkeypatch.chdir(tmp_path)
    assert SqliteStore.from_url("sqlite:///data/x.db").path == "data/x.db"
    assert SqliteStore.from_url(f"sqlite:///{tmp_path}/x.db").path == f"{tmp_path}/x.db"
    assert SqliteStore.from_url("sqlite:////abs/x.db").path == "/abs/x.db"
    memory = SqliteStore.from_url("sqlite:///:memory:")
    assert (memory.path, memory.pool_size) == (":memory:", 1)
    assert SqliteStore.from_url("sqlite:///x.db", busy_timeout=1.5).busy_timeout == 1.5
    for bad in (
        "postgresql://localhost/db",
        "sqlite://host/x.db",
        "sqlite:x.db",
        "sqlite:///",
        "sqlite:///x.db?mode=ro",
        "memory://",
    ):
        with pytest.raises(InvalidInput, match=r"sqlite:///relative/path\.db"):
            SqliteStore.from_url(bad)


async def test_from_url_relative_path_opens_in_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relative url resolves against the working directory."""
    monkeypatch.chdir(tmp_path)
    async with SqliteStore.from_url("sqlite:///rel.db") as store:
        await store.create(new_instance())
    assert (tmp_path / "rel.db").exists()


def test_constructor_rejects_bad_arguments() -> None:
    """Negative timeouts and empty pools are refused with InvalidInput."""
    with pytest.raises(InvalidInput):
        SqliteStore("x.db", busy_timeout=-1)
    with pytest.raises(InvalidInput):
        SqliteStore("x.db", pool_size=0)
    with pytest.raises(InvalidInput):
        SqliteStore("x.db", acquire_timeout=0)


async def test_unopenable_path_raises_store_error(tmp_path: Path) -> None:
    """A path in a missing directory raises StoreError, not sqlite3.OperationalError."""
    store = SqliteStore(tmp_path / "missing" / "x.db")
    with pytest.raises(StoreError, match="directory"):
        await store.open()
    with pytest.raises(EngineClosed):
        await store.get("i-1")


async def test_memory_database_works() -> None:
    """:memory: uses one connection, so every operation sees the same database."""
    async with SqliteStore(":memory:", pool_size=8) as store:
        assert store.pool_size == 1
        inst = await store.create(new_instance(n=0))
        committed = await store.commit((step(inst, data={"n": 1}),))
        assert committed is not None
        result = await store.apply_locked(
            inst.id, (), lambda s: (step(s.instance, data={"n": 2}),), RowLock()
        )
        assert result.committed is not None
        assert result.committed.version == 3
        assert [e.version for e in await store.history(inst.id)] == [2, 3]


async def test_concurrent_increments_across_two_stores(db_path: Path) -> None:
    """20 tasks on two stores of one file, read→commit retrying: no update lost, none doubled."""
    a = SqliteStore(db_path)
    b = SqliteStore(db_path)
    await a.open()
    await b.open()
    tasks, per_task = 20, 5
    try:
        await a.create(new_instance(n=0))

        async def worker(index: int) -> None:
            s = a if index % 2 else b
            for i in range(per_task):
                while True:
                    snap = await s.read("i-1", ())
                    n = snap.instance.data["n"]
                    entry = step(snap.instance, request_id=f"{index}-{i}", data={"n": n + 1})
                    if await s.commit((entry,)) is not None:
                        break

        await asyncio.gather(*(worker(i) for i in range(tasks)))
        total = tasks * per_task
        final = await b.get("i-1")
        assert final.version == 1 + total
        assert final.data == {"n": total}
        history = await a.history("i-1")
        assert [e.version for e in history] == list(range(2, total + 2))
        assert [e.data["n"] for e in history] == list(range(1, total + 1))
        assert len({e.request_id for e in history}) == total
    finally:
        await a.aclose()
        await b.aclose()


async def test_driver_errors_never_escape(db_path: Path, store: SqliteStore) -> None:
    """A corrupt row surfaces as StoreError, not a json or sqlite3 exception."""
    await store.create(new_instance())
    conn = sqlite3.connect(db_path)
    with conn:
        conn.execute("UPDATE flowlock_instances SET data = 'not json'")
    conn.close()
    with pytest.raises(StoreError, match="not valid JSON"):
        await store.get("i-1")
