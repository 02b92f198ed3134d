"""One contract for every store (memory, SQLite, PostgreSQL) and every strategy.

Each test runs once per store backend (the ``engine`` fixture is parametrised) and, where the
strategy matters, once per strategy: optimistic, pessimistic, distributed (on the memory lock
backend) and adaptive (optimistic while an instance is calm, escalated when it runs hot).
After every concurrency test the checker reads the histories, and on PostgreSQL and SQLite the
history rows are also counted with the test's own SQL.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence

import pytest

import flowlock
from conftest import BOTH_WAYS, ON_AND_OFF
from flowlock.checker import check
from flowlock.core.models import HistoryEntry
from flowlock.stores.postgres import PostgresStore
from flowlock.stores.sqlite import SqliteStore

STRATEGIES = ["optimistic", "pessimistic", "distributed", "adaptive"]


@pytest.fixture(params=STRATEGIES)
def strategy(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture(params=BOTH_WAYS)
def batching(request: pytest.FixtureRequest) -> bool:
    """Each test runs with batching on and off (see BOTH_WAYS)."""
    on: bool = request.param
    return on


def ran(strategy: str) -> str:
    """The strategy a call on a calm instance runs under: adaptive runs it optimistic."""
    return "optimistic" if strategy == "adaptive" else strategy


Recount = Callable[[flowlock.Engine, Sequence[str]], Awaitable[None]]


@pytest.fixture
def recount(request: pytest.FixtureRequest) -> Recount:
    """``await recount(engine, ids)``: the engine's histories of ``ids`` agree with the history
    rows counted by the test's own SQL (PostgreSQL, SQLite): rows per instance, no request id
    twice, version = rows + 1. The memory store has no database to count; it is skipped."""

    async def run(engine: flowlock.Engine, ids: Sequence[str]) -> None:
        histories = {iid: await engine.history(iid) for iid in ids}
        store = engine.store
        if isinstance(store, PostgresStore):
            counted = await request.getfixturevalue("sql_history")()
            counted.assert_matches(histories)
        elif isinstance(store, SqliteStore):
            conn = sqlite3.connect(store.path)
            try:
                for iid, entries in histories.items():
                    [(rows, requests, twice)] = conn.execute(
                        "SELECT count(*), count(request_id), count(*) - count(DISTINCT"
                        " coalesce(request_id, 'none:' || version)) FROM flowlock_history"
                        " WHERE instance_id = ?",
                        (iid,),
                    ).fetchall()
                    [(version,)] = conn.execute(
                        "SELECT version FROM flowlock_instances WHERE id = ?", (iid,)
                    ).fetchall()
                    assert (rows, twice, version) == (len(entries), 0, len(entries) + 1), iid
                    assert requests == sum(e.request_id is not None for e in entries), iid
            finally:
                conn.close()

    return run


async def test_create_and_get(engine: flowlock.Engine) -> None:
    """create stores the instance in its initial state at version 1; get reads it back."""
    inst = await engine.create("approval", instance_id="req-1", data={"amount": 120})
    assert (inst.state, inst.version, dict(inst.data)) == ("pending", 1, {"amount": 120})
    got = await engine.get("req-1")
    assert (got.id, got.workflow, got.state, got.version) == ("req-1", "approval", "pending", 1)
    assert got.last_event is None
    assert got.created_at is not None


async def test_create_twice_raises_instance_exists(engine: flowlock.Engine) -> None:
    """A taken id raises InstanceExists and leaves the first instance untouched."""
    await engine.create("approval", instance_id="dup", data={"n": 1})
    with pytest.raises(flowlock.InstanceExists):
        await engine.create("approval", instance_id="dup", data={"n": 2})
    assert dict((await engine.get("dup")).data) == {"n": 1}


async def test_missing_instance(engine: flowlock.Engine, strategy: str) -> None:
    """get, fire and history on an unknown id raise InstanceNotFound."""
    with pytest.raises(flowlock.InstanceNotFound):
        await engine.get("nope")
    with pytest.raises(flowlock.InstanceNotFound):
        await engine.fire("nope", "approve", strategy=strategy)
    with pytest.raises(flowlock.InstanceNotFound):
        await engine.history("nope")


async def test_fire_applies_once_and_records_history(
    engine: flowlock.Engine, strategy: str
) -> None:
    """fire moves the state, bumps the version by one and appends one history entry."""
    await engine.create("approval", instance_id="r", data={"amount": 5})
    out = await engine.fire("r", "approve", actor="alice", strategy=strategy)
    assert out.applied and not out.idempotent
    assert (out.instance.state, out.instance.version, out.strategy) == (
        "approved",
        2,
        ran(strategy),
    )
    if strategy == "adaptive":
        assert out.reason == "adaptive: optimistic (instance not escalated)"
    assert out.attempts == 1
    assert out.elapsed > 0
    [entry] = await engine.history("r")
    assert (entry.version, entry.event, entry.from_state, entry.to_state, entry.actor) == (
        2,
        "approve",
        "pending",
        "approved",
        "alice",
    )
    assert entry.strategy == ran(strategy)
    assert check(await engine.get("r"), [entry], initial_state="pending", expected_applied=1)


async def test_two_admins_rule(engine: flowlock.Engine, strategy: str) -> None:
    """The same event fired again after it was applied answers idempotent, writes nothing."""
    await engine.create("approval", instance_id="r")
    first = await engine.fire("r", "approve", actor="alice", strategy=strategy)
    second = await engine.fire("r", "approve", actor="bob", strategy=strategy)
    assert first.applied and second.idempotent and not second.applied
    assert second.instance.version == 2
    assert len(await engine.history("r")) == 1


async def test_not_allowed_carries_state_and_allowed_events(
    engine: flowlock.Engine, strategy: str
) -> None:
    """An event not allowed from the current state raises TransitionNotAllowed with the facts."""
    await engine.create("approval", instance_id="r")
    await engine.fire("r", "approve", strategy=strategy)
    with pytest.raises(flowlock.TransitionNotAllowed) as caught:
        await engine.fire("r", "reject", strategy=strategy)
    assert (caught.value.state, caught.value.allowed, caught.value.version) == ("approved", (), 2)
    await engine.create("ticket", instance_id="t")
    with pytest.raises(flowlock.TransitionNotAllowed) as caught2:
        await engine.fire("t", "reopen", strategy=strategy)
    assert caught2.value.allowed == ("close",)
    assert (await engine.get("t")).version == 1


async def test_unknown_event(engine: flowlock.Engine, strategy: str) -> None:
    """An event the workflow does not define raises UnknownEvent listing the real ones."""
    await engine.create("approval", instance_id="r")
    with pytest.raises(flowlock.UnknownEvent) as caught:
        await engine.fire("r", "sign", strategy=strategy)
    assert caught.value.known == ("approve", "reject")


async def test_request_id_is_exactly_once_even_after_a_cycle(
    engine: flowlock.Engine, strategy: str
) -> None:
    """A repeated request id returns the first outcome, also after the workflow cycled back."""
    await engine.create("ticket", instance_id="t")
    first = await engine.fire("t", "close", request_id="req-A", strategy=strategy)
    await engine.fire("t", "reopen", request_id="req-B", strategy=strategy)
    # The ticket is open again, so "close" is allowed: only the request id stops a second close.
    again = await engine.fire("t", "close", request_id="req-A", strategy=strategy)
    assert again.idempotent and not again.applied
    assert (again.instance.state, again.instance.version) == (
        first.instance.state,
        first.instance.version,
    )
    assert dict(again.instance.data) == dict(first.instance.data)
    current = await engine.get("t")
    assert (current.state, current.version) == ("open", 3)
    history = await engine.history("t")
    assert [h.request_id for h in history] == ["req-A", "req-B"]
    assert check(current, history, initial_state="open", expected_applied=2)


async def test_cycle_without_request_id_is_applied_again(
    engine: flowlock.Engine, strategy: str
) -> None:
    """Without a request id a cycle is real work: version, not state, is compared."""
    await engine.create("ticket", instance_id="t")
    for _ in range(3):
        assert (await engine.fire("t", "close", strategy=strategy)).applied
        assert (await engine.fire("t", "reopen", strategy=strategy)).applied
    current = await engine.get("t")
    assert current.version == 7
    assert check(current, await engine.history("t"), initial_state="open", expected_applied=6)


async def test_expected_version(engine: flowlock.Engine, strategy: str) -> None:
    """A stale expected_version raises VersionMismatch with the current version; fresh applies."""
    await engine.create("ticket", instance_id="t")
    await engine.fire("t", "close", strategy=strategy)
    with pytest.raises(flowlock.VersionMismatch) as caught:
        await engine.fire("t", "reopen", expected_version=1, strategy=strategy)
    assert (caught.value.current, caught.value.expected, caught.value.state) == (2, 1, "closed")
    assert (await engine.get("t")).version == 2
    out = await engine.fire("t", "reopen", expected_version=2, strategy=strategy)
    assert out.applied and out.instance.version == 3


async def test_guard_rejection_writes_nothing(engine: flowlock.Engine, strategy: str) -> None:
    """A guard's refusal raises GuardRejected with its reason and leaves the instance as it was."""
    await engine.create("inventory", instance_id="sku", data={"stock": 1})
    assert (await engine.fire("sku", "reserve", strategy=strategy)).applied
    with pytest.raises(flowlock.GuardRejected) as caught:
        await engine.fire("sku", "reserve", strategy=strategy)
    assert "out of stock" in caught.value.reason
    assert caught.value.instance_id == "sku" and caught.value.version == 2
    inst = await engine.get("sku")
    assert (inst.version, dict(inst.data)) == (2, {"stock": 0, "reserved": 1})


