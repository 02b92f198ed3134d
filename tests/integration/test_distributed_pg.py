"""The distributed strategy on real PostgreSQL with real lock backends (Redis, advisory locks):
the storm and countersign exactly once, a lost lease made harmless (by the holder's own lease
check, by the version check, and by the fencing clause alone), Redis losing its data, Redis
unreachable. Every concurrency test ends with the checker and an independent SQL count of the
history rows."""

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
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import pytest

import flowlock
from flowlock import examples
from flowlock.checker import check
from flowlock.locks.base import LockBackend
from flowlock.stores.postgres import PostgresStore

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

Factory = Callable[..., Awaitable[flowlock.Engine]]
SqlHistory = Callable[..., Awaitable[Any]]


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
    """Every row fenced, tokens never going down. A batch writes its rows under one lease, so
    they share its token; rows of different leases have different tokens."""
    tokens = [h.fencing_token or 0 for h in history]
    assert all(h.fencing_token is not None for h in history), history
    assert tokens == sorted(tokens), tokens


async def test_storm_is_exactly_once(factory: Factory, sql_history: SqlHistory) -> None:
    """100 callers approve one instance under leases, 3 rounds: 1 applied, 99 idempotent."""
    engine = await factory(strategies=[flowlock.Distributed(wait=10.0)])
    histories = {}
    for round_no in range(3):
        iid = f"storm-{round_no}"
        await engine.create("approval", instance_id=iid)
        outs = await _at_once([partial(engine.fire, iid, "approve", strategy="distributed")] * 100)
        errors = [o for o in outs if isinstance(o, BaseException)]
        assert not errors, errors[:3]
        assert sum(o.applied for o in outs) == 1 and sum(o.idempotent for o in outs) == 99
        history = histories[iid] = await engine.history(iid)
        verdict = check(await engine.get(iid), history, expected_applied=1)
        assert verdict.ok, verdict.violations
        _tokens_increase(history)
    (await sql_history()).assert_matches(histories)


async def test_countersign_every_signature_once(factory: Factory, sql_history: SqlHistory) -> None:
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
    (await sql_history()).assert_matches({"doc": history})


PAUSABLE = textwrap.dedent(
    """
    import asyncio, json, os, sys, time
    import flowlock
    from flowlock.locks.base import Held
    from flowlock.stores.postgres import PostgresStore

    url, schema, kind, redis_url, namespace, careless, pause_at, gate = sys.argv[1:9]

    def pause(where):
        # Holding the lease: say so, then block the whole process (no renewal either) until
        # the test's go file appears. The test SIGSTOPs the process meanwhile.
        print(json.dumps({"paused": where}), flush=True)
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(gate, "go")):
            if time.monotonic() > deadline:
                sys.exit("no go signal")
            time.sleep(0.01)

    def take(inst, payload, actor):
        token = flowlock.fencing_token()
        print(json.dumps({"step": {"version": inst.version, "fencing": token}}), flush=True)
        if pause_at == "step":
            pause("step")
        return {**inst.data, "stock": inst.data["stock"] - 1, "by": actor}

    async def main():
        store = PostgresStore(url, schema=schema, pool_size=2)
        if kind == "redis":
            from flowlock.locks.redis import RedisLocks
            locks = RedisLocks(redis_url, namespace=namespace, fence_floor=store.fencing_floor)
        else:
            from flowlock.locks.advisory import AdvisoryLocks
            locks = AdvisoryLocks(url, namespace=namespace, schema=schema)
        if careless == "1":
            Held.check = lambda self: None  # a careless holder: only the database can stop it
        if pause_at == "read":
            # The strategy's first read happens under the lease, before the step: pausing
            # there, A reads the instance only after B has written it.
            unpaused_read = store.read
            async def read(instance_id, request_ids):
                pause("read")
                return await unpaused_read(instance_id, request_ids)
            store.read = read
        leases = [flowlock.Distributed(ttl=2.0)]
        async with flowlock.Engine(store, locks=locks, strategies=leases) as engine:
            await engine.register(flowlock.Workflow("stock", states=["open"], initial="open",
                transitions=[flowlock.Transition("take", source="open", target="open",
                                                 effect=take)]))
            try:
                out = await engine.fire("sku", "take", actor="A", strategy="distributed")
                print(json.dumps({"applied": out.applied}), flush=True)
            except flowlock.FlowlockError as exc:
                print(json.dumps({"error": type(exc).__name__, "message": str(exc)}), flush=True)

    asyncio.run(main())
    """
)

