"""The PostgreSQL store's pipelining on real PostgreSQL: unlocked reads (one request id or none)
and compare-and-swaps of calls on different instances that arrive while ``depth`` round trips are
in flight go together, one statement for the group (``_READ_MANY``; ``commit_many`` for writes,
in rounds of distinct instances), and each call still gets its own answer.

How a group is formed on cause and not on time: the test takes every connection of the store's
pool. The first ``DEPTH`` calls sent then are in flight, each waiting for a connection; every
call after them queues in the pipeline. Given the connections back, the first slot that frees
takes everything queued as one group. :class:`CountingStore` records what went alone and what
went together (it only counts; every call goes on to the real statements), so each test says
exactly which group it made.

Every check of what was written runs the exactly-once checker over each instance's history and
counts the rows with the test's own SQL (``sql_history``).
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Coroutine, Iterable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest

import flowlock
import pg_budget
from flowlock import examples
from flowlock.checker import check
from flowlock.core.constraints import ConstraintRefused
from flowlock.core.errors import (
    EngineClosed,
    FlowlockError,
    InstanceNotFound,
    InvalidInput,
    LockTimeout,
)
from flowlock.core.models import HistoryEntry, Instance, Snapshot
from flowlock.stores.memory import MemoryStore
from flowlock.stores.postgres import PostgresStore
from store_steps import SqlHistory, assert_exactly_once, created, step

T = TypeVar("T")

BOUND = 60.0  # seconds any wait here may take before the test fails: generous, for a loaded box
POOL = 8
DEPTH = 4  # the store's rule: min(4, pool_size // 2) round trips of each kind in flight
OPENERS = [f"o{n}" for n in range(DEPTH)]  # the instances of the calls that fill the slots


class CountingStore(PostgresStore):
    """A PostgresStore that records which calls went alone and which together, and otherwise
    does exactly what the store does."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reads_alone = 0
        self.read_groups: list[int] = []  # the size of each group of reads
        self.commit_groups: list[list[str]] = []  # the instances of each group of writes
        self.rounds: list[list[str]] = []  # the instances of each commit_many
        self.fallbacks: list[int] = []  # commit_many's batches committed one by one
        self.group_sent = asyncio.Event()  # a group of writes is on its way

    async def _read_one(self, call: tuple[str, str | None]) -> Snapshot:
        self.reads_alone += 1
        return await super()._read_one(call)

    async def _read_together(
        self, calls: Sequence[tuple[str, str | None]]
    ) -> list[Snapshot | FlowlockError]:
        self.read_groups.append(len(calls))
        return await super()._read_together(calls)

    async def _commit_together(
        self, batches: Sequence[tuple[HistoryEntry, ...]]
    ) -> list[Instance | BaseException | None]:
        self.commit_groups.append([batch[0].instance_id for batch in batches])
        self.group_sent.set()
        return await super()._commit_together(batches)

    async def commit_many(
        self, batches: Sequence[Sequence[HistoryEntry]]
    ) -> list[Instance | ConstraintRefused | None]:
        self.rounds.append([batch[0].instance_id for batch in batches])
        return await super().commit_many(batches)

    async def _commit_each(
        self, batches: Sequence[tuple[HistoryEntry, ...]]
    ) -> list[Instance | ConstraintRefused | None]:
        self.fallbacks.append(len(batches))
        return await super()._commit_each(batches)


@pytest.fixture
async def store(pg_url: str, pg_schema: str) -> AsyncIterator[CountingStore]:
    s = CountingStore(pg_url, schema=pg_schema, pool_size=POOL)
    await s.open()
    try:
        yield s
    finally:
        await s.aclose()


@asynccontextmanager
async def pool_taken(store: PostgresStore) -> AsyncIterator[None]:
    """Holds every connection of the store's pool for the block: the first DEPTH calls sent in
    it stay in flight (waiting for a connection), the ones after them queue in the pipeline.
    On the way out the connections go back and the calls go on."""
    pool = store.pool  # the store may be closed inside the block
    held = [await pool.acquire() for _ in range(store.pool_size)]
    try:
        yield
    finally:
        for conn in held:
            await pool.release(conn)


