"""A soak worker: `python -m flowlock_lab.soak_worker SPEC`, SPEC a `WorkerSpec` as JSON.

It runs `tasks` callers until stdin closes or the stop time comes.
Each call is recorded and streamed to the parent as it starts and ends.
So a killed worker's calls in flight are known, as unknown.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import sys
import time
import zlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

from flowlock import examples
from flowlock.backends import build_postgres_store
from flowlock.bench.config import Target
from flowlock.bench.host import loop_factory
from flowlock.bench.registry import STRATEGIES, BuildContext
from flowlock.bench.scenarios.steps import counter
from flowlock.bench.session import build_lock_backend
from flowlock.checker import Recorder
from flowlock.core.errors import FlowlockError
from flowlock.core.models import Instance, Outcome
from flowlock.engine import Engine
from flowlock.strategies.base import Strategy
from flowlock.strategies.distributed import Distributed
from flowlock_lab.soak_results import OutcomeKind, classify

__all__ = ["WorkerSpec", "hot_id", "main", "spread_id", "storm_id"]

_STORM_SHARE, _HOT_SHARE, _SPREAD_SHARE = 0.35, 0.2, 0.35  # the rest: gets
_REJECT_SHARE = 0.15  # of storm fires: an approve and a reject race, exactly one decides
_OPEN_RETRY = 0.5  # between attempts to open while the servers are being restarted
_CLOSE_BOUND = 15.0

Op = Literal["create", "fire", "get"]


def storm_id(slot: int) -> str:
    return f"storm-{slot}"


def hot_id(slot: int) -> str:
    return f"hot-{slot}"


def spread_id(k: int) -> str:
    return f"spread-{k}"


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What one worker process runs: its name, connections, strategies, callers and seed.

    It also has the run's clock, `started` and `stop_at`, on the shared monotonic clock.
    Then the storm and hot slot lengths, and how many spread counters there are.
    Then the distributed strategies' lease ttl and wait, and the bound on one call.
    `batching` says whether the engine batches concurrent calls on one instance.
    """

    name: str
    target: Mapping[str, Any]
    strategies: tuple[str, ...]
    tasks: int
    seed: str
    started: float
    stop_at: float
    storm_slot: float
    hot_slot: float
    spread: int
    lease_ttl: float
    lease_wait: float
    call_bound: float
    batching: bool = True

    def to_json(self) -> str:
        doc = asdict(self)
        doc["target"] = dict(self.target)
        return json.dumps(doc)

    @classmethod
    def from_json(cls, raw: str) -> WorkerSpec:
        doc = json.loads(raw)
        doc["strategies"] = tuple(doc["strategies"])
        return cls(**doc)


def _emit(doc: Mapping[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc, separators=(",", ":")) + "\n")
    sys.stdout.flush()


# -- the engine ------------------------------------------------------------------------------------


async def _open_engine(spec: WorkerSpec, stack: contextlib.AsyncExitStack) -> Engine:
    """One engine with every strategy of the run; its store and lock backends go on `stack`."""
    target = Target.from_json(spec.target)
    rng = random.Random(f"{spec.seed}/locks")
    store = build_postgres_store(
        target.url,
        schema=target.schema,
        pool_size=target.pool_size,
        min_size=1,
        auto_migrate=False,
        application_name=target.application_name,
        connect_timeout=2.0,
        acquire_timeout=5.0,
        pipeline=spec.batching,
    )
    strategies: dict[str, Strategy] = {}
    for name in spec.strategies:
        built = STRATEGIES[name]
        if built.locks is not None:
            locks = build_lock_backend(built.locks, target, store, target.pool_size, rng)
            await locks.open()
            stack.push_async_callback(locks.aclose)
            strategies[name] = Distributed(locks=locks, ttl=spec.lease_ttl, wait=spec.lease_wait)
        elif built.build is not None:
            strategies[name] = built.build(BuildContext(random.Random(f"{spec.seed}/{name}")))
    engine = Engine(store, strategy="pessimistic", strategies=strategies, batching=spec.batching)
    await stack.enter_async_context(engine)
    await engine.register(examples.approval())
    await engine.register(counter())
    return engine


# -- one caller ------------------------------------------------------------------------------


