"""`flowlock bench --scale` against the running PostgreSQL: quick sizes, the JSON's shape, the
loaded rows as the loader says, and the scratch schema dropped at the end."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

import pg_budget
from flowlock.backends import build_postgres_store
from flowlock.bench.scale_load import (
    LONG_ID,
    WORKFLOW,
    load_to,
    long_length,
    scale_workflow,
    sizes_of,
)
from flowlock.checker import check_many
from flowlock.cli import app
from flowlock.engine import Engine

pytestmark = pytest.mark.postgres


def test_quick_scale_run_reports_every_figure_at_every_size(pg_url: str, tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    result = CliRunner().invoke(
        app,
        ["bench", "--scale", "200,600", "--quick", "--database-url", pg_url, "--json", str(out)],
    )
    assert result.exit_code == 0, result.output
    assert "slope" in result.stdout and "history page, deep" in result.stdout
    doc = json.loads(out.read_text())
    assert doc["kind"] == "scale"
    assert doc["sizes"] == [200, 600]
    assert doc["history_rows"] == [sizes_of(200), sizes_of(600)]
    for name in (
        "fire p50",
        "fire p99",
        "spread applied/s",
        "count held",
        "history page, deep",
        "list held, middle page",
        "flowlock_history",
        "flowlock_history indexes",
    ):
        values = doc["metrics"][name]["values"]
        assert len(values) == 2 and all(v > 0 for v in values), (name, values)
        assert doc["metrics"][name]["slope"] > 0
    assert {a["metric"] for a in doc["aims"]} == {"fire p99", "spread applied/s"}
    # Each size measured in 2 rounds, in turn; the value shown is their median.
    assert doc["args"]["rounds"] == 2 and len(doc["args"]["schemas"]) == 2
    for per_size in doc["metrics"]["fire p99"]["rounds"]:
        assert len(per_size) == 2
    assert (
        doc["metrics"]["flowlock_history"]["values"][1]
        > doc["metrics"]["flowlock_history"]["values"][0]
    )

    async def schema_left() -> bool:
        conn = await pg_budget.connect(pg_url)
        try:
            return bool(
                await conn.fetchval(
                    "SELECT count(*) FROM pg_namespace WHERE nspname = ANY($1::text[])",
                    doc["args"]["schemas"],
                )
            )
        finally:
            await conn.close()

    assert not asyncio.run(schema_left())


def test_scale_refuses_what_means_nothing_to_it(pg_url: str) -> None:
    result = CliRunner().invoke(app, ["bench", "--scale", "300", "-s", "storm"])
    assert result.exit_code == 2
    assert "mean(s) nothing to --scale" in result.output
    result = CliRunner().invoke(app, ["bench", "--scale", "1e4,1e3"])
    assert result.exit_code == 2
    assert "sizes must grow" in result.output


async def test_loaded_rows_are_what_the_engine_would_have_written(
    pg_url: str, pg_schema: str
) -> None:
    """The loader's instances and histories, grown in two steps, pass the checker; concurrent
    steps through an engine on them apply once each, and pass it again."""
    store = build_postgres_store(pg_url, schema=pg_schema, pool_size=4)
    async with Engine(store, strategy="optimistic", timers=False) as engine:
        await engine.register(scale_workflow())
        conn = await pg_budget.connect(pg_url)
        try:
            await conn.execute(f'SET search_path TO "{pg_schema}"')
            await load_to(conn, 0, 200)
            await load_to(conn, 200, 500)
            assert await conn.fetchval("SELECT count(*) FROM flowlock_instances") == 501
            assert await conn.fetchval("SELECT count(*) FROM flowlock_history") == sizes_of(500)
        finally:
            await conn.close()
        assert await engine.count(WORKFLOW, "held") == 5
        assert await engine.count(WORKFLOW, "done") == 45
        long = await engine.get(LONG_ID)
        assert long.version == long_length(500) + 1
        rng = random.Random(7)
        picks = [f"sc-{rng.choice([n for n in range(1, 501) if n % 10]):08d}" for _ in range(200)]
        outcomes = await asyncio.gather(*(engine.fire(i, "step", actor="t") for i in picks))
        assert all(o.applied for o in outcomes)
        ids = sorted({*picks, "sc-00000010", "sc-00000100", LONG_ID})
        pairs = [(await engine.get(i), await engine.history(i)) for i in ids]
        verdict = check_many(pairs, initial_state="open")
        assert verdict.ok, verdict.describe()
        for inst, history in pairs:
            assert inst.data["n"] == inst.version - 1 == len(history)
