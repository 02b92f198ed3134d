"""One timer contract for every store (memory, SQLite, PostgreSQL: the ``store_factory``
fixture is parametrised; a store that keeps no timers would be skipped, saying so).

What a commit does to timers (arm on entering a state, void on leaving it, a firing moving its
timer on) happens in the commit's own transaction; the timer service's questions (claim,
release, cancel, next due) are compare-and-swaps on the stay and firing number. Most tests run
an engine with ``timers=False`` and ask the store directly, so nothing fires behind their back;
the last ones run the timer service and wait for its firings (events and conditions, bounded).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence

import pytest

import flowlock
from flowlock.checker import check
from flowlock.core.errors import StaleTimer
from flowlock.core.models import TIMER_ACTOR, HistoryEntry, Instance, Timer, TimerFiring
from flowlock.locks import MemoryLocks
from flowlock.stores import Store
from flowlock.stores.base import TimerStore
from lock_probes import wait_until
from timer_steps import BOUND, EVERY, LATER, WF, deadline

StoreFactory = Callable[..., Store]


def timer_store(store: Store) -> TimerStore:
    """`store` as a TimerStore, or the test skipped."""
    if not isinstance(store, TimerStore):
        pytest.skip(f"{type(store).__name__} keeps no timers yet")
    return store


@pytest.fixture
async def quiet(store_factory: StoreFactory) -> AsyncIterator[flowlock.Engine]:
    """An open engine that runs no timer service (`timers=False`): timers arm and void, and
    only the test claims or fires them."""
    store = store_factory()
    timer_store(store)
    async with flowlock.Engine(store, locks=MemoryLocks(), timers=False) as engine:
        await engine.register(deadline())
        yield engine


def timers_of(engine: flowlock.Engine) -> TimerStore:
    return timer_store(engine.store)


def shape(timers: Sequence[Timer]) -> list[tuple[str, int, int]]:
    """What a list of timers is about: (event, stay, n) each, in its order."""
    return [(t.event, t.stay, t.n) for t in timers]


def seconds(a: Timer, b: Timer) -> float:
    return (b.due_at - a.due_at).total_seconds()


async def due(store: TimerStore, workflows: Sequence[str] = (WF,)) -> None:
    """Wait until a timer of `workflows` is due, as the store's own clock says."""
    async with asyncio.timeout(BOUND):
        while (left := await store.next_due(workflows)) != 0.0:
            assert left is not None, "no timer is armed"
            await asyncio.sleep(left)


def entry(
    inst: Instance, event: str, to_state: str, *, offset: int = 1, **timers: object
) -> HistoryEntry:
    """The entry of `event` at version `inst.version + offset` (the timer fields as given)."""
    return HistoryEntry(
        instance_id=inst.id,
        version=inst.version + offset,
        event=event,
        from_state="pending" if event != "resume" else "held",
        to_state=to_state,
        actor=None,
        request_id=None,
        strategy="optimistic",
        data={},
        **timers,  # type: ignore[arg-type]
    )


# -- arming, voiding, stays --------------------------------------------------------------------


async def test_a_create_arms_the_initial_states_timers_in_stay_one(quiet: flowlock.Engine) -> None:
    """A create arms the initial state's timers with stay 1, due `after` from the commit on the
    store's clock; the instance's stay_version is 1, and get() shows the earliest timer."""
    store = timers_of(quiet)
    made = await quiet.create(WF, instance_id="a")
    assert made.stay_version == 1
    armed = await store.timers("a")
    assert shape(armed) == [("remind", 1, 0), ("expire", 1, 0)]
    remind, expire = armed
    assert (remind.every, remind.limit, expire.every, expire.limit) == (EVERY, 3, None, None)
    assert {(t.instance_id, t.workflow, t.claimed_until) for t in armed} == {("a", WF, None)}
    assert abs(seconds(remind, expire) - (LATER - EVERY)) < 0.01
    got = await quiet.get("a")
    assert got.stay_version == 1
    assert got.next_timer is not None
    assert (got.next_timer.event, got.next_timer.due_at) == ("remind", remind.due_at)
    assert await store.count_timers() == 2


