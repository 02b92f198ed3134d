"""Timers through engines on real PostgreSQL: the race of a caller's approval and a deadline
falling due at the same moment across several engines, stays, reminders, guards, timers armed
inside a caller's own transaction, two engines firing one timer, a firing that failed on a busy
row, engines without timers, and the NOTIFY that wakes a sleeping timer service.
(tests/integration/test_timers_pg.py holds the store's own: LISTEN, channels, the migration.)

Timings are short (deadlines 200 ms to 1 s into the stay). A test waits for what it expects with
a generous bound, never asserts how long anything took; to show that something did NOT fire, a
test lets a *witness* timer armed later fire first (the service fires in due order). The
concurrency tests run the checker, the stay check (`timer_kit.stay_violations`) and the test's
own SQL over the history afterwards.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
import pytest

import flowlock
import pg_budget
from flowlock.checker import check, check_many
from flowlock.core.models import TIMER_ACTOR
from flowlock.metrics import Metrics
from flowlock.stores.postgres import PostgresStore
from lock_probes import wait_until
from timer_kit import deadline, due_of, fired, firings, stay_violations

pytestmark = pytest.mark.postgres

AFTER = 0.2  # the deadline of the tests that are not the race, seconds into the stay
EVERY = 0.05  # the reminders' period
BOUND = 30.0  # the most a test waits for a timer that is due (a loaded machine is slow)

SqlHistory = Callable[..., Awaitable[Any]]
MakeEngine = Callable[..., Awaitable[flowlock.Engine]]


@pytest.fixture
async def engines(pg_url: str, pg_schema: str) -> AsyncIterator[MakeEngine]:
    """Opens engines on the test's schema, each with its own metrics and a small pool, the
    deadline workflow registered as `deadline(**workflow)` builds it; closes them at the end."""
    opened: list[flowlock.Engine] = []

    async def make(
        workflow: dict[str, Any] | None = None,
        *,
        pool_size: int = 4,
        lock_timeout: float = 5.0,
        application_name: str = "flowlock",
        **options: Any,
    ) -> flowlock.Engine:
        store = PostgresStore(
            pg_url,
            schema=pg_schema,
            pool_size=pool_size,
            lock_timeout=lock_timeout,
            application_name=application_name,
            pipeline=options.get("batching", True),
        )
        eng = await flowlock.Engine(store, metrics=Metrics(), **options).open()
        opened.append(eng)
        await eng.register(deadline(**(workflow or {"after": AFTER})))
        return eng

    yield make
    for eng in opened:
        await eng.aclose()


async def _fetch(url: str, sql: str, *args: Any) -> list[asyncpg.Record]:
    conn = await pg_budget.connect(url)
    try:
        return list(await conn.fetch(sql, *args))
    finally:
        await conn.close()


async def _armed(url: str, schema: str) -> list[tuple[str, int, str, int]]:
    """The armed timers as the table holds them, by the test's own SQL: (instance, stay, event,
    n), in that order."""
    rows = await _fetch(
        url,
        f'SELECT instance_id, stay, event, n FROM "{schema}".flowlock_timers ORDER BY 1, 2, 3',
    )
    return [(r["instance_id"], r["stay"], r["event"], r["n"]) for r in rows]


async def _state(eng: flowlock.Engine, iid: str, state: str) -> None:
    async def there() -> bool:
        return (await eng.get(iid)).state == state

    await wait_until(there, within=BOUND, what=f"{iid} in {state}")


async def _rows(eng: flowlock.Engine, iid: str, event: str, n: int) -> None:
    async def enough() -> bool:
        return sum(h.event == event for h in await eng.history(iid)) >= n

    await wait_until(enough, within=BOUND, what=f"{n} {event} rows on {iid}")


async def _clean(eng: flowlock.Engine, iid: str, applied: int, initial: str = "pending") -> None:
    history = await eng.history(iid)
    verdict = check(await eng.get(iid), history, initial_state=initial, expected_applied=applied)
    assert verdict.ok, verdict.violations
    assert stay_violations(history) == []


# -- the race ------------------------------------------------------------------------------

RACE_INSTANCES = 300
RACE_ENGINES = 3
RACE_AFTER = 1.0  # long enough for 300 creates to be done before the first falls due


async def test_the_race_of_an_approval_and_its_deadline_across_three_engines(
    engines: MakeEngine, pg_url: str, pg_schema: str, sql_history: SqlHistory
) -> None:
    """300 approvals whose deadline falls due while a caller approves them, through 3 engines
    that each run a timer service: every instance ends approved or rejected, never both, with one
    history row (the caller's, or the timer's inside its stay); the losers wrote nothing."""
    fleet = [await engines({"after": RACE_AFTER}, pool_size=6) for _ in range(RACE_ENGINES)]
    ids = [f"r{n:03}" for n in range(RACE_INSTANCES)]
    made = await asyncio.gather(
        *[fleet[n % RACE_ENGINES].create("deadline", instance_id=i) for n, i in enumerate(ids)]
    )
    # Each deadline as the server computed it; the callers aim at it on this host's clock (the same
    # machine's), from 5 ms before to 30 ms after (a timer is claimed, then fired). On a slow
    # machine the last creates may come after the first deadlines: those race at once.
    due = {inst.id: due_of(inst, RACE_AFTER) for inst in made}
    rng = random.Random(23)
    answers: dict[str, str] = {}

    async def approve(n: int, iid: str) -> None:
        await asyncio.sleep(max(0.0, due[iid] + rng.uniform(-0.005, 0.03) - time.time()))
        try:
            out = await fleet[(n + 1) % RACE_ENGINES].fire(iid, "approve", actor="approver")
        except flowlock.TransitionNotAllowed:
            answers[iid] = "refused"
        else:
            answers[iid] = "applied" if out.applied else "idempotent"

    await asyncio.gather(*[approve(n, i) for n, i in enumerate(ids)])

    async def all_resolved() -> bool:
        return await fleet[0].count("deadline", state="pending") == 0

    await wait_until(all_resolved, within=BOUND, what="every instance resolved")

    async def services_idle() -> bool:
        return await _armed(pg_url, pg_schema) == []

    await wait_until(services_idle, within=BOUND, what="every timer gone")
    instances = {i: await fleet[0].get(i) for i in ids}
    histories = {i: await fleet[0].history(i) for i in ids}
    approved = [i for i in ids if instances[i].state == "approved"]
    rejected = [i for i in ids if instances[i].state == "rejected"]
    assert len(approved) + len(rejected) == RACE_INSTANCES
    for iid in approved:
        assert answers[iid] == "applied", iid
        [row] = histories[iid]
        assert (row.event, row.actor) == ("approve", "approver")
    for iid in rejected:
        assert answers[iid] == "refused", iid
        [row] = histories[iid]
        assert (row.event, row.actor, row.request_id) == ("expire", TIMER_ACTOR, "timer:1:expire:0")
    counts = await fired(len(rejected), *(e.metrics for e in fleet))
    # The race happened: both sides won some, and deadlines already claimed and in flight
    # lost to a caller (stale: refused by the step, nothing written).
    assert approved and rejected, (len(approved), len(rejected))
    assert counts["stale"] > 0, counts
    print(f"race: {len(approved)} approved, {len(rejected)} rejected; firings {counts}")
    verdict = check_many(
        [(instances[i], histories[i]) for i in ids], initial_state="pending", expected_applied=1
    )
    assert verdict.ok, verdict.violations
    assert [v for h in histories.values() for v in stay_violations(h)] == []
    (await sql_history()).assert_matches(histories)


# -- stays, reminders, guards --------------------------------------------------------------


async def test_a_deadline_fires_once_and_shows_on_the_instance(
    engines: MakeEngine, pg_url: str, pg_schema: str
) -> None:
    """A deadline fires by itself once, as the timer, under timer:1:expire:0; until then the
    instance shows it as its next timer and engine.timers lists it."""
    eng = await engines()
    made = await eng.create("deadline", instance_id="a")
    assert made.stay_version == 1
    [armed] = await eng.timers("a")
    assert (armed.event, armed.stay, armed.n, armed.workflow) == ("expire", 1, 0, "deadline")
    assert (await eng.get("a")).next_timer == armed
    assert await _armed(pg_url, pg_schema) == [("a", 1, "expire", 0)]
    await _state(eng, "a", "rejected")
    [row] = await eng.history("a")
    assert (row.actor, row.request_id) == (TIMER_ACTOR, "timer:1:expire:0")
    assert await _armed(pg_url, pg_schema) == []
    assert (await eng.get("a")).next_timer is None
    await fired(1, eng.metrics)
    await _clean(eng, "a", 1)


async def test_a_stay_left_and_reentered_fires_only_the_new_stays_timer(
    engines: MakeEngine, pg_url: str, pg_schema: str
) -> None:
    """Left and re-entered before its deadline: the first stay's timer is gone with the commit
    that left, and never fires; the new stay's fires once."""
    eng = await engines()
    await eng.create("deadline", instance_id="a")
    await eng.fire("a", "pause")
    assert await _armed(pg_url, pg_schema) == []
    await asyncio.sleep(AFTER / 2)  # the new stay's deadline falls after the old one's
    resumed = await eng.fire("a", "resume")
    assert resumed.instance.stay_version == 3
    assert await _armed(pg_url, pg_schema) == [("a", 3, "expire", 0)]
    await _state(eng, "a", "rejected")
    assert [(h.event, h.request_id) for h in await eng.history("a")] == [
        ("pause", None),
        ("resume", None),
        ("expire", "timer:3:expire:0"),
    ]
    assert (await fired(1, eng.metrics))["stale"] == 0
    await _clean(eng, "a", 3)


