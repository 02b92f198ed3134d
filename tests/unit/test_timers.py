"""Timers end to end on the memory and SQLite stores: each engine's timer service fires them
through the engine, once, only inside the stay that armed them.

Timings are short (a deadline 200 ms into the stay, reminders every 50 ms). A test waits for
what it expects with a generous bound (``wait_until``), never asserts how long anything took.
To show that something did NOT fire, a test lets a *witness* timer armed later than the one in
question fire first: the service fires in due order, so once the witness fired, the other's
due time has passed too.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

import flowlock
from flowlock.checker import check, check_many
from flowlock.core.models import TIMER_ACTOR, Timer
from flowlock.metrics import Metrics
from flowlock.stores import MemoryStore, Store
from flowlock.stores.base import TimerStore
from flowlock.stores.sqlite import SqliteStore
from lock_probes import wait_until
from timer_kit import deadline, fired, firings, stay_violations

AFTER = 0.2  # the deadline, seconds into the stay
EVERY = 0.05  # the reminders' period
BOUND = 20.0  # the most a test waits for a timer that is due (a loaded machine is slow)

StoreFactory = Callable[[], Store]
MakeEngine = Callable[..., Awaitable[flowlock.Engine]]


@pytest.fixture(params=["memory", "sqlite"])
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> StoreFactory:
    """Builds stores over one database of the backend (every store built shares it)."""
    if request.param == "memory":
        shared = MemoryStore()
        return lambda: shared
    path = tmp_path / "timers.db"
    return lambda: SqliteStore(path)


@pytest.fixture
async def engines(stores: StoreFactory) -> AsyncIterator[MakeEngine]:
    """Opens engines over the test's database, each with its own metrics and the deadline
    workflow as `deadline(**workflow)` builds it; closes them at the end."""
    opened: list[flowlock.Engine] = []

    async def make(workflow: dict[str, Any] | None = None, **options: Any) -> flowlock.Engine:
        eng = flowlock.Engine(stores(), metrics=Metrics(), **options)
        await eng.open()
        opened.append(eng)
        await eng.register(deadline(**(workflow or {"after": AFTER})))
        return eng

    yield make
    for eng in opened:
        await eng.aclose()


async def _state(eng: flowlock.Engine, iid: str, state: str) -> None:
    async def there() -> bool:
        return (await eng.get(iid)).state == state

    await wait_until(there, within=BOUND, what=f"{iid} in {state}")


async def _rows(eng: flowlock.Engine, iid: str, event: str, n: int) -> None:
    async def enough() -> bool:
        return sum(h.event == event for h in await eng.history(iid)) >= n

    await wait_until(enough, within=BOUND, what=f"{n} {event} rows on {iid}")


async def _clean(eng: flowlock.Engine, iid: str, applied: int) -> None:
    """The checker and the stay check over the instance's history."""
    history = await eng.history(iid)
    verdict = check(await eng.get(iid), history, initial_state="pending", expected_applied=applied)
    assert verdict.ok, verdict.violations
    assert stay_violations(history) == []


async def test_a_deadline_fires_once_through_the_engine(engines: MakeEngine) -> None:
    """A deadline fires by itself once: one row by the timer, under its firing's request id."""
    eng = await engines()
    made = await eng.create("deadline", instance_id="a")
    assert made.stay_version == 1
    [armed] = await eng.timers("a")
    assert (armed.event, armed.stay, armed.n) == ("expire", 1, 0)
    assert (await eng.get("a")).next_timer == armed
    await _state(eng, "a", "rejected")
    [row] = await eng.history("a")
    assert (row.event, row.actor, row.request_id) == ("expire", TIMER_ACTOR, "timer:1:expire:0")
    assert await eng.timers("a") == []
    assert (await eng.get("a")).next_timer is None
    await fired(1, eng.metrics)
    await _clean(eng, "a", 1)


async def test_a_caller_first_voids_the_deadline(engines: MakeEngine) -> None:
    """Approved before its deadline, the instance's timer is gone in the same commit and never
    fires (a witness armed later fired first)."""
    eng = await engines()
    await eng.create("deadline", instance_id="a")
    assert (await eng.fire("a", "approve")).applied
    assert await eng.timers("a") == []
    await eng.create("deadline", instance_id="witness")
    await _state(eng, "witness", "rejected")
    assert [h.event for h in await eng.history("a")] == ["approve"]
    await fired(1, eng.metrics)  # the witness's
    await _clean(eng, "a", 1)