async def test_a_large_limit_is_kept_as_given(store_factory: StoreFactory) -> None:
    """A reminder's limit and firing count are 64-bit on every store: a limit past 2**31 arms
    and reads back as given."""
    store = store_factory()
    timer_store(store)
    async with flowlock.Engine(store, locks=MemoryLocks(), timers=False) as engine:
        await engine.register(deadline(limit=2**40))
        await engine.create(WF, instance_id="a")
        [remind, _] = await timer_store(engine.store).timers("a")
        assert remind.limit == 2**40


async def test_a_keyed_create_arms_once(quiet: flowlock.Engine) -> None:
    """A create under an idempotency key arms its timers; its retry answers the first create
    and arms nothing more."""
    store = timers_of(quiet)
    await quiet.create(WF, instance_id="a", request_id="k")
    first = await store.timers("a")
    again = await quiet.create(WF, instance_id="a", request_id="k")
    assert again.version == 1
    assert [(t.event, t.due_at) for t in await store.timers("a")] == [
        (t.event, t.due_at) for t in first
    ]
    assert await store.count_timers() == 2


@pytest.mark.parametrize("strategy", ["optimistic", "pessimistic"])
async def test_leaving_a_state_voids_its_timers_and_entering_it_again_arms_a_new_stay(
    quiet: flowlock.Engine, strategy: str
) -> None:
    """Leaving the state deletes its timers in the same commit; coming back begins a new stay
    (the entry's version) whose timers are armed afresh; stay_version follows."""
    store = timers_of(quiet)
    await quiet.create(WF, instance_id="a")
    held = await quiet.fire("a", "hold", strategy=strategy)
    assert held.instance.stay_version == 2
    assert await store.timers("a") == []
    assert (await quiet.get("a")).next_timer is None
    back = await quiet.fire("a", "resume", strategy=strategy)
    assert back.instance.stay_version == 3
    assert shape(await store.timers("a")) == [("remind", 3, 0), ("expire", 3, 0)]
    assert (await quiet.get("a")).stay_version == 3


async def test_a_transition_that_keeps_the_state_keeps_the_stay(quiet: flowlock.Engine) -> None:
    """A transition whose target is its source neither voids nor re-arms: the same timers,
    due when they were, and the same stay."""
    store = timers_of(quiet)
    await quiet.create(WF, instance_id="a")
    before = await store.timers("a")
    noted = await quiet.fire("a", "note")
    assert (noted.instance.version, noted.instance.stay_version) == (2, 1)
    after = await store.timers("a")
    assert [(t.event, t.stay, t.due_at) for t in after] == [
        (t.event, t.stay, t.due_at) for t in before
    ]


async def test_a_lost_compare_and_swap_arms_and_voids_nothing(quiet: flowlock.Engine) -> None:
    """A commit whose version compare fails writes no timer: neither the voids nor the arming
    of its entries."""
    store = quiet.store
    made = await quiet.create(WF, instance_id="a")
    before = shape(await timers_of(quiet).timers("a"))
    await quiet.fire("a", "note")  # version 2: an entry built on version 1 loses
    assert await store.commit([entry(made, "hold", "held", voids=True)]) is None
    arm = deadline().timers("pending")
    stale = [
        entry(made, "hold", "held", voids=True),
        entry(made, "resume", "pending", offset=2, arm=arm),
    ]
    assert await store.commit(stale) is None
    assert shape(await timers_of(quiet).timers("a")) == before
    assert (await quiet.get("a")).stay_version == 1


