"""Pipelined pessimistic calls on real PostgreSQL: ``apply_locked`` calls on different instances
that queue while others are in flight run as ONE transaction (rows locked with SKIP LOCKED, one
request-id lookup, each plan in order, one write, one COMMIT), and every call not served by that
transaction runs alone afterwards exactly as before.

How a group is made to form, on cause and not on time: the store is built with one pipeline slot
(``pool_size=2``), and the test holds the row lock of instance ``h`` in a transaction of its own.
A call on ``h`` takes the slot and waits for that lock (``pg_blocking_pids`` shows it); the calls
started next queue behind it; rolling the test's transaction back frees the slot, and everything
queued goes as one group. A spy on the group's transaction records each group's size.

Every check of what was written runs the exactly-once checker over each instance's history and
counts the rows with the test's own SQL (``sql_history``).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import asyncpg
import pytest

import flowlock
import pg_budget
from flowlock.bench.scenarios.steps import counter
from flowlock.checker import check
from flowlock.core.errors import FlowlockError, InstanceNotFound, InvalidInput, LockTimeout
from flowlock.core.models import HistoryEntry, Snapshot
from flowlock.stores.base import LockedResult, RowLock
from flowlock.stores.postgres import PostgresStore
from flowlock.stores.postgres.operations import Operations as _Operations
from lock_probes import wait_until
from store_steps import SqlHistory, assert_exactly_once, created
from store_steps import step as _step

pytestmark = pytest.mark.postgres

BOUND = 60.0  # seconds any wait here may take before the test fails: generous, for a loaded box
WAIT = RowLock(timeout=30.0)


def step(iid: str, version: int, request_id: str | None = None) -> HistoryEntry:
    """:func:`store_steps.step`, written by the pessimistic strategy."""
    return _step(iid, version, request_id, strategy="pessimistic")


def next_step(
    iid: str, request_id: str | None = None
) -> Callable[[Snapshot], tuple[HistoryEntry, ...]]:
    """A plan that moves ``iid`` one version on from what it read under the lock."""
    return lambda snap: (step(iid, snap.instance.version + 1, request_id),)


@pytest.fixture
async def store(pg_url: str, pg_schema: str) -> AsyncIterator[PostgresStore]:
    # pool_size=2: one pipeline slot, so the calls behind one in flight queue together.
    s = PostgresStore(pg_url, schema=pg_schema, pool_size=2)
    await s.open()
    try:
        yield s
    finally:
        await s.aclose()


@pytest.fixture
def groups(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The instances of every group transaction the store runs (and still runs it)."""
    seen: list[list[str]] = []
    original = _Operations.apply_locked_together

    async def spy(self: _Operations, calls: Sequence[Any]) -> list[Any]:
        seen.append([call.instance_id for call in calls])
        return await original(self, calls)

    monkeypatch.setattr(_Operations, "apply_locked_together", spy)
    return seen


