"""The adaptive strategy on real PostgreSQL: escalation under heat (to pessimistic, or to
distributed), calm under spread load, stepping down, a fleet escalating together, and the
metrics that show it. After every concurrency test the checker reads the histories and the
history rows are counted with the test's own SQL (``sql_history``)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import flowlock
from flowlock import examples
from flowlock.checker import check, check_many
from flowlock.locks import AdvisoryLocks
from flowlock.metrics import Metrics
from flowlock.stores.postgres import PostgresStore
from flowlock.strategies.monitor import ConflictMonitor

pytestmark = pytest.mark.postgres

# The sql_history fixture of conftest: ``await sql_history()`` counts this test's history rows.
SqlHistoryFn = Callable[..., Awaitable[Any]]

# Every poll in this file gives up after this many seconds: generous, so a loaded machine only
# makes a test slower.
DEADLINE = 30.0


async def wait_until(condition: Callable[[], Awaitable[bool]], what: str) -> None:
    """Poll ``condition`` until it holds; fail after DEADLINE seconds, saying ``what``."""
    deadline = time.monotonic() + DEADLINE
    while not await condition():
        assert time.monotonic() < deadline, f"not reached within {DEADLINE:.0f} s: {what}"
        await asyncio.sleep(0.05)


class Clock:
    """A monotonic clock the test moves by hand (the monitor takes one)."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now


async def _engine(pg_url: str, schema: str, **kw: Any) -> flowlock.Engine:
    # 20, flowlock's default: 100 callers queue for it (as in production), and a test stays
    # well inside a shared server's connections (tests/pg_budget.py).
    store = PostgresStore(pg_url, schema=schema, pool_size=kw.pop("pool_size", 20))
    # Batching off unless a test says otherwise: these tests drive escalation with the
    # conflicts of concurrent callers in one process, which a batching engine does not have
    # (it applies them together); across processes the conflicts, and escalation, remain.
    kw.setdefault("batching", False)
    engine = await flowlock.Engine(store, **kw).open()
    for wf in (examples.countersign(100), examples.inventory(), examples.approval()):
        await engine.register(wf)
    return engine


async def _sign_all(
    engine: flowlock.Engine, iid: str, strategy: str, signers: int = 100
) -> list[Any]:
    go = asyncio.Event()

    async def sign(i: int) -> Any:
        await go.wait()
        return await engine.fire(iid, "sign", actor=f"signer-{i}", strategy=strategy)

    tasks = [asyncio.create_task(sign(i)) for i in range(signers)]
    await asyncio.sleep(0)
    go.set()
    return await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.slow
async def test_hot_countersign_escalates_and_every_signature_lands(
    pg_url: str, pg_schema: str, sql_history: SqlHistoryFn
) -> None:
    """100 signers x 3 rounds: optimistic alone loses signers to exhausted retries (and writes
    nothing for them); adaptive escalates each hot instance and every signature lands; the
    escalation counter and the escalated-keys gauge move by what the monitor did."""
    registry = CollectorRegistry()
    engine = await _engine(pg_url, pg_schema, metrics=Metrics(registry))

    def sample(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, labels) or 0.0

    escalations_before = sample("flowlock_escalations_total", to="pessimistic")
    gauge_before = sample("flowlock_escalated_keys")
    try:
        await engine.create("countersign", instance_id="baseline")
        baseline = await _sign_all(engine, "baseline", "optimistic")
        lost = [o for o in baseline if isinstance(o, BaseException)]
        assert lost and all(isinstance(o, flowlock.ConflictRetriesExhausted) for o in lost)
        landed = sum(isinstance(o, flowlock.Outcome) and o.applied for o in baseline)
        assert landed == 100 - len(lost)
        first = await engine.get("baseline")
        assert len(first.data["signers"]) == landed
        verdict = check(first, await engine.history("baseline"), initial_state="pending",
                        expected_applied=landed)  # fmt: skip
        assert verdict.ok, verdict.violations

        ids = ["baseline"]
        for round_no in range(3):
            iid = f"doc-{round_no}"
            ids.append(iid)
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
        (await sql_history()).assert_matches({iid: await engine.history(iid) for iid in ids})
        escalated = engine.monitor.escalations
        assert escalated >= 3

        async def recorded() -> bool:
            # The escalation-sync tick records what changed since its previous tick.
            return (
                sample("flowlock_escalations_total", to="pessimistic") - (escalations_before)
                == escalated
                and sample("flowlock_escalated_keys") == engine.monitor.active_count
            )

        await wait_until(recorded, "the sync tick recorded the escalations")
        assert sample("flowlock_escalated_keys") - gauge_before >= 1
        assert "sku" not in generate_latest(registry).decode()
    finally:
        await engine.aclose()