async def test_reminders_fire_limit_times_then_none(
    engines: MakeEngine, pg_url: str, pg_schema: str
) -> None:
    """A reminder with every= and limit=3 fires exactly 3 times (firings 0, 1, 2), then its
    row is gone; a witness armed after its last due time fired 3 times too."""
    eng = await engines({"after": None, "every": EVERY, "limit": 3})
    await eng.create("deadline", instance_id="a")
    await _rows(eng, "a", "remind", 3)

    async def gone() -> bool:
        return not [t for t in await _armed(pg_url, pg_schema) if t[0] == "a"]

    await wait_until(gone, within=BOUND, what="the reminder to be done")
    await eng.create("deadline", instance_id="witness")
    await _rows(eng, "witness", "remind", 3)
    assert [(h.request_id, h.to_state) for h in await eng.history("a")] == [
        (f"timer:1:remind:{n}", "pending") for n in range(3)
    ]
    await _clean(eng, "a", 3)


async def test_reminders_stop_when_the_instance_leaves_the_state(
    engines: MakeEngine, pg_url: str, pg_schema: str
) -> None:
    """A reminder without a limit fires while the instance stays, and never after it left."""
    eng = await engines({"after": None, "every": EVERY})
    await eng.create("deadline", instance_id="a")
    await _rows(eng, "a", "remind", 2)
    left = await eng.fire("a", "approve")
    assert not [t for t in await _armed(pg_url, pg_schema) if t[0] == "a"]
    await eng.create("deadline", instance_id="witness")
    await _rows(eng, "witness", "remind", 2)
    history = await eng.history("a")
    assert history[-1].version == left.instance.version
    assert [h.request_id for h in history[:-1]] == [
        f"timer:1:remind:{n}" for n in range(len(history) - 1)
    ]
    await _clean(eng, "a", len(history))


