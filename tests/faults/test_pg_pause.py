"""A paused PostgreSQL (SIGSTOP: its connections stay open and nothing is answered) under every
kind of round trip flowlock makes on an open connection: a read, an optimistic and a pessimistic
fire, an advisory acquire, extend and release, a RunOnce run. Each call raises a typed
FlowlockError at its client-side bound (``command_timeout`` beyond the lock wait the server
bounds), not before it and not long after; the connection it was on is dropped from its pool;
and once the server is resumed the next call works and the history is exactly once.

One throwaway EmbeddedPostgres for the module (pausing the session's shared server would stall
every other test), a fresh schema per test. The bounds are short (1 s of lock wait, 1.5 s of
command_timeout) so that a test takes a few seconds; an answer may come ``LATE`` seconds after
its bound on a loaded machine, never before it.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import pytest

import flowlock
import pg_budget
from flowlock import Instance
from flowlock.checker import check
from flowlock.embedded import EmbeddedPostgres, available
from flowlock.jobs import JobContext
from flowlock.locks.advisory import AdvisoryLocks
from flowlock.stores.postgres import PostgresStore
from lock_probes import wait_until

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.slow,
    pytest.mark.skipif(not available(), reason='needs pip install "flowlock[embedded]"'),
]

LOCK = 1.0  # lock_timeout: the wait the server bounds
COMMAND = 1.5  # command_timeout: what the client allows a round trip beyond that wait
BOUND = LOCK + COMMAND  # a store statement's client-side bound
EARLY = 0.1  # timer slack: a call never ends more than this before its bound
LATE = 10.0  # how long after its bound a call may end on a loaded machine
RUN_ONCE_LOCK_WAIT = 5.0  # RunOnce's statements wait this long for a row lock, on the server


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedPostgres]:
    pg = EmbeddedPostgres(max_connections=50)
    pg.start()
    try:
        yield pg
    finally:
        pg.stop()


@pytest.fixture
def pg(server: EmbeddedPostgres) -> Iterator[EmbeddedPostgres]:
    """The module's server, never left paused by a test that failed."""
    yield server
    server.resume()


@pytest.fixture
def schema() -> str:
    return f"pause_{uuid.uuid4().hex[:10]}"


def switch(pause: Callable[[], None]) -> flowlock.Workflow:
    """off -> on; the first ``flip`` with ``{"pause": true}`` calls ``pause()`` from its
    effect, between the engine's read and its write: the write is the round trip the paused
    server never answers. (Only the first: a retry with the same payload runs as usual.)"""
    calls: list[None] = []

    def effect(inst: Instance, payload: Mapping[str, Any], actor: str | None) -> dict[str, Any]:
        if payload.get("pause") and not calls:
            calls.append(None)
            pause()
        return {"flipped_by": actor}

    return flowlock.Workflow(
        "switch",
        states=["off", "on"],
        initial="off",
        transitions=[
            flowlock.Transition("flip", source="off", target="on", effect=effect),
            flowlock.Transition("reset", source="on", target="off"),
        ],
    )


@asynccontextmanager
async def paused(pg: EmbeddedPostgres) -> AsyncIterator[None]:
    await asyncio.to_thread(pg.pause)
    try:
        yield
    finally:
        await asyncio.to_thread(pg.resume)


async def at_bound(
    call: Awaitable[object], bound: float, error: type[BaseException], *, late: float = LATE
) -> BaseException:
    """Await ``call``: it must raise ``error`` no earlier than ``bound`` seconds and within
    ``late`` seconds after it."""
    began = time.monotonic()
    with pytest.raises(error) as caught:
        await call
    took = time.monotonic() - began
    assert bound - EARLY <= took < bound + late, f"{error.__name__} after {took:.2f} s"
    assert isinstance(caught.value, flowlock.FlowlockError)
    return caught.value


async def by_bound(
    call: Awaitable[object], bound: float, error: type[BaseException], *, late: float = LATE
) -> BaseException:
    """Await ``call``: it must raise ``error`` within ``late`` seconds after ``bound``."""
    began = time.monotonic()
    with pytest.raises(error) as caught:
        await call
    took = time.monotonic() - began
    assert took < bound + late, f"{error.__name__} after {took:.2f} s"
    assert isinstance(caught.value, flowlock.FlowlockError)
    return caught.value