class Holder:
    """A connection of the test's own that holds row locks in an open transaction."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn
        self._tx: Any = None

    async def lock(self, iid: str) -> None:
        self._tx = self.conn.transaction()
        await self._tx.start()
        await self.conn.execute("SELECT 1 FROM flowlock_instances WHERE id = $1 FOR UPDATE", iid)

    async def release(self) -> None:
        await self._tx.rollback()

    async def blocking(self) -> bool:
        """Whether a session waits for a lock this transaction holds."""
        return (
            int(
                await self.conn.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
                    self.conn.get_server_pid(),
                )
            )
            > 0
        )


@pytest.fixture
async def holders(pg_url: str, pg_schema: str) -> AsyncIterator[Callable[[], Awaitable[Holder]]]:
    opened: list[asyncpg.Connection] = []

    async def make() -> Holder:
        conn = await pg_budget.connect(pg_url, server_settings={"search_path": pg_schema})
        opened.append(conn)
        return Holder(conn)

    yield make
    for conn in opened:
        await conn.close()


async def queued_behind_h(
    store: PostgresStore,
    holder: Holder,
    calls: Sequence[tuple[str, Sequence[str], Callable[[Snapshot], Any], RowLock]],
) -> tuple[asyncio.Task[LockedResult], list[asyncio.Task[LockedResult]]]:
    """A call on ``h`` holding the store's only pipeline slot while it waits for ``holder``'s
    lock, and ``calls`` queued behind it (started, not yet run)."""
    await holder.lock("h")
    first = asyncio.create_task(store.apply_locked("h", (), next_step("h"), WAIT))
    await wait_until(lambda: holder.blocking(), within=BOUND, what="the call on h waiting")
    tasks = [asyncio.create_task(store.apply_locked(*call)) for call in calls]
    await asyncio.sleep(0)  # each task runs up to its place in the queue
    return first, tasks


async def answers(tasks: Sequence[asyncio.Task[LockedResult]]) -> list[Any]:
    done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), BOUND)
    return list(done)


# -- tests ------------------------------------------------------------------------------------


async def test_queued_calls_commit_in_one_transaction(
    store: PostgresStore,
    sql_history: SqlHistory,
    groups: list[list[str]],
    holders: Callable[[], Awaitable[Holder]],
) -> None:
    ids = ["a", "b", "c", "d", "e"]
    await created(store, "h", *ids)
    holder = await holders()
    first, tasks = await queued_behind_h(
        store,
        holder,
        [
            # One request id (a batch of one), several, none.
            ("a", ("ra",), next_step("a", "ra"), WAIT),
            ("b", ("rb", "rb2"), next_step("b", "rb"), WAIT),
            ("c", (), next_step("c"), WAIT),
            ("d", ("rd",), next_step("d", "rd"), RowLock(nowait=True)),
            ("e", [], next_step("e"), WAIT),
        ],
    )
    assert not any(task.done() for task in tasks)
    await holder.release()
    results = await answers([first, *tasks])
    assert all(isinstance(r, LockedResult) and r.committed is not None for r in results), results
    assert groups == [ids]
    # One transaction: every history row of the group stamped with its one now().
    ats = {(await store.history(iid))[0].at for iid in ids}
    assert len(ats) == 1
    assert (await store.history("h"))[0].at not in ats
    for result in results[1:]:
        assert result.committed.version == 2
        assert result.waited is not None and result.held is not None
        assert result.snapshot.priors == {}
    await assert_exactly_once(store, sql_history, dict.fromkeys(["h", *ids], 1))

    # The same request ids again, in a group: found under the lock, in priors.
    seen: dict[str, Snapshot] = {}

    def remember(iid: str) -> Callable[[Snapshot], None]:
        def plan(snap: Snapshot) -> None:
            seen.setdefault(iid, snap)

        return plan

    first, tasks = await queued_behind_h(
        store,
        holder,
        [("a", ("ra",), remember("a"), WAIT), ("b", ["rb", "rb2", "rb"], remember("b"), WAIT)],
    )
    await holder.release()
    again = await answers([first, *tasks])
    assert [r.committed for r in again[1:]] == [None, None]
    assert groups[-1] == ["a", "b"]
    assert {rid: e.version for rid, e in seen["a"].priors.items()} == {"ra": 2}
    assert set(seen["b"].priors) == {"rb"}
    await assert_exactly_once(store, sql_history, {"h": 2, **dict.fromkeys(ids, 1)})


@pytest.mark.parametrize("released", [True, False], ids=["then-applies", "lock-timeout"])
async def test_a_row_held_elsewhere_is_skipped_and_its_call_waits_alone(
    store: PostgresStore,
    sql_history: SqlHistory,
    groups: list[list[str]],
    holders: Callable[[], Awaitable[Holder]],
    released: bool,
) -> None:
    await created(store, "h", "a", "b", "x")
    slot, other = await holders(), await holders()
    await other.lock("x")
    x_lock = WAIT if released else RowLock(timeout=0.2)
    first, tasks = await queued_behind_h(
        store,
        slot,
        [
            ("a", (), next_step("a"), WAIT),
            ("x", ("rx",), next_step("x", "rx"), x_lock),
            ("b", (), next_step("b"), WAIT),
        ],
    )
    await slot.release()
    if released:
        # The group committed a and b without waiting for x; x's call then waits alone.
        await wait_until(other.blocking, within=BOUND, what="the call on x waiting alone")
        assert (await store.get("a")).version == 2 and (await store.get("b")).version == 2
        assert (await store.get("x")).version == 1
        await other.release()
    results = await answers([first, *tasks])
    if not released:
        await other.release()
    assert groups == [["a", "x", "b"]]
    assert results[1].committed.version == 2 and results[3].committed.version == 2
    if released:
        assert results[2].committed.version == 2
        assert results[2].snapshot.priors == {}
    else:
        assert isinstance(results[2], LockTimeout), results[2]
    await assert_exactly_once(
        store, sql_history, {"h": 1, "a": 1, "b": 1, "x": 1 if released else 0}
    )


class Refused(FlowlockError):
    """A plan's own refusal."""


async def test_a_plan_that_fails_leaves_the_others_committed(
    store: PostgresStore,
    sql_history: SqlHistory,
    groups: list[list[str]],
    holders: Callable[[], Awaitable[Holder]],
) -> None:
    await created(store, "h", "a", "b", "c", "d", "e")

    def refuse(snap: Snapshot) -> tuple[HistoryEntry, ...]:
        raise Refused("no")

    holder = await holders()
    first, tasks = await queued_behind_h(
        store,
        holder,
        [
            ("a", (), next_step("a"), WAIT),
            ("b", (), refuse, WAIT),
            # Versions read + 2: the compare-and-swap matches no row under the lock.
            ("c", (), lambda snap: (step("c", snap.instance.version + 2),), WAIT),
            ("d", (), lambda snap: [step("d", 2), step("d", 4)], WAIT),  # malformed
            ("e", (), lambda snap: None, WAIT),  # no write
        ],
    )
    await holder.release()
    results = await answers([first, *tasks])
    assert groups == [["a", "b", "c", "d", "e"]]
    assert results[1].committed.version == 2
    assert isinstance(results[2], Refused)
    assert isinstance(results[3], InvalidInput) and "read version + 1" in str(results[3])
    assert isinstance(results[4], InvalidInput) and "in order" in str(results[4])
    assert results[5].committed is None and results[5].snapshot.instance.version == 1
    await assert_exactly_once(store, sql_history, {"h": 1, "a": 1, "b": 0, "c": 0, "d": 0, "e": 0})