async def test_a_guard_refusing_a_deadline_writes_nothing_and_cancels_it(
    engines: MakeEngine, pg_url: str, pg_schema: str
) -> None:
    """The deadline's guard refuses: no history row, the instance unchanged, the timer gone."""
    eng = await engines()
    await eng.create("deadline", instance_id="a", data={"hold": True})
    await wait_until(lambda: firings(eng.metrics)["refused"] == 1, within=BOUND, what="the refusal")
    assert await _armed(pg_url, pg_schema) == []
    inst = await eng.get("a")
    assert (inst.state, inst.version, await eng.history("a")) == ("pending", 1, [])


async def test_a_refused_reminder_leaves_the_next_one_armed(
    engines: MakeEngine, pg_url: str, pg_schema: str
) -> None:
    """A reminder's guard refuses: nothing is written and the next firing is armed; once the
    guard lets it through (a caller's transition that keeps the state, and the stay), the
    next firing applies."""
    eng = await engines({"after": None, "every": EVERY})
    await eng.create("deadline", instance_id="a", data={"quiet": True})
    await wait_until(lambda: firings(eng.metrics)["refused"] >= 1, within=BOUND, what="a refusal")
    [(_, stay, _, n)] = await _armed(pg_url, pg_schema)
    assert (stay, await eng.history("a")) == (1, [])
    assert n >= 1
    spoke = await eng.fire("a", "speak")
    assert spoke.instance.stay_version == 1
    await _rows(eng, "a", "remind", 1)
    await eng.fire("a", "approve")
    reminders = [h.request_id for h in await eng.history("a") if h.event == "remind"]
    assert reminders and "timer:1:remind:0" not in reminders
    await fired(len(reminders), eng.metrics)
    await _clean(eng, "a", len(reminders) + 2)


