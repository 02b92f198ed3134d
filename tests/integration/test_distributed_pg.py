"""The distributed strategy on real PostgreSQL with real lock backends (Redis, advisory locks):
the storm and countersign exactly once, a lost lease made harmless, Redis losing its data,
Redis unreachable."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

import pytest

import flowlock
from flowlock import examples
from flowlock.checker import check
from flowlock.locks.base import LockBackend
from flowlock.stores.postgres import PostgresStore

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

Factory = Callable[..., Awaitable[flowlock.Engine]]


def _locks(kind: str, pg_url: str, schema: str, redis_url: str, namespace: str,
           store: PostgresStore) -> LockBackend:  # fmt: skip
    if kind == "redis":
        from flowlock.locks.redis import RedisLocks

        return RedisLocks(redis_url, namespace=namespace, fence_floor=store.fencing_floor)
    advisory = pytest.importorskip("flowlock.locks.advisory")
    backend: LockBackend = advisory.AdvisoryLocks(pg_url, namespace=namespace, schema=schema)
    return backend


@pytest.fixture(params=["redis", "advisory"])
async def factory(
    request: pytest.FixtureRequest, pg_url: str, pg_schema: str, redis_url: str,
    redis_namespace: str,
) -> AsyncIterator[Factory]:  # fmt: skip
    """Opens engines with the distributed strategy on one lock backend; closes them after."""
    opened: list[flowlock.Engine] = []

    async def make(pool_size: int = 100, **options: Any) -> flowlock.Engine:
        store = PostgresStore(pg_url, schema=pg_schema, pool_size=pool_size)
        locks = _locks(request.param, pg_url, pg_schema, redis_url, redis_namespace, store)
        engine = await flowlock.Engine(store, locks=locks, **options).open()
        opened.append(engine)
        for wf in (examples.approval(), examples.countersign(100), examples.inventory()):
            await engine.register(wf)
        return engine

    yield make
    for engine in opened:
        await engine.aclose()


async def _at_once(calls: list[Callable[[], Awaitable[Any]]]) -> list[Any]:
    go = asyncio.Event()

    async def run(call: Callable[[], Awaitable[Any]]) -> Any:
        await go.wait()
        return await call()

    tasks = [asyncio.create_task(run(c)) for c in calls]
    await asyncio.sleep(0)
    go.set()
    return await asyncio.gather(*tasks, return_exceptions=True)


def _tokens_increase(history: list[flowlock.HistoryEntry]) -> None:
    tokens = [h.fencing_token or 0 for h in history]
    assert all(h.fencing_token is not None for h in history), history
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens), tokens


async def test_storm_is_exactly_once(factory: Factory) -> None:
    """100 callers approve one instance under leases, 3 rounds: 1 applied, 99 idempotent."""
    engine = await factory(strategies=[flowlock.Distributed(wait=10.0)])
    for round_no in range(3):
        iid = f"storm-{round_no}"
        await engine.create("approval", instance_id=iid)
        outs = await _at_once([partial(engine.fire, iid, "approve", strategy="distributed")] * 100)
        errors = [o for o in outs if isinstance(o, BaseException)]
        assert not errors, errors[:3]
        assert sum(o.applied for o in outs) == 1 and sum(o.idempotent for o in outs) == 99
        history = await engine.history(iid)
        assert check(await engine.get(iid), history, expected_applied=1).ok
        _tokens_increase(history)


async def test_countersign_every_signature_once(factory: Factory) -> None:
    """100 signers under leases: all 100 recorded once, approved once, tokens increasing."""
    engine = await factory(strategies=[flowlock.Distributed(wait=20.0)])
    await engine.create("countersign", instance_id="doc")
    outs = await _at_once(
        [
            partial(engine.fire, "doc", "sign", actor=f"signer-{i}", strategy="distributed")
            for i in range(100)
        ]
    )
    errors = [o for o in outs if isinstance(o, BaseException)]
    assert not errors, errors[:3]
    assert all(o.applied for o in outs)
    final = await engine.get("doc")
    history = await engine.history("doc")
    assert final.state == "approved" and len(set(final.data["signers"])) == 100
    verdict = check(final, history, initial_state="pending", expected_applied=100)
    assert verdict.ok, verdict.violations
    _tokens_increase(history)


PAUSABLE = textwrap.dedent(
    """
    import asyncio, json, sys, time
    import flowlock
    from flowlock import examples
    from flowlock.locks.base import Held
    from flowlock.stores.postgres import PostgresStore

    url, schema, kind, redis_url, namespace, skip_check = sys.argv[1:7]

    def slow_effect(inst, payload, actor):
        print("IN-STEP", flowlock.fencing_token(), flush=True)
        time.sleep(0.5)  # the test SIGSTOPs this process here, holding the lease
        return {**inst.data, "stock": inst.data["stock"] - 1, "by": actor}

    async def main():
        store = PostgresStore(url, schema=schema, pool_size=2)
        if kind == "redis":
            from flowlock.locks.redis import RedisLocks
            locks = RedisLocks(redis_url, namespace=namespace, fence_floor=store.fencing_floor)
        else:
            from flowlock.locks.advisory import AdvisoryLocks
            locks = AdvisoryLocks(url, namespace=namespace, schema=schema)
        if skip_check == "1":
            Held.check = lambda self: None  # a careless holder: only the database can stop it
        leases = [flowlock.Distributed(ttl=1.0)]
        async with flowlock.Engine(store, locks=locks, strategies=leases) as engine:
            await engine.register(flowlock.Workflow("stock", states=["open"], initial="open",
                transitions=[flowlock.Transition("take", source="open", target="open",
                                                 effect=slow_effect)]))
            try:
                out = await engine.fire("sku", "take", actor="A", strategy="distributed")
                print(json.dumps({"applied": out.applied}), flush=True)
            except flowlock.FlowlockError as exc:
                print(json.dumps({"error": type(exc).__name__}), flush=True)

    asyncio.run(main())
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("skip_check", ["0", "1"], ids=["checked", "careless"])
async def test_paused_holder_cannot_write_after_losing_its_lease(
    factory: Factory, request: pytest.FixtureRequest, pg_url: str, pg_schema: str,
    redis_url: str, redis_namespace: str, skip_check: str,
) -> None:  # fmt: skip
    """Holder A is SIGSTOPped past its ttl inside its step; B takes the lease and writes; A
    resumes and is refused: by its own lease check, or (a careless holder that skips the check)
    by the version and fencing checks in the database. One write per token, tokens increasing."""
    kind = request.node.callspec.params["factory"]
    engine = await factory(pool_size=5, strategies=[flowlock.Distributed(wait=5.0)])

    def take(inst: Any, payload: Any, actor: str | None) -> dict[str, Any]:
        return {**inst.data, "stock": inst.data["stock"] - 1, "by": actor}

    await engine.register(
        flowlock.Workflow(
            "stock",
            states=["open"],
            initial="open",
            transitions=[flowlock.Transition("take", source="open", target="open", effect=take)],
        )
    )
    await engine.create("stock", instance_id="sku", data={"stock": 10})
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", PAUSABLE, pg_url, pg_schema, kind, redis_url, redis_namespace,
        skip_check, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        if not line.startswith("IN-STEP"):
            raise AssertionError(line + (await proc.stderr.read()).decode())
        a_token = int(line.split()[1])
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            # Past A's 1 s ttl: the key expires in Redis; for advisory locks the server ends
            # A's idle session, which releases the lock.
            await asyncio.sleep(1.5)
            started = time.monotonic()
            b = await engine.fire("sku", "take", actor="B", strategy="distributed")
            assert b.applied and time.monotonic() - started < 5
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        raw_out, raw_err = await asyncio.wait_for(proc.communicate(), 30)
        out, err = line + raw_out.decode(), raw_err.decode()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    report = json.loads(out.strip().splitlines()[-1])
    assert report.get("error") in ("LockLost", "StoreError"), (report, err[-2000:])
    final = await engine.get("sku")
    history = await engine.history("sku")
    assert final.data == {"stock": 9, "by": "B"}
    assert [h.actor for h in history] == ["B"]
    assert history[0].fencing_token is not None and history[0].fencing_token > a_token
    assert check(final, history, expected_applied=1).ok


