"""Durable timers on the SQLite store: armed, moved on and voided in the transaction of the
commit's compare-and-swap, claimed by one store object at a time, and fired by an engine."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

import flowlock
from flowlock.checker import check
from flowlock.core import migrations
from flowlock.core.models import HistoryEntry, Instance, Snapshot, Timer, TimerFiring, Timing
from flowlock.stores.base import RowLock, TimerStore
from flowlock.stores.sqlite import SqliteStore
from lock_probes import wait_until

TIMERS = "006_timers"
SOON = Timing("expire", 60.0)
NOW = Timing("expire", 0.0)  # due at once: claimable without waiting


def new(instance_id: str = "i", workflow: str = "approval") -> Instance:
    return Instance(id=instance_id, workflow=workflow, state="pending", version=0, data={})


def entry(
    inst: Instance,
    to_state: str,
    *,
    version: int | None = None,
    arm: Sequence[Timing] = (),
    voids: bool = False,
    timer: TimerFiring | None = None,
    from_state: str | None = None,
) -> HistoryEntry:
    """The entry after `inst` (or at `version`), from the state it is in (or `from_state`)."""
    return HistoryEntry(
        instance_id=inst.id,
        version=inst.version + 1 if version is None else version,
        event="go",
        from_state=inst.state if from_state is None else from_state,
        to_state=to_state,
        actor=None,
        request_id=None,
        strategy="optimistic",
        data={},
        arm=tuple(arm),
        voids=voids,
        timer=timer,
    )


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "timers.db"


@pytest.fixture
async def store(db_path: Path) -> AsyncIterator[SqliteStore]:
    async with SqliteStore(db_path) as s:
        yield s


async def committed(store: SqliteStore, entries: Sequence[HistoryEntry]) -> Instance:
    inst = await store.commit(entries)
    assert inst is not None
    return inst


def test_the_sqlite_store_is_a_timer_store() -> None:
    """SqliteStore implements the TimerStore port, so every engine on it runs the service."""
    assert isinstance(SqliteStore(":memory:"), TimerStore)


async def test_create_arms_the_first_stay_and_get_shows_the_next_timer(store: SqliteStore) -> None:
    """A create arms its timers with stay 1, due `after` from the commit; get() shows the
    earliest as next_timer, and the instance's stay_version is 1."""
    before = datetime.now(UTC)
    made = await store.create(new(), arm=(SOON, Timing("remind", 5.0, 5.0, 3)))
    assert (made.stay_version, made.version) == (1, 1)
    remind, expire = await store.timers("i")
    assert (remind.event, remind.stay, remind.n, remind.every, remind.limit) == (
        "remind",
        1,
        0,
        5.0,
        3,
    )
    assert (expire.event, expire.stay, expire.every, expire.limit) == ("expire", 1, None, None)
    assert before + timedelta(seconds=59) < expire.due_at < datetime.now(UTC) + timedelta(60)
    assert remind.lag == 0.0 and remind.claimed_until is None
    shown = await store.get("i")
    assert shown.stay_version == 1 and shown.next_timer == remind
    await store.create(new("plain"))
    assert (await store.get("plain")).next_timer is None
    assert await store.count_timers() == 2


async def test_a_keyed_create_arms_once(store: SqliteStore) -> None:
    """A retried keyed create answers the first one and arms nothing more."""
    await store.create(new(), "k", arm=(SOON,))
    again = await store.create(new(), "k", arm=(Timing("other", 1.0),))
    assert again.stay_version == 1
    assert [t.event for t in await store.timers("i")] == ["expire"]


async def test_entering_a_state_arms_its_stay_and_leaving_voids(store: SqliteStore) -> None:
    """A commit that changes the state moves stay_version and arms the new stay; one that
    keeps it leaves both alone; voids deletes the instance's timers."""
    inst = await store.create(new(), arm=(SOON,))
    inst = await committed(store, [entry(inst, "review", voids=True, arm=(Timing("nag", 30),))])
    assert inst.stay_version == 2
    [nag] = await store.timers("i")
    assert (nag.event, nag.stay) == ("nag", 2)
    inst = await committed(store, [entry(inst, "review")])  # stays: nothing changes
    assert (inst.version, inst.stay_version) == (3, 2)
    assert [t.stay for t in await store.timers("i")] == [2]
    inst = await committed(store, [entry(inst, "done", voids=True)])
    assert inst.stay_version == 4 and await store.timers("i") == []
    assert (await store.get("i")).stay_version == 4


