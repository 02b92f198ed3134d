"""The README's "Inside your own transaction" and "Connections and bounds" examples, run as
written against the real PostgreSQL."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

import flowlock
import pg_budget
from flowlock import examples
from flowlock.stores.postgres import PostgresStore

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _block(heading: str) -> str:
    """The first python block under ``heading``."""
    section = README.split(heading, 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None, heading
    return code.group(1)


async def test_the_transactional_example_commits_or_rolls_back_the_order_with_the_reservation(
    pg_url: str, pg_schema: str
) -> None:
    """place_order() as the README writes it: the first order commits its row and its
    reservation; the second, out of stock, raises GuardRejected and leaves no row behind."""
    namespace: dict[str, Any] = {}
    exec(_block("### Inside your own transaction"), namespace)
    place_order = namespace["place_order"]
    store = PostgresStore(pg_url, schema=pg_schema, pool_size=2)
    async with flowlock.Engine(store) as engine:
        await engine.register(examples.inventory())
        await engine.create("inventory", instance_id="sku-1", data={"stock": 1, "reserved": 0})
        conn = await pg_budget.connect(pg_url, server_settings={"search_path": pg_schema})
        try:
            await conn.execute("CREATE TABLE orders (id text PRIMARY KEY, sku text NOT NULL)")
            await place_order(engine, conn, "o-1")
            with pytest.raises(flowlock.GuardRejected, match="out of stock"):
                await place_order(engine, conn, "o-2")
            assert await conn.fetchval("SELECT array_agg(id) FROM orders") == ["o-1"]
        finally:
            await conn.close()
        assert (await engine.get("sku-1")).data == {"stock": 0, "reserved": 1}
        assert [h.request_id for h in await engine.history("sku-1")] == ["o-1"]


def test_the_connections_example_is_accepted_as_written() -> None:
    """Every keyword of the "Connections and bounds" example is accepted (nothing is opened)."""
    namespace: dict[str, Any] = {"flowlock": flowlock}
    exec(_block("### Connections and bounds"), namespace)
    engine = namespace["engine"]
    store = engine.store
    assert isinstance(store, PostgresStore)
    assert (store.pool_size, store.acquire_timeout, store.lock_timeout) == (20, 10.0, 5.0)
    assert store.application_name == "orders-api"
    assert engine.strategies["distributed"].wait == 5
