"""A worker process of the cross-process constraint tests (test_constraints_procs_pg.py).

Run as ``python constraint_worker.py CONFIG_JSON``. It opens an engine on the shared database
(PostgreSQL, or a SQLite file), registers constraint_kit's workflows, waits at the start gate
(proc_worker.Gate), runs its ``mode`` in its contended phase, records the phase and prints one
JSON line (its report).

- ``storm``: ``callers`` tasks, until ``seconds`` are up, each picks one of ``ids`` at random and
  moves it: ``start`` when it is queued, ``finish`` (or now and then ``reassign`` to another of
  ``keys``) when it is in review. Capacity refusals are expected: the report counts them and
  keeps those that did not name ``LIMIT`` holders. Options: ``blind``, a start or a finish at
  random without a read first (concurrent calls on one instance batch); ``swap``, never a
  finish (a review in review always moves to another reviewer); ``in_transaction``, each call
  fired inside a transaction of the application's own that also writes an audit row when it
  applied; ``hold`` (instance ids), each of them also started inside a transaction of its own
  that never commits (the process is to be killed).
- ``desks``: a caller per instance of ``ids`` takes a desk's seat (waiting for one to free),
  keeps it ``seated`` seconds (0.02) and leaves, ``rounds`` times.
- ``unique``: creates each of ``ids`` (a subscription of ``customer``) at once, in ``tasks``
  concurrent tasks; reports each create's answer (the holder a UniqueViolation names).
- ``churn``: ``callers`` tasks keep creating subscriptions of ``customer`` until ``seconds``
  are up, each one created cancelled a moment later.
- ``rate``: ``callers`` tasks ping the instances of ``ids`` until ``seconds`` are up; a
  RateLimited caller sleeps a little (not its whole retry_after: the callers keep pressing).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: constraint_kit

from proc_worker import all_started, ready_and_wait, record_phase

import flowlock
from constraint_kit import LIMIT, workflows


def _engine(cfg: dict[str, Any]) -> flowlock.Engine:
    """The engine of `cfg`: its backend, strategy (distributed: leases in Redis) and pool."""
    strategy = cfg.get("strategy", "optimistic")
    optimistic = flowlock.Optimistic(max_attempts=cfg.get("max_attempts", 50), backoff_cap=0.05)
    if cfg.get("backend", "postgres") == "sqlite":
        from flowlock.stores.sqlite import SqliteStore

        sqlite = SqliteStore(cfg["path"], busy_timeout=30.0, pool_size=cfg.get("pool_size", 2))
        return flowlock.Engine(sqlite, strategies=[optimistic], strategy=strategy)
    from flowlock.stores.postgres import PostgresStore

    # Small pools: 4 processes must fit a server other tests share (tests/pg_budget.py).
    store = PostgresStore(
        cfg["url"],
        schema=cfg["schema"],
        pool_size=cfg.get("pool_size", 4),
        application_name=cfg.get("application_name", "flowlock"),
    )
    if strategy == "distributed":
        from flowlock.locks.redis import RedisLocks

        locks = RedisLocks(
            cfg["redis_url"], namespace=cfg["namespace"], fence_floor=store.fencing_floor
        )
        leases = flowlock.Distributed(wait=30.0)
        return flowlock.Engine(
            store, locks=locks, strategies=[optimistic, leases], strategy=strategy
        )
    return flowlock.Engine(store, strategies=[optimistic], strategy=strategy)


class Tally:
    """What one worker saw: applied events, errors by type (a sample of each), odd refusals."""

    def __init__(self) -> None:
        self.calls = 0
        self.applied: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.samples: dict[str, str] = {}
        self.odd: list[str] = []
        self.retry_after: list[float] = []
        self.waited: list[float] = []

    def error(self, exc: BaseException) -> None:
        name = type(exc).__name__
        self.errors[name] += 1
        self.samples.setdefault(name, str(exc)[:400])

    def report(self, proc: int, **more: Any) -> dict[str, Any]:
        return {
            "proc": proc,
            "calls": self.calls,
            "applied": self.applied,
            "errors": self.errors,
            "samples": self.samples,
            "odd": self.odd[:20],
            "retry_after": [min(self.retry_after, default=0), max(self.retry_after, default=0)],
            "waited": max(self.waited, default=0.0),
            **more,
        }


async def _in_transaction(
    engine: flowlock.Engine,
    pool: Any,
    cfg: dict[str, Any],
    iid: str,
    event: str,
    payload: dict[str, Any] | None,
) -> flowlock.Outcome:
    """`event` fired inside a transaction of the application's own, which also writes a row
    of its own (the audit table) when the transition applied: both commit, or neither."""
    async with pool.acquire() as conn, conn.transaction():
        out = await engine.fire(
            iid, event, actor=f"p{cfg['proc']}", payload=payload, connection=conn
        )
        if out.applied:
            await conn.execute(
                f'INSERT INTO "{cfg["schema"]}".audit (instance_id, version, event)'
                " VALUES ($1, $2, $3)",
                iid,
                out.instance.version,
                event,
            )
    return out


async def _storm(engine: flowlock.Engine, cfg: dict[str, Any], tally: Tally, until: float) -> None:
    ids: list[str] = cfg["ids"]
    keys: list[str] = cfg["keys"]
    pool = None
    if cfg.get("in_transaction"):  # the application's own connections, few (a shared server)
        import asyncpg

        pool = await asyncpg.create_pool(cfg["url"], min_size=1, max_size=3)

    async def caller(n: int) -> None:
        rng = random.Random(f"{cfg['proc']}-{n}")
        while time.monotonic() < until:
            iid = rng.choice(ids)
            tally.calls += 1
            try:
                if cfg.get("blind"):  # no read first: concurrent calls batch on the instance
                    event, payload = rng.choice(["start", "finish"]), None
                    out = await engine.fire(iid, event, actor=f"p{cfg['proc']}")
                    tally.applied[event] += out.applied
                    continue
                inst = await engine.get(iid)
                if inst.state == "queued":
                    event, payload = "start", None
                elif cfg.get("swap"):  # always to another reviewer: a release and a take
                    others = [k for k in keys if k != inst.data["reviewer"]]
                    event, payload = "reassign", {"reviewer": rng.choice(others)}
                elif len(keys) > 1 and rng.random() < 0.2:
                    event, payload = "reassign", {"reviewer": rng.choice(keys)}
                else:
                    event, payload = "finish", None
                if pool is None:
                    out = await engine.fire(iid, event, actor=f"p{cfg['proc']}", payload=payload)
                else:
                    out = await _in_transaction(engine, pool, cfg, iid, event, payload)
            except flowlock.CapacityReached as exc:
                tally.error(exc)
                if len(exc.holders) != LIMIT or exc.limit != LIMIT or iid in exc.holders:
                    tally.odd.append(f"{iid}: {exc.limit} {exc.holders}")
                await asyncio.sleep(rng.uniform(0, 0.01))
                continue
            except flowlock.FlowlockError as exc:
                tally.error(exc)
                continue
            if out.applied:
                tally.applied[event] += 1

    try:
        await asyncio.gather(*(caller(n) for n in range(cfg["callers"])))
    finally:
        if pool is not None:
            await pool.close()


async def _hold(engine: flowlock.Engine, cfg: dict[str, Any], iid: str, n: int) -> None:
    """Starts `iid` inside a transaction of a connection of its own, says so (a file `held-n`
    in the gate), and never commits: the process is to be killed in the middle of it."""
    import asyncpg

    server = {"application_name": cfg.get("application_name", "flowlock")}
    conn = await asyncpg.connect(cfg["url"], server_settings=server)
    deadline = time.monotonic() + 60.0
    while True:
        try:
            async with conn.transaction():
                # A lease cannot be held inside a transaction of the caller's: optimistic.
                own = "optimistic" if cfg.get("strategy") == "distributed" else None
                await engine.fire(iid, "start", actor=f"held-{n}", strategy=own, connection=conn)
                (Path(cfg["gate"]) / f"held-{n}").touch()
                await asyncio.sleep(600)  # killed long before
        except flowlock.CapacityReached:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.01)  # the key is full now: try again


async def _desks(engine: flowlock.Engine, cfg: dict[str, Any], tally: Tally) -> None:
    """Each caller, on an instance of its own, takes a seat (waiting for one), keeps it a
    moment and leaves, `rounds` times; the longest wait is reported."""

    async def caller(iid: str) -> None:
        for _ in range(cfg["rounds"]):
            tally.calls += 1
            began = time.monotonic()
            try:
                out = await engine.fire(iid, "take", actor=f"p{cfg['proc']}")
            except flowlock.FlowlockError as exc:
                tally.error(exc)
                return
            tally.waited.append(time.monotonic() - began)
            tally.applied["take"] += out.applied
            await asyncio.sleep(cfg.get("seated", 0.02))
            tally.calls += 1
            out = await engine.fire(iid, "leave", actor=f"p{cfg['proc']}")
            tally.applied["leave"] += out.applied

    await asyncio.gather(*(caller(iid) for iid in cfg["ids"]))


async def _unique(engine: flowlock.Engine, cfg: dict[str, Any]) -> dict[str, Any]:
    gate = asyncio.Semaphore(cfg.get("tasks", len(cfg["ids"])))
    answers: dict[str, Any] = {}

    async def one(iid: str) -> None:
        async with gate:
            try:
                made = await engine.create(
                    "subscription", instance_id=iid, data={"customer_id": cfg["customer"]}
                )
            except flowlock.UniqueViolation as exc:
                answers[iid] = {
                    "error": "UniqueViolation",
                    "holder": exc.holder,
                    "kind": exc.kind,
                    "key": exc.key,
                    "message": str(exc),
                }
            except flowlock.FlowlockError as exc:
                answers[iid] = {"error": type(exc).__name__, "message": str(exc)[:400]}
            else:
                answers[iid] = {"created": made.version}

    await asyncio.gather(*(one(iid) for iid in cfg["ids"]))
    return answers


async def _churn(engine: flowlock.Engine, cfg: dict[str, Any], tally: Tally, until: float) -> None:
    """Callers keep creating subscriptions of one customer; the one created is cancelled a
    moment later, making room for the next."""

    async def caller(n: int) -> None:
        rng = random.Random(f"{cfg['proc']}-{n}")
        k = 0
        while time.monotonic() < until:
            k += 1
            iid = f"c{cfg['proc']}-{n}-{k}"
            tally.calls += 1
            try:
                await engine.create(
                    "subscription", instance_id=iid, data={"customer_id": cfg["customer"]}
                )
            except flowlock.UniqueViolation as exc:
                tally.error(exc)
                if exc.holder is None or exc.holder == iid:
                    tally.odd.append(f"{iid}: holder {exc.holder!r}")
                await asyncio.sleep(rng.uniform(0, 0.005))
                continue
            except flowlock.FlowlockError as exc:
                tally.error(exc)
                continue
            tally.applied["create"] += 1
            await asyncio.sleep(rng.uniform(0, 0.01))
            out = await engine.fire(iid, "cancel", actor=f"p{cfg['proc']}")
            tally.applied["cancel"] += out.applied

    await asyncio.gather(*(caller(n) for n in range(cfg["callers"])))


async def _rate(engine: flowlock.Engine, cfg: dict[str, Any], tally: Tally, until: float) -> None:
    ids: list[str] = cfg["ids"]

    async def caller(n: int) -> None:
        rng = random.Random(f"{cfg['proc']}-{n}")
        while time.monotonic() < until:
            tally.calls += 1
            try:
                out = await engine.fire(rng.choice(ids), "ping", actor=f"p{cfg['proc']}")
            except flowlock.RateLimited as exc:
                tally.error(exc)
                tally.retry_after.append(exc.retry_after)
                await asyncio.sleep(min(exc.retry_after, rng.uniform(0.005, 0.03)))
                continue
            except flowlock.FlowlockError as exc:
                tally.error(exc)
                continue
            if out.applied:
                tally.applied["ping"] += 1

    await asyncio.gather(*(caller(n) for n in range(cfg["callers"])))


async def main(cfg: dict[str, Any]) -> None:
    tally = Tally()
    more: dict[str, Any] = {}
    async with _engine(cfg) as engine:
        for wf in workflows():
            await engine.register(wf)
        for iid in cfg.get("warm", [])[:4]:  # connections opened before the phase
            await engine.get(iid)
        await ready_and_wait(cfg["gate"], cfg["proc"])
        start = time.monotonic()
        await all_started(cfg["gate"], cfg["proc"])
        until = time.monotonic() + cfg.get("seconds", 0.0)
        if cfg["mode"] == "storm":
            held = [_hold(engine, cfg, iid, n) for n, iid in enumerate(cfg.get("hold", []))]
            await asyncio.gather(_storm(engine, cfg, tally, until), *held)
        elif cfg["mode"] == "desks":
            await _desks(engine, cfg, tally)
        elif cfg["mode"] == "churn":
            await _churn(engine, cfg, tally, until)
        elif cfg["mode"] == "unique":
            more["answers"] = await _unique(engine, cfg)
        else:
            await _rate(engine, cfg, tally, until)
        record_phase(cfg["gate"], cfg["proc"], start, time.monotonic())
    print(json.dumps(tally.report(cfg["proc"], **more)), flush=True)


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
