"""Engine batching on a real PostgreSQL (and Redis for the distributed strategy): concurrent
``fire`` calls on one instance are decided together and written with one compare-and-swap, and
the guarantees stay those of one call at a time.

- 100 callers x storm / countersign / inventory / hot (see :mod:`batch_worker`), per strategy, in
  one process and across 4 OS processes: every call answered (an Outcome or a typed flowlock
  error), the scenario's counts exact, and the checker and the history rows counted with SQL
  clean after each run;
- the sessions ended (``pg_terminate_backend``) while a batch's write is in flight: every caller
  gets a typed error, and retried with their request ids every transition applies exactly once;
- a caller cancelled while it runs alone with others queued behind it, inside a batch in flight,
  or queued: the others all finish;
- the same sequential calls with batching on and off leave the same state and history.

How a write is held in flight, on cause and not on time: the test inserts, in a transaction it
keeps open, the history row of the version the engine is about to write. The engine's write
(the compare-and-swap, or the pessimistic strategy's write under its row lock) then waits inside
its INSERT for the test's transaction, and ``pg_blocking_pids`` shows it waiting for exactly that
transaction. Rolling the test's transaction back lets the write go on; nothing of the test's row
is ever committed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from batch_worker import QUORUM, SCENARIOS, STOCK, Scenario, answer, connect, register
from proc_worker import Gate

import flowlock
import pg_budget
from flowlock.checker import OVERSELL, check

pytestmark = pytest.mark.postgres

# The batching under test (flip to False to check a test itself against one transaction per call:
# the tests that rely on a batch forming then fail on their batch_size asserts, and only there).
BATCHING = True
CALLERS = 100
PROCESSES = 4
WITHIN = 60.0  # seconds any wait of these tests is bounded by: generous, never a speed
WORKER = Path(__file__).with_name("batch_worker.py")

DISTRIBUTED = pytest.param("distributed", marks=pytest.mark.redis)
STRATEGIES = ["optimistic", "pessimistic", DISTRIBUTED, "adaptive"]
# What a session ended under a call is to the store: nothing written, or maybe written.
LOST = (flowlock.ConnectionLost, flowlock.OutcomeUnknown)
# What a retry may meet while the pool replaces the connections of ended sessions.
RETRYABLE = (*LOST, flowlock.StoreBusy, flowlock.LockTimeout)

EngineFactory = Callable[..., Awaitable[flowlock.Engine]]
SqlHistory = Callable[..., Awaitable[Any]]
Record = dict[str, Any]


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture
def app() -> str:
    """An application_name of this test's own, to find its sessions in pg_stat_activity."""
    return f"flowlock-b-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def servers(
    request: pytest.FixtureRequest, pg_url: str, pg_schema: str, strategy: str
) -> dict[str, str]:
    """Where this test's engines (and worker processes) find their servers: PostgreSQL on the
    test's schema, and Redis in the test's namespace for the distributed strategy (every test
    of this file is parametrized by ``strategy``)."""
    where = {"url": pg_url, "schema": pg_schema}
    if strategy == "distributed":
        where["redis_url"] = request.getfixturevalue("redis_url")
        where["namespace"] = request.getfixturevalue("redis_namespace")
    return where


@pytest.fixture
async def make_engine(servers: dict[str, str], app: str) -> AsyncIterator[EngineFactory]:
    """Opens engines as :func:`batch_worker.connect` builds them, sessions named ``app``; closes
    them at the end."""
    opened: list[flowlock.Engine] = []

    async def make(batching: bool = BATCHING, pool_size: int = 20, **kw: Any) -> flowlock.Engine:
        engine = connect(
            servers["url"],
            servers["schema"],
            batching=batching,
            redis_url=servers.get("redis_url"),
            namespace=servers.get("namespace", "default"),
            app=app,
            pool_size=pool_size,
            **kw,
        )
        await engine.open()
        opened.append(engine)
        await register(engine)
        return engine

    yield make
    for engine in opened:
        await engine.aclose()


@pytest.fixture
async def admin(pg_url: str) -> AsyncIterator[asyncpg.Connection]:
    """A plain connection of the test's own, to look at pg_stat_activity and end sessions."""
    conn = await pg_budget.connect(pg_url)
    yield conn
    await conn.close()


