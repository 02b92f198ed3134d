"""Repairs under live traffic on PostgreSQL: force while 100 callers fire, under every strategy
(optimistic, pessimistic, distributed with Redis leases, adaptive); pause while callers fire;
a workflow's pause as one row seen by another engine; timers of a paused instance fire after
the resume. The checker and the test's own SQL read the history after each."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import pytest

import flowlock
from flowlock.checker import check
from flowlock.core.admin import FORCE_EVENT, PAUSE_EVENT, RESUME_EVENT
from flowlock.stores.postgres import PostgresStore
from lock_probes import wait_until
from timer_kit import deadline

pytestmark = pytest.mark.postgres

Make = Callable[..., Awaitable[flowlock.Engine]]
SqlHistory = Callable[..., Awaitable[Any]]
CALLERS = 100
INSTANCES = 10


def _add(inst: flowlock.Instance, payload: Mapping[str, Any], actor: str | None) -> dict[str, Any]:
    return {**inst.data, "n": int(inst.data.get("n", 0)) + 1}


COUNTER = flowlock.Workflow(
    "counter",
    states=["open", "closed"],
    initial="open",
    transitions=[
        flowlock.Transition("add", source="open", target="open", effect=_add),
        flowlock.Transition("close", source="open", target="closed"),
        flowlock.Transition("reopen", source="closed", target="open"),
    ],
)


@pytest.fixture
def redis(request: pytest.FixtureRequest) -> tuple[str, str] | None:
    """Redis's URL and a fresh key namespace for a test run under the distributed strategy."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is None or callspec.params.get("strategy") != "distributed":
        return None
    return request.getfixturevalue("redis_url"), request.getfixturevalue("redis_namespace")


@pytest.fixture
async def make(redis: tuple[str, str] | None, pg_url: str, pg_schema: str) -> AsyncIterator[Make]:
    """Opens engines on this test's schema with `strategy` as their default (distributed: on
    Redis leases, fenced), the counter and the deadline workflows registered."""
    opened: list[flowlock.Engine] = []

    async def open_engine(strategy: str = "optimistic", **options: Any) -> flowlock.Engine:
        store = PostgresStore(pg_url, schema=pg_schema, pool_size=40)
        if strategy == "distributed":
            from flowlock.locks.redis import RedisLocks

            assert redis is not None
            redis_url, namespace = redis
            options["locks"] = RedisLocks(
                redis_url, namespace=namespace, fence_floor=store.fencing_floor
            )
            options["strategies"] = [flowlock.Distributed(wait=20.0)]
        engine = await flowlock.Engine(store, strategy=strategy, **options).open()
        opened.append(engine)
        for wf in (COUNTER, deadline(after=0.3)):
            await engine.register(wf)
        return engine

    yield open_engine
    for engine in opened:
        await engine.aclose()


async def _until_done(call: Callable[[], Awaitable[Any]]) -> Any:
    """`call` retried while it loses to the callers (an operator's retry, under the same request
    id, so it applies once however many times it is sent)."""
    for _ in range(200):
        try:
            return await call()
        except flowlock.ConcurrencyError:
            await asyncio.sleep(0.01)
    raise AssertionError("the repair lost every race for 200 tries")


async def _verify(
    engine: flowlock.Engine, ids: list[str], applied: Mapping[str, int], sql: SqlHistory
) -> dict[str, list[flowlock.HistoryEntry]]:
    """Each instance's history passes the checker with `applied[id]` applied calls, agrees with
    the SQL count, and its counter equals its applied adds: no update was lost."""
    histories = {}
    for iid in ids:
        inst, rows = await engine.get(iid), await engine.history(iid)
        histories[iid] = rows
        verdict = check(inst, rows, initial_state="open", expected_applied=applied[iid])
        assert verdict.ok, verdict.violations
        adds = sum(r.event == "add" for r in rows)
        assert inst.data["n"] == adds, (iid, inst.data, adds)
    (await sql()).assert_matches(histories)
    return histories