def timed_out(exc: BaseException) -> bool:
    """Whether the driver's error under ``exc`` is asyncpg's client-side timeout."""
    seen: BaseException | None = exc
    while seen is not None and not isinstance(seen, TimeoutError):
        seen = seen.__cause__
    return seen is not None


async def gone(url: str, pid: int) -> bool:
    """Whether the server session ``pid`` has ended (the server saw its socket close)."""
    conn = await pg_budget.connect(url, timeout=10)
    try:
        found = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid, timeout=10
        )
    finally:
        await conn.close(timeout=10)
    return bool(found == 0)


async def pid_of(pool: asyncpg.Pool) -> int:
    """The server pid of ``pool``'s one connection (no round trip: asyncpg knows it)."""
    async with pool.acquire(timeout=10) as conn:
        return conn.get_server_pid()


def store_of(engine: flowlock.Engine) -> PostgresStore:
    store = engine.store
    assert isinstance(store, PostgresStore)
    return store


async def assert_clean(engine: flowlock.Engine, instance_id: str, applied: int) -> None:
    inst = await engine.get(instance_id)
    verdict = check(inst, await engine.history(instance_id), expected_applied=applied)
    assert verdict.ok, verdict


@pytest.mark.parametrize("own_pool", [True, False], ids=["flowlocks-pool", "applications-pool"])
async def test_a_read_on_a_paused_server_is_connection_lost_at_its_bound(
    pg: EmbeddedPostgres, schema: str, own_pool: bool
) -> None:
    """engine.get on an open connection to a paused server: ConnectionLost (from asyncpg's
    TimeoutError) at lock_timeout + command_timeout, on flowlock's pool and on an application's
    pool alike; the connection is dropped; after resume the next get works."""
    app_pool = None
    if own_pool:
        engine = flowlock.Engine.connect(
            pg.url, schema=schema, max_size=1, lock_timeout=LOCK, command_timeout=COMMAND
        )
    else:
        # asyncpg's defaults: no command_timeout of its own, so only flowlock's timeout= holds.
        async with flowlock.Engine.connect(pg.url, schema=schema):
            pass  # migrated
        app_pool = await pg_budget.create_pool(
            pg.url, min_size=1, max_size=1, server_settings={"search_path": schema}
        )
        engine = flowlock.Engine.connect(pool=app_pool, lock_timeout=LOCK, command_timeout=COMMAND)
    try:
        async with engine:
            await engine.register(switch(pg.pause))
            await engine.create("switch", instance_id="s", data={})
            pool = store_of(engine).pool
            before = await pid_of(pool)
            async with paused(pg):
                lost = await at_bound(engine.get("s"), BOUND, flowlock.ConnectionLost)
                assert timed_out(lost) and "command_timeout" in str(lost)
                assert pool.get_size() == 0  # terminated, not given back
            await wait_until(lambda: gone(pg.url, before), what="the old session to end")
            assert (await engine.get("s")).state == "off"
            assert await pid_of(pool) != before
            await assert_clean(engine, "s", 0)
    finally:
        if app_pool is not None:
            await app_pool.close()


@pytest.mark.parametrize("strategy", ["optimistic", "pessimistic"])
async def test_a_write_sent_to_a_paused_server_fails_typed_at_its_bound(
    pg: EmbeddedPostgres, schema: str, strategy: str
) -> None:
    """The server is paused between the engine's read and its write (from the step's effect):
    the optimistic compare-and-swap, one autocommit statement that may commit once the server
    runs again, is OutcomeUnknown; the pessimistic write, in a transaction whose COMMIT was
    never sent, is ConnectionLost. Both at their bound, the connection dropped; the retry with
    the same request_id after resume applies once in all (the checker agrees)."""
    async with flowlock.Engine.connect(
        pg.url, schema=schema, max_size=1, lock_timeout=LOCK, command_timeout=COMMAND
    ) as engine:
        await engine.register(switch(pg.pause))
        await engine.create("switch", instance_id="s", data={})
        pool = store_of(engine).pool
        before = await pid_of(pool)
        expected = flowlock.OutcomeUnknown if strategy == "optimistic" else flowlock.ConnectionLost
        try:
            failed = await at_bound(
                engine.fire(
                    "s", "flip", actor="a", request_id="r1", payload={"pause": True},
                    strategy=strategy,
                ),
                BOUND,
                expected,
            )  # fmt: skip
            assert timed_out(failed)
            assert pool.get_size() == 0
        finally:
            await asyncio.to_thread(pg.resume)
        await wait_until(lambda: gone(pg.url, before), what="the old session to end")
        retry = await engine.fire(
            "s", "flip", actor="a", request_id="r1", payload={"pause": True}, strategy=strategy
        )
        if strategy == "pessimistic":
            # Nothing was committed: the server rolled the transaction back with the session.
            assert retry.applied and not retry.idempotent
        else:
            assert retry.applied != retry.idempotent
        await assert_clean(engine, "s", 1)