# -- what every concurrency test checks ----------------------------------------------------------


def stock_never_negative(data: Mapping[str, Any]) -> str | None:
    return None if data["stock"] >= 0 else f"stock below zero: {data['stock']}"


async def verify(
    engine: flowlock.Engine,
    sql_history: SqlHistory,
    scenario: Scenario,
    iid: str,
    results: Sequence[Record],
    callers: int,
) -> None:
    """Every caller answered, with an Outcome or a typed error; the scenario's counts exact; the
    checker clean over the history (versions contiguous, no request id twice, as many rows as
    applied outcomes, the chain and the final instance agreeing) and the rows counted with SQL."""
    assert len(results) == callers
    untyped = [r for r in results if r.get("typed") is False]
    assert not untyped, untyped[:3]
    applied = [r for r in results if r.get("applied")]
    idempotent = [r for r in results if r.get("idempotent")]
    errors = [r for r in results if "error" in r]
    final = await engine.get(iid)
    history = await engine.history(iid)
    invariant = None
    if scenario.name == "storm":
        assert not errors, errors[:3]
        assert (len(applied), len(idempotent)) == (1, callers - 1)
        assert {r["state"] for r in results} == {"approved"}
        assert (final.state, final.version) == ("approved", 2)
    elif scenario.name == "countersign":
        assert not errors, errors[:3]
        assert (len(applied), len(idempotent)) == (QUORUM, callers - QUORUM)
        assert final.state == "approved"
        assert sorted(final.data["signers"]) == sorted(r["actor"] for r in applied)
        assert [h.to_state for h in history].count("approved") == 1
        # The idempotent callers came after the quorum: they were answered "approved".
        assert {r["state"] for r in idempotent} <= {"approved"}
    elif scenario.name == "inventory":
        refused = [r for r in errors if r["error"] == "GuardRejected"]
        assert (len(applied), len(refused)) == (STOCK, callers - STOCK), errors[:3]
        assert all("out of stock" in r["message"] for r in refused)
        assert dict(final.data) == {"stock": 0, "reserved": STOCK}
        invariant = stock_never_negative
    else:  # hot: every call must apply
        assert not errors, errors[:3]
        assert len(applied) == callers
        assert dict(final.data) == {"stock": callers}
        assert [h.version for h in history] == list(range(2, callers + 2))
        assert final.version == callers + 1
    if scenario.request_ids:
        # Each applied call's own request id, once; no other.
        assert sorted(h.request_id or "" for h in history) == sorted(
            r["request_id"] for r in applied
        )
    verdict = check(
        final,
        history,
        initial_state=scenario.initial_state,
        expected_applied=len(applied),
        invariant=invariant,
        invariant_kind=OVERSELL,
    )
    assert verdict.ok, verdict.violations
    (await sql_history()).assert_matches({iid: history})


def batched(results: Sequence[Record]) -> bool:
    """Some calls shared a write (or a read that answered them all)."""
    return any(r.get("batch_size", 1) > 1 for r in results)


async def at_once(
    engine: flowlock.Engine, scenario: Scenario, iid: str, strategy: str, callers: int
) -> list[Record]:
    """``callers`` calls released together (they all wait on one event), each answered within
    WITHIN seconds or the test fails."""
    go = asyncio.Event()

    async def caller(i: int) -> Record:
        await go.wait()
        return await answer(engine, scenario, iid, strategy, f"c{i}")

    tasks = [asyncio.create_task(caller(i)) for i in range(callers)]
    await asyncio.sleep(0)
    go.set()
    async with asyncio.timeout(WITHIN):
        return await asyncio.gather(*tasks)


# -- 100 callers in one process ------------------------------------------------------------------


# The quick suite (-m "not slow") runs each scenario once, under optimistic or pessimistic; the
# other parametrizations are slow.
QUICK = {("optimistic", "storm"), ("optimistic", "countersign"), ("pessimistic", "inventory"),
         ("pessimistic", "hot")}  # fmt: skip


def _slow_unless(strategy: str, scenario: str) -> list[pytest.MarkDecorator]:
    return [] if (strategy, scenario) in QUICK else [pytest.mark.slow]


