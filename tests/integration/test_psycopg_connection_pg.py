"""`connection=` with psycopg 3 on real PostgreSQL: a blocking `psycopg.Connection` on the sync
engine, a `psycopg.AsyncConnection` on the async one. The store's caller-transaction code runs
over them unchanged (flowlock._pg.borrowed), so what it reads back and the errors it reads must
be those of asyncpg: a create key met again, a duplicate request id in two transactions, a
row lock that stays held past the bound, timers armed and messages emitted in the caller's
commit, the data and payloads read back as objects, and the times in UTC whatever the session's
time zone."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from datetime import UTC, timedelta
from typing import Any

import psycopg
import pytest

import flowlock
import flowlock.sync
from flowlock.checker import check

pytestmark = pytest.mark.postgres


def _emit(inst: flowlock.Instance, payload: Mapping[str, Any], actor: str | None) -> list[Any]:
    return [flowlock.Emit("shipped", {"id": inst.id, "by": actor})]


def _order() -> flowlock.Workflow:
    return flowlock.Workflow(
        "order",
        states=["new", "paid", "shipped", "late"],
        initial="new",
        transitions=[
            flowlock.Transition("pay", source="new", target="paid"),
            flowlock.Transition("ship", source="paid", target="shipped", emit=_emit),
            # Armed when "paid" is entered: by the caller's commit, or not at all.
            flowlock.Transition("overdue", source="paid", target="late", after=timedelta(hours=1)),
        ],
    )


@pytest.fixture
def engine(pg_url: str, pg_schema: str) -> Iterator[flowlock.sync.Engine]:
    with flowlock.sync.Engine.connect(pg_url, schema=pg_schema, max_size=6) as eng:
        eng.register(_order())
        eng.register(flowlock.examples.approval())
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(f'CREATE TABLE "{pg_schema}".orders (id text PRIMARY KEY)')
        yield eng


def _connect(pg_url: str, schema: str) -> psycopg.Connection[Any]:
    """The application's connection: its own time zone, flowlock's schema not on its path."""
    conn = psycopg.connect(pg_url, options="-c timezone=America/New_York")
    conn.execute(f'SET search_path = "{schema}", public')
    conn.commit()
    return conn


def test_timers_messages_data_and_times_commit_with_the_callers_row(
    engine: flowlock.sync.Engine, pg_url: str, pg_schema: str
) -> None:
    with _connect(pg_url, pg_schema) as conn:
        with conn.transaction():
            conn.execute("INSERT INTO orders VALUES ('o-1')")
            made = engine.create(
                "order", instance_id="o-1", data={"items": [1, 2], "note": "ü"}, connection=conn
            )
            paid = engine.fire("o-1", "pay", payload={"card": "x"}, connection=conn)
            shipped = engine.fire("o-1", "ship", actor="ann", connection=conn, request_id="s")
            again = engine.fire("o-1", "ship", actor="ann", connection=conn, request_id="s")
        assert made.data == {"items": [1, 2], "note": "ü"}
        assert paid.applied and shipped.applied and again.replayed
        assert shipped.instance.updated_at is not None
        assert shipped.instance.updated_at.tzinfo == UTC
        with conn.transaction():
            conn.execute("INSERT INTO orders VALUES ('o-2')")
            engine.create("order", instance_id="o-2", connection=conn)
            engine.fire("o-2", "pay", connection=conn)  # arms "overdue" in this commit
    [message] = engine.messages("o-1")
    assert (message.kind, dict(message.payload)) == ("shipped", {"id": "o-1", "by": "ann"})
    assert [h.payload for h in engine.history("o-1")] == [{"card": "x"}, {}]
    assert engine.timers("o-1") == []  # left "paid": its timer went with it
    assert [t.event for t in engine.timers("o-2")] == ["overdue"]


def test_a_rollback_leaves_no_timer_message_nor_row(
    engine: flowlock.sync.Engine, pg_url: str, pg_schema: str
) -> None:
    engine.create("order", instance_id="r-1")

    def undone(conn: psycopg.Connection[Any]) -> None:
        with conn.transaction():
            conn.execute("INSERT INTO orders VALUES ('r-1')")
            engine.fire("r-1", "pay", connection=conn)
            raise RuntimeError("undo")

    with _connect(pg_url, pg_schema) as conn:
        with pytest.raises(RuntimeError):
            undone(conn)
        assert conn.execute("SELECT count(*) FROM orders").fetchone() == (0,)
    assert engine.get("r-1").state == "new"
    assert engine.timers("r-1") == [] and engine.history("r-1") == []


def test_a_create_key_met_again_answers_the_first_create(
    engine: flowlock.sync.Engine, pg_url: str, pg_schema: str
) -> None:
    with _connect(pg_url, pg_schema) as conn:
        with conn.transaction():
            first = engine.create("order", instance_id="k-1", request_id="ck", connection=conn)
        with conn.transaction():
            # The key's INSERT fails on its constraint (read from psycopg's error) in a savepoint:
            # the create answers the first one and the caller's transaction goes on.
            again = engine.create("order", instance_id="k-1", request_id="ck", connection=conn)
            conn.execute("INSERT INTO orders VALUES ('k-1')")
            with pytest.raises(flowlock.InstanceExists):
                engine.create("order", instance_id="k-1", connection=conn)
            conn.execute("INSERT INTO orders VALUES ('k-2')")
        assert conn.execute("SELECT count(*) FROM orders").fetchone() == (2,)
    assert again == first


def test_one_request_id_in_two_transactions_applies_once(
    engine: flowlock.sync.Engine, pg_url: str, pg_schema: str
) -> None:
    engine.create("approval", instance_id="d-1")
    with _connect(pg_url, pg_schema) as first, _connect(pg_url, pg_schema) as second:
        with first.transaction():
            assert engine.fire("d-1", "approve", request_id="same", connection=first).applied
            answers: list[Any] = []

            def duplicate() -> None:
                try:
                    with second.transaction():
                        answers.append(
                            engine.fire("d-1", "approve", request_id="same", connection=second)
                        )
                except Exception as exc:  # reported below
                    answers.append(exc)

            waiter = threading.Thread(target=duplicate)
            waiter.start()
            time.sleep(0.5)  # it waits on the history row the first transaction inserted
            assert not answers
        waiter.join(30)
    [answer] = answers
    # After the first committed, the second's insert hit the request id's unique index (the
    # psycopg error read as asyncpg's); it then answers as a replay, or as a lost race.
    if isinstance(answer, flowlock.Outcome):
        assert not answer.applied and answer.replayed
    else:
        assert isinstance(answer, flowlock.ConflictRetriesExhausted), answer
    assert len(engine.history("d-1")) == 1
    verdict = check(engine.get("d-1"), engine.history("d-1"), initial_state="pending",
                    expected_applied=1)  # fmt: skip
    assert verdict.ok, verdict.violations


def test_a_row_lock_held_past_the_bound_is_a_lock_timeout(
    engine: flowlock.sync.Engine, pg_url: str, pg_schema: str
) -> None:
    engine.create("approval", instance_id="l-1")
    slow = flowlock.Pessimistic(lock_timeout=0.3)
    with _connect(pg_url, pg_schema) as holder, _connect(pg_url, pg_schema) as other:
        with holder.transaction():
            engine.fire("l-1", "approve", strategy="pessimistic", connection=holder)
            with other.transaction():
                started = time.monotonic()
                with pytest.raises(flowlock.LockTimeout):
                    engine.fire("l-1", "reject", strategy=slow, connection=other)
                assert time.monotonic() - started < 5
                # flowlock's part undone, the caller's transaction usable, its settings back.
                assert other.execute("SHOW lock_timeout").fetchone() == ("0",)
                other.execute("INSERT INTO orders VALUES ('l-1')")
        assert other.execute("SELECT count(*) FROM orders").fetchone() == (1,)
    assert engine.get("l-1").state == "approved"


async def test_the_async_engine_takes_a_psycopg_async_connection(
    pg_url: str, pg_schema: str
) -> None:
    async with flowlock.Engine.connect(pg_url, schema=pg_schema) as eng:
        await eng.register(flowlock.examples.approval())
        async with await psycopg.AsyncConnection.connect(pg_url) as conn:
            await conn.execute(f'CREATE TABLE "{pg_schema}".notes (id text)')
            await conn.commit()
            async with conn.transaction():
                await eng.create("approval", instance_id="a-1", connection=conn)
                await conn.execute(f"INSERT INTO \"{pg_schema}\".notes VALUES ('a-1')")
            try:
                async with conn.transaction():
                    await eng.fire("a-1", "approve", connection=conn)
                    raise RuntimeError("undo")
            except RuntimeError:
                pass
            await conn.set_autocommit(True)
            with pytest.raises(flowlock.InvalidInput, match="open transaction"):
                await eng.fire("a-1", "approve", connection=conn)
        assert (await eng.get("a-1")).state == "pending"
        assert await eng.history("a-1") == []


async def test_a_statement_past_its_bound_is_cancelled_on_the_server(pg_url: str) -> None:
    """What the store's bounds rely on: a statement that outlives its timeout raises
    TimeoutError, as asyncpg's would, and is cancelled on the server rather than left running
    on the caller's connection."""
    import asyncpg

    from flowlock._pg.borrowed import ThreadedPsycopg

    with psycopg.connect(pg_url) as conn:
        borrowed = ThreadedPsycopg(conn)
        try:
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                await borrowed.fetchval("SELECT pg_sleep(30)", timeout=0.3)
            assert time.monotonic() - started < 5
            # Cancelled: the transaction failed with it, the connection is idle, not busy.
            assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR
            conn.rollback()
            await borrowed.execute("CREATE TEMP TABLE t (k int PRIMARY KEY)")
            await borrowed.execute("INSERT INTO t VALUES ($1)", 1)
            with pytest.raises(asyncpg.UniqueViolationError) as caught:
                await borrowed.execute("INSERT INTO t VALUES ($1)", 1)
            assert caught.value.constraint_name == "t_pkey"
            assert caught.value.sqlstate == "23505"
        finally:
            borrowed.close()


async def test_an_async_statement_past_its_bound_is_cancelled_too(pg_url: str) -> None:
    from flowlock._pg.borrowed import AsyncPsycopg

    async with await psycopg.AsyncConnection.connect(pg_url) as conn:
        borrowed = AsyncPsycopg(conn)
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await borrowed.fetchval("SELECT pg_sleep(30)", timeout=0.3)
        assert time.monotonic() - started < 5
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR
        await conn.rollback()
        assert await borrowed.fetchval("SELECT 41 + $1", 1, timeout=5) == 42