async def test_a_pessimistic_fire_waiting_for_a_row_lock_when_the_server_pauses(
    pg: EmbeddedPostgres, schema: str
) -> None:
    """A pessimistic fire waits for a row lock another session holds; the server pauses
    meanwhile, so its own lock_timeout never fires: the client ends the call at the
    strategy's lock_timeout + command_timeout (ConnectionLost: no COMMIT was sent), the
    connection dropped; after resume the holder lets go and the fire applies once."""
    async with flowlock.Engine.connect(
        pg.url, schema=schema, max_size=1, lock_timeout=LOCK, command_timeout=COMMAND
    ) as engine:
        await engine.register(switch(pg.pause))
        await engine.create("switch", instance_id="s", data={})
        pool = store_of(engine).pool
        before = await pid_of(pool)
        holder = await pg_budget.connect(pg.url, timeout=10)
        try:
            await holder.execute("BEGIN")
            await holder.execute(
                f"SELECT 1 FROM \"{schema}\".flowlock_instances WHERE id = 's' FOR UPDATE"
            )
            began = time.monotonic()
            call = asyncio.ensure_future(
                engine.fire("s", "flip", actor="a", request_id="r1", strategy="pessimistic")
            )
            await asyncio.sleep(LOCK / 4)  # the FOR UPDATE is waiting on the server
            async with paused(pg):
                with pytest.raises(flowlock.ConnectionLost) as caught:
                    await call
                took = time.monotonic() - began
                assert BOUND - EARLY <= took < BOUND + LATE, took
                assert timed_out(caught.value)
                assert pool.get_size() == 0
            await holder.execute("ROLLBACK")
        finally:
            await holder.close(timeout=10)
        await wait_until(lambda: gone(pg.url, before), what="the old session to end")
        retry = await engine.fire("s", "flip", actor="a", request_id="r1", strategy="pessimistic")
        assert retry.applied and not retry.idempotent
        await assert_clean(engine, "s", 1)


async def test_advisory_lock_calls_on_a_paused_server_fail_typed_at_io_timeout(
    pg: EmbeddedPostgres, schema: str
) -> None:
    """locks="advisory" with command_timeout: the backend's round trips are bounded by it.
    On a paused server an acquire is LockUnavailable, an extend and a release LockNotOwned (the
    lease's session is terminated, so its lock is freed once the server runs), a distributed
    fire LockUnavailable; each at command_timeout. After resume the same key is free, the
    calls work, and the history is exactly once."""
    async with flowlock.Engine.connect(
        pg.url,
        schema=schema,
        locks="advisory",
        lock_timeout=LOCK,
        command_timeout=COMMAND,
    ) as engine:
        locks = engine.locks
        assert isinstance(locks, AdvisoryLocks)
        await engine.register(switch(pg.pause))
        await engine.create("switch", instance_id="s", data={})
        extended = await locks.acquire("k-extend", ttl=30)
        released = await locks.acquire("k-release", ttl=30)
        async with paused(pg):
            await at_bound(locks.acquire("k-acquire", ttl=30), COMMAND, flowlock.LockUnavailable)
            # Leases share holder sessions (bulk): the acquire's timeout may have ended the
            # session these two are on, and then they are LockNotOwned at once, never later.
            await by_bound(locks.extend(extended), COMMAND, flowlock.LockNotOwned)
            await by_bound(locks.release(released), COMMAND, flowlock.LockNotOwned)
            await at_bound(
                engine.fire("s", "flip", actor="a", request_id="r1", strategy="distributed"),
                COMMAND,
                flowlock.LockUnavailable,
            )
        for key in ("k-acquire", "k-extend", "k-release"):
            await wait_until(functools.partial(_free, locks, key), what=f"{key} to be free")
            lease = await locks.acquire(key, ttl=30)  # wait=0: LockBusy if anything held it
            await locks.release(lease)
        out = await engine.fire("s", "flip", actor="a", request_id="r1", strategy="distributed")
        assert out.applied
        await assert_clean(engine, "s", 1)