async def test_a_stay_left_and_reentered_fires_only_the_new_stays_timer(
    engines: MakeEngine,
) -> None:
    """Left and re-entered before its deadline: the first stay's timer never fires, the new
    stay's fires once, AFTER into the new stay."""
    eng = await engines()
    await eng.create("deadline", instance_id="a")
    await eng.fire("a", "pause")
    assert await eng.timers("a") == []
    await asyncio.sleep(AFTER / 2)  # the new stay's deadline falls after the old one's
    resumed = await eng.fire("a", "resume")
    assert resumed.instance.stay_version == 3
    [armed] = await eng.timers("a")
    assert (armed.event, armed.stay) == ("expire", 3)
    await _state(eng, "a", "rejected")
    history = await eng.history("a")
    assert [(h.event, h.request_id) for h in history] == [
        ("pause", None),
        ("resume", None),
        ("expire", "timer:3:expire:0"),
    ]
    assert (await fired(1, eng.metrics))["stale"] == 0
    await _clean(eng, "a", 3)


async def test_a_state_keeping_transition_does_not_reset_the_stay(
    engines: MakeEngine,
) -> None:
    """A caller's transition that keeps the state leaves the stay and its timers as they were."""
    eng = await engines({"after": AFTER, "every": 60.0})
    await eng.create("deadline", instance_id="a")
    before = [(t.event, t.stay, t.n, t.due_at) for t in await eng.timers("a")]
    spoke = await eng.fire("a", "speak")
    assert spoke.instance.stay_version == 1
    assert [(t.event, t.stay, t.n, t.due_at) for t in await eng.timers("a")] == before
    await _state(eng, "a", "rejected")
    assert [h.request_id for h in await eng.history("a")] == [None, "timer:1:expire:0"]
    await _clean(eng, "a", 2)


async def test_reminders_fire_limit_times_then_none(engines: MakeEngine) -> None:
    """A reminder with every= and limit=3 fires exactly 3 times, numbered 0, 1, 2, then is gone
    (a witness armed after its last due time fired 3 times too)."""
    eng = await engines({"after": None, "every": EVERY, "limit": 3})
    await eng.create("deadline", instance_id="a")
    await _rows(eng, "a", "remind", 3)

    async def gone() -> bool:
        return await eng.timers("a") == []

    await wait_until(gone, within=BOUND, what="the reminder to be done")
    await eng.create("deadline", instance_id="witness")
    await _rows(eng, "witness", "remind", 3)
    history = await eng.history("a")
    assert [(h.request_id, h.actor, h.to_state) for h in history] == [
        (f"timer:1:remind:{n}", TIMER_ACTOR, "pending") for n in range(3)
    ]
    assert (await eng.get("a")).state == "pending"
    await _clean(eng, "a", 3)


async def test_reminders_stop_when_the_instance_leaves_the_state(
    engines: MakeEngine,
) -> None:
    """A reminder without a limit fires while the instance stays, and never once it left."""
    eng = await engines({"after": None, "every": EVERY})
    await eng.create("deadline", instance_id="a")
    await _rows(eng, "a", "remind", 2)
    left = await eng.fire("a", "approve")
    assert await eng.timers("a") == []
    await eng.create("deadline", instance_id="witness")
    await _rows(eng, "witness", "remind", 2)
    history = await eng.history("a")
    assert history[-1].version == left.instance.version
    assert all(h.event == "remind" for h in history[:-1])
    assert [h.request_id for h in history[:-1]] == [
        f"timer:1:remind:{n}" for n in range(len(history) - 1)
    ]
    await _clean(eng, "a", len(history))


async def test_a_guard_refusing_a_deadline_cancels_it(engines: MakeEngine) -> None:
    """The deadline's guard refuses: nothing is written, and the timer is cancelled."""
    eng = await engines()
    await eng.create("deadline", instance_id="a", data={"hold": True})
    await wait_until(lambda: firings(eng.metrics)["refused"] == 1, within=BOUND, what="the refusal")
    assert await eng.timers("a") == []
    inst = await eng.get("a")
    assert (inst.state, inst.version, await eng.history("a")) == ("pending", 1, [])
    assert firings(eng.metrics)["applied"] == 0