async def test_a_batch_voids_then_moves_then_arms_its_last_stay(store: SqliteStore) -> None:
    """In one batch: voids first, then fired timers, then only the last entering entry's
    stay is armed (with that entry's version)."""
    inst = await store.create(new(), arm=(Timing("remind", 0.0, 10.0),))
    [remind] = await store.timers("i")
    fired = entry(inst, "pending", timer=remind.firing)
    batch = [
        fired,
        entry(inst, "review", version=3, voids=True, arm=(Timing("nag", 30),)),
        entry(inst, "pending", version=4, from_state="review", voids=True, arm=(SOON,)),
        entry(inst, "pending", version=5),
    ]
    inst = await committed(store, batch)
    assert (inst.version, inst.stay_version) == (5, 4)
    assert [(t.event, t.stay) for t in await store.timers("i")] == [("expire", 4)]
    # Without a void in the batch, the fired reminder moves on and the new stay is armed too.
    other = await store.create(new("j"), arm=(Timing("remind", 0.0, 10.0),))
    [remind] = await store.timers("j")
    batch = [
        entry(other, "pending", timer=remind.firing),
        entry(other, "review", version=3, arm=(Timing("nag", 30),)),
    ]
    await committed(store, batch)
    assert [(t.event, t.stay, t.n) for t in await store.timers("j")] == [
        ("remind", 1, 1),
        ("nag", 3, 0),
    ]


async def test_a_lost_compare_and_swap_arms_nothing(store: SqliteStore) -> None:
    """A commit that loses writes no timer, voids none; commit_many's winners arm theirs."""
    a = await store.create(new("a"), arm=(SOON,))
    b = await store.create(new("b"))
    stale = entry(a, "done", version=5, voids=True)
    assert await store.commit([stale]) is None
    assert [t.event for t in await store.timers("a")] == ["expire"]
    answers = await store.commit_many([[stale], [entry(b, "review", arm=(Timing("nag", 30),))]])
    assert answers[0] is None and answers[1] is not None
    assert [t.event for t in await store.timers("a")] == ["expire"]
    assert [(t.event, t.stay) for t in await store.timers("b")] == [("nag", 2)]


async def test_apply_locked_arms_and_a_refused_plan_rolls_back(store: SqliteStore) -> None:
    """The pessimistic path arms in its transaction; a plan that raises leaves nothing armed."""
    await store.create(new(), arm=(SOON,))

    def leave(snap: Snapshot) -> list[HistoryEntry]:
        return [entry(snap.instance, "review", voids=True, arm=(Timing("nag", 30),))]

    def broken(snap: Snapshot) -> list[HistoryEntry]:
        raise flowlock.InvalidInput("no")

    result = await store.apply_locked("i", [], leave, RowLock())
    assert result.committed is not None and result.committed.stay_version == 2
    assert [(t.event, t.stay) for t in await store.timers("i")] == [("nag", 2)]
    with pytest.raises(flowlock.InvalidInput):
        await store.apply_locked("i", [], broken, RowLock())
    assert [(t.event, t.stay) for t in await store.timers("i")] == [("nag", 2)]


async def test_a_stay_left_and_reentered_never_fires_its_old_timer(store: SqliteStore) -> None:
    """Left and re-entered before its timer was due: the old stay's timer is gone (never
    claimable, its cancel refused); only the new stay's fires."""
    inst = await store.create(new(), arm=(NOW,))
    [old] = await store.timers("i")
    inst = await committed(store, [entry(inst, "approved", voids=True)])
    inst = await committed(store, [entry(inst, "pending", arm=(NOW,))])
    [claimed] = await store.claim_timers(["approval"], limit=10, lease=30, owner="e")
    assert (claimed.stay, claimed.event) == (3, "expire")
    assert await store.cancel_timer(old) is False
    firing = entry(inst, "rejected", voids=True, timer=claimed.firing)
    inst = await committed(store, [firing])
    assert await store.timers("i") == [] and await store.count_timers() == 0


