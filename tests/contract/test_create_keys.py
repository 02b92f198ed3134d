"""A create's request_id is an idempotency key, as an event's is (issue 22, item 7).

A retry under the key answers the first create (the instance as created, version 1) and makes no
second instance, also after the instance has moved on; the key with another id, workflow or data
raises CreateKeyReused (an IdempotencyKeyReused) and writes nothing. Every store; the concurrent
cases on PostgreSQL with creates that really overlap.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

import flowlock
import pg_budget
from flowlock._inspect import check_instances
from flowlock.checker import check
from flowlock.stores.postgres import PostgresStore


async def _count(engine: flowlock.Engine) -> int:
    return await engine.count()


async def test_a_retry_answers_the_first_create(engine: flowlock.Engine) -> None:
    """The same key, id, workflow and data (keys in another order) answers the instance as first
    created, equal to the first answer, and creates nothing."""
    first = await engine.create(
        "inventory", instance_id="sku", data={"stock": 10, "site": "a"}, request_id="k1"
    )
    again = await engine.create(
        "inventory", instance_id="sku", data={"site": "a", "stock": 10.0}, request_id="k1"
    )
    assert again == first
    assert (again.version, again.state, again.last_event) == (1, "open", None)
    assert again.updated_at == again.created_at
    assert await _count(engine) == 1
    assert await engine.history("sku") == []


async def test_a_retry_after_the_instance_moved_answers_it_as_created(
    engine: flowlock.Engine,
) -> None:
    """The instance moved to version 4: a retry still answers version 1, its first state and
    data, as an event's replay answers the state its first application left."""
    first = await engine.create("ticket", instance_id="r", data={"amount": 5}, request_id="c")
    await engine.fire("r", "close", request_id="e1")
    await engine.fire("r", "reopen", request_id="e2")
    await engine.fire("r", "close", request_id="e3")
    moved = await engine.get("r")
    assert (moved.version, moved.state) == (4, "closed")
    again = await engine.create("ticket", instance_id="r", data={"amount": 5}, request_id="c")
    assert again == first and again.version == 1 and again.state == "open"
    assert await engine.get("r") == moved
    assert len(await engine.history("r")) == 3
    report = await check_instances(engine, None)
    assert report.verdict.ok, report.verdict.violations


@pytest.mark.parametrize(
    ("change", "mismatch"),
    [
        ({"instance_id": "other"}, "instance_id"),
        ({"workflow": "ticket", "data": None}, "workflow"),
        ({"data": {"amount": 6}}, "data"),
        ({"data": None}, "data"),
    ],
)
async def test_the_key_with_another_create_is_refused(
    engine: flowlock.Engine, change: dict[str, Any], mismatch: str
) -> None:
    """Another id, workflow or data under a used key raises CreateKeyReused, an
    IdempotencyKeyReused and InvalidInput, naming what differs; nothing is written."""
    await engine.create("approval", instance_id="r", data={"amount": 5}, request_id="c")
    asked: dict[str, Any] = {"instance_id": "r", "data": {"amount": 5}, "workflow": "approval"}
    asked.update(change)
    workflow = asked.pop("workflow")
    with pytest.raises(flowlock.CreateKeyReused) as caught:
        await engine.create(workflow, request_id="c", **asked)
    reused = caught.value
    assert isinstance(reused, flowlock.IdempotencyKeyReused)
    assert isinstance(reused, flowlock.InvalidInput)
    assert (reused.request_id, reused.mismatch, reused.original_instance_id) == ("c", mismatch, "r")
    assert reused.original_workflow == "approval" and dict(reused.original_data) == {"amount": 5}
    assert "'c'" in str(reused) and "new request_id" in str(reused)
    assert await _count(engine) == 1
    with pytest.raises(flowlock.InstanceNotFound):
        await engine.get("other")