ONE_PROCESS = [
    pytest.param(
        strategy,
        scenario,
        marks=[*_slow_unless(strategy, scenario)]
        + ([pytest.mark.redis] if strategy == "distributed" else []),
        id=f"{strategy}-{scenario}",
    )
    for strategy in ("optimistic", "pessimistic", "distributed", "adaptive")
    for scenario in SCENARIOS
]


@pytest.mark.parametrize(("strategy", "scenario"), ONE_PROCESS)
async def test_hundred_callers_on_one_instance_in_one_process(
    make_engine: EngineFactory, sql_history: SqlHistory, strategy: str, scenario: str
) -> None:
    """100 callers at once on one instance, batching on: every call answered, the scenario's
    counts exact (one approval; QUORUM signatures; STOCK sold and the rest refused; 100
    restocks at versions 2..101), the checker clean, and calls did share a batch."""
    engine = await make_engine()
    sc = SCENARIOS[scenario]
    iid = f"{scenario}-1"
    await engine.create(sc.workflow, instance_id=iid, data=sc.data)
    results = await at_once(engine, sc, iid, strategy, CALLERS)
    await verify(engine, sql_history, sc, iid, results, CALLERS)
    assert batched(results) == BATCHING, sorted({r.get("batch_size") for r in results}, key=str)


@pytest.mark.parametrize(("strategy", "scenario"), [
    ("optimistic", "inventory"),
    ("pessimistic", "hot"),
    pytest.param("distributed", "countersign", marks=[pytest.mark.redis, pytest.mark.slow]),
    pytest.param("adaptive", "hot", marks=pytest.mark.slow),
])  # fmt: skip
async def test_batches_in_a_row_when_more_are_queued_than_max_batch(
    make_engine: EngineFactory, sql_history: SqlHistory, strategy: str, scenario: str
) -> None:
    """max_batch=7 under 100 callers: the queue is worked off in batches of at most 7, one after
    the other (each reading what the one before it committed), and the scenario's counts and the
    checker are those of one call at a time."""
    engine = await make_engine(max_batch=7)
    sc = SCENARIOS[scenario]
    iid = f"{scenario}-1"
    await engine.create(sc.workflow, instance_id=iid, data=sc.data)
    results = await at_once(engine, sc, iid, strategy, CALLERS)
    await verify(engine, sql_history, sc, iid, results, CALLERS)
    sizes = [r["batch_size"] for r in results if "batch_size" in r]
    assert max(sizes) <= 7, sorted(set(sizes))
    if BATCHING:
        # More than 7 calls shared batches of at most 7: there were batches in a row.
        assert len([r for r in results if r.get("batch_size", 1) > 1]) > 7, sorted(set(sizes))


# -- 100 callers in 4 OS processes ---------------------------------------------------------------


async def in_processes(servers: dict[str, str], gate_dir: Path, **cfg: Any) -> list[Record]:
    """PROCESSES worker processes (batch_worker.py), CALLERS / PROCESSES callers each, released
    by one gate; their answers, once their contended phases are shown to have overlapped."""
    gate = Gate(gate_dir, PROCESSES)
    procs = []
    try:
        for p in range(PROCESSES):
            conf = {
                **servers,
                "callers": CALLERS // PROCESSES,
                "proc": p,
                "gate": str(gate),
                "batching": BATCHING,
                "within": WITHIN,
                **cfg,
            }
            procs.append(
                await asyncio.create_subprocess_exec(
                    sys.executable,
                    str(WORKER),
                    json.dumps(conf),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                )
            )
        await gate.open_when_ready(procs)
        results: list[Record] = []
        for proc in procs:
            out, err = await asyncio.wait_for(proc.communicate(), timeout=2 * WITHIN)
            assert proc.returncode == 0, err.decode()[-3000:]
            results += [json.loads(line) for line in out.decode().splitlines()]
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    gate.assert_overlapped()
    return results


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_hundred_callers_on_one_instance_across_processes(
    make_engine: EngineFactory,
    sql_history: SqlHistory,
    servers: dict[str, str],
    tmp_path: Path,
    strategy: str,
    scenario: str,
) -> None:
    """4 OS processes x 25 callers on one shared instance, batching on in each: every call
    answered, the scenario's counts exact across the processes, the checker clean."""
    engine = await make_engine()
    sc = SCENARIOS[scenario]
    iid = f"{scenario}-shared"
    await engine.create(sc.workflow, instance_id=iid, data=sc.data)
    results = await in_processes(
        servers, tmp_path, scenario=scenario, strategy=strategy, instance=iid
    )
    await verify(engine, sql_history, sc, iid, results, CALLERS)
    if BATCHING:
        assert batched(results)