@pytest.mark.slow
async def test_tokens_keep_increasing_across_an_empty_redis_restart(
    pg_url: str, pg_schema: str
) -> None:
    """Redis restarted empty while a lease is held: later fencing tokens are still higher than
    every earlier one (floored from PostgreSQL), and the stale holder's write is refused."""
    from flowlock.embedded import EmbeddedRedis
    from flowlock.locks.redis import RedisLocks

    with EmbeddedRedis() as server:
        store = PostgresStore(pg_url, schema=pg_schema, pool_size=5)
        locks = RedisLocks(server.url, namespace="restart", fence_floor=store.fencing_floor)
        async with flowlock.Engine(store, locks=locks) as engine:
            await engine.register(examples.inventory())
            await engine.create("inventory", instance_id="sku", data={"stock": 10})
            for _ in range(3):
                await engine.fire("sku", "reserve", strategy="distributed")
            held = await locks.acquire("sku", ttl=30)  # a lease held across the restart
            await asyncio.to_thread(server.restart)
            for _ in range(3):
                await engine.fire("sku", "reserve", strategy="distributed")
            history = await engine.history("sku")
            _tokens_increase(history)
            assert history[3].fencing_token > held.fencing > history[2].fencing_token  # type: ignore[operator]
            stale = await store.read("sku", None)
            refused = await store.commit(
                flowlock.HistoryEntry(
                    instance_id="sku", version=stale.instance.version + 1, event="reserve",
                    from_state="open", to_state="open", actor="stale", request_id=None,
                    strategy="distributed", data={"stock": 0}, fencing_token=held.fencing,
                )
            )  # fmt: skip
            assert refused is None
            assert check(await engine.get("sku"), history, expected_applied=6).ok


async def test_unreachable_redis_is_a_typed_error_within_the_bound(
    pg_url: str, pg_schema: str
) -> None:
    """Redis unreachable at acquire: LockUnavailable within the wait bound, nothing written."""
    from flowlock.locks.redis import RedisLocks

    store = PostgresStore(pg_url, schema=pg_schema, pool_size=2)
    locks = RedisLocks("redis://127.0.0.1:1/0", socket_timeout=0.5)
    async with flowlock.Engine(
        store, locks=locks, strategies=[flowlock.Distributed(wait=1.0)]
    ) as engine:
        await engine.register(examples.approval())
        await engine.create("approval", instance_id="req")
        started = time.monotonic()
        with pytest.raises(flowlock.LockUnavailable):
            await engine.fire("req", "approve", strategy="distributed")
        assert time.monotonic() - started < 3.0
        assert (await engine.get("req")).version == 1
        assert await engine.history("req") == []