async def test_keys_and_ids_are_separate(engine: flowlock.Engine) -> None:
    """An id taken without a key is InstanceExists under a new key (the key is not recorded, so
    it stays free); a new key on a new id creates; a create without a key is as before."""
    await engine.create("ticket", instance_id="t")
    with pytest.raises(flowlock.InstanceExists):
        await engine.create("ticket", instance_id="t", request_id="k")
    made = await engine.create("ticket", instance_id="u", request_id="k")
    assert made.id == "u"
    with pytest.raises(flowlock.InstanceExists):
        await engine.create("ticket", instance_id="u")
    assert await engine.store.create_request("u") == ("k", made)
    assert await engine.store.create_request("t") is None


async def test_a_bad_key_is_refused_before_anything_is_written(engine: flowlock.Engine) -> None:
    """An empty or control-character key is InvalidInput, as fire's request_id is."""
    for bad in ("", "a\x00b", 7):
        with pytest.raises(flowlock.InvalidInput):
            await engine.create("ticket", instance_id="t", request_id=bad)  # type: ignore[arg-type]
    assert await _count(engine) == 0


async def test_concurrent_creates_under_one_key_make_one_instance(
    engine: flowlock.Engine,
) -> None:
    """Twenty creates under one key at once: one instance, every answer the same."""
    answers = await asyncio.gather(
        *(
            engine.create("approval", instance_id="r", data={"n": 1}, request_id="k")
            for _ in range(20)
        )
    )
    assert all(a == answers[0] for a in answers)
    assert await _count(engine) == 1
    inst = await engine.get("r")
    assert check(inst, await engine.history("r"), initial_state="pending").ok


async def test_the_checker_finds_a_history_that_does_not_start_where_the_create_did(
    pg_url: str, pg_schema: str
) -> None:
    """`flowlock check` reads the key's record: a first row that starts elsewhere, or data at
    version 1 that is not what the create made, is reported."""
    async with flowlock.Engine(PostgresStore(pg_url, schema=pg_schema)) as engine:
        await engine.register(flowlock.examples.approval())
        await engine.create("approval", instance_id="a", data={"x": 1}, request_id="ka")
        await engine.create("approval", instance_id="b", data={"x": 1}, request_id="kb")
        await engine.fire("b", "approve")
        assert (await check_instances(engine, None)).verdict.ok
        conn = await pg_budget.connect(pg_url, server_settings={"search_path": pg_schema})
        try:
            await conn.execute("UPDATE flowlock_create_requests SET data = '{\"x\": 2}'")
            await conn.execute(
                "UPDATE flowlock_create_requests SET state = 'approved' WHERE request_id = 'kb'"
            )
        finally:
            await conn.close()
        kinds = sorted(v.kind for v in (await check_instances(engine, None)).verdict.violations)
        assert kinds == ["broken-chain", "final-mismatch"]


# -- PostgreSQL: creates that really overlap ---------------------------------------------------


async def _waiting_on_locks(url: str, application_name: str, count: int) -> None:
    """Until `count` sessions of `application_name` wait for a lock (a bounded wait)."""
    conn = await pg_budget.connect(url)
    try:
        for _ in range(500):
            n = await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE application_name = $1 AND wait_event_type = 'Lock'",
                application_name,
            )
            if n >= count:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"{count} session(s) of {application_name} never waited for a lock")
    finally:
        await conn.close()