@pytest.mark.parametrize("strategy", ["optimistic", "pessimistic", "distributed", "adaptive"])
async def test_force_under_100_callers_is_exactly_once(
    make: Make, sql_history: SqlHistory, strategy: str
) -> None:
    """100 callers fire `add` at 10 instances while an operator forces each one to closed and
    back, each force sent three times at once under one request id: each forced row is written
    once (the other two replay it), no add is lost, the checker passes."""
    engine = await make(strategy)
    ids = [f"f-{strategy}-{i}" for i in range(INSTANCES)]
    for iid in ids:
        await engine.create("counter", instance_id=iid, data={"n": 0})
    applied: Counter[str] = Counter()
    adds = 0  # the callers' adds applied (`applied` counts the forces too)
    closed = 0  # the callers' adds refused: their instance was closed
    stop = asyncio.Event()

    async def caller(k: int) -> None:
        nonlocal adds, closed
        j = 0
        while not stop.is_set():
            iid = ids[(k + j) % INSTANCES]
            j += 1
            try:
                if (await engine.fire(iid, "add", request_id=f"add-{k}-{j}")).applied:
                    applied[iid] += 1
                    adds += 1
            except flowlock.TransitionNotAllowed:
                closed += 1
            except flowlock.ConcurrencyError:
                pass

    async def force_thrice(iid: str, state: str, rid: str) -> None:
        def force() -> Awaitable[flowlock.Outcome]:
            return engine.force(iid, state, reason="drain", actor="ops", request_id=rid)

        outs = await asyncio.gather(*(_until_done(force) for _ in "abc"))
        assert sum(o.applied for o in outs) == 1 and sum(o.replayed for o in outs) == 2, outs
        assert {o.instance.version for o in outs} == {outs[0].instance.version}
        applied[iid] += 1

    callers = [asyncio.create_task(caller(k)) for k in range(CALLERS)]
    try:
        # Each step waits for the callers to have done something in it, not for a fixed time.
        await wait_until(lambda: adds >= INSTANCES, what="the callers' adds")
        await asyncio.gather(*(force_thrice(i, "closed", f"close-{i}") for i in ids))
        seen = closed
        await wait_until(lambda: closed >= seen + CALLERS, what="adds refused while closed")
        await asyncio.gather(*(force_thrice(i, "open", f"open-{i}") for i in ids))
        seen = adds
        await wait_until(lambda: adds >= seen + INSTANCES, what="adds after the reopen")
    finally:
        stop.set()
        await asyncio.gather(*callers)
    # A late retry of a force replays: nothing more is written.
    first = ids[0]
    late = await engine.force(
        first, "closed", reason="drain", actor="ops", request_id=f"close-{first}"
    )
    assert late.replayed and not late.applied
    histories = await _verify(engine, ids, applied, sql_history)
    for iid, rows in histories.items():
        forced = [r for r in rows if r.forced]
        assert [r.request_id for r in forced] == [f"close-{iid}", f"open-{iid}"], forced
        assert all(r.reason == "drain" and r.actor == "ops" for r in forced)
        if strategy == "distributed":
            assert all(r.fencing_token is not None for r in rows)
    assert sum(applied.values()) > 2 * INSTANCES  # the callers did get adds through


