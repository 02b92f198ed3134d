"""Sessions ended under the engine and the advisory locks on a real PostgreSQL: every call that
fails raises a typed flowlock error (ConnectionLost, OutcomeUnknown, LockNotOwned,
LockUnavailable), never one of asyncpg's; the broken connections are dropped, so the calls after
recover; and the history stays exactly once (the checker, and the rows counted with SQL).

The sessions are ended with ``pg_terminate_backend``, which sends the same FATAL message as a
server restart or a failover. :func:`terminate_unnoticed` ends them while the test's event loop
is blocked, so asyncpg has not read that message when the next call starts (as when a call comes
right after a restart): the call then runs on a connection that asyncpg still takes for alive,
the case in which asyncpg raised ``InternalClientError`` ("cannot switch to state 15; another
operation is in progress") to the caller.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import asyncpg
import pytest

import flowlock
import pg_budget
from flowlock import examples
from flowlock.checker import check
from flowlock.locks.advisory import AdvisoryLocks
from flowlock.stores.postgres import PostgresStore
from lock_probes import advisory_sessions, wait_until

pytestmark = pytest.mark.postgres

SqlHistory = Callable[..., Awaitable[Any]]
EngineFactory = Callable[..., Awaitable[flowlock.Engine]]
STRATEGIES = ["optimistic", "pessimistic"]
# What a lost session is to the store: nothing written, or maybe written.
LOST = (flowlock.ConnectionLost, flowlock.OutcomeUnknown)
# What a caller may see while sessions are being ended under concurrent calls: a lost session,
# or an ordinary lost race / bounded wait, each of them safe to retry with the same request id.
RETRYABLE = (
    *LOST,
    flowlock.ConflictRetriesExhausted,
    flowlock.LockTimeout,
    flowlock.StoreBusy,
)
DRIVER = (asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError, OSError)
QUORUM = 10_000  # signatures never reach it: every signature is one applied transition
HELD = 30.0  # a lease that must stay held for the whole test


def assert_typed(exc: BaseException, allowed: tuple[type[BaseException], ...]) -> None:
    """``exc`` is one of the ``allowed`` flowlock errors (its exact type is named in the
    message), raised from the driver's error when there was one; never a driver error."""
    assert isinstance(exc, flowlock.FlowlockError), f"untyped: {type(exc).__module__}.{exc!r}"
    assert type(exc).__module__.startswith("flowlock."), repr(exc)
    assert isinstance(exc, allowed), repr(exc)
    if isinstance(exc, LOST):
        assert isinstance(exc.__cause__, DRIVER), repr(exc.__cause__)


def terminate_unnoticed(url: str, *, app: str | None = None, pids: Sequence[int] = ()) -> int:
    """End the server sessions named ``app`` (or with these ``pids``) and wait until the server
    has ended them, blocking the calling thread, and so its event loop, all along: the asyncpg
    connections of that loop have not read the server's FATAL message when the next call starts.
    Returns how many sessions were ended."""

    async def run() -> int:
        conn = await pg_budget.connect(url)
        try:
            found = list(pids)
            if app is not None:
                rows = await conn.fetch(
                    "SELECT pid FROM pg_stat_activity WHERE application_name = $1", app
                )
                found += [r["pid"] for r in rows]
            for pid in found:
                await conn.fetchval("SELECT pg_terminate_backend($1)", pid)
            deadline = time.monotonic() + 30
            alive = "SELECT count(*) FROM pg_stat_activity WHERE pid = any($1::int[])"
            while await conn.fetchval(alive, found):
                assert time.monotonic() < deadline, "the terminated sessions did not end"
                await asyncio.sleep(0.01)
            return len(found)
        finally:
            await conn.close()

    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        return thread.submit(asyncio.run, run()).result()


async def terminate_now(admin: asyncpg.Connection, app: str) -> list[int]:
    """End every session named ``app`` without waiting (the loop goes on meanwhile); their
    pids."""
    rows = await admin.fetch(
        # In the select list, not the WHERE clause: run only on the rows the filter kept.
        "SELECT pid, pg_terminate_backend(pid) FROM pg_stat_activity "
        "WHERE application_name = $1 AND pid <> pg_backend_pid()",
        app,
    )
    return [r["pid"] for r in rows]