@pytest.mark.parametrize("other_id", [False, True], ids=["same-id", "other-id"])
async def test_creates_waiting_on_an_uncommitted_create_of_the_key_answer_it(
    pg_url: str, pg_schema: str, other_id: bool
) -> None:
    """A create under key K sits uncommitted in a caller's transaction; two creates under K
    from two other engines wait for it (seen in pg_stat_activity), then answer the first create
    once it commits (or, asking for another id, CreateKeyReused); one instance, its key once."""
    name = f"ck-{pg_schema}"
    first_engine = flowlock.Engine(PostgresStore(pg_url, schema=pg_schema))
    engines = [
        flowlock.Engine(PostgresStore(pg_url, schema=pg_schema, application_name=name))
        for _ in range(2)
    ]
    async with first_engine:
        for eng in (first_engine, *engines):
            await eng.open()
            await eng.register(flowlock.examples.approval())
        try:
            conn = await pg_budget.connect(pg_url)
            try:
                tx = conn.transaction()
                await tx.start()
                first = await first_engine.create(
                    "approval", instance_id="r", data={"a": 1}, request_id="K", connection=conn
                )
                ids = ["x", "y"] if other_id else ["r", "r"]
                racing = [
                    asyncio.create_task(
                        eng.create("approval", instance_id=i, data={"a": 1}, request_id="K")
                    )
                    for eng, i in zip(engines, ids, strict=True)
                ]
                await _waiting_on_locks(pg_url, name, 2)
                await tx.commit()
            finally:
                await conn.close()
            answers = await asyncio.gather(*racing, return_exceptions=True)
        finally:
            for eng in engines:
                await eng.aclose()
        if other_id:
            assert all(isinstance(a, flowlock.CreateKeyReused) for a in answers), answers
        else:
            committed = await first_engine.get("r")
            assert answers == [committed, committed]
            assert (first.id, first.version, dict(first.data)) == ("r", 1, {"a": 1})
        assert await first_engine.count() == 1
        assert (await check_instances(first_engine, None)).verdict.ok


async def test_a_create_under_a_key_that_rolls_back_leaves_the_key_free(
    pg_url: str, pg_schema: str
) -> None:
    """A waiting create under K goes on and creates when the first create under K rolls back."""
    name = f"ck-{pg_schema}"
    async with (
        flowlock.Engine(PostgresStore(pg_url, schema=pg_schema)) as first_engine,
        flowlock.Engine(PostgresStore(pg_url, schema=pg_schema, application_name=name)) as other,
    ):
        for eng in (first_engine, other):
            await eng.register(flowlock.examples.approval())
        conn = await pg_budget.connect(pg_url)
        try:
            tx = conn.transaction()
            await tx.start()
            await first_engine.create("approval", instance_id="r", request_id="K", connection=conn)
            racing = asyncio.create_task(other.create("approval", instance_id="s", request_id="K"))
            await _waiting_on_locks(pg_url, name, 1)
            await tx.rollback()
        finally:
            await conn.close()
        made = await racing
        assert made.id == "s"
        assert [i.id for i in await other.list()] == ["s"]
        assert await other.store.create_request("s") == ("K", made)


async def test_a_recorded_key_inside_a_callers_transaction_leaves_it_usable(
    pg_url: str, pg_schema: str
) -> None:
    """Inside a caller's transaction, a create under a recorded key with another id raises
    CreateKeyReused and undoes only its own statement: the caller's rows still commit."""
    async with flowlock.Engine(PostgresStore(pg_url, schema=pg_schema)) as engine:
        await engine.register(flowlock.examples.approval())
        await engine.create("approval", instance_id="r", request_id="K")
        conn = await pg_budget.connect(pg_url, server_settings={"search_path": pg_schema})
        try:
            await conn.execute("CREATE TABLE mine (n int)")
            async with conn.transaction():
                await conn.execute("INSERT INTO mine VALUES (1)")
                with pytest.raises(flowlock.CreateKeyReused):
                    await engine.create("approval", instance_id="s", request_id="K",
                                        connection=conn)  # fmt: skip
                again = await engine.create(
                    "approval", instance_id="r", request_id="K", connection=conn
                )
                assert again.version == 1
                await conn.execute("INSERT INTO mine VALUES (2)")
            assert await conn.fetchval("SELECT count(*) FROM mine") == 2
        finally:
            await conn.close()
        assert await engine.count() == 1


async def test_many_engines_racing_one_key_make_one_instance(
    pg_engine_factory: Callable[..., Any],
) -> None:
    """Three engines (three pools), ten creates each under one key, at once: one instance, thirty
    equal answers."""
    engines = [await pg_engine_factory() for _ in range(3)]
    answers = await asyncio.gather(
        *(
            eng.create("approval", instance_id="r", data={"n": 1}, request_id="K")
            for eng in engines
            for _ in range(10)
        )
    )
    assert all(a == answers[0] for a in answers)
    assert await engines[0].count() == 1
    assert (await check_instances(engines[0], None)).verdict.ok
