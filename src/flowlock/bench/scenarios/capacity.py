"""Instances moving in and out of a state of capacity 5 per key: never more than 5 holders.

`capacity-spread`: 10 N callers (1,000 for the default 100 workers) each move M instances of
their own (10: 10,000 instances) in and out of `held`, over one key per 20 callers (50 keys).
`capacity-storm`: the same callers, each with one instance of ONE key, enter, hold 1 ms and
leave, M times (3). `-s capacity` names both. `--quick` runs N / 2 callers, once each.

A refused enter (CapacityReached) is retried after a jittered, growing sleep (5 ms doubling up
to 1 ms per caller of the round) for up to `ENTER_BOUND` seconds; past it the caller gives up
and its last refusal is the call's answer. The raw floor does the same rule by hand
(`flowlock.bench.capacity_raw`).

The verdict: the generic history check, plus the slot log replayed in (key, seq) order never
above the limit, consistent with itself and with the history (`flowlock.bench.capacity_results`).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from flowlock.bench.capacity_raw import TABLES, add_counters, move, read_log
from flowlock.bench.capacity_read import log_rows, read_rows
from flowlock.bench.capacity_results import (
    SLOT_LOG,
    CapacityFigures,
    LogRow,
    jain,
    match_history,
    prove_holders,
)
from flowlock.bench.raw import NAME as RAW
from flowlock.bench.results import CallSpec, Judgement, Params, RoundPlan, RoundRecord
from flowlock.bench.scenarios.base import Fired, Floor, Scenario, Session
from flowlock.checker import Violation
from flowlock.checker.constraints import check_constraints, slot_rules
from flowlock.core.constraints import Capacity, CapacityReached, State
from flowlock.core.definition import Transition, Workflow
from flowlock.core.errors import TransitionRefused
from flowlock.core.models import HistoryEntry, Instance
from flowlock.engine import Engine
from flowlock.stores.constraint_store import ConstraintRows

__all__ = [
    "BACKOFF_FIRST",
    "BACKOFF_PER_CALLER",
    "CALLERS_PER_KEY",
    "CALLERS_PER_WORKER",
    "ENTER_BOUND",
    "HELD",
    "KIND",
    "LIMIT",
    "WORKFLOW",
    "CapacitySpread",
    "CapacityStorm",
    "CapacityWait",
    "SlotNotTaken",
    "capacity_workflow",
    "slot_key",
]

WORKFLOW = "capacity"
IDLE = "idle"
HELD = "held"
KIND = f"{WORKFLOW}.{HELD}"
"""The slots' kind: the default, `<workflow>.<state>`."""
LIMIT = 5
CALLERS_PER_WORKER = 10
"""Callers per `--workers` (10 N: 1,000 for the default 100); `--quick` runs N / 2 (50)."""
CALLERS_PER_KEY = 20
"""Spread: one key per 20 callers (50 keys for 1,000 callers, 5 for 100)."""
ENTER_BOUND = 10.0
"""Seconds a caller retries a refused enter before it gives up: every wait has a bound."""
BACKOFF_FIRST = 0.005
"""The first sleep after a refusal (seconds); each next one doubles, up to the round's cap."""
BACKOFF_PER_CALLER = 0.001
"""The cap of a caller's sleep is 1 ms per caller of the round (1 s for 1,000, 0.1 s for 100):
the waiters then poll about a thousand times a second together, whatever their number. A
lower cap measured worse, not better: at 50 ms for 1,000 callers the refused attempts took the
pool's connections from the holders' leaves, and the raw floor's storm fell from about 270 to
20 applied/s."""
_WARMUP_CALLERS = 100
_CREATE_CONCURRENCY = 64


def slot_key(inst: Instance) -> object:
    """The key an instance counts under: its data's `key`."""
    return inst.data["key"]


def capacity_workflow(name: str = WORKFLOW, wait: float | None = None) -> Workflow:
    """idle -> held (capacity `LIMIT` per `data["key"]`) -> idle, by `enter` and `leave`;
    `wait`: seconds an enter waits for a slot inside the engine (`Capacity(wait=)`)."""
    held = State(HELD, capacity=Capacity(key=slot_key, limit=LIMIT, wait=wait))
    return Workflow(
        name,
        states=[IDLE, held],
        initial=IDLE,
        transitions=[
            Transition("enter", source=IDLE, target=held),
            Transition("leave", source=held, target=IDLE),
        ],
    )


class SlotNotTaken(TransitionRefused):
    """The caller's enter never got a slot (it gave up after the bound): nothing to leave.
    Answered without a call to the engine, as a refusal."""

    def __init__(self, instance_id: str) -> None:
        super().__init__(
            f"instance {instance_id!r} never entered {HELD!r} (its caller gave up after "
            f"{ENTER_BOUND:g} s without a slot); its leave is not made"
        )