async def test_a_reminder_moves_on_every_period_until_its_limit(store: SqliteStore) -> None:
    """Each applied firing of a reminder moves it one period on, unclaimed, with n + 1; the
    limit-th is the last; a firing that was already applied moves nothing."""
    remind = Timing("remind", 0.0, 100.0, 2)
    inst = await store.create(new(), arm=(remind,))
    [first] = await store.claim_timers(["approval"], limit=5, lease=30, owner="e")
    inst = await committed(store, [entry(inst, "pending", timer=first.firing)])
    [second] = await store.timers("i")
    assert (second.n, second.claimed_until) == (1, None)
    assert second.due_at == first.due_at + timedelta(seconds=100)
    inst = await committed(store, [entry(inst, "pending", timer=first.firing)])  # n 0 again
    assert [t.n for t in await store.timers("i")] == [1]
    inst = await committed(store, [entry(inst, "pending", timer=second.firing)])
    assert await store.timers("i") == []


async def test_a_reminder_without_a_limit_keeps_going(store: SqliteStore) -> None:
    """every= without limit= moves on after every firing."""
    inst = await store.create(new(), arm=(Timing("remind", 10.0, 1.0),))
    for n in range(3):
        [timer] = await store.timers("i")
        assert timer.n == n
        inst = await committed(store, [entry(inst, "pending", timer=timer.firing)])
    assert [t.n for t in await store.timers("i")] == [3]


async def test_cancel_is_a_compare_and_swap_on_stay_and_firing(store: SqliteStore) -> None:
    """cancel_timer moves a reminder on or deletes a one-shot, once: again (or after the
    timer was voided) it answers False and changes nothing."""
    inst = await store.create(new(), arm=(SOON, Timing("remind", 5.0, 5.0, 3)))
    remind, expire = await store.timers("i")
    assert await store.cancel_timer(remind) is True
    assert await store.cancel_timer(remind) is False
    assert [(t.event, t.n) for t in await store.timers("i")] == [("remind", 1), ("expire", 0)]
    assert await store.cancel_timer(expire) is True
    assert [t.event for t in await store.timers("i")] == ["remind"]
    [moved] = await store.timers("i")
    await committed(store, [entry(inst, "done", voids=True)])
    assert await store.cancel_timer(moved) is False
    assert await store.count_timers() == 0


async def test_claims_are_exclusive_between_store_objects_on_one_file(db_path: Path) -> None:
    """Two store objects on one file claiming at once never get the same timer, and every
    due timer is claimed; only the given workflows', earliest due first."""
    async with SqliteStore(db_path) as a, SqliteStore(db_path) as b:
        for i in range(30):
            await a.create(new(f"i{i:02}"), arm=(Timing("expire", -1.0 + i / 1000),))
        await a.create(new("other", workflow="leave"), arm=(NOW,))
        claimers = [(a, "a"), (b, "b")] * 5
        rounds = await asyncio.gather(
            *[s.claim_timers(["approval"], limit=4, lease=30, owner=n) for s, n in claimers]
        )
        got = [t.instance_id for claimed in rounds for t in claimed]
        assert len(got) == len(set(got)) == 30
        for claimed in rounds:
            assert [t.due_at for t in claimed] == sorted(t.due_at for t in claimed)
        assert await b.claim_timers(["approval"], limit=50, lease=30, owner="b") == []
        [timer] = await a.timers("i00")
        assert timer.claimed_until is not None
        [other] = await b.claim_timers(["leave", "approval"], limit=50, lease=30, owner="b")
        assert other.instance_id == "other"


async def test_a_released_or_expired_claim_can_be_claimed_again(store: SqliteStore) -> None:
    """release_timer gives a claim back at once (only its owner's); a claim whose lease ran
    out is claimable again."""
    await store.create(new(), arm=(NOW,))
    [timer] = await store.claim_timers(["approval"], limit=5, lease=30, owner="a")
    await store.release_timer(timer, "b")  # not b's claim: nothing
    assert await store.claim_timers(["approval"], limit=5, lease=30, owner="b") == []
    await store.release_timer(timer, "a")
    [again] = await store.claim_timers(["approval"], limit=5, lease=0.05, owner="b")
    assert again.firing == timer.firing
    late: list[Timer] = []

    async def claimed_again() -> bool:
        late.extend(await store.claim_timers(["approval"], limit=5, lease=30, owner="c"))
        return bool(late)

    await wait_until(claimed_again, within=30, what="the 50 ms claim running out")
    assert [t.firing for t in late] == [timer.firing]