async def test_the_stays_of_batches(quiet: flowlock.Engine) -> None:
    """Batches of several instances in one commit_many, and of one instance in one commit:
    voids first, then the firings, then the stay the last entering entry begins is armed;
    stay_version is that entry's version, or unchanged when none enters."""
    store = quiet.store
    timers = timers_of(quiet)
    arm = deadline().timers("pending")
    a, b, c = [await quiet.create(WF, instance_id=i) for i in "abc"]
    [remind_c, expire_c] = await timers.timers("c")
    moved = await store.commit_many(
        [
            # a leaves its state and comes back in one batch: one new stay, version 3.
            [
                entry(a, "hold", "held", voids=True),
                entry(a, "resume", "pending", offset=2, arm=arm),
            ],
            # b stays: nothing of its timers changes.
            [entry(b, "note", "pending"), entry(b, "note", "pending", offset=2)],
            # c fires its reminder while staying: that timer moves on, one period later.
            [entry(c, "remind", "pending", timer=TimerFiring(1, "remind", 0))],
        ]
    )
    assert [(m.version, m.stay_version) for m in moved if isinstance(m, Instance)] == [
        (3, 3),
        (3, 1),
        (2, 1),
    ]
    assert shape(await timers.timers("a")) == [("remind", 3, 0), ("expire", 3, 0)]
    assert shape(await timers.timers("b")) == [("remind", 1, 0), ("expire", 1, 0)]
    now_c = await timers.timers("c")
    assert shape(now_c) == [("remind", 1, 1), ("expire", 1, 0)]
    assert abs(seconds(remind_c, now_c[0]) - EVERY) < 0.01
    assert now_c[1].due_at == expire_c.due_at

    # One instance, one commit: the last entering entry leaves the state; nothing is armed.
    b3 = dataclasses.replace(b, version=3)
    batch = [
        entry(b3, "hold", "held", voids=True),
        entry(b3, "resume", "pending", offset=2, arm=arm),
        entry(b3, "hold", "held", offset=3, voids=True),
    ]
    done = await store.commit(batch)
    assert done is not None and (done.version, done.stay_version) == (6, 6)
    assert await timers.timers("b") == []


# -- the timer service's questions -------------------------------------------------------------


async def test_a_reminder_moves_on_every_period_until_its_limit(quiet: flowlock.Engine) -> None:
    """Each firing of a reminder moves it on one period after its last due time (n counts the
    firings) until `limit` firings were done; then it is gone and the deadline stays armed."""
    store = timers_of(quiet)
    await quiet.create(WF, instance_id="a")
    firsts: list[Timer] = []
    for n in range(3):
        await due(store)
        [claimed] = await store.claim_timers([WF], limit=10, lease=30, owner="me")
        assert (claimed.event, claimed.n, claimed.stay) == ("remind", n, 1)
        assert claimed.lag >= 0
        firsts.append(claimed)
        fired = await quiet._fire_timer(claimed)
        assert fired.applied and fired.instance.stay_version == 1
    assert [seconds(firsts[0], t) for t in firsts[1:]] == pytest.approx(
        [EVERY, 2 * EVERY], abs=0.01
    )
    assert shape(await store.timers("a")) == [("expire", 1, 0)]
    history = await quiet.history("a")
    assert [(h.event, h.actor, h.request_id) for h in history] == [
        ("remind", TIMER_ACTOR, f"timer:1:remind:{n}") for n in range(3)
    ]


async def test_cancel_is_a_compare_and_swap_on_the_stay_and_firing(quiet: flowlock.Engine) -> None:
    """cancel_timer ends one firing as its commit would (a reminder moves on, a one-shot timer
    is deleted) and answers True; the same firing again, or a voided timer, answers False
    and changes nothing."""
    store = timers_of(quiet)
    await quiet.create(WF, instance_id="a")
    await due(store)
    [remind] = await store.claim_timers([WF], limit=10, lease=30, owner="me")
    assert await store.cancel_timer(remind)
    assert shape(await store.timers("a")) == [("remind", 1, 1), ("expire", 1, 0)]
    assert not await store.cancel_timer(remind)  # that firing is over
    [moved, expire] = await store.timers("a")
    assert await store.cancel_timer(expire)  # a one-shot timer: deleted
    assert shape(await store.timers("a")) == [("remind", 1, 1)]
    await quiet.fire("a", "hold")
    assert not await store.cancel_timer(moved)  # voided with its stay
    assert await store.count_timers() == 0