@pytest.mark.parametrize("strategy", ["optimistic", "pessimistic"])
async def test_no_fire_applies_between_pause_and_resume(
    make: Make, sql_history: SqlHistory, strategy: str
) -> None:
    """50 callers fire at one instance; another engine pauses it. Once pause returned, nothing
    is applied until the resume but a force; the history shows no fired row in between."""
    engine, operator = await make(strategy), await make(strategy)
    iid = f"p-{strategy}"
    await engine.create("counter", instance_id=iid, data={"n": 0})
    applied: Counter[str] = Counter()
    refused: Counter[int] = Counter()  # by caller
    stop = asyncio.Event()

    async def caller(k: int) -> None:
        j = 0
        while not stop.is_set():
            j += 1
            try:
                if (await engine.fire(iid, "add", request_id=f"a-{k}-{j}")).applied:
                    applied[iid] += 1
            except flowlock.InstancePaused:
                refused[k] += 1
                await asyncio.sleep(0.005)
            except flowlock.ConcurrencyError:
                pass

    def each_refused_twice_since(seen: Counter[int]) -> Callable[[], bool]:
        # A caller's calls are one after another: once it was refused, every call it had in
        # flight at the pause has ended. Twice: each also tried again after that.
        return lambda: all(refused[k] >= seen[k] + 2 for k in range(50))

    callers = [asyncio.create_task(caller(k)) for k in range(50)]
    try:
        await wait_until(lambda: applied[iid] >= 20, what="the callers' adds")
        paused = await _until_done(
            lambda: operator.pause(iid, reason="audit", actor="ops", request_id="pause-1")
        )
        assert isinstance(paused, flowlock.Outcome) and paused.applied
        at = paused.instance.version
        await wait_until(each_refused_twice_since(Counter()), what="every caller refused")
        assert (await operator.get(iid)).version == at
        forced = await operator.force(iid, "open", reason="touch", actor="ops")
        assert forced.applied and forced.instance.version == at + 1 and forced.instance.paused
        await wait_until(each_refused_twice_since(refused.copy()), what="refused after force")
        resumed = await _until_done(
            lambda: operator.resume(iid, reason="done", actor="ops", request_id="resume-1")
        )
        assert isinstance(resumed, flowlock.Outcome) and resumed.instance.version == at + 2
        seen = applied[iid]
        await wait_until(lambda: applied[iid] >= seen + 20, what="adds after the resume")
    finally:
        stop.set()
        await asyncio.gather(*callers)
    applied[iid] += 3  # the pause, the force and the resume
    rows = (await _verify(engine, [iid], applied, sql_history))[iid]
    events = [r.event for r in rows]
    start = events.index(PAUSE_EVENT)
    assert events[start : start + 3] == [PAUSE_EVENT, FORCE_EVENT, RESUME_EVENT]
    assert sum(refused.values()) > 0 and events[start + 3 :].count("add") > 0


async def test_a_workflow_pause_is_one_row_seen_by_another_engine(
    make: Make, pg_url: str, pg_schema: str
) -> None:
    """Pausing a workflow of 300 instances writes one row: no instance row, no history row.
    Another engine's fires at every instance are refused until the resume; then they apply."""
    import asyncpg

    one, other = await make(), await make("pessimistic")
    ids = [f"w-{i:03d}" for i in range(300)]
    await asyncio.gather(*(one.create("counter", instance_id=i, data={"n": 0}) for i in ids))
    conn = await asyncpg.connect(pg_url, server_settings={"search_path": pg_schema})

    async def rows() -> tuple[list[Any], int, int]:
        versions = await conn.fetch("SELECT id, version, updated_at FROM flowlock_instances")
        history = await conn.fetchval("SELECT count(*) FROM flowlock_history")
        pauses = await conn.fetchval("SELECT count(*) FROM flowlock_workflow_pauses")
        return sorted(map(tuple, versions)), history, pauses

    try:
        before = await rows()
        pause = await one.pause(workflow="counter", reason="bad deploy", actor="ops")
        assert isinstance(pause, flowlock.WorkflowPause)
        after = await rows()
        assert after[:2] == before[:2] and (before[2], after[2]) == (0, 1)
        outs = await asyncio.gather(*(other.fire(i, "add") for i in ids), return_exceptions=True)
        assert all(isinstance(o, flowlock.InstancePaused) for o in outs), outs[:3]
        assert {o.scope for o in outs if isinstance(o, flowlock.InstancePaused)} == {"workflow"}
        assert await rows() == after
        assert await other.workflow_pauses() == [pause]
        assert await other.resume(workflow="counter") == pause
        fired = await asyncio.gather(*(other.fire(i, "add") for i in ids))
        assert all(o.applied for o in fired)
    finally:
        await conn.close()