# -- holding a write in flight -------------------------------------------------------------------


class HeldVersion:
    """The history row of ``version`` inserted in a transaction the test keeps open: an engine
    writing that version waits inside its INSERT (the primary key) until the test rolls back."""

    def __init__(self, conn: asyncpg.Connection, tx: Any) -> None:
        self.conn = conn
        self._tx = tx
        self.pid = conn.get_server_pid()

    @classmethod
    async def take(cls, url: str, schema: str, iid: str, version: int) -> HeldVersion:
        conn = await pg_budget.connect(url, server_settings={"search_path": schema})
        tx = conn.transaction()
        await tx.start()
        # Without the foreign key's check: it would take a KEY SHARE lock on the instance row,
        # and the pessimistic strategy's FOR UPDATE would wait for the test before any write.
        # (Replica mode skips the check for this transaction only; it needs a superuser, as the
        # test servers' user is.)
        await conn.execute("SET LOCAL session_replication_role = replica")
        await conn.execute(
            "INSERT INTO flowlock_history (instance_id, version, event, from_state, to_state,"
            " strategy, data) VALUES ($1, $2, 'held-by-test', 'open', 'open', 'test', '{}')",
            iid,
            version,
        )
        return cls(conn, tx)

    async def release(self) -> None:
        """Roll the test's row back (idempotent) and close the connection."""
        if not self.conn.is_closed():
            try:
                await self._tx.rollback()
            finally:
                await self.conn.close()


async def blocked_by(admin: asyncpg.Connection, app: str, held: HeldVersion) -> list[int]:
    """The sessions named ``app`` that wait for ``held``'s transaction."""
    rows = await admin.fetch(
        "SELECT pid FROM pg_stat_activity WHERE application_name = $1"
        " AND $2 = ANY(pg_blocking_pids(pid))",
        app,
        held.pid,
    )
    return [r["pid"] for r in rows]


async def until_blocked(admin: asyncpg.Connection, app: str, held: HeldVersion, what: str) -> None:
    """Until a session of the engine waits for ``held`` (WITHIN seconds at most)."""
    deadline = time.monotonic() + WITHIN
    while not await blocked_by(admin, app, held):
        assert time.monotonic() < deadline, f"not within {WITHIN:.0f} s: {what}"
        await asyncio.sleep(0.01)


async def queued(tasks: Sequence[asyncio.Task[Any]]) -> None:
    """Let every task run up to its first wait: a call whose instance is busy joins its queue
    there (its strategy is given, so no read comes before)."""
    for _ in range(5):
        await asyncio.sleep(0)
    assert not any(t.done() for t in tasks), [t.result() for t in tasks if t.done()]


async def terminate(admin: asyncpg.Connection, app: str) -> list[int]:
    """End every session named ``app`` (the engine's pool) without waiting; their pids."""
    rows = await admin.fetch(
        "SELECT pid, pg_terminate_backend(pid) FROM pg_stat_activity"
        " WHERE application_name = $1 AND pid <> pg_backend_pid()",
        app,
    )
    return [r["pid"] for r in rows]


async def until_ended(admin: asyncpg.Connection, pids: Sequence[int]) -> None:
    """Until the server has ended the sessions ``pids`` (WITHIN seconds at most)."""
    assert pids, "no session to end"
    deadline = time.monotonic() + WITHIN
    alive = "SELECT count(*) FROM pg_stat_activity WHERE pid = any($1::int[])"
    while await admin.fetchval(alive, list(pids)):
        assert time.monotonic() < deadline, f"the ended sessions were still there after {WITHIN} s"
        await asyncio.sleep(0.01)


HOT = SCENARIOS["hot"]  # every call must apply: each request id applied exactly once in the end