# (A skips its own lease check, where A pauses): what refuses A's write, in the message of
# the LockLost it gets, and the version A's step read.
PAUSED = {
    # A's own lease check, after its step: the lease ran out on its clock.
    "checked-in-step": ("0", "step", "its ttl ran out on the local clock", 1),
    # The database: A read version 1, B wrote version 2: the version check refuses A (its
    # stale token too); the strategy then sees the newer token and reports LockLost.
    "careless-stale-version": ("1", "step", "a newer lease (fencing token above", 1),
    # The database: A read after B wrote, so its version is current and only the fencing
    # clause (A's token below B's) can refuse the write.
    "careless-current-version": ("1", "read", "a newer lease (fencing token above", 2),
}


async def _read_until(proc: asyncio.subprocess.Process, key: str) -> list[dict[str, Any]]:
    """A's JSON lines up to and including the first that has ``key``."""
    assert proc.stdout is not None and proc.stderr is not None
    lines: list[dict[str, Any]] = []
    while not lines or key not in lines[-1]:
        raw = await asyncio.wait_for(proc.stdout.readline(), 60)
        if not raw:
            raise AssertionError(f"A ended early: {lines} {(await proc.stderr.read()).decode()}")
        lines.append(json.loads(raw))
    return lines


async def _wait_until(condition: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + 30
    while not await condition():
        assert time.monotonic() < deadline, f"{what} did not happen within 30 s"
        await asyncio.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(PAUSED))
async def test_paused_holder_cannot_write_after_losing_its_lease(
    factory: Factory, request: pytest.FixtureRequest, pg_url: str, pg_schema: str,
    redis_url: str, redis_namespace: str, tmp_path: Path, sql_history: SqlHistory, variant: str,
) -> None:  # fmt: skip
    """Holder A is SIGSTOPped holding its lease (in its step, or before its read); once the
    lease has run out B takes it and writes; A resumes and gets LockLost from what the variant
    says: its own lease check, the version check, or the fencing clause alone (a careless
    holder whose version is current). Nothing of A's is written; B's token is above A's."""
    careless, pause_at, refused_by, version_read = PAUSED[variant]
    kind = request.node.callspec.params["factory"]
    engine = await factory(pool_size=5, strategies=[flowlock.Distributed(wait=5.0)])
    assert engine.locks is not None
    locks = engine.locks

    def take(inst: Any, payload: Any, actor: str | None) -> dict[str, Any]:
        return {**inst.data, "stock": inst.data["stock"] - 1, "by": actor}

    # A's `take` (PAUSABLE's, the same step with a pause in it) is named "__main__:take": named
    # alike, both processes register one definition version and A may fire at the instance.
    take.__module__, take.__qualname__ = "__main__", "take"
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
        careless, pause_at, str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        before = await _read_until(proc, "paused")
        assert before[-1] == {"paused": pause_at}
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            # A holds the lease until its ttl runs out under it: the Redis key expires, or the
            # server ends A's idle lease session and the advisory lock goes with it.
            await _wait_until(
                lambda: _free(locks, "sku"), "A's lease running out while A is stopped"
            )
            b = await engine.fire("sku", "take", actor="B", strategy="distributed")
            assert b.applied and b.instance.version == 2
        finally:
            (tmp_path / "go").touch()
            os.kill(proc.pid, signal.SIGCONT)
        raw_out, raw_err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    err = raw_err.decode()
    assert proc.returncode == 0, err[-2000:]
    lines = before + [json.loads(line) for line in raw_out.decode().splitlines()]
    steps = [x["step"] for x in lines if "step" in x]
    report = lines[-1]
    assert report.get("error") == "LockLost", (report, err[-2000:])
    assert refused_by in report["message"], report
    assert len(steps) == 1 and steps[0]["version"] == version_read, steps
    a_token = steps[0]["fencing"]
    final = await engine.get("sku")
    history = await engine.history("sku")
    assert final.data == {"stock": 9, "by": "B"} and final.version == 2
    assert [h.actor for h in history] == ["B"]
    assert history[0].fencing_token is not None and history[0].fencing_token > a_token
    verdict = check(final, history, expected_applied=1)
    assert verdict.ok, verdict.violations
    (await sql_history()).assert_matches({"sku": history})


