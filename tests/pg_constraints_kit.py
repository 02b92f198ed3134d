"""What the PostgreSQL constraint tests share: the workflows (reviews with a capacity and a
rate limit, subscriptions unique per customer), engines on the test's schema, and the test's own
SQL over the constraint tables."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

import asyncpg

import flowlock
import pg_budget
from flowlock.core.models import Instance
from flowlock.stores.postgres import PostgresStore

KIND = "review.in_review"
BOUND = 10.0  # seconds any single wait of these tests may take on a loaded machine


def review(limit: int = 2) -> flowlock.Workflow:
    """Reviews: at most `limit` in review per reviewer (data["r"]); `reassign` moves one to
    another reviewer (payload["to"]) without leaving the state; `ping` is rate limited to 2
    per minute per reviewer."""

    def to(inst: Instance, payload: Any, actor: str | None) -> dict[str, Any]:
        return {**inst.data, "r": payload["to"]}

    in_review = flowlock.State(
        "in_review", capacity=flowlock.Capacity(key=lambda i: i.data["r"], limit=limit)
    )
    return flowlock.Workflow(
        "review",
        states=["open", in_review, "done"],
        initial="open",
        transitions=[
            flowlock.Transition("start", source="open", target="in_review"),
            flowlock.Transition("finish", source="in_review", target="done"),
            flowlock.Transition("reassign", source="in_review", target="in_review", effect=to),
            flowlock.Transition(
                "ping",
                source="open",
                target="open",
                rate=flowlock.Rate(key=lambda i: i.data["r"], per=timedelta(minutes=1), limit=2),
            ),
        ],
    )


def subscription() -> flowlock.Workflow:
    """One active subscription per customer (data["c"])."""
    return flowlock.Workflow(
        "sub",
        states=["active", "ended"],
        initial="active",
        transitions=[flowlock.Transition("end", source="active", target="ended")],
        unique=flowlock.Unique(key=lambda i: i.data["c"], states=["active"]),
    )


class Sql:
    """The test's own reads of the constraint tables (plain SQL, one connection)."""

    def __init__(self, conn: asyncpg.Connection, schema: str) -> None:
        self.conn, self.schema = conn, schema

    async def val(self, sql: str, *args: Any) -> Any:
        return await self.conn.fetchval(sql.replace("{s}", f'"{self.schema}"'), *args)

    async def holders(self, key: str, kind: str = KIND) -> list[str]:
        rows = await self.conn.fetch(
            f'SELECT instance_id FROM "{self.schema}".flowlock_slots '
            "WHERE kind = $1 AND key = $2 ORDER BY instance_id",
            kind,
            key,
        )
        return [r["instance_id"] for r in rows]

    async def counter(self, key: str, kind: str = KIND) -> int | None:
        found = await self.val(
            "SELECT holders FROM {s}.flowlock_capacity WHERE kind = $1 AND key = $2", kind, key
        )
        return None if found is None else int(found)

    async def version(self, iid: str) -> int:
        return int(await self.val("SELECT version FROM {s}.flowlock_instances WHERE id = $1", iid))

    async def history(self, iid: str) -> int:
        return int(
            await self.val("SELECT count(*) FROM {s}.flowlock_history WHERE instance_id = $1", iid)
        )

    async def log(self) -> list[tuple[str, int, str, int, int]]:
        rows = await self.conn.fetch(
            f'SELECT key, seq, instance_id, delta, holders FROM "{self.schema}".flowlock_slot_log '
            "ORDER BY kind, key, seq"
        )
        return [(r["key"], r["seq"], r["instance_id"], r["delta"], r["holders"]) for r in rows]

    async def most_held(self) -> int:
        """The most slots any key holds now, counted from the slot rows themselves."""
        found = await self.val(
            "SELECT coalesce(max(n), 0) FROM (SELECT count(*) AS n FROM {s}.flowlock_slots "
            "GROUP BY kind, key) AS per_key"
        )
        return int(found)


@asynccontextmanager
async def reading(pg_url: str, pg_schema: str) -> AsyncIterator[Sql]:
    """The test's own connection, reading the test's schema (each module's `sql` fixture)."""
    conn = await pg_budget.connect(pg_url)
    try:
        yield Sql(conn, pg_schema)
    finally:
        await conn.close()


Make = Callable[..., Awaitable[flowlock.Engine]]


@asynccontextmanager
async def engines(pg_url: str, pg_schema: str) -> AsyncIterator[Make]:
    """Opens engines on the test's schema with the review (capacity `limit`) and subscription
    workflows, closed at the end (each module's `make` fixture)."""
    opened: list[flowlock.Engine] = []

    async def build(
        pool_size: int = 4,
        limit: int = 2,
        locks: Callable[[PostgresStore], Any] | None = None,
        **options: Any,
    ) -> flowlock.Engine:
        store = PostgresStore(
            pg_url, schema=pg_schema, pool_size=pool_size, pipeline=options.get("batching", True)
        )
        if locks is not None:
            options["locks"] = locks(store)
        eng = await flowlock.Engine(store, **options).open()
        opened.append(eng)
        await eng.register(review(limit))
        await eng.register(subscription())
        return eng

    try:
        yield build
    finally:
        for eng in opened:
            await eng.aclose()


async def reviews(eng: flowlock.Engine, reviewer: str, *ids: str) -> None:
    for iid in ids:
        await eng.create("review", instance_id=iid, data={"r": reviewer})


def store_of(eng: flowlock.Engine) -> PostgresStore:
    store = eng.store
    assert isinstance(store, PostgresStore)
    return store