async def test_drop_deletes_a_reminder_while_it_is_at_that_firing(quiet: flowlock.Engine) -> None:
    """drop_timer deletes the timer outright, a reminder with firings left too (cancel would
    move it on); on a timer that moved on or was voided it answers False and changes nothing."""
    store = timers_of(quiet)
    await quiet.create(WF, instance_id="a")
    await due(store)
    [remind] = await store.claim_timers([WF], limit=10, lease=30, owner="me")
    assert (remind.event, remind.n) == ("remind", 0)
    assert await store.drop_timer(remind)
    assert shape(await store.timers("a")) == [("expire", 1, 0)]
    assert not await store.drop_timer(remind)  # gone already

    await quiet.create(WF, instance_id="b")
    [first, _] = await store.timers("b")
    assert await store.cancel_timer(first)  # moved on to n = 1
    before = await store.timers("b")
    assert not await store.drop_timer(first)  # at n = 1 now, not 0
    assert await store.timers("b") == before

    [moved, expire] = before
    await quiet.fire("b", "hold")
    await quiet.fire("b", "resume")  # a new stay: the old timers were voided
    after = await store.timers("b")
    assert not await store.drop_timer(moved)
    assert not await store.drop_timer(expire)
    assert await store.timers("b") == after
    assert shape(after) == [("remind", 3, 0), ("expire", 3, 0)]
    assert await store.count_timers() == 3


async def test_a_timer_of_an_ended_stay_is_refused_and_never_fires(quiet: flowlock.Engine) -> None:
    """A stay left and entered again before its timer fired: the old timer is gone, firing it
    anyway is refused (StaleTimer) and writes nothing, cancelling it answers False."""
    store = timers_of(quiet)
    await quiet.create(WF, instance_id="a")
    [_, old] = await store.timers("a")
    await quiet.fire("a", "hold")
    await quiet.fire("a", "resume")
    with pytest.raises(StaleTimer):
        await quiet._fire_timer(old)
    assert not await store.cancel_timer(old)
    assert [h.event for h in await quiet.history("a")] == ["hold", "resume"]
    assert {t.stay for t in await store.timers("a")} == {3}


async def test_claims_never_give_one_timer_to_two_claimers(store_factory: StoreFactory) -> None:
    """Four claimers on two stores of one database, at once, a few timers each per round: every
    due timer is claimed exactly once; then all are held (next_due is the end of the lease) and
    none is claimable until one is released."""
    stores = [store_factory(), store_factory()]
    timer_store(stores[0])
    async with (
        flowlock.Engine(stores[0], locks=MemoryLocks(), timers=False) as one,
        flowlock.Engine(stores[1], locks=MemoryLocks(), timers=False) as two,
    ):
        for engine in (one, two):
            await engine.register(deadline(every=None, after=0.05))
        for i in range(40):
            await one.create(WF, instance_id=f"i{i:02}")

        async def all_due() -> bool:
            return len(await timer_store(stores[0]).due_timers(within=0, limit=100)) == 40

        await wait_until(all_due, within=BOUND, what="every deadline came due")

        async def claimer(store: Store, owner: str) -> list[Timer]:
            mine: list[Timer] = []
            while got := await timer_store(store).claim_timers(
                [WF], limit=3, lease=30, owner=owner
            ):
                mine += got
            return mine

        rounds = await asyncio.gather(*(claimer(stores[n % 2], f"c{n}") for n in range(4)))
        claimed = [t.instance_id for got in rounds for t in got]
        assert sorted(claimed) == [f"i{i:02}" for i in range(40)]
        first = timer_store(stores[1])
        assert await first.claim_timers([WF], limit=100, lease=30, owner="late") == []
        left = await first.next_due([WF])
        assert left is not None and 20 < left <= 30
        # Released by its owner only: then claimable at once.
        owner, timer = next((f"c{n}", got[0]) for n, got in enumerate(rounds) if got)
        await first.release_timer(timer, "someone else")
        assert await first.claim_timers([WF], limit=100, lease=30, owner="late") == []
        await first.release_timer(timer, owner)
        assert await first.next_due([WF]) == 0.0
        [again] = await first.claim_timers([WF], limit=100, lease=30, owner="late")
        assert (again.instance_id, again.event, again.stay, again.n) == (
            timer.instance_id,
            timer.event,
            timer.stay,
            timer.n,
        )