async def _free(locks: AdvisoryLocks, key: str) -> bool:
    return not await locks.locked(key)


async def test_run_once_on_a_paused_server_fails_typed_at_its_bound_and_the_tick_is_done_once(
    pg: EmbeddedPostgres, schema: str
) -> None:
    """The server pauses while a RunOnce job runs (from inside the job): recording the tick as
    done is OutcomeUnknown at RunOnce's lock wait + command_timeout, and the lease's release,
    on the same paused server, gives up at its io_timeout. After resume the next run of the
    tick either finds it done or takes it over and finishes it: one row, done."""
    async with (
        AdvisoryLocks(pg.url, schema=schema, io_timeout=COMMAND) as locks,
        flowlock.RunOnce(locks, pg.url, schema=schema, command_timeout=COMMAND) as runner,
    ):
        runs: list[int] = []

        async def job(ctx: JobContext) -> int:
            runs.append(ctx.fencing)
            if len(runs) == 1:
                await asyncio.to_thread(pg.pause)
            return len(runs)

        bound = RUN_ONCE_LOCK_WAIT + COMMAND
        try:
            failed = await at_bound(
                runner.run("nightly", "t1", job),
                bound,
                flowlock.OutcomeUnknown,
                late=COMMAND + LATE,  # and the release's io_timeout after it
            )
            assert timed_out(failed)
        finally:
            await asyncio.to_thread(pg.resume)
        after = await runner.run("nightly", "t1", job)
        assert after.status in ("done_elsewhere", "took_over"), after
        conn = await pg_budget.connect(pg.url, timeout=10)
        try:
            rows = await conn.fetch(
                f'SELECT state FROM "{schema}".flowlock_job_runs WHERE job = $1',
                "nightly",
                timeout=10,
            )
        finally:
            await conn.close(timeout=10)
        assert [r["state"] for r in rows] == ["done"]
        assert len(runs) == (2 if after.status == "took_over" else 1)


async def test_a_fencing_epoch_bump_on_a_paused_server_is_lock_unavailable_at_its_bound(
    pg: EmbeddedPostgres, schema: str
) -> None:
    """The Redis backend's fencing epochs, in PostgreSQL: a bump on a paused server raises
    LockUnavailable at the caller's bound, the connection (which may hold the epoch's
    session-level lock) terminated; after resume the next bump takes the epoch after the
    last committed one, never the same again."""
    async with flowlock.Engine.connect(
        pg.url, schema=schema, max_size=1, lock_timeout=LOCK, command_timeout=COMMAND
    ) as engine:
        store = store_of(engine)
        epochs = store.fence_epochs
        async with epochs.advance("ns", "k", at_least=0, bound=COMMAND) as first:
            pass
        before = await pid_of(store.pool)

        async def bump() -> None:
            async with epochs.advance("ns", "k", at_least=0, bound=COMMAND):
                pass

        async with paused(pg):
            failed = await at_bound(bump(), COMMAND, flowlock.LockUnavailable)
            assert timed_out(failed)
            assert store.pool.get_size() == 0
        await wait_until(lambda: gone(pg.url, before), what="the old session to end")
        async with epochs.advance("ns", "k", at_least=0, bound=COMMAND) as after:
            # The paused bump may have committed once the server ran again (first + 1), or not.
            assert after in (first + 1, first + 2)


async def test_closing_an_engine_whose_server_is_paused_is_bounded(
    pg: EmbeddedPostgres, schema: str
) -> None:
    """aclose() says goodbye to each idle connection and waits for the server to hang up: on a
    paused server that wait ends at the round trip's bound instead of never."""
    engine = flowlock.Engine.connect(
        pg.url, schema=schema, min_size=3, lock_timeout=LOCK, command_timeout=COMMAND
    )
    await engine.open()
    async with paused(pg):
        began = time.monotonic()
        await engine.aclose()
        assert time.monotonic() - began < BOUND + LATE
    assert engine.closed
