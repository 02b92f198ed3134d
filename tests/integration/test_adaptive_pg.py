"""The adaptive strategy on real PostgreSQL: escalation under heat, calm under spread load,
stepping down, a fleet escalating together, and the metrics that show it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import flowlock
from flowlock import examples
from flowlock.checker import check
from flowlock.metrics import Metrics
from flowlock.stores.postgres import PostgresStore
from flowlock.strategies.monitor import ConflictMonitor

pytestmark = pytest.mark.postgres


async def _engine(pg_url: str, schema: str, **kw: Any) -> flowlock.Engine:
    store = PostgresStore(pg_url, schema=schema, pool_size=kw.pop("pool_size", 100))
    engine = await flowlock.Engine(store, **kw).open()
    for wf in (examples.countersign(100), examples.inventory(), examples.approval()):
        await engine.register(wf)
    return engine


async def _sign_all(engine: flowlock.Engine, iid: str, strategy: str) -> list[Any]:
    go = asyncio.Event()

    async def sign(i: int) -> Any:
        await go.wait()
        return await engine.fire(iid, "sign", actor=f"signer-{i}", strategy=strategy)

    tasks = [asyncio.create_task(sign(i)) for i in range(100)]
    await asyncio.sleep(0)
    go.set()
    return await asyncio.gather(*tasks, return_exceptions=True)


async def test_hot_countersign_escalates_and_every_signature_lands(
    pg_url: str, pg_schema: str
) -> None:
    """100 signers x 3 rounds: optimistic alone loses signers to exhausted retries; adaptive
    escalates each hot instance and every signature lands; metrics show the escalation."""
    registry = CollectorRegistry()
    engine = await _engine(pg_url, pg_schema, metrics=Metrics(registry))
    try:
        await engine.create("countersign", instance_id="baseline")
        baseline = await _sign_all(engine, "baseline", "optimistic")
        assert any(isinstance(o, flowlock.ConflictRetriesExhausted) for o in baseline)

        for round_no in range(3):
            iid = f"doc-{round_no}"
            await engine.create("countersign", instance_id=iid)
            outs = await _sign_all(engine, iid, "adaptive")
            errors = [o for o in outs if isinstance(o, BaseException)]
            assert not errors, errors[:3]
            assert all(o.applied for o in outs)
            assert {o.strategy for o in outs} <= {"optimistic", "pessimistic"}
            assert any(o.strategy == "pessimistic" and "escalated" in o.reason for o in outs)
            final = await engine.get(iid)
            assert final.state == "approved" and len(final.data["signers"]) == 100
            verdict = check(final, await engine.history(iid), initial_state="pending",
                            expected_applied=100)  # fmt: skip
            assert verdict.ok, verdict.violations
        assert engine.monitor.escalations >= 3
        await asyncio.sleep(0.7)  # one escalation-sync tick updates the gauges and counters
        text = generate_latest(registry).decode()
        assert 'flowlock_escalations_total{to="pessimistic"}' in text
        assert "flowlock_escalated_keys" in text
    finally:
        await engine.aclose()


async def test_spread_load_never_escalates(pg_url: str, pg_schema: str) -> None:
    """Spread load over 1,000 instances: adaptive never escalates and runs every call as
    optimistic in one attempt, exactly like the optimistic strategy."""
    engine = await _engine(pg_url, pg_schema, pool_size=20)
    try:
        ids = [f"sku-{i}" for i in range(1000)]
        for iid in ids:
            await engine.create("inventory", instance_id=iid, data={"stock": 10})
        sem = asyncio.Semaphore(50)

        async def reserve(iid: str) -> flowlock.Outcome:
            async with sem:
                return await engine.fire(iid, "reserve", strategy="adaptive")

        outs = []
        for _ in range(2):  # two passes; within a pass every call is on its own instance
            outs += await asyncio.gather(*[reserve(iid) for iid in ids])
        assert all(o.applied and o.strategy == "optimistic" for o in outs)
        assert sum(o.attempts for o in outs) == len(outs)
        assert engine.monitor.escalations == 0
        assert not engine.monitor._windows  # no key was ever hot enough to be tracked
    finally:
        await engine.aclose()


async def test_steps_back_down_after_the_cooldown(pg_url: str, pg_schema: str) -> None:
    """After the storm stops the instance returns to optimistic once the cool-down has passed."""
    engine = await _engine(pg_url, pg_schema, monitor=ConflictMonitor(cooldown=1.0))
    try:
        await engine.create("countersign", instance_id="doc")
        outs = await _sign_all(engine, "doc", "adaptive")
        assert all(isinstance(o, flowlock.Outcome) and o.applied for o in outs)
        assert engine.monitor.escalations >= 1
        assert any(o.strategy == "pessimistic" for o in outs)
        for _ in range(50):  # past the cool-down (and the board's copy of it), bounded
            if engine.monitor.escalated("doc") is None:
                break
            await asyncio.sleep(0.1)
        assert engine.monitor.escalated("doc") is None
        assert engine.monitor.deescalations >= 1
        await engine.create("inventory", instance_id="calm", data={"stock": 5})
        out = await engine.fire("calm", "reserve", strategy="adaptive")
        assert out.strategy == "optimistic"
    finally:
        await engine.aclose()


WORKER = textwrap.dedent(
    """
    import asyncio, json, sys
    import flowlock
    from flowlock import examples
    from flowlock.stores.postgres import PostgresStore

    async def main(url, schema):
        store = PostgresStore(url, schema=schema, pool_size=100)
        async with flowlock.Engine(store) as engine:
            await engine.register(examples.countersign(100))
            await engine.create("countersign", instance_id="shared")
            go = asyncio.Event()
            async def sign(i):
                await go.wait()
                return await engine.fire("shared", "sign", actor=f"s{i}", strategy="adaptive")
            tasks = [asyncio.create_task(sign(i)) for i in range(100)]
            await asyncio.sleep(0); go.set()
            outs = await asyncio.gather(*tasks)
            await asyncio.sleep(1.2)  # let the sync task publish the escalation
            print(json.dumps({"escalated": engine.monitor.escalated("shared") is not None,
                              "applied": sum(o.applied for o in outs)}))

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