async def test_missing_instance_fails_only_its_call(
    store: PostgresStore,
    sql_history: SqlHistory,
    groups: list[list[str]],
    holders: Callable[[], Awaitable[Holder]],
) -> None:
    await created(store, "h", "a", "b")
    holder = await holders()
    first, tasks = await queued_behind_h(
        store,
        holder,
        [
            ("a", (), next_step("a"), WAIT),
            ("nope", ("r",), next_step("nope"), WAIT),
            ("b", (), next_step("b"), WAIT),
        ],
    )
    await holder.release()
    results = await answers([first, *tasks])
    assert groups == [["a", "nope", "b"]]
    assert isinstance(results[2], InstanceNotFound)
    assert results[1].committed.version == 2 and results[3].committed.version == 2
    await assert_exactly_once(store, sql_history, {"h": 1, "a": 1, "b": 1})


async def test_two_calls_on_one_instance_apply_one_after_the_other(
    store: PostgresStore,
    sql_history: SqlHistory,
    groups: list[list[str]],
    holders: Callable[[], Awaitable[Holder]],
) -> None:
    await created(store, "h", "a", "b")
    holder = await holders()
    first, tasks = await queued_behind_h(
        store,
        holder,
        [
            ("a", ("a1",), next_step("a", "a1"), WAIT),
            ("b", (), next_step("b"), WAIT),
            ("a", ("a2",), next_step("a", "a2"), WAIT),
        ],
    )
    await holder.release()
    results = await answers([first, *tasks])
    assert groups == [["a", "b"]]
    assert results[1].committed.version == 2 and results[3].committed.version == 3
    assert [e.request_id for e in await store.history("a")] == ["a1", "a2"]
    await assert_exactly_once(store, sql_history, {"h": 1, "a": 2, "b": 1})


async def test_an_applied_request_id_in_the_write_runs_the_group_alone(
    store: PostgresStore,
    sql_history: SqlHistory,
    groups: list[list[str]],
    holders: Callable[[], Awaitable[Holder]],
) -> None:
    """A plan that writes a request id already applied (a plan's bug) fails the group's one
    statement whole: the group rolls back, and each call runs alone, so only that one fails."""
    await created(store, "h", "a", "b")
    await store.apply_locked("b", (), next_step("b", "done"), WAIT)
    holder = await holders()
    first, tasks = await queued_behind_h(
        store,
        holder,
        [("a", (), next_step("a"), WAIT), ("b", (), next_step("b", "done"), WAIT)],
    )
    await holder.release()
    results = await answers([first, *tasks])
    assert groups == [["a", "b"]]
    assert results[1].committed.version == 2
    assert isinstance(results[2], InvalidInput) and "request ids not yet applied" in str(results[2])
    await assert_exactly_once(store, sql_history, {"h": 1, "a": 1, "b": 1})


# -- the engine ------------------------------------------------------------------------------


@pytest.mark.slow
async def test_engine_spread_under_pessimistic_is_exactly_once(
    pg_url: str, pg_schema: str, sql_history: SqlHistory, groups: list[list[str]]
) -> None:
    """100 callers x 10 steps each over 1,000 counters, pessimistic: every call applied, each
    counter's history contiguous and equal to its count, and groups did form."""
    ids = [f"c{n:04d}" for n in range(1000)]
    rng = random.Random(11)
    lanes = [[rng.choice(ids) for _ in range(10)] for _ in range(100)]
    store = PostgresStore(pg_url, schema=pg_schema, pool_size=20)
    async with flowlock.Engine(store) as engine:
        await engine.register(counter())
        for iid in ids:
            await engine.create("counter", instance_id=iid)

        async def caller(lane: list[str]) -> list[flowlock.Outcome]:
            return [await engine.fire(iid, "step", strategy="pessimistic") for iid in lane]

        outcomes = await asyncio.wait_for(asyncio.gather(*map(caller, lanes)), BOUND)
        assert all(o.applied for lane in outcomes for o in lane)
        applied = dict.fromkeys(ids, 0)
        for lane in lanes:
            for iid in lane:
                applied[iid] += 1
        histories = {iid: await store.history(iid) for iid in ids}
        for iid, rows in histories.items():
            instance = await store.get(iid)
            verdict = check(instance, rows, initial_state="open", expected_applied=applied[iid])
            assert verdict.ok, verdict.violations
            assert instance.data.get("n", 0) == applied[iid]
        (await sql_history()).assert_matches(histories)
    assert any(len(group) > 1 for group in groups)