async def ended(admin: asyncpg.Connection, pids: Sequence[int]) -> None:
    """Until the server has ended the sessions ``pids`` (gone from pg_stat_activity)."""

    async def gone() -> bool:
        alive = "SELECT count(*) FROM pg_stat_activity WHERE pid = any($1::int[])"
        return not await admin.fetchval(alive, list(pids))

    await wait_until(gone, what="the end of the terminated sessions")


@pytest.fixture
def app() -> str:
    """An application_name of this test's own, to find its sessions in pg_stat_activity."""
    return f"flowlock-t-{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def admin(pg_url: str) -> AsyncIterator[asyncpg.Connection]:
    """A plain connection of the test's own, to end sessions and look at pg_stat_activity."""
    conn = await pg_budget.connect(pg_url)
    yield conn
    await conn.close()


@pytest.fixture
async def make_engine(pg_url: str, pg_schema: str, app: str) -> AsyncIterator[EngineFactory]:
    """Opens engines whose every pooled connection is open from the start (min_size =
    pool_size) and named ``app``; closes them at the end."""
    opened: list[flowlock.Engine] = []

    async def make(pool_size: int = 5, **options: Any) -> flowlock.Engine:
        store = PostgresStore(
            pg_url,
            schema=pg_schema,
            pool_size=pool_size,
            min_size=pool_size,
            application_name=app,
            lock_timeout=options.pop("lock_timeout", 5.0),
        )
        engine = await flowlock.Engine(store, **options).open()
        opened.append(engine)
        await engine.register(examples.countersign(QUORUM))
        return engine

    yield make
    for engine in opened:
        await engine.aclose()


async def sign(
    engine: flowlock.Engine, doc: str, actor: str, strategy: str
) -> flowlock.Outcome | BaseException:
    """One signature, its request id derived from the actor; the outcome or the error."""
    try:
        return await engine.fire(
            doc, "sign", actor=actor, request_id=f"req-{actor}", strategy=strategy
        )
    except Exception as exc:  # every one is asserted on by the caller
        return exc


async def verify(
    engine: flowlock.Engine, sql_history: SqlHistory, docs: dict[str, set[str]]
) -> None:
    """Each document holds exactly the expected signatures, each once: its data, the checker
    over its history (one applied transition per signature) and the rows counted with SQL."""
    histories = {}
    for doc, actors in docs.items():
        final = await engine.get(doc)
        signers = final.data.get("signers", [])
        assert sorted(signers) == sorted(actors), doc
        history = await engine.history(doc)
        verdict = check(final, history, expected_applied=len(actors), initial_state="pending")
        assert verdict.ok, verdict.violations
        histories[doc] = history
    counted = await sql_history()
    counted.assert_matches(histories)
    assert {doc: counted.rows.get(doc, 0) for doc in docs} == {d: len(a) for d, a in docs.items()}


async def settle(
    engine: flowlock.Engine, doc: str, actor: str, strategy: str, seen: list[BaseException]
) -> flowlock.Outcome:
    """Fire ``actor``'s signature with its one request id until it has an answer (a lost session
    or a lost race is retried: the request id makes that safe); every error on the way is kept
    in ``seen``."""
    for _ in range(200):
        outcome = await sign(engine, doc, actor, strategy)
        if isinstance(outcome, flowlock.Outcome):
            return outcome
        seen.append(outcome)
        if not isinstance(outcome, RETRYABLE):
            raise outcome
    raise AssertionError(f"{actor}'s signature never got an answer: {seen[-3:]}")