def versions(results: Iterable[Instance | BaseException | None]) -> list[int | None]:
    """The version each commit left its instance at, None for a lost compare-and-swap (any
    other answer fails the test)."""
    out: list[int | None] = []
    for r in results:
        assert r is None or isinstance(r, Instance), r
        out.append(None if r is None else r.version)
    return out


def started(calls: Iterable[Coroutine[Any, Any, T]]) -> list[asyncio.Task[T]]:
    return [asyncio.create_task(call) for call in calls]


async def answers(tasks: Sequence[asyncio.Task[T]]) -> list[T | BaseException]:
    """Each task's result or exception, all within BOUND."""
    async with asyncio.timeout(BOUND):
        return await asyncio.gather(*tasks, return_exceptions=True)


async def grouped_commits(
    store: CountingStore, batches: Sequence[Sequence[HistoryEntry]]
) -> list[Instance | BaseException | None]:
    """``batches`` committed as one group of the pipeline (behind DEPTH opening commits on the
    OPENERS, which must win): each batch's answer."""
    version = {o: (await store.get(o)).version for o in OPENERS}
    async with pool_taken(store):
        openers = started(store.commit((step(o, version[o] + 1),)) for o in OPENERS)
        queued = started(store.commit(batch) for batch in batches)
        await asyncio.sleep(0)  # every task has sent its call: DEPTH in flight, the rest queued
    assert all(isinstance(r, Instance) for r in await answers(openers))
    return await answers(queued)


# -- reads --------------------------------------------------------------------------------------


async def test_concurrent_reads_each_get_their_own_snapshot(store: CountingStore) -> None:
    """200 reads at once over 50 instances (and some that do not exist), each with no request id,
    one of its instance's, one of another instance's, one nobody used, or (not pipelined) two:
    each read gets its own instance and its own priors, or InstanceNotFound for a missing
    instance only; DEPTH reads went alone and every other read of one id or none in one
    statement."""
    rng = random.Random(11)
    ids = [f"i{n:02d}" for n in range(50)]
    await created(store, *ids)
    # Instance n has n % 4 entries, its first with the request id "common" (also used on the
    # other instances: a read must find its own instance's entry only).
    entries: dict[str, dict[str, HistoryEntry]] = {}
    for n, iid in enumerate(ids):
        for v in range(2, 2 + n % 4):
            used = "common" if v == 2 else f"{iid}-r{v}"
            assert await store.commit((step(iid, v, used),)) is not None
        entries[iid] = {e.request_id or "": e for e in await store.history(iid)}

    calls: list[tuple[str, tuple[str, ...]]] = []
    for k in range(200):
        iid = f"gone-{k}" if rng.random() < 0.1 else rng.choice(ids)
        kind = rng.choice(["none", "own", "other", "unused", "list"])
        own = sorted(entries.get(iid, {})) or ["unused"]
        request: tuple[str, ...] = {
            "none": (),
            "own": (rng.choice(own),),
            "other": (f"{rng.choice(ids)}-r3",),
            "unused": (f"unused-{k}",),
            "list": (rng.choice(own), f"unused-{k}"),
        }[kind]
        calls.append((iid, request))

    results = await answers(started(store.read(iid, rid) for iid, rid in calls))

    for (iid, rid), got in zip(calls, results, strict=True):
        if iid.startswith("gone-"):
            assert isinstance(got, InstanceNotFound) and got.instance_id == iid, (iid, got)
            continue
        assert isinstance(got, Snapshot), (iid, rid, got)
        version = 1 + int(iid[1:]) % 4
        assert (got.instance.id, got.instance.version) == (iid, version)
        want = {r: entries[iid][r] for r in rid if r in entries[iid]}
        assert dict(got.priors) == want, (iid, rid)
    pipelined = sum(len(rid) < 2 for _, rid in calls)
    assert store.reads_alone == DEPTH
    assert store.read_groups == [pipelined - DEPTH]