@dataclass(slots=True)
class _Round:
    """What the callers of the running round tally in this process."""

    keys: dict[str, str]
    """instance id -> its key"""
    versions: dict[str, int]
    """instance id -> the version the raw floor last wrote (1 after create)"""
    rng: random.Random
    held: set[str] = field(default_factory=set)
    refusals: Counter[str] = field(default_factory=Counter)
    """CapacityReached answers per caller (actor)."""
    gave_up: int = 0
    cap: float = 1.0
    """The longest sleep between two tries of a refused enter (seconds)."""


class _Capacity(Scenario):
    """What both capacity scenarios share: the workflow, the retries, the proof."""

    default_rounds = 1
    quick_rounds = 1
    quick_ops = 1
    uses_ops = True
    floor: Floor = "counter"
    tallied = True
    full_by_default = False
    hold = 0.0
    """Seconds a caller holds its slot before it leaves (counted in the leave's latency)."""
    floor_limit = LIMIT
    workflow = WORKFLOW
    """The workflow's name: its slots' kind is `<workflow>.held`."""
    wait: float | None = None
    """`Capacity(wait=)`: the engine waits for a slot, woken by releases, and the caller
    does not poll (the raw floor, which has no such wait, still does)."""
    """The limit the raw floor's counter UPDATE enforces. The verdict holds every pair to
    `LIMIT`: a floor with a looser guard fails it (the tests' deliberately broken floor)."""

    def __init__(self) -> None:
        self._round: _Round | None = None

    def workflows(self, params: Params) -> Sequence[Workflow]:
        return [capacity_workflow(self.workflow, self.wait)]

    @property
    def kind(self) -> str:
        return f"{self.workflow}.{HELD}"

    def callers(self, workers: int, quick: bool) -> int:
        return max(1, workers // 2) if quick else CALLERS_PER_WORKER * workers

    def key_count(self, callers: int) -> int:
        raise NotImplementedError

    def owned(self, ops: int) -> int:
        """How many instances one caller moves (spread: `ops`; storm: one)."""
        raise NotImplementedError

    def cycles(self, ops: int) -> int:
        """How many times a caller moves each of its instances in and out (storm: `ops`)."""
        raise NotImplementedError

    async def prepare(self, pool: asyncpg.Pool) -> None:
        await pool.execute(TABLES)

    async def setup(
        self, engine: Engine, key: str, params: Params, rng: random.Random
    ) -> RoundPlan:
        callers = min(params.workers, _WARMUP_CALLERS) if params.warmup else params.workers
        keys = [f"{key}-k{k}" for k in range(self.key_count(callers))]
        per = self.owned(params.ops)
        owned = [[f"{key}-c{c}-{j}" for j in range(per)] for c in range(callers)]
        key_of = {
            iid: keys[(c * per + j) % len(keys)]
            for c, ids in enumerate(owned)
            for j, iid in enumerate(ids)
        }
        sem = asyncio.Semaphore(_CREATE_CONCURRENCY)

        async def create(iid: str) -> None:
            async with sem:
                await engine.create(self.workflow, instance_id=iid, data={"key": key_of[iid]})

        await asyncio.gather(*(create(i) for i in key_of))
        pool = getattr(engine.store, "pool", None)
        if isinstance(pool, asyncpg.Pool):
            await add_counters(pool, keys)  # the raw floor's counter rows
        cycles = self.cycles(params.ops)
        lanes = tuple(
            tuple(
                CallSpec(iid, event, actor=f"c{c}")
                for iid in ids
                for _ in range(cycles)
                for event in ("enter", "leave")
            )
            for c, ids in enumerate(owned)
        )
        self._round = _Round(
            key_of,
            dict.fromkeys(key_of, 1),
            random.Random(rng.random()),
            cap=max(BACKOFF_FIRST, BACKOFF_PER_CALLER * callers),
        )
        return RoundPlan(dict.fromkeys(key_of, IDLE), lanes=lanes, extra={"keys": keys})

    def _tally(self) -> _Round:
        if self._round is None:  # pragma: no cover - the runner sets a round up first
            raise RuntimeError("the capacity scenario fired before its round was set up")
        return self._round

    async def _once(self, session: Session, call: CallSpec, take: bool) -> Fired:
        tally = self._tally()
        if session.strategy != RAW:
            return await session.fire(call)
        iid = call.instance_id
        tally.versions[iid] = await move(
            session.pool,
            instance_id=iid,
            key=tally.keys[iid],
            kind=self.kind,
            limit=self.floor_limit,
            take=take,
            version=tally.versions[iid],
            states=(IDLE, HELD) if take else (HELD, IDLE),
            event=call.event,
            actor=call.actor,
        )
        return Fired("applied")

    async def fire(self, session: Session, call: CallSpec) -> Fired:
        tally = self._tally()
        iid = call.instance_id
        if call.event == "leave":
            if iid not in tally.held:
                raise SlotNotTaken(iid)
            if self.hold:
                await asyncio.sleep(self.hold)
            fired = await self._once(session, call, take=False)
            tally.held.discard(iid)
            return fired
        if self.wait is not None and session.strategy != RAW:
            return await self._waited(session, call)
        until = time.monotonic() + ENTER_BOUND
        backoff = BACKOFF_FIRST
        while True:
            try:
                fired = await self._once(session, call, take=True)
            except CapacityReached:
                tally.refusals[call.actor or ""] += 1
                pause = backoff * tally.rng.uniform(0.5, 1.5)
                if time.monotonic() + pause > until:
                    tally.gave_up += 1
                    raise
                await asyncio.sleep(pause)
                backoff = min(2 * backoff, tally.cap)
                continue
            tally.held.add(iid)
            return fired

    async def _waited(self, session: Session, call: CallSpec) -> Fired:
        """One enter that the engine holds until a slot frees (at most `wait` seconds)."""
        tally = self._tally()
        try:
            fired = await self._once(session, call, take=True)
        except CapacityReached:
            tally.refusals[call.actor or ""] += 1
            tally.gave_up += 1
            raise
        tally.held.add(call.instance_id)
        return fired

    async def readback(
        self, session: Session, plan: RoundPlan
    ) -> tuple[dict[str, Instance], dict[str, list[HistoryEntry]], dict[str, Any]]:
        finals, histories, extra = await super().readback(session, plan)
        keys = list(plan.extra["keys"])
        rows: ConstraintRows | None = None
        log: list[LogRow] | None
        if session.strategy == RAW:
            log = await read_log(session.pool, keys)
        else:
            rows = await read_rows(session.pool, self.kind, keys)
            log = None if rows is None else log_rows(rows)
        tally = self._tally()
        return (
            finals,
            histories,
            {
                **extra,
                "log": log,
                "rows": rows,
                "refusals": dict(tally.refusals),
                "gave_up": tally.gave_up,
            },
        )

    def judge(self, record: RoundRecord, params: Params) -> Judgement:
        log: list[LogRow] | None = record.extra.get("log")
        if log is None:
            return Judgement(
                False,
                (
                    Violation(
                        SLOT_LOG,
                        "the store kept no slot log (no flowlock_slot_log table): it applied no "
                        "capacity claims, so nothing held the limit",
                    ),
                ),
            )
        found = list(match_history(log, record.histories, HELD))
        rows: ConstraintRows | None = record.extra.get("rows")
        if rows is None:
            found.extend(prove_holders(log, LIMIT).problems)  # the raw floor's own log
        else:
            # The engine's rows: flowlock's own constraint check, as `flowlock check` runs it.
            found.extend(
                check_constraints(
                    rows,
                    record.finals.values(),
                    (e for entries in record.histories.values() for e in entries),
                    {self.workflow: slot_rules(capacity_workflow(self.workflow, self.wait))},
                )
            )
        return Judgement(False, tuple(found))

    def capacity(self, records: Sequence[RoundRecord]) -> CapacityFigures | None:
        log = [row for record in records for row in record.extra.get("log") or ()]
        shares: list[float] = []
        refusals = gave_up = 0
        for record in records:
            refused: dict[str, int] = record.extra.get("refusals", {})
            refusals += sum(refused.values())
            gave_up += int(record.extra.get("gave_up", 0))
            entered = Counter(
                r.call.actor
                for r in record.results
                if r.kind == "applied" and r.call.event == "enter"
            )
            if self.wait is None:
                waited = [actor for actor, n in refused.items() if n > 0]
            else:
                # The engine's waits are not seen from here: every caller is a waiter.
                waited = sorted({c.actor or "" for lane in record.plan.lanes for c in lane})
            shares.extend(float(entered[actor]) for actor in waited)
        keys = len(records[0].plan.extra["keys"]) if records else 0
        return CapacityFigures(
            limit=LIMIT,
            keys=keys,
            max_holders=prove_holders(log, LIMIT).max_holders,
            refusals=refusals,
            gave_up=gave_up,
            waiters=len(shares),
            jain_fairness=jain(shares),
            log_events=len(log),
        )


class CapacitySpread(_Capacity):
    """10 N callers move M instances each in and out of `held`, one key per 20 callers."""

    name = "capacity-spread"
    summary = "10 N callers move M instances each in and out of a state of capacity 5, 50 keys"
    default_ops = 10

    def key_count(self, callers: int) -> int:
        return max(1, callers // CALLERS_PER_KEY)

    def owned(self, ops: int) -> int:
        return ops

    def cycles(self, ops: int) -> int:
        return 1


class CapacityStorm(_Capacity):
    """10 N callers, one key of capacity 5: each enters, holds 1 ms and leaves, M times."""

    name = "capacity-storm"
    summary = "10 N callers on ONE key of capacity 5: enter, hold 1 ms, leave, M times"
    default_ops = 3
    hold = 0.001

    def key_count(self, callers: int) -> int:
        return 1

    def owned(self, ops: int) -> int:
        return 1

    def cycles(self, ops: int) -> int:
        return ops


class CapacityWait(CapacityStorm):
    """The storm with `Capacity(wait=10)`: the engine holds a refused enter until a release
    wakes it, and the caller tries once (the raw floor still polls)."""

    name = "capacity-wait"
    summary = "capacity-storm with Capacity(wait=10 s): the engine waits for a slot, no polling"
    workflow = "capacity-wait"
    wait = ENTER_BOUND
