"""The benchmark's outbox section on PostgreSQL, at --quick size.

hot-outbox and spread-outbox with two strategies: each pair's rounds without messages and with
one per transition, every message delivered to the handler's sink, then the dispatcher's idle
cost in a database of the bench's own. Only the shape and the correctness figures are asserted
(every message delivered once, none stray or left, the checker clean, nothing left behind),
never a speed.
"""

from __future__ import annotations

from typing import Any

import pytest

import pg_budget
from flowlock.bench import BenchConfig, run_bench
from flowlock.bench.outbox_load import deliver
from flowlock.bench.report import to_json
from flowlock.bench.scenarios.outbox import WORKFLOW, emitting_counter, sink_of
from flowlock.bench.servers import DatabaseServer, probe
from flowlock.core.errors import InvalidInput
from flowlock.engine import Engine
from flowlock.stores.postgres import PostgresStore

pytestmark = pytest.mark.postgres

CALLS = 300  # --quick: 100 callers x 3 steps, one round of each kind
STRATEGIES = ("optimistic", "pessimistic")


async def _left(url: str, schema: str) -> list[str]:
    """The run's schemas and databases still on the server."""
    conn = await pg_budget.connect(url)
    try:
        schemas = await conn.fetch(
            "SELECT nspname FROM pg_namespace WHERE nspname LIKE $1", f"{schema}%"
        )
        bases = await conn.fetch(
            "SELECT datname FROM pg_database WHERE datname LIKE $1", f"{schema}%"
        )
    finally:
        await conn.close()
    return [r[0] for r in schemas] + [r[0] for r in bases]


def _check_pair(pair: dict[str, Any], result: dict[str, Any]) -> None:
    """Every applied step's message reached the handler once, and nothing else did."""
    assert pair["emitted"] == result["applied"] == CALLS
    assert pair["delivered"] == CALLS and pair["all_delivered"] is True
    assert (pair["lost"], pair["stray"], pair["left"], pair["duplicates"]) == (0, 0, 0, 0)
    assert pair["verdict"] == {"ok": True, "violations": 0}
    assert result["verdict"] == {"ok": True, "violations": []}
    assert pair["applied_per_s"] > 0 and pair["without_applied_per_s"] > 0
    assert pair["ratio"] == pytest.approx(
        pair["applied_per_s"] / pair["without_applied_per_s"], abs=0.01
    )
    assert isinstance(pair["met"], bool) and pair["target_ratio"] == 0.9
    for lag in (pair["lag"], pair["claim_lag"]):
        assert lag["count"] == CALLS
        assert 0 <= lag["p50_ms"] <= lag["p99_ms"] <= lag["max_ms"]


@pytest.mark.slow
async def test_quick_outbox_section(pg_url: str) -> None:
    """A --quick run of `-s outbox` with two strategies: each pair's rounds with messages
    deliver every message once (the checker clean, its rounds without messages too), the
    ratio and the lag are reported, the idle cost is counted by kind in a database of its
    own, and no schema or database is left."""
    config = BenchConfig(
        database_url=pg_url,
        scenarios=("outbox",),
        strategies=STRATEGIES,
        quick=True,
        seed=13,
        pool_size=8,
    )
    try:
        await probe(DatabaseServer(pg_url, "external"), config)
    except InvalidInput as exc:
        pytest.skip(f"a quick outbox run does not fit the server's free connections: {exc}")
    report = await run_bench(config)
    doc = to_json(report)
    assert report.ok, doc["outbox"]
    pairs = [(r["scenario"], r["strategy"]) for r in doc["results"]]
    expected = [(s, t) for s in ("hot-outbox", "spread-outbox") for t in STRATEGIES]
    assert pairs == expected
    outbox = doc["outbox"]
    assert [(p["scenario"], p["strategy"]) for p in outbox["pairs"]] == expected
    assert [p["baseline"] for p in outbox["pairs"]] == ["hot", "hot", "spread", "spread"]
    for pair, result in zip(outbox["pairs"], doc["results"], strict=True):
        _check_pair(pair, result)
    for result in report.results:
        assert result.without is not None and result.without.verdict.ok
        assert result.without.applied == CALLS

    idle = outbox["idle"]
    assert idle is not None, outbox["notes"]
    assert idle["database"] == "dedicated" and idle["done"] == 200
    assert idle["window_s"] > 0
    kinds = {"timers", "outbox", "listen", "escalations", "other"}
    assert set(idle["statements_by_kind"]) == kinds
    assert idle["scans_per_s"] is None  # --quick settles too briefly to count them
    assert outbox["targets"] == {
        "applied_per_s_ratio": 0.9,
        "idle_outbox_statements_per_s": 0.0,
    }
    assert await _left(pg_url, doc["args"]["schema"]) == []


async def test_the_idle_database_is_filled_with_delivered_messages(
    pg_url: str, pg_schema: str
) -> None:
    """What the idle cost's database is prepared with: every message emitted, delivered to the
    sink once and done, none pending (as many as asked, spread over the counters)."""
    store = PostgresStore(pg_url, schema=pg_schema, pool_size=4)
    engine = Engine(store, timers=False)
    sink = sink_of(engine)
    async with engine:
        await engine.register(emitting_counter())
        assert await deliver(engine, "prep-", 250) == 250
        counts = await store.count_messages()
        histories = [await engine.history(f"prep-{i}") for i in (0, 49, 99)]
        inst = await engine.get("prep-0")
    assert counts["done"] == 250
    assert counts["pending"] == counts["running"] == counts["dead"] == 0
    assert len(sink.deliveries) == 250 and len({d.key for d in sink.deliveries}) == 250
    assert [len(h) for h in histories] == [3, 3, 2]  # 250 over 100 counters
    assert inst.workflow == WORKFLOW and inst.data == {"n": 3}