async def test_next_due_counts_due_times_and_claims(store: SqliteStore) -> None:
    """next_due: None with nothing armed, the seconds to the earliest due timer, 0 when one
    is due, the end of a claim while every due timer is claimed; other workflows ignored."""
    assert await store.next_due(["approval"]) is None
    await store.create(new("a"), arm=(SOON,))
    await store.create(new("x", workflow="leave"), arm=(NOW,))
    wait = await store.next_due(["approval"])
    assert wait is not None and 50 < wait <= 60
    await store.create(new("b"), arm=(NOW,))
    assert await store.next_due(["approval"]) == 0.0
    await store.claim_timers(["approval"], limit=5, lease=20, owner="e")
    wait = await store.next_due(["approval"])
    assert wait is not None and 10 < wait <= 20
    assert await store.next_due([]) is None


async def test_timers_due_timers_and_counts(store: SqliteStore) -> None:
    """timers() lists an instance's timers by due time; due_timers lists due and soon-due
    ones with their lag; count_timers counts every armed timer."""
    await store.create(new("late"), arm=(Timing("expire", -2.0),))
    await store.create(new("soon"), arm=(Timing("expire", 5.0),))
    await store.create(new("later"), arm=(Timing("expire", 500.0),))
    due = await store.due_timers(within=10, limit=10)
    assert [t.instance_id for t in due] == ["late", "soon"]
    assert due[0].lag >= 2.0 and due[1].lag == 0.0
    assert [t.instance_id for t in await store.due_timers(within=1000, limit=1)] == ["late"]
    assert await store.count_timers() == 3
    assert await store.timers("nobody") == []


async def test_armed_is_set_by_a_commit_that_arms(store: SqliteStore) -> None:
    """armed() is set, with the new timer's due time, by a commit of this store that armed a
    timer; not by one that armed none nor by a lost compare-and-swap."""
    inst = await store.create(new())
    async with store.armed() as signal:
        inst = await committed(store, [entry(inst, "pending")])
        assert not signal.is_set()
        assert await store.commit([entry(inst, "review", version=9, arm=(SOON,))]) is None
        assert not signal.is_set()
        loop = asyncio.get_running_loop()
        await committed(store, [entry(inst, "review", arm=(SOON,))])
        assert signal.is_set()
        assert signal.earliest is not None and signal.earliest > loop.time() + 50
        signal.clear()
        await store.create(new("j"), arm=(NOW,))
        assert signal.is_set()


async def test_a_workflow_without_timers_sends_no_timer_statement(store: SqliteStore) -> None:
    """Creates and commits that arm, void and fire nothing never touch flowlock_timers."""
    seen: list[str] = []
    pool = store._pool
    assert pool is not None
    for worker in pool.workers:
        await asyncio.wrap_future(
            worker.executor.submit(worker.conn.set_trace_callback, seen.append)
        )
    inst = await store.create(new())
    inst = await committed(store, [entry(inst, "review"), entry(inst, "done", version=3)])
    await store.commit_many([[entry(inst, "done")]])
    assert seen and not [s for s in seen if "flowlock_timers" in s]


def _deadline(name: str = "approval", after: float = 0.1) -> flowlock.Workflow:
    """Approve, or expire `after` seconds into pending; reopen goes back to pending."""
    return flowlock.Workflow(
        name,
        states=["pending", "approved", "rejected"],
        initial="pending",
        transitions=[
            flowlock.Transition("approve", source="pending", target="approved"),
            flowlock.Transition(
                "expire", source="pending", target="rejected", after=timedelta(seconds=after)
            ),
            flowlock.Transition("reopen", source="approved", target="pending"),
            flowlock.Transition("amend", source="approved", target="approved"),
        ],
    )