async def test_a_refused_reminder_leaves_the_next_one_armed(engines: MakeEngine) -> None:
    """A reminder's guard refuses firing 0: nothing is written, and firing 1 is armed; once the
    guard lets it through (a state-keeping caller transition), the next firing applies."""
    eng = await engines({"after": None, "every": EVERY})
    await eng.create("deadline", instance_id="a", data={"quiet": True})
    await wait_until(lambda: firings(eng.metrics)["refused"] >= 1, within=BOUND, what="a refusal")
    [armed] = await eng.timers("a")
    assert armed.n >= 1
    assert await eng.history("a") == []
    await eng.fire("a", "speak")
    await _rows(eng, "a", "remind", 1)
    await eng.fire("a", "approve")
    history = await eng.history("a")
    reminders = [h.request_id for h in history if h.event == "remind"]
    assert "timer:1:remind:0" not in reminders
    assert reminders[0] is not None and int(reminders[0].rsplit(":", 1)[1]) >= 1
    await fired(len(reminders), eng.metrics)
    await _clean(eng, "a", len(history))


async def test_engines_without_timers_fire_nothing(engines: MakeEngine) -> None:
    """An engine with timers=False runs no service and fires nothing; the timer stays armed
    (overdue) until an engine with timers comes, which fires it once."""
    caller = await engines(timers=False)
    assert caller.timer_service is None
    await caller.create("deadline", instance_id="a")
    await asyncio.sleep(AFTER * 3)  # past the due time: nothing may fire it
    [armed] = await caller.timers("a")
    assert (await caller.get("a")).state == "pending"
    assert armed.lag > 0
    firing = await engines()
    await _state(caller, "a", "rejected")
    await fired(1, firing.metrics)
    assert firings(caller.metrics) == firings(Metrics())  # all zero
    await _clean(caller, "a", 1)


async def test_two_engines_fire_each_timer_once(engines: MakeEngine) -> None:
    """Two engines' services over one database share the due timers: each fires once."""
    one = await engines()
    two = await engines()
    ids = [f"i{n}" for n in range(20)]
    for iid in ids:
        await one.create("deadline", instance_id=iid)

    async def all_rejected() -> bool:
        return await one.count("deadline", state="rejected") == len(ids)

    await wait_until(all_rejected, within=BOUND, what="every deadline")
    counts = await fired(len(ids), one.metrics, two.metrics)
    assert counts["failed"] == 0
    pairs = [(await one.get(i), await one.history(i)) for i in ids]
    verdict = check_many(pairs, initial_state="pending", expected_applied=1)
    assert verdict.ok, verdict.violations
    assert [v for _, h in pairs for v in stay_violations(h)] == []


async def test_a_claim_that_runs_out_fires_elsewhere_once(
    stores: StoreFactory, engines: MakeEngine
) -> None:
    """A claimer that took due timers and died (its claim left to run out): an engine fires
    them once after the lease."""
    caller = await engines(timers=False)
    for iid in ("a", "b"):
        await caller.create("deadline", instance_id=iid)
    store = stores()
    assert isinstance(store, TimerStore)
    await store.open()
    try:

        async def claimed() -> bool:
            got = await store.claim_timers(["deadline"], limit=10, lease=0.5, owner="dead")
            held.extend(got)
            return len(held) == 2

        held: list[Timer] = []
        await wait_until(claimed, within=BOUND, what="the dead claimer's claims")
        assert all(t.claimed_until is not None for t in await caller.timers("a"))
        firing = await engines()
        for iid in ("a", "b"):
            await _state(caller, iid, "rejected")
            await _clean(caller, iid, 1)
        await fired(2, firing.metrics)
    finally:
        if store is not caller.store:
            await store.aclose()


async def test_a_workflow_no_engine_runs_keeps_its_timers_until_one_registers_it(
    engines: MakeEngine,
) -> None:
    """An engine fires only the timers of workflows it runs: another workflow's due timer
    stays armed (a witness of its own workflow fired meanwhile) until it registers that
    workflow too, and then fires once."""
    runner = await engines({"after": AFTER, "name": "other"})
    caller = await engines(timers=False)
    await caller.create("deadline", instance_id="a")
    await runner.create("other", instance_id="witness")
    await _state(runner, "witness", "rejected")
    [armed] = await caller.timers("a")
    assert armed.lag > 0 and armed.claimed_until is None
    assert (await caller.get("a")).state == "pending"
    await runner.register(deadline(after=AFTER))
    await _state(caller, "a", "rejected")
    await fired(2, runner.metrics)
    await _clean(caller, "a", 1)