async def test_adaptive_escalates_to_distributed(
    pg_url: str, pg_schema: str, sql_history: SqlHistoryFn
) -> None:
    """With escalate_to="distributed" and PostgreSQL advisory locks, a hot instance escalates to
    the distributed strategy: calls during the storm and after it run under a lease
    (outcome.strategy "distributed", a fencing token on their history rows, strictly
    increasing), every signature lands once, and the history is clean."""
    clock = Clock()  # never moves: the escalation cannot cool down during the test
    monitor = ConflictMonitor(escalate_to="distributed", clock=clock)
    # Leases (and waiting acquirers) hold a connection each: the other callers queue for one,
    # within the lease's wait. 12 + 3 side + 10 store connections: a busy server has room.
    locks = AdvisoryLocks(pg_url, schema=pg_schema, pool_size=12)
    engine = await _engine(
        pg_url,
        pg_schema,
        pool_size=10,
        locks=locks,
        monitor=monitor,
        strategies=[flowlock.Distributed(ttl=30, wait=DEADLINE)],
    )
    try:
        await engine.register(examples.countersign(1000, name="petition"))
        await engine.create("petition", instance_id="hot")
        outs = await _sign_all(engine, "hot", "adaptive")
        errors = [o for o in outs if isinstance(o, BaseException)]
        assert not errors, errors[:3]
        assert all(o.applied for o in outs)
        assert {o.strategy for o in outs} <= {"optimistic", "distributed"}
        leased = [o for o in outs if o.strategy == "distributed"]
        assert leased and all("escalated to distributed" in (o.reason or "") for o in leased)
        escalation = engine.monitor.escalated("hot")
        assert escalation is not None and escalation.strategy == "distributed"

        later = await engine.fire("hot", "sign", actor="later", strategy="adaptive")
        assert later.applied and later.strategy == "distributed"
        assert later.reason is not None and "escalated to distributed" in later.reason

        history = await engine.history("hot")
        tokens = [h.fencing_token for h in history if h.strategy == "distributed"]
        assert len(tokens) == len(leased) + 1 and None not in tokens
        assert tokens == sorted(set(tokens))  # type: ignore[type-var]
        assert all(h.fencing_token is None for h in history if h.strategy == "optimistic")
        final = await engine.get("hot")
        assert len(final.data["signers"]) == 101
        verdict = check(final, history, initial_state="pending", expected_applied=101)
        assert verdict.ok, verdict.violations
        (await sql_history()).assert_matches({"hot": history})
    finally:
        await engine.aclose()


@pytest.mark.slow
async def test_spread_load_never_escalates(
    pg_url: str, pg_schema: str, sql_history: SqlHistoryFn
) -> None:
    """Spread load over 1,000 instances: adaptive never escalates and runs every call as
    optimistic in one attempt, exactly like the optimistic strategy; every history is clean."""
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

        async def read(iid: str) -> tuple[flowlock.Instance, list[flowlock.HistoryEntry]]:
            async with sem:
                return await engine.get(iid), await engine.history(iid)

        pairs = await asyncio.gather(*[read(iid) for iid in ids])
        histories = {inst.id: history for inst, history in pairs}
        finals = [inst for inst, _ in pairs]
        assert all(dict(f.data) == {"stock": 8, "reserved": 2} for f in finals)
        verdict = check_many(
            [(f, histories[f.id]) for f in finals], initial_state="open", expected_applied=2
        )
        assert verdict.ok, verdict.violations
        (await sql_history()).assert_matches(histories)
    finally:
        await engine.aclose()