async def _free(locks: LockBackend, key: str) -> bool:
    return not await locks.locked(key)


async def test_store_refuses_a_stale_token_at_the_current_version(
    pg_url: str, pg_schema: str, sql_history: SqlHistory
) -> None:
    """A commit at the current version with a fencing token below the last one written is
    refused by the fencing clause alone (nothing written); the same entry with the last token
    is applied."""
    store = PostgresStore(pg_url, schema=pg_schema, pool_size=2)
    async with flowlock.Engine(store) as engine:
        await engine.register(examples.inventory())
        await engine.create("inventory", instance_id="sku", data={"stock": 10})
        first = flowlock.HistoryEntry(
            instance_id="sku", version=2, event="reserve", from_state="open", to_state="open",
            actor="t5", request_id=None, strategy="distributed", data={"stock": 9},
            fencing_token=5,
        )  # fmt: skip
        assert (await store.commit((first,))) is not None
        current = await store.get("sku")
        stale = replace(first, version=current.version + 1, actor="t4", data={"stock": 8},
                        fencing_token=4)  # fmt: skip
        assert await store.commit((stale,)) is None
        assert (await store.get("sku")).version == current.version == 2
        assert await store.fencing_floor("sku") == 5
        assert [h.actor for h in await engine.history("sku")] == ["t5"]
        (await sql_history()).assert_matches({"sku": await engine.history("sku")})
        same_token = await store.commit((replace(stale, fencing_token=5),))
        assert same_token is not None and same_token.version == 3
        history = await engine.history("sku")
        assert [(h.actor, h.fencing_token) for h in history] == [("t5", 5), ("t4", 5)]
        (await sql_history()).assert_matches({"sku": history})


@pytest.mark.slow
async def test_tokens_keep_increasing_across_an_empty_redis_restart(
    pg_url: str, pg_schema: str, sql_history: SqlHistory
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
            stale = await store.read("sku", ())  # the current version: only the token is stale
            refused = await store.commit(
                (flowlock.HistoryEntry(
                    instance_id="sku", version=stale.instance.version + 1, event="reserve",
                    from_state="open", to_state="open", actor="stale", request_id=None,
                    strategy="distributed", data={"stock": 0}, fencing_token=held.fencing,
                ),)
            )  # fmt: skip
            assert refused is None
            assert await engine.history("sku") == history
            verdict = check(await engine.get("sku"), history, expected_applied=6)
            assert verdict.ok, verdict.violations
            (await sql_history()).assert_matches({"sku": history})


async def test_unreachable_redis_is_a_typed_error_within_the_bound(
    pg_url: str, pg_schema: str, sql_history: SqlHistory
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
        assert time.monotonic() - started < 1.0 + 5  # the wait bound, generously
        assert (await engine.get("req")).version == 1
        assert await engine.history("req") == []
        (await sql_history()).assert_matches({"req": []})
