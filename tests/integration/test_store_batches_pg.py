"""The PostgreSQL store's batches on real PostgreSQL: k entries of one instance written with one
compare-and-swap from v to v + k (``commit`` and ``apply_locked``), a read of several request
ids, and ``commit_many`` writing several instances in one statement, each compare-and-swap on its
own, without deadlocks between concurrent calls.

Every check of what was written counts rows with the test's own SQL (``sql_history``) and runs
the exactly-once checker over each instance's history.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import asyncpg
import pytest

import pg_budget
from flowlock.core.constraints import ConstraintRefused
from flowlock.core.errors import InstanceNotFound, InvalidInput, LockTimeout, OutcomeUnknown
from flowlock.core.models import HistoryEntry, Instance, InstanceQuery, Snapshot
from flowlock.stores.base import RowLock
from flowlock.stores.postgres import PostgresStore
from lock_probes import wait_until
from store_steps import SqlHistory, assert_exactly_once, created, step

pytestmark = pytest.mark.postgres

BOUND = 60.0  # seconds any wait here may take before the test fails: generous, for a loaded box


def steps(iid: str, first: int, k: int, prefix: str | None = None) -> list[HistoryEntry]:
    """k entries of ``iid`` from version ``first`` on, with request ids ``prefix``-<version>."""
    return [
        step(iid, v, None if prefix is None else f"{prefix}-{v}") for v in range(first, first + k)
    ]


@pytest.fixture
async def store(pg_url: str, pg_schema: str) -> AsyncIterator[PostgresStore]:
    s = PostgresStore(pg_url, schema=pg_schema, pool_size=12)
    await s.open()
    try:
        yield s
    finally:
        await s.aclose()


# -- commit of k entries ----------------------------------------------------------------------


async def test_k_entries_commit_as_one_compare_and_swap(
    store: PostgresStore, sql_history: SqlHistory
) -> None:
    await created(store, "a")
    batch = steps("a", 2, 3, prefix="r")
    batch[1] = step("a", 3, "r-3", token=7)
    batch[2] = step("a", 4, "r-4", token=9)
    committed = await store.commit(batch)
    assert committed is not None
    assert (committed.version, committed.state, committed.last_event) == (4, "s4", "e4")
    assert committed.data == {"n": 4}
    rows = await store.history("a")
    assert [r.version for r in rows] == [2, 3, 4]
    assert [r.request_id for r in rows] == ["r-2", "r-3", "r-4"]
    assert [r.fencing_token for r in rows] == [None, 7, 9]
    assert [r.payload for r in rows] == [{"call": "r-2"}, {"call": "r-3"}, {"call": "r-4"}]
    assert {r.at for r in rows} == {committed.updated_at}
    assert await store.fencing_floor("a") == 9  # the last entry's token
    await assert_exactly_once(store, sql_history, {"a": 3})
    # The one-entry path is the same port: a bare entry and a one-entry list.
    assert (await store.commit((step("a", 5),))) is not None
    assert (await store.commit([step("a", 6)])) is not None
    await assert_exactly_once(store, sql_history, {"a": 5})


async def test_stale_batch_writes_nothing(store: PostgresStore, sql_history: SqlHistory) -> None:
    await created(store, "a")
    assert await store.commit((step("a", 2, "first"),)) is not None
    assert await store.commit(steps("a", 2, 3, prefix="late")) is None
    assert await store.commit(steps("a", 4, 2, prefix="ahead")) is None  # no such version read
    assert (await store.get("a")).version == 2
    await assert_exactly_once(store, sql_history, {"a": 1})


async def test_batch_with_a_lower_fencing_token_is_refused(
    store: PostgresStore, sql_history: SqlHistory
) -> None:
    await created(store, "a")
    assert await store.commit([step("a", 2, token=5), step("a", 3, token=5)]) is not None
    assert await store.commit([step("a", 4, token=3), step("a", 5, token=3)]) is None
    assert await store.fencing_floor("a") == 5
    assert await store.commit([step("a", 4, token=5), step("a", 5, token=6)]) is not None
    assert await store.fencing_floor("a") == 6
    await assert_exactly_once(store, sql_history, {"a": 4})


async def test_request_id_already_applied_fails_the_whole_batch(
    store: PostgresStore, sql_history: SqlHistory
) -> None:
    await created(store, "a")
    assert await store.commit((step("a", 2, "x"),)) is not None
    assert await store.commit([step("a", 3, "y"), step("a", 4, "x")]) is None
    assert (await store.get("a")).version == 2
    assert [r.request_id for r in await store.history("a")] == ["x"]
    await assert_exactly_once(store, sql_history, {"a": 1})


@pytest.mark.parametrize(
    ("entries", "complaint"),
    [
        ([], "at least one"),
        ([step("a", 2), step("a", 4)], "in order"),
        ([step("a", 3), step("a", 2)], "in order"),
        ([step("a", 2), step("b", 3)], "in order"),
        ([step("a", 2, "same"), step("a", 3, "same")], "twice"),
    ],
    ids=["empty", "gap", "backwards", "two-instances", "request-twice"],
)
async def test_malformed_batch_is_refused_before_any_write(
    store: PostgresStore, sql_history: SqlHistory, entries: list[HistoryEntry], complaint: str
) -> None:
    await created(store, "a", "b")
    with pytest.raises(InvalidInput, match=complaint):
        await store.commit(entries)
    with pytest.raises(InvalidInput, match=complaint):
        await store.commit_many([(step("b", 2),), entries])
    await assert_exactly_once(store, sql_history, {"a": 0, "b": 0})


# -- reads of several request ids -------------------------------------------------------------


async def test_read_of_several_request_ids_returns_exactly_those_found(
    store: PostgresStore,
) -> None:
    await created(store, "a", "b")
    await store.commit([step("a", 2, "p"), step("a", 3, "q"), step("a", 4, None)])
    await store.commit((step("b", 2, "r"),))  # another instance's request id is not a's
    snap = await store.read("a", ["q", "missing", "p", "q", "r"])
    assert snap.instance.version == 4
    assert {rid: e.version for rid, e in snap.priors.items()} == {"p": 2, "q": 3}
    assert snap.priors["q"] == (await store.history("a"))[1]
    assert (await store.read("a", ["missing"])).priors == {}
    empty = await store.read("a", [])
    assert (empty.instance.version, empty.priors) == (4, {})
    # One request id is a batch of one: its entry in priors.
    one = await store.read("a", ("p",))
    assert {rid: e.version for rid, e in one.priors.items()} == {"p": 2}
    with pytest.raises(InstanceNotFound):
        await store.read("nope", ["p"])
    with pytest.raises(InstanceNotFound):
        await store.read("nope", [])


# -- apply_locked with a batch plan -----------------------------------------------------------


async def test_apply_locked_writes_a_batch_plan(
    store: PostgresStore, sql_history: SqlHistory
) -> None:
    await created(store, "a")
    seen: list[Snapshot] = []

    def plan(snap: Snapshot) -> list[HistoryEntry]:
        seen.append(snap)
        v = snap.instance.version
        return [step("a", v + 1 + i, rid) for i, rid in enumerate(("c1", "c2", "c3"))
                if rid not in snap.priors]  # fmt: skip

    result = await store.apply_locked("a", ["c1", "c2", "c3"], plan, RowLock(timeout=5.0))
    assert result.committed is not None and result.committed.version == 4
    assert seen[-1].priors == {}
    # A retry of the same calls finds their entries under the lock and writes nothing.
    again = await store.apply_locked("a", ["c1", "c2", "c3"], plan, RowLock(timeout=5.0))
    assert again.committed is None
    assert set(seen[-1].priors) == {"c1", "c2", "c3"}
    assert [e.version for e in seen[-1].priors.values()] == [2, 3, 4]
    # A plan may answer None; one request id is a batch of one, its entry in priors.
    none = await store.apply_locked("a", ("c2",), lambda s: None, RowLock(timeout=5.0))
    assert none.committed is None and set(none.snapshot.priors) == {"c2"}
    await assert_exactly_once(store, sql_history, {"a": 3})


async def test_apply_locked_refuses_a_malformed_plan_and_rolls_back(
    store: PostgresStore, sql_history: SqlHistory
) -> None:
    await created(store, "a", "b")
    lock = RowLock(timeout=5.0)
    with pytest.raises(InvalidInput, match="in order"):
        await store.apply_locked("a", (), lambda s: [step("a", 2), step("a", 4)], lock)
    with pytest.raises(InvalidInput, match="'b'"):
        await store.apply_locked("a", (), lambda s: [step("b", 2)], lock)
    # The row lock was let go: a nowait lock on it is granted.
    done = await store.apply_locked("a", (), lambda s: (step("a", 2),), RowLock(nowait=True))
    assert done.committed is not None
    await assert_exactly_once(store, sql_history, {"a": 1, "b": 0})


# -- commit_many ------------------------------------------------------------------------------


async def test_commit_many_lets_each_compare_and_swap_stand_alone(
    store: PostgresStore, sql_history: SqlHistory
) -> None:
    await created(store, "w1", "l1", "w2", "l2", "w3")
    # l1 and l2 move on before the batches, which were decided at version 1.
    await store.commit((step("l1", 2, "early"),))
    await store.commit((step("l2", 2, token=10),))
    results = await store.commit_many(
        [
            steps("w1", 2, 2, prefix="w1"),
            steps("l1", 2, 3, prefix="l1"),
            (step("w2", 2, "w2"),),
            [step("l2", 3, token=4)],  # a lower fencing token
            steps("w3", 2, 4),
        ]
    )
    assert [(r.id, r.version) if isinstance(r, Instance) else r for r in results] == [
        ("w1", 3),
        None,
        ("w2", 2),
        None,
        ("w3", 5),
    ]
    await assert_exactly_once(store, sql_history, {"w1": 2, "l1": 1, "w2": 1, "l2": 1, "w3": 4})
    assert await store.commit_many([]) == []
    assert [r is not None for r in await store.commit_many([(step("w2", 3),)])] == [True]


async def test_commit_many_with_an_applied_request_id_fails_only_that_batch(
    store: PostgresStore, sql_history: SqlHistory, monkeypatch: pytest.MonkeyPatch
) -> None:
    await created(store, "a", "b", "c")
    await store.commit((step("b", 2, "done"),))
    fallbacks = _count_fallbacks(monkeypatch)
    results = await store.commit_many(
        [steps("a", 2, 2, prefix="a"), [step("b", 3, "new"), step("b", 4, "done")], (step("c", 2),)]
    )
    assert [None if r is None else r.version for r in results] == [3, None, 2]
    assert fallbacks == [3]
    await assert_exactly_once(store, sql_history, {"a": 2, "b": 1, "c": 1})


async def test_commit_many_refuses_an_instance_twice(
    store: PostgresStore, sql_history: SqlHistory
) -> None:
    await created(store, "a", "b")
    with pytest.raises(InvalidInput, match="'a' appears in two batches"):
        await store.commit_many([(step("a", 2),), (step("b", 2),), [step("a", 3)]])
    with pytest.raises(InvalidInput, match="at least one history entry"):
        await store.commit_many([(step("b", 2),), ()])
    await assert_exactly_once(store, sql_history, {"a": 0, "b": 0})


def _count_fallbacks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records each time commit_many falls back to committing its batches one by one (how many
    batches), and still does it."""
    calls: list[int] = []
    original = PostgresStore._commit_each

    async def spy(
        self: PostgresStore, batches: Sequence[Any]
    ) -> list[Instance | ConstraintRefused | None]:
        calls.append(len(batches))
        return await original(self, batches)

    monkeypatch.setattr(PostgresStore, "_commit_each", spy)
    return calls