# -- writes -------------------------------------------------------------------------------------


async def test_concurrent_commits_over_distinct_instances(
    store: CountingStore, sql_history: SqlHistory
) -> None:
    """40 compare-and-swaps from version 1 in one group, every fourth on an instance that moved
    on before: only those lose (None); the others are written, each with its own entry."""
    ids = [f"c{n:02d}" for n in range(40)]
    await created(store, *OPENERS, *ids)
    stale = set(ids[::4])
    for iid in stale:
        assert await store.commit((step(iid, 2, f"{iid}-early"),)) is not None

    results = await grouped_commits(store, [(step(iid, 2, f"{iid}-late"),) for iid in ids])

    for iid, got in zip(ids, results, strict=True):
        if iid in stale:
            assert got is None, (iid, got)
        else:
            assert isinstance(got, Instance) and (got.id, got.version) == (iid, 2), (iid, got)
        [entry] = await store.history(iid)
        assert entry.request_id == f"{iid}-{'early' if iid in stale else 'late'}"
    assert store.commit_groups == [ids]
    assert store.rounds == [ids]
    assert store.fallbacks == []
    await assert_exactly_once(store, sql_history, dict.fromkeys([*OPENERS, *ids], 1))


async def test_two_batches_for_one_instance_in_a_group_go_in_rounds(
    store: CountingStore, sql_history: SqlHistory
) -> None:
    """Three batches for ``a`` queued in one group with others (two decided at version 1, as two
    engines would, and one at version 2): they go in three rounds in queue order; the first
    wins, the second loses, the third (decided after the first) wins; a's history is
    contiguous."""
    await created(store, *OPENERS, "a", "b", "c")
    batches: list[Sequence[HistoryEntry]] = [
        (step("a", 2, "a-first"),),
        [step("b", 2, "b-1"), step("b", 3, "b-2")],
        (step("a", 2, "a-second"),),
        (step("c", 2),),
        (step("a", 3, "a-third"),),
    ]

    results = await grouped_commits(store, batches)

    assert versions(results) == [2, 3, None, 2, 3]
    assert store.commit_groups == [["a", "b", "a", "c", "a"]]
    assert store.rounds == [["a", "b", "c"], ["a"], ["a"]]
    assert [(e.version, e.request_id) for e in await store.history("a")] == [
        (2, "a-first"),
        (3, "a-third"),
    ]
    applied = {**dict.fromkeys(OPENERS, 1), "a": 2, "b": 2, "c": 1}
    await assert_exactly_once(store, sql_history, applied)


async def test_a_request_id_applied_before_fails_only_its_batch(
    store: CountingStore, sql_history: SqlHistory
) -> None:
    """A group whose statement hits a request id applied before (b's "done"): the statement is
    rolled back whole and each batch committed alone, so only b's batch answers None."""
    await created(store, *OPENERS, "a", "b", "c")
    assert await store.commit((step("b", 2, "done"),)) is not None

    results = await grouped_commits(
        store,
        [
            [step("a", 2, "a-2"), step("a", 3, "a-3")],
            [step("b", 3, "new"), step("b", 4, "done")],
            (step("c", 2, "c-2"),),
        ],
    )

    assert versions(results) == [3, None, 2]
    assert store.rounds == [["a", "b", "c"]]
    assert store.fallbacks == [3]
    assert [e.request_id for e in await store.history("b")] == ["done"]
    applied = {**dict.fromkeys(OPENERS, 1), "a": 2, "b": 1, "c": 1}
    await assert_exactly_once(store, sql_history, applied)