# -- timers inside a caller's own transaction ------------------------------------------------


async def test_a_create_rolled_back_arms_nothing_and_a_committed_one_fires(
    engines: MakeEngine, pg_url: str, pg_schema: str
) -> None:
    """create(connection=) inside the caller's transaction: rolled back, no timer is armed (and
    none fires); committed, the timer is armed by that commit and fires once."""
    eng = await engines()
    conn = await pg_budget.connect(pg_url)
    try:
        tx = conn.transaction()
        await tx.start()
        await eng.create("deadline", instance_id="gone", connection=conn)
        await tx.rollback()
        assert await _armed(pg_url, pg_schema) == []
        async with conn.transaction():
            await eng.create("deadline", instance_id="kept", connection=conn)
            assert await _armed(pg_url, pg_schema) == []  # not before the commit
        assert await _armed(pg_url, pg_schema) == [("kept", 1, "expire", 0)]
    finally:
        await conn.close()
    await _state(eng, "kept", "rejected")
    with pytest.raises(flowlock.InstanceNotFound):
        await eng.get("gone")
    await fired(1, eng.metrics)
    await _clean(eng, "kept", 1)


async def test_a_fire_rolled_back_arms_nothing_and_a_committed_one_fires(
    engines: MakeEngine, pg_url: str, pg_schema: str
) -> None:
    """fire(connection=) that enters a timed state inside the caller's transaction: rolled
    back, nothing is armed and the instance stays a draft (a witness's deadline fired first);
    committed, the deadline is armed by that commit and fires once."""
    eng = await engines({"after": AFTER, "initial": "draft"})
    for iid in ("rolled", "kept"):
        await eng.create("deadline", instance_id=iid)
    assert await _armed(pg_url, pg_schema) == []
    conn = await pg_budget.connect(pg_url)
    try:
        tx = conn.transaction()
        await tx.start()
        assert (await eng.fire("rolled", "submit", connection=conn)).applied
        await tx.rollback()
        assert await _armed(pg_url, pg_schema) == []
        async with conn.transaction():
            await eng.fire("kept", "submit", connection=conn)
        assert await _armed(pg_url, pg_schema) == [("kept", 2, "expire", 0)]
    finally:
        await conn.close()
    await _state(eng, "kept", "rejected")
    assert [h.request_id for h in await eng.history("kept")] == [None, "timer:2:expire:0"]
    rolled = await eng.get("rolled")
    assert (rolled.state, rolled.version, await eng.history("rolled")) == ("draft", 1, [])
    await _clean(eng, "kept", 2, initial="draft")


# -- engines -------------------------------------------------------------------------------


async def test_engines_without_timers_fire_nothing(
    engines: MakeEngine, pg_url: str, pg_schema: str
) -> None:
    """timers=False engines run no service and fire nothing: the timer stays armed, overdue,
    until an engine with timers opens; that one fires it once."""
    callers = [await engines(timers=False) for _ in range(2)]
    assert all(c.timer_service is None for c in callers)
    await callers[0].create("deadline", instance_id="a")
    await asyncio.sleep(AFTER * 3)  # past the due time: nothing may fire it
    [armed] = await callers[1].timers("a")
    assert armed.lag > 0 and armed.claimed_until is None
    assert (await callers[1].get("a")).state == "pending"
    firing = await engines()
    await _state(callers[0], "a", "rejected")
    await fired(1, firing.metrics)
    assert all(sum(firings(c.metrics).values()) == 0 for c in callers)
    await _clean(firing, "a", 1)