@pytest.mark.slow
async def test_escalation_in_one_process_reaches_another(pg_url: str, pg_schema: str) -> None:
    """An instance escalated by one process is run escalated by another within about a second."""
    engine = await _engine(pg_url, pg_schema, pool_size=5)
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", WORKER, pg_url, pg_schema,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()[-2000:]
        report = json.loads(out.decode().strip().splitlines()[-1])
        assert report == {"escalated": True, "applied": 100}
        for _ in range(30):  # the other process adopts it on its next sync (every 0.5 s)
            if engine.monitor.escalated("shared") is not None:
                break
            await asyncio.sleep(0.1)
        assert engine.monitor.escalated("shared") is not None
        # A call here on the shared instance runs escalated although this process saw no conflict.
        late = await engine.fire("shared", "sign", actor="late", strategy="adaptive")
        assert late.idempotent and late.strategy == "pessimistic"
        assert late.reason is not None and "escalated" in late.reason
    finally:
        await engine.aclose()


async def test_metrics_match_the_calls_made(pg_url: str, pg_schema: str) -> None:
    """After a known sequence of calls the metrics endpoint shows exactly those counts."""
    registry = CollectorRegistry()
    engine = await _engine(pg_url, pg_schema, pool_size=5, metrics=Metrics(registry))
    try:
        await engine.create("inventory", instance_id="sku", data={"stock": 2})
        await engine.create("approval", instance_id="req")
        await engine.fire("sku", "reserve", strategy="pessimistic")
        await engine.fire("sku", "reserve")
        with pytest.raises(flowlock.GuardRejected):
            await engine.fire("sku", "reserve")
        await engine.fire("req", "approve")
        await engine.fire("req", "approve")  # idempotent
        text = generate_latest(registry).decode()
    finally:
        await engine.aclose()

    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }

    def value(name: str, **labels: str) -> float:
        return samples.get((name, tuple(sorted(labels.items()))), 0.0)

    t = "flowlock_transitions_total"
    inv = {"workflow": "inventory", "event": "reserve"}
    assert value(t, **inv, strategy="pessimistic", outcome="applied") == 1
    assert value(t, **inv, strategy="optimistic", outcome="applied") == 1
    assert value(t, **inv, strategy="optimistic", outcome="refused") == 1
    appr = {"workflow": "approval", "event": "approve", "strategy": "optimistic"}
    assert value(t, **appr, outcome="applied") == 1
    assert value(t, **appr, outcome="idempotent") == 1
    assert value("flowlock_attempts_count", strategy="optimistic") == 3
    assert value("flowlock_transition_duration_seconds_count", strategy="pessimistic",
                 workflow="inventory") == 1  # fmt: skip
    assert value("flowlock_lock_wait_seconds_count", strategy="pessimistic") == 1
    assert "sku" not in text and "req" not in text  # no instance id as a label