async def test_a_group_that_fails_whole_fails_each_call_and_the_store_goes_on(
    pg_url: str, pg_schema: str, sql_history: SqlHistory
) -> None:
    """The test holds h's row lock past the store's lock_timeout (0.5 s): the group's one
    statement waits for it and is rolled back, every call of the group gets LockTimeout, nothing
    of it is written; with the lock let go, the same group commits whole."""
    store = CountingStore(pg_url, schema=pg_schema, pool_size=POOL, lock_timeout=0.5)
    await store.open()
    locker = await pg_budget.connect(pg_url)
    group = ["x", "y", "h", "z"]
    try:
        await created(store, *OPENERS, *group)
        await locker.execute(f'SET search_path = "{pg_schema}"')
        async with locker.transaction():
            await locker.execute("SELECT 1 FROM flowlock_instances WHERE id = 'h' FOR UPDATE")
            failed = await grouped_commits(store, [(step(iid, 2, iid),) for iid in group])
        assert all(isinstance(r, LockTimeout) for r in failed), failed
        assert store.rounds == [group] and store.fallbacks == []
        for iid in group:
            assert (await store.get(iid)).version == 1
        await assert_exactly_once(
            store, sql_history, {**dict.fromkeys(OPENERS, 1), **dict.fromkeys(group, 0)}
        )

        again = await grouped_commits(store, [(step(iid, 2, iid),) for iid in group])
        assert versions(again) == [2, 2, 2, 2]
        assert store.rounds == [group, group]
        reads = await answers(started(store.read(iid, (iid,)) for iid in group))
        found = [r.priors[iid].version for iid, r in zip(group, reads, strict=True)
                 if isinstance(r, Snapshot) and iid in r.priors]  # fmt: skip
        assert found == [2] * 4
        await assert_exactly_once(
            store, sql_history, {**dict.fromkeys(OPENERS, 2), **dict.fromkeys(group, 1)}
        )
    finally:
        await locker.close()
        await store.aclose()


# -- closing ------------------------------------------------------------------------------------


async def test_closing_the_store_answers_every_queued_call(
    pg_url: str, pg_schema: str, sql_history: SqlHistory
) -> None:
    """The store is closed while DEPTH reads and DEPTH writes are in flight and 30 of each are
    queued behind them: every call is answered, with its result or EngineClosed, and the rows
    written are exactly those of the commits answered with an instance."""
    store = CountingStore(pg_url, schema=pg_schema, pool_size=POOL)
    await store.open()
    ids = [f"q{n:02d}" for n in range(DEPTH + 30)]
    try:
        await created(store, *ids)
        async with pool_taken(store):
            writes = started(store.commit((step(iid, 2, iid),)) for iid in ids)
            reads = started(store.read(iid, ()) for iid in ids)
            await asyncio.sleep(0)
            closing = asyncio.create_task(store.aclose())
            await asyncio.sleep(0)
        wrote = await answers(writes)
        read = await answers(reads)
        async with asyncio.timeout(BOUND):
            await closing
    finally:
        await store.aclose()
    assert all(isinstance(r, Instance | EngineClosed) for r in wrote), wrote
    assert all(isinstance(r, Snapshot | EngineClosed) for r in read), read
    print(f"\n{Counter(type(r).__name__ for r in [*wrote, *read])}")
    applied = {iid: int(isinstance(r, Instance)) for iid, r in zip(ids, wrote, strict=True)}
    counted = await sql_history()
    assert counted.rows == {iid: 1 for iid, n in applied.items() if n}
    assert counted.versions == {iid: 1 + n for iid, n in applied.items()}


async def test_closing_the_store_lets_a_group_in_flight_finish(
    store: CountingStore, sql_history: SqlHistory
) -> None:
    """A group already sent when the store closes is waited for: each of its calls gets its own
    result, and the rows agree."""
    ids = [f"g{n:02d}" for n in range(20)]
    await created(store, *OPENERS, *ids)
    async with pool_taken(store):
        openers = started(store.commit((step(o, 2),)) for o in OPENERS)
        queued = started(store.commit((step(iid, 2, iid),)) for iid in ids)
        await asyncio.sleep(0)
    async with asyncio.timeout(BOUND):
        await store.group_sent.wait()  # resumes once the group's driver waits on the server
        await store.aclose()
    assert store.commit_groups == [ids]
    assert versions(await answers(queued)) == [2] * len(ids)
    # An opener still waiting for a connection when the pool closes is EngineClosed, unsent.
    opened = await answers(openers)
    assert all(isinstance(r, Instance | EngineClosed) for r in opened), opened
    written = [*ids, *(o for o, r in zip(OPENERS, opened, strict=True) if isinstance(r, Instance))]
    assert (await sql_history()).rows == dict.fromkeys(written, 1)


