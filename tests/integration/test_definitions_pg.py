"""Every PostgreSQL write path stamps the definition version: the caller's transaction
(connection=), a batch of calls on one instance (one compare-and-swap of k rows), and the
pipeline's statement over many instances."""

from __future__ import annotations

import asyncio

import pytest

import flowlock
import pg_budget
from flowlock.checker import check


def counter() -> flowlock.Workflow:
    """One state, a transition that keeps it (so many calls apply), and one that leaves it."""

    def bump(inst: flowlock.Instance, payload: object, actor: str | None) -> dict[str, int]:
        return {"n": int(inst.data.get("n", 0)) + 1}

    return flowlock.Workflow(
        "counter",
        states=["open", "shut"],
        initial="open",
        policy="inventory",
        transitions=[
            flowlock.Transition("bump", source="open", target="open", effect=bump),
            flowlock.Transition("shut", source="open", target="shut"),
        ],
    )


@pytest.mark.parametrize("strategy", ["optimistic", "pessimistic"])
async def test_the_callers_transaction_stamps_the_version(
    pg_url: str, pg_schema: str, strategy: str
) -> None:
    """create and fire with connection= pin and stamp the version like any call."""
    async with flowlock.connect(pg_url, schema=pg_schema) as engine:
        await engine.register(counter())
        conn = await pg_budget.connect(pg_url)
        try:
            async with conn.transaction():
                made = await engine.create("counter", instance_id="a", connection=conn)
                assert made.definition_version == 1
                fired = await engine.fire("a", "bump", strategy=strategy, connection=conn)
                assert fired.instance.definition_version == 1
        finally:
            await conn.close()
        assert (await engine.get("a")).definition_version == 1
        assert [e.definition_version for e in await engine.history("a")] == [1]


async def test_batches_and_the_pipeline_stamp_every_row(pg_url: str, pg_schema: str) -> None:
    """Concurrent calls on one instance (batched) and on many (pipelined) write the version on
    every history row and on the instance; the checker passes."""
    async with flowlock.connect(pg_url, schema=pg_schema, max_size=4) as engine:
        assert await engine.register(counter()) == 1
        ids = [f"i{n}" for n in range(8)]
        for iid in ids:
            await engine.create("counter", instance_id=iid)
        outcomes = await asyncio.gather(
            *(engine.fire(iid, "bump") for iid in ids for _ in range(6))
        )
        assert all(o.applied for o in outcomes)
        assert max(o.batch_size for o in outcomes) > 1  # some calls were written together
        for iid in ids:
            rows = await engine.history(iid)
            assert [e.definition_version for e in rows] == [1] * 6
            inst = await engine.get(iid)
            assert (inst.definition_version, inst.data["n"]) == (1, 6)
            assert check(inst, rows, initial_state="open", expected_applied=6)


async def test_an_open_that_cannot_store_the_early_registers_closes_again(
    pg_url: str, pg_schema: str
) -> None:
    """A workflow registered before open() is stored by open(); when that fails (no tables),
    open raises MigrationError and leaves the engine closed, and a later open stores it."""
    from flowlock.stores.postgres import PostgresStore

    engine = flowlock.Engine(PostgresStore(pg_url, schema=pg_schema, auto_migrate=False))
    assert await engine.register(counter()) == 0
    with pytest.raises(flowlock.MigrationError, match="flowlock db migrate"):
        await engine.open()
    assert engine.closed
    async with flowlock.connect(pg_url, schema=pg_schema):  # migrates the schema
        pass
    async with engine:
        assert [v.version for v in await engine.definitions()] == [1]