async def verify_hot(
    engine: flowlock.Engine,
    sql_history: SqlHistory,
    iid: str,
    answered: set[str],
    cancelled: set[str] | None = None,
) -> set[str]:
    """The hot instance holds one restock per request id that was answered applied, plus at
    most one for each cancelled call (its write may have gone through), none twice; the
    checker clean. Returns the request ids applied."""
    final = await engine.get(iid)
    history = await engine.history(iid)
    ids = [h.request_id or "" for h in history]
    assert len(ids) == len(set(ids)), ids
    assert answered <= set(ids) <= answered | (cancelled or set()), (sorted(ids), sorted(answered))
    assert dict(final.data) == {"stock": len(ids)}
    verdict = check(final, history, initial_state="open", expected_applied=len(ids))
    assert verdict.ok, verdict.violations
    (await sql_history()).assert_matches({iid: history})
    return set(ids)


# -- sessions ended while a batch writes ---------------------------------------------------------


@pytest.mark.parametrize(
    "strategy",
    [
        "optimistic",
        "pessimistic",
        pytest.param("distributed", marks=[pytest.mark.redis, pytest.mark.slow]),
        pytest.param("adaptive", marks=pytest.mark.slow),
    ],
)
async def test_sessions_ended_while_a_batch_writes(
    make_engine: EngineFactory,
    sql_history: SqlHistory,
    admin: asyncpg.Connection,
    pg_url: str,
    pg_schema: str,
    app: str,
    strategy: str,
) -> None:
    """A batch of 20 restocks (each its own request id) is writing when every session of the
    engine is ended: each of the 20 callers gets the same typed error, never a driver error or a
    hang. Retried with the same request ids, every restock is applied exactly once.

    Where the kill lands: on the batch's write statement, sent and waiting. For optimistic,
    distributed and adaptive (not escalated) that statement is the commit (one autocommit
    compare-and-swap): OutcomeUnknown. For pessimistic it runs inside the transaction that holds
    the row lock, before its COMMIT: ConnectionLost (nothing was committed) is the exact answer,
    OutcomeUnknown an allowed cautious one."""
    engine = await make_engine(pool_size=4)
    iid = "hot"
    await engine.create(HOT.workflow, instance_id=iid, data=HOT.data)
    first = await HeldVersion.take(pg_url, pg_schema, iid, 2)
    second = await HeldVersion.take(pg_url, pg_schema, iid, 3)
    try:
        # A lone call writes version 2 and waits for the test; 20 calls queue behind it.
        lone = asyncio.create_task(answer(engine, HOT, iid, strategy, "lone"))
        await until_blocked(admin, app, first, "the lone call's write waiting for version 2")
        actors = [f"c{i}" for i in range(20)]
        batch = [asyncio.create_task(answer(engine, HOT, iid, strategy, a)) for a in actors]
        await queued(batch)
        # The lone call commits; the 20 are taken as one batch, whose write (versions 3..22)
        # waits for the test's version 3: the write is in flight when the sessions end.
        await first.release()
        async with asyncio.timeout(WITHIN):
            alone = await lone
        assert alone.get("applied") and alone["batch_size"] == 1, alone
        await until_blocked(admin, app, second, "the batch's write waiting for version 3")
        # Version 3 is let go only once the ended sessions are gone: the ended write cannot
        # have gone on. The retries below then find nothing in their way.
        await until_ended(admin, await terminate(admin, app))
        await second.release()
        async with asyncio.timeout(WITHIN):
            results = await asyncio.gather(*batch)
    finally:
        await first.release()
        await second.release()

    assert not [r for r in results if r.get("typed") is False], results[:3]
    # The batch shared one write, which was ended: every one of its callers has an error.
    assert all("error" in r for r in results), results[:3]
    errors = {r["error"] for r in results}
    assert len(errors) == 1, results[:3]  # one write, one fate for all of its calls
    (error,) = errors
    assert error in {e.__name__ for e in LOST}, results[:3]
    if strategy in ("optimistic", "distributed"):
        # The compare-and-swap is one autocommit statement: once it is sent, flowlock cannot
        # tell whether it committed.
        assert error == "OutcomeUnknown", results[:3]
        assert all("same request_id" in r["message"] for r in results), results[0]

    # Retried with the same request ids, concurrently (batched again), until each is answered.
    pending = actors
    seen: list[Record] = []
    for _ in range(10):
        async with asyncio.timeout(WITHIN):
            again = await asyncio.gather(*(answer(engine, HOT, iid, strategy, a) for a in pending))
        for r in again:
            if "error" in r:
                assert r["typed"] and r["error"] in {e.__name__ for e in RETRYABLE}, r
                seen.append(r)
            else:
                # The ended write cannot have committed (its session ended while it waited for
                # the test's row, which was let go only after): the retry applies it.
                assert r["applied"], r
        pending = [r["actor"] for r in again if "error" in r]
        if not pending:
            break
    assert not pending, seen[-3:]
    ids = await verify_hot(engine, sql_history, iid, {f"hot-{a}" for a in ["lone", *actors]})
    assert len(ids) == 21