async def test_countersign_quorum(engine: flowlock.Engine, strategy: str) -> None:
    """Each approver signs once; a second signature is refused; quorum moves to approved."""
    await engine.create("countersign", instance_id="doc")
    assert (await engine.fire("doc", "sign", actor="a", strategy=strategy)).instance.state == (
        "pending"
    )
    with pytest.raises(flowlock.GuardRejected):
        await engine.fire("doc", "sign", actor="a", strategy=strategy)
    await engine.fire("doc", "sign", actor="b", strategy=strategy)
    last = await engine.fire("doc", "sign", actor="c", strategy=strategy)
    assert last.instance.state == "approved"
    assert last.instance.data["signers"] == ["a", "b", "c"]
    history = await engine.history("doc")
    assert [h.to_state for h in history] == ["pending", "pending", "approved"]


@ON_AND_OFF
async def test_concurrent_duplicates_of_one_request(
    engine: flowlock.Engine, strategy: str, recount: Recount
) -> None:
    """Five concurrent calls with one request id: applied once, identical outcomes, one history
    row (checker, and the rows counted by SQL)."""
    await engine.create("approval", instance_id="r")
    outs = await asyncio.gather(
        *[
            engine.fire("r", "approve", request_id="once", actor=f"u{i}", strategy=strategy)
            for i in range(5)
        ]
    )
    assert sum(o.applied for o in outs) == 1
    assert {(o.instance.state, o.instance.version) for o in outs} == {("approved", 2)}
    history = await engine.history("r")
    assert [h.request_id for h in history] == ["once"]
    verdict = check(await engine.get("r"), history, initial_state="pending", expected_applied=1)
    assert verdict.ok, verdict.violations
    await recount(engine, ["r"])