async def test_closing_an_engine_answers_every_call(
    pg_url: str, pg_schema: str, sql_history: SqlHistory
) -> None:
    """100 callers restocking 200 instances, each firing until the engine says it is closed;
    the engine is closed after 200 answers: every call in flight then is answered with its
    Outcome, every later one with EngineClosed, nothing hangs, and each instance's history holds
    exactly its applied calls."""
    engine = await flowlock.Engine.connect(pg_url, schema=pg_schema, max_size=POOL).open()
    ids = [f"s{n:03d}" for n in range(200)]
    try:
        await engine.register(examples.inventory())
        for iid in ids:
            await engine.create("inventory", instance_id=iid, data={"stock": 0})
        rng = random.Random(5)
        answered = 0
        enough = asyncio.Event()
        applied: Counter[str] = Counter()

        async def caller(c: int) -> FlowlockError | None:
            nonlocal answered
            for k in range(50):
                iid = rng.choice(ids)
                try:
                    out = await engine.fire(
                        iid, "restock", request_id=f"c{c}-{k}", payload={"qty": 1},
                        strategy="optimistic",
                    )  # fmt: skip
                except FlowlockError as exc:
                    return exc
                assert out.applied
                applied[iid] += 1
                answered += 1
                if answered >= 200:
                    enough.set()
            return None

        callers = started(caller(c) for c in range(100))
        async with asyncio.timeout(BOUND):
            await enough.wait()
            await engine.aclose()
        ends = await answers(callers)
    finally:
        await engine.aclose()
    assert all(isinstance(r, EngineClosed) or r is None for r in ends), ends
    assert any(isinstance(r, EngineClosed) for r in ends)
    print(f"\n{sum(applied.values())} calls applied, then the engine closed")
    counted = await sql_history()
    assert counted.rows == dict(applied)
    assert counted.versions == {iid: 1 + applied[iid] for iid in ids}


# -- the engine over many instances, pipelined or not ------------------------------------------

CALLERS = 100
INSTANCES = 1000
CALLS_EACH = 10