# -- the store -----------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_every_session_ended_then_twenty_calls_raise_typed_errors_and_recover(
    make_engine: EngineFactory,
    sql_history: SqlHistory,
    pg_url: str,
    app: str,
    strategy: str,
) -> None:
    """Every pooled session ended under the engine, then 20 signatures: the ones that fail raise
    ConnectionLost / OutcomeUnknown (never an asyncpg error), the pool is renewed, the later ones
    succeed, and retried with their request ids every signature is applied exactly once."""
    engine = await make_engine(pool_size=5)
    await engine.create("countersign", instance_id="doc")
    assert terminate_unnoticed(pg_url, app=app) == 5

    actors = [f"signer-{i}" for i in range(20)]
    outcomes = [await sign(engine, "doc", actor, strategy) for actor in actors]
    errors = [o for o in outcomes if isinstance(o, BaseException)]
    for error in errors:
        assert_typed(error, LOST)
    # The first call ran on a connection whose session had ended; the calls after it got fresh
    # ones: after one dead connection was found, the pool's others were replaced too.
    assert isinstance(outcomes[0], flowlock.ConnectionLost), outcomes[0]
    assert all(isinstance(o, flowlock.Outcome) and o.applied for o in outcomes[1:]), errors

    # A failed signature retried with its request id: applied now, or (OutcomeUnknown whose
    # write had committed) answered idempotently. Either way applied exactly once.
    for actor, outcome in zip(actors, outcomes, strict=True):
        if isinstance(outcome, BaseException):
            again = await sign(engine, "doc", actor, strategy)
            assert isinstance(again, flowlock.Outcome), again
            assert again.applied or isinstance(outcome, flowlock.OutcomeUnknown)
    await verify(engine, sql_history, {"doc": set(actors)})


@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_sessions_of_an_applications_pool_ended_then_calls_are_typed_and_recover(
    sql_history: SqlHistory, pg_url: str, pg_schema: str, app: str, strategy: str
) -> None:
    """The same on an application's own pool (pool=, each call in a transaction of flowlock's):
    the call on a dead connection raises ConnectionLost, never an asyncpg error; the connection
    is terminated rather than given back, the pool's others are replaced, and the calls after
    succeed on the same, still open, pool."""
    pool = await pg_budget.create_pool(
        pg_url, min_size=5, max_size=5, server_settings={"application_name": app}
    )
    try:
        async with flowlock.Engine.connect(pool=pool, schema=pg_schema) as engine:
            await engine.register(examples.countersign(QUORUM))
            await engine.create("countersign", instance_id="doc")
            assert terminate_unnoticed(pg_url, app=app) == 5
            actors = [f"signer-{i}" for i in range(10)]
            outcomes = [await sign(engine, "doc", actor, strategy) for actor in actors]
            assert isinstance(outcomes[0], flowlock.ConnectionLost), outcomes[0]
            assert_typed(outcomes[0], LOST)
            assert all(isinstance(o, flowlock.Outcome) and o.applied for o in outcomes[1:])
            again = await sign(engine, "doc", actors[0], strategy)
            assert isinstance(again, flowlock.Outcome) and again.applied
            await verify(engine, sql_history, {"doc": set(actors)})
        assert not pool.is_closing()
    finally:
        await pool.close()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_sessions_ended_while_calls_are_in_flight(
    make_engine: EngineFactory,
    sql_history: SqlHistory,
    admin: asyncpg.Connection,
    app: str,
    strategy: str,
) -> None:
    """24 tasks sign three documents while a background task keeps ending the engine's sessions:
    every error any call raised is a typed, retryable flowlock error; retried with their request
    ids, all 240 signatures are applied exactly once; and once the sessions are left alone,
    every call succeeds."""
    engine = await make_engine(
        pool_size=8, strategies=[flowlock.Optimistic(max_attempts=10, backoff_cap=0.05)]
    )
    docs = {f"doc-{d}": set[str]() for d in range(3)}
    for doc in docs:
        await engine.create("countersign", instance_id=doc)
    seen: list[BaseException] = []
    rng = random.Random(9)
    firing = asyncio.Event()
    terminated: list[int] = []

    async def signer(task: int) -> None:
        doc = f"doc-{task % 3}"
        for n in range(10):
            actor = f"t{task}-s{n}"
            docs[doc].add(actor)
            await settle(engine, doc, actor, strategy, seen)
            firing.set()

    async def terminator() -> None:
        # Paced fault injection (not ordering): end every session of the engine, let the pool
        # open new ones and the calls run on them, again, until the signers are done.
        await firing.wait()
        for _ in range(500):
            terminated.extend(await terminate_now(admin, app))
            await asyncio.sleep(rng.uniform(0.02, 0.1))

    chaos = asyncio.create_task(terminator())
    try:
        await asyncio.gather(*(signer(t) for t in range(24)))
    finally:
        chaos.cancel()
        await asyncio.gather(chaos, return_exceptions=True)

    assert terminated
    for error in seen:
        assert_typed(error, RETRYABLE)
    assert any(isinstance(e, LOST) for e in seen), "no call was caught by an ended session"
    # Left alone (the last sessions ended have ended), the pool recovers: every call succeeds
    # the first time.
    await ended(admin, terminated)
    for doc in docs:
        outcome = await sign(engine, doc, f"after-{doc}", strategy)
        assert isinstance(outcome, flowlock.Outcome) and outcome.applied, outcome
        docs[doc].add(f"after-{doc}")
    await verify(engine, sql_history, docs)