async def test_next_due_counts_only_the_workflows_asked_for(quiet: flowlock.Engine) -> None:
    """next_due: None with no timer armed (or none of those workflows); else the seconds until
    the earliest, on the store's clock, 0 once it is due; a claim that ran out counts as due."""
    store = timers_of(quiet)
    assert await store.next_due([WF]) is None
    await quiet.create(WF, instance_id="a")
    left = await store.next_due([WF])
    assert left is not None and left <= EVERY
    assert await store.next_due(["other"]) is None
    await due(store)
    [claimed] = await store.claim_timers([WF], limit=10, lease=0.1, owner="me")
    held = await store.next_due([WF])
    assert held is not None and held <= 0.1
    await due(store)  # the claim ran out
    [again] = await store.claim_timers([WF], limit=10, lease=30, owner="other")
    assert (again.event, again.n) == (claimed.event, claimed.n)


async def test_due_timers_and_counts(quiet: flowlock.Engine) -> None:
    """due_timers lists the timers due within a window, earliest first, with their lag;
    count_timers counts them all; timers() of an unknown instance is empty."""
    store = timers_of(quiet)
    for i in "ab":
        await quiet.create(WF, instance_id=i)

    async def both_overdue() -> bool:
        return len(await store.due_timers(within=0, limit=10)) == 2

    await wait_until(both_overdue, within=BOUND, what="both reminders came due")
    overdue = await store.due_timers(within=0, limit=10)
    assert shape(overdue) == [("remind", 1, 0)] * 2
    assert [t.instance_id for t in overdue] == ["a", "b"]
    assert all(t.lag >= 0 for t in overdue)
    assert len(await store.due_timers(within=LATER * 2, limit=10)) == 4
    assert len(await store.due_timers(within=LATER * 2, limit=3)) == 3
    assert await store.count_timers() == 4
    assert await store.timers("nobody") == []


async def test_armed_is_set_when_a_commit_arms_a_timer(quiet: flowlock.Engine) -> None:
    """armed() yields an event that a commit arming a timer sets (on PostgreSQL once the
    commit is done, by NOTIFY)."""
    store = timers_of(quiet)
    async with store.armed() as armed:
        # PostgreSQL sets it once LISTEN is up (anything armed before reached nobody).
        await asyncio.sleep(0.2)
        armed.clear()
        await quiet.create(WF, instance_id="a")
        async with asyncio.timeout(BOUND):
            await armed.wait()


# -- the timer service, end to end -------------------------------------------------------------


async def test_the_service_fires_a_deadline_once_as_the_timer(store_factory: StoreFactory) -> None:
    """An engine running its timer service fires a due deadline once, under the firing's request
    id and actor flowlock:timer, only in the stay that armed it: a stay left and entered again
    before its deadline fired fires the new stay's only, and the checker finds the history
    whole."""
    workflow = deadline(after=0.3, every=None)
    timer_store(store_factory())  # skipped where timers are not kept yet
    # Armed, left and entered again with no service running, so that no firing can come first.
    async with flowlock.Engine(store_factory(), locks=MemoryLocks(), timers=False) as quiet:
        await quiet.register(workflow)
        await quiet.create(WF, instance_id="a")
        await quiet.create(WF, instance_id="b")
        await quiet.fire("b", "hold")
        await quiet.fire("b", "resume")
    async with flowlock.Engine(store_factory(), locks=MemoryLocks()) as engine:
        await engine.register(workflow)

        async def expired() -> bool:
            states = [(await engine.get(i)).state for i in "ab"]
            return states == ["rejected", "rejected"]

        await wait_until(expired, within=BOUND, what="both deadlines fired")
        for iid, stay in (("a", 1), ("b", 3)):
            history = await engine.history(iid)
            fired = [(h.actor, h.request_id) for h in history if h.event == "expire"]
            assert fired == [(TIMER_ACTOR, f"timer:{stay}:expire:0")]
            verdict = check(await engine.get(iid), history, initial_state="pending")
            assert verdict.ok, verdict
        assert await timer_store(engine.store).count_timers() == 0