@ON_AND_OFF
async def test_concurrent_different_requests_lose_no_update(
    engine: flowlock.Engine, strategy: str, batching: bool, recount: Recount
) -> None:
    """Ten concurrent reservations on one stock: every call that answers applied is one history
    row and one unit of stock, none is lost or doubled; every locking strategy (and adaptive,
    which finishes a call that lost its races under the lock) applies them all, and so does a
    batching engine (the first call alone, the other nine as one batch), while plain optimistic
    without batching may give up on some with ConflictRetriesExhausted, which wrote nothing."""
    await engine.create("inventory", instance_id="sku", data={"stock": 100})
    outs = await asyncio.gather(
        *[
            engine.fire("sku", "reserve", actor=f"u{i}", request_id=f"q{i}", strategy=strategy)
            for i in range(10)
        ],
        return_exceptions=True,
    )
    kinds = Counter(type(o).__name__ for o in outs)
    applied = [o for o in outs if isinstance(o, flowlock.Outcome)]
    assert all(o.applied for o in applied)
    if strategy == "optimistic" and not batching:
        assert set(kinds) <= {"Outcome", "ConflictRetriesExhausted"}, outs
        exhausted = [o for o in outs if isinstance(o, flowlock.ConflictRetriesExhausted)]
        assert all(e.attempts == 3 for e in exhausted), exhausted
        # A caller gives up after its 3 compare-and-swaps each found the version moved on:
        # 3 commits, all by others of the ten (nothing else writes the instance).
        assert not exhausted or len(applied) >= 3, kinds
    else:
        assert kinds == {"Outcome": 10}, outs
    if batching:
        assert sorted(o.batch_size for o in applied) == [1] + [9] * 9, applied
    final = await engine.get("sku")
    assert dict(final.data) == {"stock": 100 - len(applied), "reserved": len(applied)}
    history = await engine.history("sku")
    assert sorted(h.request_id or "" for h in history) == sorted(
        o.request_id or "" for o in applied
    )
    verdict = check(final, history, initial_state="open", expected_applied=len(applied))
    assert verdict.ok, verdict.violations
    await recount(engine, ["sku"])


async def test_sql_text_is_data(engine: flowlock.Engine, strategy: str) -> None:
    """Ids, actors, request ids and data carrying SQL are stored verbatim, never executed."""
    evil = "x'); DROP TABLE flowlock_instances; --"
    await engine.create("approval", instance_id=evil, data={"note": evil})
    out = await engine.fire(evil, "approve", actor=evil, request_id=evil, strategy=strategy)
    assert out.applied
    [entry] = await engine.history(evil)
    assert (entry.instance_id, entry.actor, entry.request_id) == (evil, evil, evil)
    assert (await engine.get(evil)).data["note"] == evil


async def test_history_entries_are_values(engine: flowlock.Engine) -> None:
    """history returns frozen HistoryEntry values, oldest first."""
    await engine.create("ticket", instance_id="t")
    await engine.fire("t", "close")
    await engine.fire("t", "reopen")
    history = await engine.history("t")
    assert all(isinstance(h, HistoryEntry) for h in history)
    assert [h.version for h in history] == [2, 3]
    assert history[0].at is not None and history[0].at <= history[1].at  # type: ignore[operator]