async def test_a_call_waiting_for_a_row_lock_whose_session_is_ended_is_connection_lost(
    make_engine: EngineFactory,
    sql_history: SqlHistory,
    admin: asyncpg.Connection,
    pg_url: str,
    pg_schema: str,
    app: str,
) -> None:
    """A pessimistic call queued for a row lock when its session is ended raises ConnectionLost
    (its transaction never reached COMMIT: nothing was written); the next call succeeds."""
    engine = await make_engine(pool_size=2, strategies=[flowlock.Pessimistic(lock_timeout=60)])
    await engine.create("countersign", instance_id="doc")
    holder = await pg_budget.connect(pg_url, server_settings={"search_path": pg_schema})
    try:
        tx = holder.transaction()
        await tx.start()
        await holder.execute("SELECT 1 FROM flowlock_instances WHERE id = 'doc' FOR UPDATE")
        call = asyncio.create_task(sign(engine, "doc", "alice", "pessimistic"))

        async def queued() -> bool:
            return bool(
                await admin.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 "
                    "AND wait_event_type = 'Lock'",
                    app,
                )
            )

        await wait_until(queued, what="the call queueing for the row lock")
        assert await terminate_now(admin, app)
        lost = await call
        assert type(lost) is flowlock.ConnectionLost, lost
        assert_typed(lost, (flowlock.ConnectionLost,))
        await tx.rollback()
    finally:
        await holder.close()
    outcome = await sign(engine, "doc", "alice", "pessimistic")
    assert isinstance(outcome, flowlock.Outcome) and outcome.applied, outcome
    await verify(engine, sql_history, {"doc": {"alice"}})


async def test_a_compare_and_swap_whose_session_is_ended_is_outcome_unknown(
    make_engine: EngineFactory,
    sql_history: SqlHistory,
    admin: asyncpg.Connection,
    pg_url: str,
    pg_schema: str,
    app: str,
) -> None:
    """An optimistic compare-and-swap (one autocommit statement) whose session is ended after it
    was sent raises OutcomeUnknown: flowlock cannot tell whether it committed. Retried with the
    same request id it is applied once (here it had not committed: the retry applies it)."""
    engine = await make_engine(pool_size=2, lock_timeout=60.0)
    await engine.create("countersign", instance_id="doc")
    holder = await pg_budget.connect(pg_url, server_settings={"search_path": pg_schema})
    try:
        tx = holder.transaction()
        await tx.start()
        # The read takes no lock; the compare-and-swap's UPDATE waits for this one.
        await holder.execute("SELECT 1 FROM flowlock_instances WHERE id = 'doc' FOR UPDATE")
        call = asyncio.create_task(sign(engine, "doc", "alice", "optimistic"))

        async def queued() -> bool:
            return bool(
                await admin.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 "
                    "AND wait_event_type = 'Lock'",
                    app,
                )
            )

        await wait_until(queued, what="the compare-and-swap queueing for the row lock")
        assert await terminate_now(admin, app)
        unknown = await call
        assert type(unknown) is flowlock.OutcomeUnknown, unknown
        assert_typed(unknown, (flowlock.OutcomeUnknown,))
        assert "same request_id" in str(unknown)
        await tx.rollback()
    finally:
        await holder.close()
    again = await sign(engine, "doc", "alice", "optimistic")
    assert isinstance(again, flowlock.Outcome) and again.applied, again
    await verify(engine, sql_history, {"doc": {"alice"}})