class _Caller:
    """One task's loop of calls, each recorded and streamed."""

    def __init__(
        self, spec: WorkerSpec, engine: Engine, recorder: Recorder, index: int, stop: asyncio.Event
    ) -> None:
        self.spec = spec
        self.engine = engine
        self.recorder = recorder
        self.name = f"{spec.name}-t{index}"
        self.rng = random.Random(f"{spec.seed}/t{index}")
        self.stop = stop
        self.numbers = itertools.count()
        self.tried_storm = self.tried_hot = -1

    async def run(self) -> None:
        while not self.stop.is_set() and time.monotonic() < self.spec.stop_at:
            await self.one()

    def _slot(self, length: float) -> int:
        return int((time.monotonic() - self.spec.started) / length)

    async def one(self) -> None:
        pick = self.rng.random()
        if pick < _STORM_SHARE:
            slot = self._slot(self.spec.storm_slot)
            iid = storm_id(slot)
            if slot != self.tried_storm:
                self.tried_storm = slot
                await self.call(iid, "create", None, self._create(iid, "approval", {"slot": slot}))
                return
            event = "reject" if self.rng.random() < _REJECT_SHARE else "approve"
            await self.call(iid, "fire", event, self._fire(iid, event))
        elif pick < _STORM_SHARE + _HOT_SHARE:
            slot = self._slot(self.spec.hot_slot)
            iid = hot_id(slot)
            if slot != self.tried_hot:
                self.tried_hot = slot
                await self.call(iid, "create", None, self._create(iid, "counter", {"n": 0}))
                return
            await self.call(iid, "fire", "step", self._fire(iid, "step"))
        elif pick < _STORM_SHARE + _HOT_SHARE + _SPREAD_SHARE:
            iid = spread_id(self.rng.randrange(self.spec.spread))
            await self.call(iid, "fire", "step", self._fire(iid, "step"))
        else:
            iid = spread_id(self.rng.randrange(self.spec.spread))
            if self.rng.random() < 0.5:
                iid = hot_id(self._slot(self.spec.hot_slot))
            await self.call(iid, "get", None, lambda: self.engine.get(iid))

    def _create(
        self, iid: str, workflow: str, data: Mapping[str, Any]
    ) -> Callable[[], Awaitable[Instance]]:
        return lambda: self.engine.create(workflow, instance_id=iid, data=data)

    def _strategy(self, iid: str) -> str:
        """A strategy at random; a distributed one on the lock backend that guards `iid`."""
        strategy = self.rng.choice(self.spec.strategies)
        if STRATEGIES[strategy].locks is None:
            return strategy
        # Why one backend per instance: two lock services guarding one resource would each
        # grant a lease on it, and fencing would refuse whichever token is lower (LockLost),
        # drowning the leases really lost to pauses and restarts in that noise.
        leased = [n for n in self.spec.strategies if STRATEGIES[n].locks is not None]
        return leased[zlib.crc32(iid.encode()) % len(leased)]

    def _fire(self, iid: str, event: str) -> Callable[[], Awaitable[Outcome]]:
        strategy = self._strategy(iid)
        request_id = f"{self.name}-{next(self.numbers)}"
        return lambda: self.engine.fire(
            iid, event, actor=self.name, request_id=request_id, strategy=strategy
        )

    async def call(
        self,
        iid: str,
        op: Op,
        event: str | None,
        make: Callable[[], Awaitable[Instance | Outcome]],
    ) -> None:
        handle = self.recorder.invoke(iid, op, event)
        number = f"{self.name}-{next(self.numbers)}"
        _emit({"e": "inv", "n": number, "t": handle.invoked_at, "i": iid, "op": op, "ev": event})
        error: str | None = None
        kind: OutcomeKind
        try:
            async with asyncio.timeout(self.spec.call_bound) as bound:
                result = await make()
        except TimeoutError as exc:
            if not bound.expired():
                kind, error, record = "escaped", type(exc).__name__, handle.unknown(exc)
            else:
                kind, error = "hung", "no answer within the soak's bound on a call"
                record = handle.unknown(error)
        except Exception as exc:
            kind, status = classify(exc)
            error = type(exc).__name__
            record = handle.fail(exc) if status == "fail" else handle.unknown(exc)
            if not isinstance(exc, FlowlockError):
                _emit({"e": "escaped", "n": number, "x": f"{type(exc).__name__}: {exc}"})
        else:
            record = handle.ok(result)
            if isinstance(result, Outcome):
                kind = "applied" if result.applied else "idempotent"
            else:
                kind = "created" if op == "create" else "read"
        _emit({"e": "end", "n": number, "k": kind, "x": error, "r": record.to_dict()})


# -- the process ----------------------------------------------------------------------------------


async def _stdin_closed() -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while await reader.read(4096):
        pass


async def _until_stopped(spec: WorkerSpec, stop: asyncio.Event) -> None:
    closed = asyncio.create_task(_stdin_closed())
    try:
        await asyncio.wait_for(asyncio.shield(closed), max(0.0, spec.stop_at - time.monotonic()))
    except TimeoutError:
        pass
    finally:
        closed.cancel()
        stop.set()


async def _serve(spec: WorkerSpec) -> None:
    stop = asyncio.Event()
    watcher = asyncio.create_task(_until_stopped(spec, stop))
    recorder = Recorder()
    async with contextlib.AsyncExitStack() as outer:
        engine: Engine | None = None
        while engine is None and not stop.is_set():
            stack = contextlib.AsyncExitStack()
            try:
                engine = await _open_engine(spec, stack)
            except FlowlockError as exc:
                await stack.aclose()
                _emit({"e": "note", "m": f"open failed, retrying: {type(exc).__name__}: {exc}"})
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), _OPEN_RETRY)
            else:
                outer.push_async_callback(_close_within, stack)
        if engine is not None:
            _emit({"e": "ready"})
            callers = [_Caller(spec, engine, recorder, k, stop) for k in range(spec.tasks)]
            await asyncio.gather(*(c.run() for c in callers))
    await watcher
    _emit({"e": "bye", "calls": len(recorder)})


async def _close_within(stack: contextlib.AsyncExitStack) -> None:
    try:
        await asyncio.wait_for(stack.aclose(), _CLOSE_BOUND)
    except (TimeoutError, FlowlockError) as exc:
        _emit({"e": "note", "m": f"closing: {type(exc).__name__}: {exc}"})


def main() -> None:
    """Run the callers of the spec given as the first argument, until stdin closes."""
    spec = WorkerSpec.from_json(sys.argv[1])
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(_serve(spec))


if __name__ == "__main__":
    main()
