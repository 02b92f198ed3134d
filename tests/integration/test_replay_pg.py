"""The replay check's PostgreSQL side: a create inside the application's transaction keeps its
initial data too, and an instance created before migration 016 (initial_data NULL) replays from
its first row, counted as `unreplayed_first`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest

import flowlock
import pg_budget
from flowlock import Transition, Workflow
from flowlock.stores.postgres import PostgresStore

pytestmark = pytest.mark.postgres


def _doc(step: int) -> Workflow:
    def effect(inst: flowlock.Instance, payload: Mapping[str, Any], actor: str | None) -> Any:
        return {**inst.data, "n": int(inst.data.get("n", 0)) + step}

    return Workflow(
        "doc",
        states=["a", "b", "c"],
        initial="a",
        transitions=[
            Transition("go", source="a", target="b", effect=effect),
            Transition("on", source="b", target="c", effect=effect),
        ],
    )


@pytest.fixture
async def engine(pg_url: str, pg_schema: str) -> AsyncIterator[flowlock.Engine]:
    async with flowlock.Engine(PostgresStore(pg_url, schema=pg_schema, pool_size=2)) as eng:
        await eng.register(_doc(1))
        yield eng


async def test_a_create_in_the_callers_transaction_keeps_its_initial_data(
    engine: flowlock.Engine, pg_url: str
) -> None:
    """create(connection=conn) writes initial_data in the caller's transaction, like any create."""
    conn = await pg_budget.connect(pg_url)
    try:
        async with conn.transaction():
            await engine.create("doc", instance_id="tx", data={"n": 5}, connection=conn)
    finally:
        await conn.close()
    await engine.fire("tx", "go")
    report = await engine.check_definition(_doc(1))
    assert report.ok and (report.checked_transitions, report.unreplayed_first) == (1, 0)
    changed = await engine.check_definition(_doc(2))
    [found] = changed.divergences
    assert (found.kind, found.expected, found.found) == ("data", {"n": 6}, {"n": 7})


async def test_an_instance_created_before_016_replays_from_its_first_row(
    engine: flowlock.Engine, pg_url: str, pg_schema: str
) -> None:
    """initial_data NULL: the first row is taken as recorded, the later ones are replayed."""
    await engine.create("doc", instance_id="old", data={"n": 0})
    await engine.fire("old", "go")
    await engine.fire("old", "on")
    conn = await pg_budget.connect(pg_url)
    try:
        await conn.execute(f'UPDATE "{pg_schema}".flowlock_instances SET initial_data = NULL')
    finally:
        await conn.close()
    report = await engine.check_definition(_doc(2))
    assert (report.unreplayed_first, report.checked_transitions) == (1, 1)
    assert [(d.version, d.kind) for d in report.divergences] == [(3, "data")]