async def test_a_timer_armed_by_another_engine_wakes_a_sleeping_service(
    engines: MakeEngine,
) -> None:
    """An idle service sleeps (nothing due: up to its safety bound of minutes); a deadline
    armed by another engine's commit wakes it by NOTIFY, and it fires at its due time."""
    firing = await engines()
    service = firing.timer_service
    assert service is not None and service.running
    await asyncio.sleep(0.2)  # the service found nothing due and sleeps
    caller = await engines(timers=False)
    await caller.create("deadline", instance_id="a")
    await _state(caller, "a", "rejected")
    await fired(1, firing.metrics)


async def _lock_waiters(url: str, app: str) -> int:
    """How many sessions named `app` wait for a lock (behind the test's, or behind another
    waiter: a second waiter for a row waits on the first one's tuple lock)."""
    sql = (
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1"
        " AND cardinality(pg_blocking_pids(pid)) > 0"
    )
    return int((await _fetch(url, sql, app))[0][0])


async def test_two_engines_firing_one_timer_apply_it_once(
    engines: MakeEngine, pg_url: str, pg_schema: str, sql_history: SqlHistory
) -> None:
    """The first engine's firing waits on the instance's row (the test holds it) past its
    claim's lease; a second engine claims the same timer and fires it too. Once the row is free,
    one firing applies and the other writes nothing: one history row."""
    caller = await engines(timers=False)
    await caller.create("deadline", instance_id="a")
    holder = await pg_budget.connect(pg_url)
    try:
        tx = holder.transaction()
        await tx.start()
        await holder.execute(
            f'SELECT 1 FROM "{pg_schema}".flowlock_instances WHERE id = $1 FOR UPDATE', "a"
        )
        app = f"timers-{uuid.uuid4().hex[:8]}"
        # One firing at a time, so that this engine cannot claim the timer again itself.
        first = await engines(
            strategy="pessimistic", timer_lease=1, timer_batch=1, lock_timeout=30,
            application_name=app,
        )  # fmt: skip

        async def waits(n: int) -> bool:
            return await _lock_waiters(pg_url, app) == n

        await wait_until(lambda: waits(1), within=BOUND, what="the first firing to wait")
        second = await engines(
            strategy="pessimistic", timer_lease=1, lock_timeout=30, application_name=app
        )
        await wait_until(lambda: waits(2), within=BOUND, what="the second firing to wait")
        assert first.timer_service is not None and second.timer_service is not None
        [claim] = await _fetch(
            pg_url, f'SELECT claimed_by FROM "{pg_schema}".flowlock_timers WHERE instance_id = $1',
            "a",
        )  # fmt: skip
        assert claim["claimed_by"] == second.timer_service.owner
        await tx.commit()
    finally:
        await holder.close()
    await _state(caller, "a", "rejected")

    def both_done() -> bool:
        counts = firings(first.metrics, second.metrics)
        return counts["applied"] + counts["idempotent"] + counts["stale"] == 2

    await wait_until(both_done, within=BOUND, what="both firings to answer")
    # The later one finds the firing applied (idempotent) or its stay ended (stale): nothing
    # written either way.
    counts = firings(first.metrics, second.metrics)
    assert counts["applied"] == 1 and counts["idempotent"] + counts["stale"] == 1, counts
    history = await caller.history("a")
    assert [h.request_id for h in history] == ["timer:1:expire:0"]
    await _clean(caller, "a", 1)
    (await sql_history()).assert_matches({"a": history})


async def test_a_firing_that_failed_on_a_busy_row_fires_again_once_it_is_free(
    engines: MakeEngine, pg_url: str, pg_schema: str
) -> None:
    """A firing that fails for a reason that passes (its lock wait ran out: the test holds the
    row) gives its claim back and fires again soon, not once its lease (minutes) ran out."""
    caller = await engines(timers=False)
    await caller.create("deadline", instance_id="a")
    holder = await pg_budget.connect(pg_url)
    try:
        async with holder.transaction():
            await holder.execute(
                f'SELECT 1 FROM "{pg_schema}".flowlock_instances WHERE id = $1 FOR UPDATE', "a"
            )
            firing = await engines(
                strategies=[flowlock.Pessimistic(lock_timeout=0.2)],
                strategy="pessimistic",
                timer_lease=600,
            )
            await wait_until(
                lambda: firings(firing.metrics)["failed"] >= 1, within=BOUND, what="a failure"
            )
    finally:
        await holder.close()
    await _state(caller, "a", "rejected")
    await fired(1, firing.metrics)
    await _clean(caller, "a", 1)