async def _settled(engine: flowlock.Engine, ids: Sequence[str], state: str) -> None:
    """Wait (at most 30 s) until every instance of `ids` is in `state`."""

    async def there() -> bool:
        return [(await engine.get(i)).state for i in ids] == [state] * len(ids)

    await wait_until(there, within=30, what=f"{list(ids)} in {state}")


async def test_two_engines_on_one_file_fire_each_deadline_once(db_path: Path) -> None:
    """Two engines sharing a SQLite file: every deadline fires once (actor flowlock:timer,
    the firing's request id); an approval voids its timer; the checker finds nothing wrong."""
    url = f"sqlite:///{db_path}"
    async with flowlock.connect(url) as one, flowlock.connect(url) as two:
        for engine in (one, two):
            await engine.register(_deadline())
            await engine.register(_deadline("slow", after=600))
        ids = [f"r{i}" for i in range(10)]
        for i, iid in enumerate(ids):
            await (one if i % 2 else two).create("approval", instance_id=iid)
        await one.create("slow", instance_id="ok")
        assert [t.event for t in await two.timers("ok")] == ["expire"]
        await two.fire("ok", "approve")
        assert await one.timers("ok") == []
        await _settled(one, ids, "rejected")
        for iid in ids:
            history = await one.history(iid)
            assert [(h.event, h.actor, h.request_id) for h in history] == [
                ("expire", "flowlock:timer", "timer:1:expire:0")
            ]
            verdict = check(await one.get(iid), history, initial_state="pending")
            assert verdict.ok, verdict.violations
        assert await one.timers("r0") == [] and (await one.get("r0")).next_timer is None


def _old_rows(path: Path, sql: str, *args: Any) -> None:
    db = sqlite3.connect(path)
    try:
        db.execute(sql, args)
        db.commit()
    finally:
        db.close()


async def test_a_database_made_before_timers_migrates(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file migrated up to before 006 takes it: old instances have no stay (NULL, kept by a
    write that keeps the state, set by one that changes it), and timers then arm and fire on
    them and on new ones."""
    assert TIMERS in [m.name for m in migrations.load("sqlite")]
    before = [m for m in migrations.load("sqlite") if m.name < TIMERS]
    with monkeypatch.context() as patched:
        patched.setattr(migrations, "load", lambda dialect: before)
        async with SqliteStore(db_path):
            pass
    _old_rows(
        db_path,
        "INSERT INTO flowlock_instances (id, workflow, state, version, data, last_event,"
        " created_at, updated_at) VALUES ('old', 'approval', 'approved', 2, '{}', 'approve',"
        " '2024-01-01T00:00:00+00:00', '2024-01-01T00:00:00+00:00')",
    )
    async with flowlock.connect(f"sqlite:///{db_path}") as engine:
        await engine.register(_deadline())
        assert (await engine.get("old")).stay_version is None
        amended = await engine.fire("old", "amend")
        assert (amended.instance.version, amended.instance.stay_version) == (3, None)
        assert (await engine.get("old")).stay_version is None
        reopened = await engine.fire("old", "reopen")
        assert reopened.instance.stay_version == 4
        assert (await engine.create("approval", instance_id="new")).stay_version == 1
        await _settled(engine, ["old", "new"], "rejected")
        [*_, expired] = await engine.history("old")
        assert (expired.actor, expired.request_id) == ("flowlock:timer", "timer:4:expire:0")


async def test_deleting_an_instance_deletes_its_timers(store: SqliteStore) -> None:
    """As on PostgreSQL (ON DELETE CASCADE), deleting an instance row deletes its timers: the
    store's connections enforce foreign keys, so without the cascade the delete would fail."""
    await store.create(new("gone"), arm=(SOON,))
    await store.create(new("kept"), arm=(SOON,))
    pool = store._pool
    assert pool is not None
    worker = pool.workers[0]

    def delete(conn: sqlite3.Connection) -> int:
        [(enforced,)] = conn.execute("PRAGMA foreign_keys").fetchall()
        conn.execute("DELETE FROM flowlock_instances WHERE id = 'gone'")
        return int(enforced)

    assert await asyncio.wrap_future(worker.executor.submit(delete, worker.conn)) == 1
    assert await store.timers("gone") == []
    assert [t.instance_id for t in await store.timers("kept")] == ["kept"]