async def _blocked_by(conn: asyncpg.Connection) -> list[int]:
    """The server pids of the sessions waiting for a lock ``conn`` holds."""
    rows = await conn.fetch(
        "SELECT pid FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
        conn.get_server_pid(),
    )
    return [r["pid"] for r in rows]


async def test_concurrent_commit_many_in_opposite_orders_never_deadlocks(
    store: PostgresStore, sql_history: SqlHistory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """8 tasks x 50 rounds over 20 instances, each round a commit_many over a random half of
    them (ascending for even tasks, descending for odd ones): every statement locks in id
    order, so none is ever rolled back by the deadlock detector (no fallback), and every
    history is contiguous with no request id twice."""
    ids = [f"i{n:02d}" for n in range(20)]
    await created(store, *ids)
    fallbacks = _count_fallbacks(monkeypatch)
    applied = dict.fromkeys(ids, 0)
    lost = 0
    tasks_n, rounds = 8, 50

    async def worker(t: int) -> None:
        nonlocal lost
        rng = random.Random(t)
        for _ in range(rounds):
            chosen = sorted(rng.sample(ids, 10), reverse=t % 2 == 1)
            now = {
                i.id: i.version
                for i in await store.list_instances(InstanceQuery(), after=None, limit=100)
            }
            batches = [
                steps(iid, now[iid] + 1, rng.randint(1, 3), prefix=uuid.uuid4().hex)
                for iid in chosen
            ]
            for batch, got in zip(batches, await store.commit_many(batches), strict=True):
                if got is None:
                    lost += 1
                else:
                    assert isinstance(got, Instance) and got.version == batch[-1].version
                    applied[got.id] += len(batch)

    await asyncio.wait_for(asyncio.gather(*(worker(t) for t in range(tasks_n))), BOUND)
    assert fallbacks == []
    print(f"\n{sum(applied.values())} entries applied, {lost} batches lost their race")
    assert sum(applied.values()) > 0 and lost > 0  # the tasks really raced
    for iid in ids:
        rows = await store.history(iid)
        assert [r.version for r in rows] == list(range(2, 2 + len(rows))), iid
        assert len({r.request_id for r in rows}) == len(rows), iid
    await assert_exactly_once(store, sql_history, applied)


async def test_commit_many_survives_a_deadlock_with_a_callers_transaction(
    store: PostgresStore, sql_history: SqlHistory, pg_url: str, pg_schema: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A caller's transaction holds b and then wants a, while commit_many holds a and waits for
    b: PostgreSQL's deadlock detector rolls commit_many's statement back (the caller's
    deadlock_timeout is set longer, so commit_many's check runs first) and commit_many commits
    each batch alone instead of raising."""
    await created(store, "a", "b")
    fallbacks = _count_fallbacks(monkeypatch)
    caller = await pg_budget.connect(pg_url)
    try:
        await caller.execute("SET deadlock_timeout = '30s'")
        await caller.execute(f'SET search_path = "{pg_schema}"')
        await caller.execute("BEGIN")
        await caller.execute("UPDATE flowlock_instances SET data = data WHERE id = 'b'")
        many = asyncio.create_task(
            store.commit_many([(step("a", 2, "ra"),), (step("b", 2, "rb"),)])
        )

        async def waiting_for_caller() -> bool:
            return bool(await _blocked_by(caller))

        await wait_until(waiting_for_caller, within=BOUND, what="commit_many waiting on b")
        # Closes the cycle; returns once the detector has rolled commit_many's statement back.
        await asyncio.wait_for(
            caller.execute("UPDATE flowlock_instances SET data = data WHERE id = 'a'"), BOUND
        )
        await caller.execute("ROLLBACK")
        results = await asyncio.wait_for(many, BOUND)
    finally:
        await caller.close()
    assert [None if r is None else r.version for r in results] == [2, 2]
    assert fallbacks == [2]
    await assert_exactly_once(store, sql_history, {"a": 1, "b": 1})


async def test_commit_many_past_lock_timeout_writes_nothing(
    pg_url: str, pg_schema: str, sql_history: SqlHistory
) -> None:
    """A row held longer than lock_timeout: LockTimeout naming the instances, and nothing of any
    batch written (the statement is one)."""
    store = PostgresStore(pg_url, schema=pg_schema, lock_timeout=0.3)
    await store.open()
    caller = await pg_budget.connect(pg_url)
    try:
        await created(store, "a", "b")
        await caller.execute(f'SET search_path = "{pg_schema}"')
        async with caller.transaction():
            await caller.execute("SELECT 1 FROM flowlock_instances WHERE id = 'b' FOR UPDATE")
            with pytest.raises(LockTimeout, match="'a, b'"):
                await store.commit_many([(step("a", 2),), (step("b", 2),)])
        await assert_exactly_once(store, sql_history, {"a": 0, "b": 0})
        results = await store.commit_many([(step("a", 2),), (step("b", 2),)])
        assert [r is not None for r in results] == [True, True]
    finally:
        await caller.close()
        await store.aclose()


async def test_commit_many_lost_in_flight_is_outcome_unknown(
    store: PostgresStore, sql_history: SqlHistory, pg_url: str, pg_schema: str
) -> None:
    """The session ends while the statement waits for a row lock: the write may have been sent,
    so OutcomeUnknown (here nothing was written), and the store goes on with a fresh
    connection."""
    await created(store, "a", "b")
    caller = await pg_budget.connect(pg_url)
    try:
        await caller.execute(f'SET search_path = "{pg_schema}"')
        async with caller.transaction():
            await caller.execute("SELECT 1 FROM flowlock_instances WHERE id = 'b' FOR UPDATE")
            many = asyncio.create_task(store.commit_many([(step("a", 2),), (step("b", 2),)]))

            async def blocked() -> bool:
                return bool(await _blocked_by(caller))

            await wait_until(blocked, within=BOUND, what="commit_many waiting on b")
            [pid] = await _blocked_by(caller)
            await caller.execute("SELECT pg_terminate_backend($1)", pid)
            with pytest.raises(OutcomeUnknown, match="'a, b'"):
                await asyncio.wait_for(many, BOUND)
    finally:
        await caller.close()
    await assert_exactly_once(store, sql_history, {"a": 0, "b": 0})
    assert [r is not None for r in await store.commit_many([(step("a", 2),), (step("b", 2),)])] == [
        True,
        True,
    ]


# -- inside a caller's transaction and on an application's pool ---------------------------------


async def test_batches_inside_a_callers_transaction(
    store: PostgresStore, sql_history: SqlHistory, pg_url: str
) -> None:
    await created(store, "a", "b")
    conn = await pg_budget.connect(pg_url)
    try:
        # Rolled back by the caller: nothing stays.
        tr = conn.transaction()
        await tr.start()
        async with store.in_transaction(conn) as tx:
            assert (await tx.commit(steps("a", 2, 3, prefix="t"))) is not None
        await tr.rollback()
        await assert_exactly_once(store, sql_history, {"a": 0, "b": 0})

        async with conn.transaction(), store.in_transaction(conn) as tx:
            committed = await tx.commit(steps("a", 2, 3, prefix="t"))
            assert committed is not None and committed.version == 4
            snap = await tx.read("a", ["t-2", "t-4", "nope"])
            assert sorted(snap.priors) == ["t-2", "t-4"]
            # An applied request id undoes that batch only; the transaction goes on.
            assert await tx.commit([step("a", 5, "new"), step("a", 6, "t-3")]) is None
            results = await tx.commit_many([(step("a", 5, "a5"),), steps("b", 2, 2, prefix="b")])
            assert [r is not None for r in results] == [True, True]
            locked = await tx.apply_locked(
                "b", ["b-2", "b-4"], lambda s: [step("b", 4, "b-4")], RowLock(timeout=5.0)
            )
            assert locked.committed is not None and set(locked.snapshot.priors) == {"b-2"}
    finally:
        await conn.close()
    await assert_exactly_once(store, sql_history, {"a": 4, "b": 3})


async def test_batches_on_an_applications_pool(
    pg_url: str, pg_schema: str, sql_history: SqlHistory
) -> None:
    owner = PostgresStore(pg_url, schema=pg_schema)
    await owner.open()  # migrates the schema
    await owner.aclose()
    app_pool = await pg_budget.create_pool(pg_url, min_size=1, max_size=4)
    assert app_pool is not None
    store = PostgresStore(pool=app_pool, schema=pg_schema)
    await store.open()
    try:
        await created(store, "a", "b", "c")
        assert (await store.commit(steps("a", 2, 2, prefix="a"))) is not None
        assert (await store.read("a", ["a-2", "a-3"])).priors.keys() == {"a-2", "a-3"}
        results = await store.commit_many(
            [(step("a", 4, "a-2"),), steps("b", 2, 3, prefix="b"), (step("c", 2),)]
        )
        assert [None if r is None else r.version for r in results] == [None, 4, 2]
        await assert_exactly_once(store, sql_history, {"a": 2, "b": 3, "c": 1})
        async with app_pool.acquire() as conn:
            assert not conn.is_in_transaction()
    finally:
        await store.aclose()
        await app_pool.close()


# -- how much one statement saves -------------------------------------------------------------


@pytest.mark.slow
async def test_measure_commit_many_against_single_commits(store: PostgresStore) -> None:
    """Prints (no assert on speed) the time of one commit_many over 100 instances against 100
    single commits, one after another and all at once (run with -s to see it)."""
    ids = [f"m{n:03d}" for n in range(100)]
    await created(store, *ids)
    version = 1
    figures: dict[str, list[float]] = {"commit_many": [], "sequential": [], "gathered": []}
    for _ in range(6):  # the first round prepares the statements on the pool's connections
        started = time.perf_counter()
        many = await store.commit_many([(step(iid, version + 1),) for iid in ids])
        figures["commit_many"].append(time.perf_counter() - started)
        assert all(r is not None for r in many)
        started = time.perf_counter()
        for iid in ids:
            assert await store.commit((step(iid, version + 2),)) is not None
        figures["sequential"].append(time.perf_counter() - started)
        started = time.perf_counter()
        await asyncio.gather(*(store.commit((step(iid, version + 3),)) for iid in ids))
        figures["gathered"].append(time.perf_counter() - started)
        version += 3
    for name, times in figures.items():
        warm = sorted(times[1:])
        print(
            f"\n{name}: 100 instances, best {warm[0] * 1000:.1f} ms, "
            f"median {warm[len(warm) // 2] * 1000:.1f} ms"
        )