# -- the advisory locks --------------------------------------------------------------------------


@pytest.fixture
async def advisory(pg_url: str, pg_schema: str, app: str) -> AsyncIterator[AdvisoryLocks]:
    """An open advisory backend whose sessions are named ``app``."""
    locks = AdvisoryLocks(
        pg_url, schema=pg_schema, namespace=f"t_{uuid.uuid4().hex[:8]}", application_name=app
    )
    await locks.open()
    yield locks
    await locks.aclose()


async def holder_pid(admin: asyncpg.Connection, locks: AdvisoryLocks, key: str) -> int:
    held = [s.pid for s in await advisory_sessions(admin, locks.lock_id(key)) if s.granted]
    assert held, f"nobody holds {key!r}"
    return held[0]


@pytest.mark.parametrize("call", ["extend", "release"])
async def test_extend_and_release_after_the_lease_session_ended_unnoticed_are_not_owned(
    advisory: AdvisoryLocks, admin: asyncpg.Connection, pg_url: str, call: str
) -> None:
    """extend and release of a lease whose session was ended before asyncpg read the server's
    message raise LockNotOwned (raised from the typed session error), never asyncpg's
    InternalClientError; the backend then takes the key again."""
    for round_ in range(3):
        key = f"k{round_}"
        lease = await advisory.acquire(key, ttl=HELD)
        assert terminate_unnoticed(pg_url, pids=[await holder_pid(admin, advisory, key)]) == 1
        ending = advisory.extend(lease) if call == "extend" else advisory.release(lease)
        with pytest.raises(flowlock.LockNotOwned) as caught:
            await ending
        assert isinstance(caught.value.__cause__, flowlock.FlowlockError), caught.value.__cause__
        again = await advisory.acquire(key, ttl=HELD, wait=5)
        await advisory.release(again)


async def test_an_acquire_whose_session_is_ended_while_it_waits_is_lock_unavailable(
    advisory: AdvisoryLocks, admin: asyncpg.Connection
) -> None:
    """An acquire queued behind a holder whose own session is ended raises LockUnavailable (the
    server ended its session), never a driver error; later acquires work."""
    held = await advisory.acquire("k", ttl=HELD)
    waiting = asyncio.ensure_future(advisory.acquire("k", ttl=HELD, wait=HELD))
    queued: list[int] = []

    async def in_queue() -> bool:
        queued[:] = [
            s.pid for s in await advisory_sessions(admin, advisory.lock_id("k")) if not s.granted
        ]
        return bool(queued)

    await wait_until(in_queue, what="the acquire queueing for the lock")
    assert await admin.fetchval("SELECT pg_terminate_backend($1)", queued[0])
    with pytest.raises(flowlock.LockUnavailable) as caught:
        await waiting
    assert isinstance(caught.value.__cause__, DRIVER), caught.value.__cause__
    await advisory.release(held)
    lease = await advisory.acquire("k", ttl=HELD, wait=5)
    await advisory.release(lease)


async def test_acquires_after_every_session_ended_unnoticed_are_typed_then_recover(
    advisory: AdvisoryLocks, pg_url: str, app: str
) -> None:
    """Every session of the backend (lease and side pools) ended under it: the acquires that fail
    raise LockUnavailable, the dead connections are dropped, and within a few calls acquires
    succeed again, every one after that."""
    for n in range(3):  # connections in both pools
        lease = await advisory.acquire(f"warm-{n}", ttl=HELD)
        await advisory.release(lease)
    assert terminate_unnoticed(pg_url, app=app) >= 2
    results: list[object] = []
    for n in range(10):
        try:
            lease = await advisory.acquire(f"k{n}", ttl=HELD)
        except Exception as exc:  # every one is asserted on below
            results.append(exc)
        else:
            results.append(lease)
            await advisory.release(lease)
    failed = [r for r in results if isinstance(r, BaseException)]
    for error in failed:
        assert isinstance(error, flowlock.LockUnavailable), repr(error)
        assert isinstance(error.__cause__, DRIVER), error.__cause__
    assert len(failed) <= 3, failed
    assert all(not isinstance(r, BaseException) for r in results[len(failed) :]), results