def _spread_params() -> list[Any]:
    return [
        pytest.param(strategy, batching, id=f"{strategy}-{'batching' if batching else 'off'}")
        for strategy in ("optimistic", "adaptive")
        for batching in (True, False)
    ]


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "batching"), _spread_params())
async def test_hundred_callers_spread_over_a_thousand_instances(
    pg_url: str,
    pg_schema: str,
    sql_history: SqlHistory,
    monkeypatch: pytest.MonkeyPatch,
    strategy: str,
    batching: bool,
) -> None:
    """100 callers x 10 restocks, each on a random one of 1,000 instances, with each call's own
    request id and quantity, through ``Engine.connect(batching=...)``: every call applied, each
    instance's stock the sum of its calls' quantities, the checker clean on every instance and
    the rows counted with SQL agreeing. With batching on the store's pipeline sent reads and
    writes together; off, it sent none."""
    groups: Counter[str] = Counter()
    original_reads, original_writes = PostgresStore._read_together, PostgresStore._commit_together

    async def reads_counted(self: PostgresStore, calls: Sequence[Any]) -> Any:
        groups["reads"] += 1
        return await original_reads(self, calls)

    async def writes_counted(self: PostgresStore, batches: Sequence[Any]) -> Any:
        groups["writes"] += 1
        return await original_writes(self, batches)

    monkeypatch.setattr(PostgresStore, "_read_together", reads_counted)
    monkeypatch.setattr(PostgresStore, "_commit_together", writes_counted)
    engine = flowlock.Engine.connect(
        pg_url,
        schema=pg_schema,
        batching=batching,
        strategies=[flowlock.Optimistic(max_attempts=50, backoff_cap=0.05)],
    )
    ids = [f"sku{n:04d}" for n in range(INSTANCES)]
    async with engine:
        await engine.register(examples.inventory())
        async with asyncio.timeout(BOUND):
            for chunk in range(0, INSTANCES, 100):
                await asyncio.gather(
                    *(
                        engine.create("inventory", instance_id=iid, data={"stock": 0})
                        for iid in ids[chunk : chunk + 100]
                    )
                )
        rng = random.Random(f"{strategy}-{batching}")
        plan = [
            [(rng.choice(ids), rng.randint(1, 3)) for _ in range(CALLS_EACH)]
            for _ in range(CALLERS)
        ]
        go = asyncio.Event()

        async def caller(c: int) -> list[flowlock.Outcome | BaseException]:
            await go.wait()
            got: list[flowlock.Outcome | BaseException] = []
            for k, (iid, qty) in enumerate(plan[c]):
                try:
                    got.append(
                        await engine.fire(
                            iid,
                            "restock",
                            actor=f"c{c}",
                            request_id=f"c{c}-{k}",
                            payload={"qty": qty},
                            strategy=strategy,
                        )
                    )
                except Exception as exc:  # every call must apply: the test fails on any error
                    got.append(exc)
            return got

        tasks = started(caller(c) for c in range(CALLERS))
        await asyncio.sleep(0)
        go.set()
        results = await answers(tasks)

        stock: defaultdict[str, int] = defaultdict(int)
        applied: defaultdict[str, list[str]] = defaultdict(list)
        for c, got in enumerate(results):
            assert isinstance(got, list), got
            for (iid, qty), out in zip(plan[c], got, strict=True):
                assert isinstance(out, flowlock.Outcome) and out.applied, (iid, out)
                stock[iid] += qty
                applied[iid].append(out.request_id or "")
        assert sum(map(len, applied.values())) == CALLERS * CALLS_EACH

        async def verdict(iid: str) -> tuple[str, list[HistoryEntry]]:
            final, history = await engine.get(iid), await engine.history(iid)
            assert final.data["stock"] == stock[iid], iid
            assert sorted(h.request_id or "" for h in history) == sorted(applied[iid]), iid
            found = check(final, history, initial_state="open", expected_applied=len(applied[iid]))
            assert found.ok, found.violations
            return iid, history

        async with asyncio.timeout(BOUND):
            histories = dict(await asyncio.gather(*(verdict(iid) for iid in ids)))
    (await sql_history()).assert_matches(histories)
    print(f"\n{strategy}, batching {batching}: {dict(groups)} statements sent for groups")
    if batching:
        assert groups["reads"] > 0 and groups["writes"] > 0, groups
    else:
        assert not groups, groups


# -- what is refused before anything is opened -------------------------------------------------


@pytest.mark.parametrize("flag", ["yes", 1, None, 0.0])
def test_pipeline_must_be_a_bool(flag: object) -> None:
    with pytest.raises(InvalidInput, match=f"pipeline must be True or False, not {flag!r}"):
        PostgresStore("postgresql://nobody@127.0.0.1:1/none", pipeline=flag)  # type: ignore[arg-type]


@pytest.mark.parametrize("flag", ["yes", 1, None])
def test_connect_batching_must_be_a_bool(flag: object, tmp_path: Path) -> None:
    """Refused by Engine.connect (and the Engine) before any store is built: no database file
    appears, no server is reached (the PostgreSQL URL points at a closed port)."""
    db = tmp_path / "never.db"
    message = f"batching must be True or False, not {flag!r}"
    for url in ("postgresql://nobody@127.0.0.1:1/none", f"sqlite:///{db}", "memory://"):
        with pytest.raises(InvalidInput, match=message):
            flowlock.Engine.connect(url, batching=flag)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match=message):
        flowlock.Engine(MemoryStore(), batching=flag)  # type: ignore[arg-type]
    assert not db.exists()