async def test_steps_back_down_after_the_cooldown(
    pg_url: str, pg_schema: str, sql_history: SqlHistoryFn
) -> None:
    """A hot instance stays escalated until the cool-down has passed with no contention (on the
    monitor's clock, moved by the test), then its next call runs optimistic again; the
    de-escalation counter moves by one."""
    clock = Clock()
    # The monitor's wall clock an hour behind: the escalations it publishes are already over
    # for the board (which compares them with the real time), so the board never hands this
    # engine its own escalation back and only the monitor's clock decides when it ends.
    monitor = ConflictMonitor(cooldown=5.0, clock=clock, wall=lambda: time.time() - 3600)
    registry = CollectorRegistry()
    engine = await _engine(pg_url, pg_schema, monitor=monitor, metrics=Metrics(registry))

    def deescalated() -> float:
        return registry.get_sample_value("flowlock_deescalations_total") or 0.0

    before = deescalated()
    try:
        await engine.register(examples.countersign(1000, name="petition"))
        await engine.create("petition", instance_id="hot")
        outs = await _sign_all(engine, "hot", "adaptive")
        assert all(isinstance(o, flowlock.Outcome) and o.applied for o in outs)
        assert engine.monitor.escalations >= 1
        assert any(o.strategy == "pessimistic" for o in outs)

        still = await engine.fire("hot", "sign", actor="still-hot", strategy="adaptive")
        assert still.applied and still.strategy == "pessimistic"
        clock.now += 4.9  # within the cool-down: still escalated
        assert engine.monitor.escalated("hot") is not None
        clock.now += 0.2  # 5.1 s with no contention: past it
        assert engine.monitor.escalated("hot") is None
        assert engine.monitor.deescalations == 1

        calm = await engine.fire("hot", "sign", actor="calm-again", strategy="adaptive")
        assert calm.applied and calm.strategy == "optimistic"
        assert calm.reason == "adaptive: optimistic (instance not escalated)"

        async def recorded() -> bool:
            return deescalated() - before == 1

        await wait_until(recorded, "the sync tick recorded the de-escalation")
        history = await engine.history("hot")
        final = await engine.get("hot")
        verdict = check(final, history, initial_state="pending", expected_applied=102)
        assert verdict.ok, verdict.violations
        (await sql_history()).assert_matches({"hot": history})
    finally:
        await engine.aclose()


WORKER = textwrap.dedent(
    """
    import asyncio, json, sys, time
    import flowlock
    from flowlock import examples
    from flowlock.stores.postgres import PostgresStore
    from flowlock.strategies.monitor import ConflictMonitor

    async def main(url, schema):
        store = PostgresStore(url, schema=schema, pool_size=10)
        # A long cool-down: the escalation must still stand when the other process looks.
        monitor = ConflictMonitor(cooldown=120)
        async with flowlock.Engine(store, monitor=monitor, batching=False) as engine:
            await engine.register(examples.countersign(100))
            await engine.create("countersign", instance_id="shared")
            go = asyncio.Event()
            async def sign(i):
                await go.wait()
                return await engine.fire("shared", "sign", actor=f"s{i}", strategy="adaptive")
            tasks = [asyncio.create_task(sign(i)) for i in range(100)]
            await asyncio.sleep(0); go.set()
            outs = await asyncio.gather(*tasks)
            deadline = time.monotonic() + 30
            # Until the sync task has published the escalation on the board.
            while not any(e.key == "shared" for e in await store.active(time.time())):
                assert time.monotonic() < deadline, "the escalation was never published"
                await asyncio.sleep(0.05)
            print(json.dumps({"escalated": engine.monitor.escalated("shared") is not None,
                              "applied": sum(o.applied for o in outs)}))

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


@pytest.mark.slow
async def test_escalation_in_one_process_reaches_another(
    pg_url: str, pg_schema: str, sql_history: SqlHistoryFn
) -> None:
    """An instance escalated by one process is run escalated by another, which adopts the
    escalation from the board on its next sync; the shared history is clean."""
    engine = await _engine(pg_url, pg_schema, pool_size=5)
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", WORKER, pg_url, pg_schema,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 0, err.decode()[-2000:]
        report = json.loads(out.decode().strip().splitlines()[-1])
        assert report == {"escalated": True, "applied": 100}

        async def adopted() -> bool:
            return engine.monitor.escalated("shared") is not None

        await wait_until(adopted, "this process adopted the other's escalation")
        # A call here on the shared instance runs escalated although this process saw no conflict.
        late = await engine.fire("shared", "sign", actor="late", strategy="adaptive")
        assert late.idempotent and late.strategy == "pessimistic"
        assert late.reason is not None and "escalated" in late.reason
        history = await engine.history("shared")
        verdict = check(await engine.get("shared"), history, initial_state="pending",
                        expected_applied=100)  # fmt: skip
        assert verdict.ok, verdict.violations
        (await sql_history()).assert_matches({"shared": history})
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
        await engine.fire("sku", "reserve", strategy="optimistic")
        with pytest.raises(flowlock.GuardRejected):
            await engine.fire("sku", "reserve", strategy="optimistic")
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