# -- callers cancelled around a batch ------------------------------------------------------------


def _cancel_cases() -> list[Any]:
    """Strategy x who is cancelled; the quick suite keeps optimistic, and pessimistic's "lone"
    (its cancelled call dies in a transaction holding the row lock)."""
    cases = []
    for strategy in ("optimistic", "pessimistic", "distributed", "adaptive"):
        for who in ("lone", "batch-first", "queued"):
            marks = (
                []
                if strategy == "optimistic" or (strategy, who) == ("pessimistic", "lone")
                else [pytest.mark.slow]
            )
            if strategy == "distributed":
                marks.append(pytest.mark.redis)
            cases.append(pytest.param(strategy, who, marks=marks, id=f"{strategy}-{who}"))
    return cases


@pytest.mark.parametrize(("strategy", "who"), _cancel_cases())
async def test_a_cancelled_caller_leaves_the_others_to_finish(
    make_engine: EngineFactory,
    sql_history: SqlHistory,
    admin: asyncpg.Connection,
    pg_url: str,
    pg_schema: str,
    app: str,
    strategy: str,
    who: str,
) -> None:
    """A lone call writing with 10 calls queued behind it, then that batch of 10 writing with 5
    more queued: cancelling the lone call, whose end hands the queue on ("lone"), the first call
    of the batch in flight, whose fields the batch carries ("batch-first"), or a queued call
    ("queued") cancels only that caller. Every other call finishes, applied, in the batch it
    was queued into; a call cancelled while it was queued is never applied; a cancelled call
    whose write was in flight may have been applied, once; nothing is applied twice."""
    engine = await make_engine(pool_size=4)
    iid = "hot"
    await engine.create(HOT.workflow, instance_id=iid, data=HOT.data)
    first = await HeldVersion.take(pg_url, pg_schema, iid, 2)
    second = await HeldVersion.take(pg_url, pg_schema, iid, 3)
    cancelled: set[str] = set()

    def start(actor: str) -> asyncio.Task[Record]:
        return asyncio.create_task(answer(engine, HOT, iid, strategy, actor), name=actor)

    try:
        lone = start("lone")
        await until_blocked(admin, app, first, "the lone call's write waiting for version 2")
        batch = [start(f"b{i}") for i in range(10)]
        await queued(batch)
        if who == "lone":
            lone.cancel()
            cancelled.add("lone")
        await first.release()
        # The batch of 10 writes versions 3..12 (2..11 if the lone write was undone) and, at
        # version 3, waits for the test.
        await until_blocked(admin, app, second, "the batch's write waiting for version 3")
        later = [start(f"q{i}") for i in range(5)]
        await queued(later)
        if who == "batch-first":
            batch[0].cancel()
            cancelled.add("b0")
        elif who == "queued":
            later[2].cancel()
            cancelled.add("q2")
        await second.release()
        async with asyncio.timeout(WITHIN):
            done = await asyncio.gather(lone, *batch, *later, return_exceptions=True)
    finally:
        await first.release()
        await second.release()

    answered: dict[str, Record] = {}
    for task, result in zip([lone, *batch, *later], done, strict=True):
        name = task.get_name()
        if name in cancelled:
            assert isinstance(result, asyncio.CancelledError), (name, result)
            continue
        assert isinstance(result, dict) and result.get("applied"), (name, result)
        answered[name] = result
    assert {answered[f"b{i}"]["batch_size"] for i in range(10) if f"b{i}" in answered} == {10}
    later_size = 5 - (who == "queued")
    assert {answered[f"q{i}"]["batch_size"] for i in range(5) if f"q{i}" in answered} == {
        later_size
    }
    ids = await verify_hot(
        engine,
        sql_history,
        iid,
        {f"hot-{name}" for name in answered},
        {f"hot-{name}" for name in cancelled},
    )
    if who == "queued":
        assert "hot-q2" not in ids  # taken out of the queue before any batch took it