async def test_a_paused_instance_keeps_its_timer_until_the_resume(
    make: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deadline falls due while its instance is paused: it is not fired, not lost; once the
    instance is resumed it fires, once."""
    engine = await make(timer_lease=0.5)
    service = engine.timer_service
    assert service is not None
    outcomes: list[str] = []
    real = service._outcome

    async def counted(timer: flowlock.Timer) -> str:
        outcomes.append(await real(timer))
        return outcomes[-1]

    monkeypatch.setattr(service, "_outcome", counted)
    await engine.create("deadline", instance_id="t-1")
    await engine.pause("t-1", reason="hold the deadline", actor="ops")
    # Due at 0.3 s; it waits until claimed and found paused twice (its lease ran out between),
    # rather than a fixed 1.5 s.
    await wait_until(lambda: outcomes.count("paused") >= 2, what="two claims found it paused")
    assert outcomes == ["paused", "paused"]
    assert (await engine.get("t-1")).state == "pending"
    assert [t.event for t in await engine.timers("t-1")] == ["expire"]
    assert service.fired == 0
    await engine.resume("t-1", actor="ops")

    async def expired() -> bool:
        return (await engine.get("t-1")).state == "rejected"

    await wait_until(expired, within=20.0, what="the deadline fired after the resume")
    rows = await engine.history("t-1")
    assert [r.event for r in rows] == [PAUSE_EVENT, RESUME_EVENT, "expire"]
    assert rows[-1].request_id == "timer:1:expire:0"
    assert check(await engine.get("t-1"), rows, initial_state="pending").ok


@pytest.mark.parametrize("strategy", ["optimistic", "pessimistic"])
async def test_nothing_lands_once_a_workflow_pause_returned(
    make: Make, pg_url: str, pg_schema: str, strategy: str
) -> None:
    """100 callers fire at 20 instances of a workflow while another engine pauses the whole
    workflow: from the moment the pause returned, no history row is added (the fires decided
    before it committed have landed or lost their compare-and-swap), until the resume."""
    import asyncpg

    engine, operator = await make(strategy), await make(strategy)
    ids = [f"s-{strategy}-{i}" for i in range(20)]
    for iid in ids:
        await engine.create("counter", instance_id=iid, data={"n": 0})
    refused: Counter[int] = Counter()  # by caller
    adds = 0
    stop = asyncio.Event()

    async def caller(k: int) -> None:
        nonlocal adds
        j = 0
        while not stop.is_set():
            j += 1
            try:
                await engine.fire(ids[(k + j) % len(ids)], "add")
                adds += 1
            except flowlock.InstancePaused:
                refused[k] += 1
                await asyncio.sleep(0.002)
            except flowlock.ConcurrencyError:
                pass

    conn = await asyncpg.connect(pg_url, server_settings={"search_path": pg_schema})
    count = "SELECT count(*) FROM flowlock_history"
    callers = [asyncio.create_task(caller(k)) for k in range(CALLERS)]
    try:
        await wait_until(lambda: adds >= 2 * len(ids), what="the callers' adds")
        await operator.pause(workflow="counter", reason="freeze", actor="ops")
        at_pause = await conn.fetchval(count)
        # Each caller refused twice: every fire it had in flight at the pause has ended (its
        # calls are one after another), and it tried again after.
        await wait_until(
            lambda: all(refused[k] >= 2 for k in range(CALLERS)), what="every caller refused"
        )
        assert await conn.fetchval(count) == at_pause
        await operator.resume(workflow="counter")

        async def landed() -> bool:
            return bool(await conn.fetchval(count) > at_pause)

        await wait_until(landed, what="fires after the resume")
    finally:
        stop.set()
        await asyncio.gather(*callers)
        await conn.close()
    for iid in ids:
        inst, rows = await engine.get(iid), await engine.history(iid)
        assert check(inst, rows, initial_state="open").ok
        assert inst.data["n"] == len(rows)


async def test_force_inside_your_transaction(make: Make, pg_url: str, pg_schema: str) -> None:
    """`force(..., connection=)` joins the caller's transaction: rolled back with it, or
    committed with it, exactly once by its request id."""
    import asyncpg

    engine = await make("pessimistic")
    await engine.create("counter", instance_id="tx-1", data={"n": 0})
    conn = await asyncpg.connect(pg_url)
    try:
        tx = conn.transaction()
        await tx.start()
        inside = await engine.force(
            "tx-1", "closed", reason="r", actor="ops", request_id="tx-f", connection=conn
        )
        assert inside.applied and inside.instance.state == "closed"
        await tx.rollback()
        assert (await engine.get("tx-1")).state == "open" and await engine.history("tx-1") == []
        async with conn.transaction():
            await engine.force(
                "tx-1", "closed", reason="r", actor="ops", request_id="tx-f", connection=conn
            )
        again = await engine.force("tx-1", "closed", reason="r", actor="ops", request_id="tx-f")
        assert again.replayed and [r.kind for r in await engine.history("tx-1")] == ["forced"]
    finally:
        await conn.close()