# -- on and off agree ----------------------------------------------------------------------------


def _call(
    engine: flowlock.Engine, iid: str, strategy: str, event: str, **kw: Any
) -> Callable[[], Awaitable[flowlock.Outcome]]:
    return lambda: engine.fire(iid, event, strategy=strategy, **kw)


async def _sequence(engine: flowlock.Engine, prefix: str, strategy: str) -> list[Any]:
    """The same calls, one after the other, on two instances named with ``prefix``: what each
    answered (an Outcome's fields, or the error's type)."""
    sku, req = f"{prefix}-sku", f"{prefix}-req"
    await engine.create("inventory", instance_id=sku, data={"stock": 3})
    await engine.create("approval", instance_id=req)
    calls = [
        _call(engine, sku, strategy, "reserve", request_id="r1", actor="ann"),
        _call(engine, sku, strategy, "reserve", request_id="r1", actor="ann"),
        _call(engine, sku, strategy, "reserve", request_id="r2", payload={"qty": 5}),
        _call(engine, sku, strategy, "restock", request_id="r3", payload={"qty": 2}),
        _call(engine, sku, strategy, "reserve", expected_version=1),
        _call(engine, sku, strategy, "reserve", request_id="r1", payload={"qty": 2}),
        _call(engine, sku, strategy, "reserve", request_id="r4", payload={"qty": 4}),
        _call(engine, sku, strategy, "reserve", actor="bob"),
        _call(engine, req, strategy, "approve", actor="ann"),
        _call(engine, req, strategy, "approve", actor="bob"),
        _call(engine, req, strategy, "reject", actor="cat"),
    ]
    answers: list[Any] = []
    for call in calls:
        try:
            out = await call()
        except flowlock.FlowlockError as exc:
            answers.append(type(exc).__name__)
        else:
            answers.append((out.applied, out.idempotent, out.batch_size, _kept(out.instance)))
    return answers


def _kept(inst: flowlock.Instance) -> tuple[Any, ...]:
    """What two instances given the same calls agree on (not their id, not their times)."""
    return (inst.workflow, inst.state, inst.version, dict(inst.data), inst.last_event)


def _entries(history: Sequence[flowlock.HistoryEntry]) -> list[dict[str, Any]]:
    """The history rows without what differs between two instances (their id, their times)."""
    return [
        {k: v for k, v in dataclasses.asdict(h).items() if k not in ("instance_id", "at")}
        for h in history
    ]


@pytest.mark.parametrize("strategy", ["optimistic", "pessimistic"])
async def test_batching_on_and_off_agree_on_sequential_calls(
    make_engine: EngineFactory, sql_history: SqlHistory, strategy: str
) -> None:
    """The same sequential calls (applied, repeated, refused, stale, reused key) with batching
    on and off: the same answers, the same final instances and the same history rows."""
    on = await make_engine(batching=True)
    off = await make_engine(batching=False)
    assert await _sequence(on, "on", strategy) == await _sequence(off, "off", strategy)
    for name in ("sku", "req"):
        assert _kept(await on.get(f"on-{name}")) == _kept(await off.get(f"off-{name}"))
        assert _entries(await on.history(f"on-{name}")) == _entries(
            await off.history(f"off-{name}")
        )
    histories = {iid: await on.history(iid) for iid in ("on-sku", "on-req", "off-sku", "off-req")}
    for iid, history in histories.items():
        verdict = check(await on.get(iid), history)
        assert verdict.ok, verdict.violations
    (await sql_history()).assert_matches(histories)
