"""The issue's race: an approver's click and the expiry fall due in the same milliseconds.

Every instance of a round is an approval that expires `after` its creation. Each has one
caller, who fires `approve` at the instance's due time (within a couple of milliseconds
either side), while the timer services of the worker processes' engines fire `expire`.
Exactly one of the two may apply; the loser writes nothing.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import asyncpg

from flowlock.bench.results import CallSpec, Judgement, Params, RoundPlan, RoundRecord
from flowlock.bench.scenarios.base import Floor, Scenario, Session, results_for
from flowlock.bench.timer_results import Quantiles, RaceFigures
from flowlock.checker import DOUBLE_APPLY, LOST_UPDATE, Violation, check
from flowlock.core.definition import Transition, Workflow
from flowlock.core.models import TIMER_ACTOR, HistoryEntry, Instance, Timer, timer_request_id
from flowlock.engine import Engine
from flowlock.stores.base import EscalationBoard, TransactionalStore

__all__ = [
    "LAG_AFTER",
    "LAG_WORKFLOW",
    "RACE_WORKFLOW",
    "TIMER_NOT_ARMED",
    "Deadline",
    "create_together",
    "deadline_workflow",
    "entry_violations",
    "race_after",
]

RACE_WORKFLOW = "deadline"
"""The race's workflow: pending, then approved by a caller or rejected by its expiry."""
LAG_WORKFLOW = "deadline-lag"
"""The same definition for the timers section's lag and idle measurements (its own name, so
their timers and the race's never mix)."""
LAG_AFTER = 3600.0
"""The lag workflow's expiry, in seconds: its timers are armed as if created an hour before."""
JITTER = 0.002
"""Seconds either side of the due time at which each caller approves, at random (seeded)."""
SETTLE_BOUND = 60.0
"""The longest the readback waits for the last instance to be resolved, past its due time."""
_READS = 8  # concurrent reads of timers (and creates, off PostgreSQL)

TIMER_NOT_ARMED = "timer-not-armed"
"""A violation: a created instance has no armed expiry (or more than one)."""


def race_after(instances: int) -> float:
    """The race's `after` in seconds: time to create the round and arm its callers first.

    Half a second, plus 2 ms per instance (creating them in one transaction, reading their
    timers back, and sending the calls to the worker processes: about 1 ms per instance on
    the 2-core development machine).
    """
    return 0.5 + 0.002 * instances


def deadline_workflow(after: float, name: str = RACE_WORKFLOW) -> Workflow:
    """An approval that its `expire` rejects `after` seconds into its pending stay.

    No strategy of its own: the engine's default fires the timers (the pair's strategy).
    """
    return Workflow(
        name,
        states=["pending", "approved", "rejected"],
        initial="pending",
        transitions=[
            Transition("approve", source="pending", target="approved"),
            Transition(
                "expire", source="pending", target="rejected", after=timedelta(seconds=after)
            ),
        ],
    )


async def create_together(engine: Engine, workflow: str, ids: Sequence[str]) -> None:
    """Create every instance of `ids`; on PostgreSQL in one transaction of a caller's own.

    One transaction gives every instance the same creation time, so every expiry falls due
    at the same instant (the due time is the database's transaction time plus `after`).
    """
    store = engine.store
    pool: asyncpg.Pool | None = getattr(store, "pool", None)
    if isinstance(store, TransactionalStore) and isinstance(pool, asyncpg.Pool):
        async with pool.acquire() as conn, conn.transaction():
            for iid in ids:
                await engine.create(workflow, instance_id=iid, connection=conn)
        return
    gate = asyncio.Semaphore(_READS)

    async def one(iid: str) -> None:
        async with gate:
            await engine.create(workflow, instance_id=iid)

    await asyncio.gather(*(one(iid) for iid in ids))


async def _timers_of(engine: Engine, ids: Sequence[str]) -> dict[str, list[Timer]]:
    """Each instance's armed timers, read through the engine (a few reads at a time)."""
    gate = asyncio.Semaphore(_READS)

    async def one(iid: str) -> tuple[str, list[Timer]]:
        async with gate:
            return iid, await engine.timers(iid)

    return dict(await asyncio.gather(*(one(iid) for iid in ids)))


async def clock_offset(engine: Engine) -> float:
    """The database server's clock minus this machine's, in seconds (0 on the memory store).

    Due times are on the server's clock; callers sleep on this machine's.
    """
    store = engine.store
    if not (isinstance(store, TransactionalStore) and isinstance(store, EscalationBoard)):
        return 0.0  # the memory store shows due times on this machine's clock
    before = time.time()
    server = await store.now()
    return server - (before + time.time()) / 2


def entry_violations(
    iid: str, final: Instance, rows: Sequence[HistoryEntry], caller: str | None
) -> list[Violation]:
    """Whoever wrote the instance's one row is the one its final state names."""
    if len(rows) != 1 or final.state == "pending":
        return []  # counted elsewhere: a double apply, or nobody resolved it
    row = rows[0]
    expiry = timer_request_id(1, "expire", 0)
    if final.state == "approved" and (row.event != "approve" or row.actor != caller):
        return [
            Violation(
                LOST_UPDATE,
                f"instance {iid!r}: approved, but its row is {row.event!r} by {row.actor!r} "
                f"(the approval of {caller!r} expected)",
                row.version,
            )
        ]
    if final.state == "rejected" and (
        row.event != "expire" or row.actor != TIMER_ACTOR or row.request_id != expiry
    ):
        return [
            Violation(
                LOST_UPDATE,
                f"instance {iid!r}: rejected, but its row is {row.event!r} by {row.actor!r} "
                f"under {row.request_id!r} (the timer's {expiry!r} expected)",
                row.version,
            )
        ]
    return []


def _answers(record: RoundRecord) -> dict[str, float]:
    """When each timed call was answered, on the database server's clock.

    A history row's `at` is the start of the transaction that wrote it, which may have held
    several calls for a while (a pipelined group): an approval counts as resolved when its
    caller got the answer.
    """
    offset = float(record.plan.extra.get("offset", 0.0))
    return {
        r.call.instance_id: r.call.at + r.latency + offset
        for r in record.results
        if r.call.at is not None
    }


class Deadline(Scenario):
    """N x ops approvals whose approval and expiry fall due at the same instant.

    Each caller approves one instance at its due time; the worker processes' engines fire the
    expiries. Correct when every instance ends approved (by its caller, told so) or rejected
    (by its timer, the caller refused), with one history row, and no timer left armed (the
    checker's timer rules, given each instance's armed timers).
    """

    name = "deadline"
    summary = (
        "N x ops approvals; each caller approves as its expiry falls due, and the worker "
        "processes' timer services fire the expiries"
    )
    default_rounds = 1
    quick_rounds = 1
    default_ops = 20
    quick_ops = 2
    uses_ops = True
    multiprocess = True
    floor: Floor = "statement"
    has_floor = False
    timed = True

    def workflows(self, params: Params) -> Sequence[Workflow]:
        race = deadline_workflow(race_after(params.workers * params.ops))
        return [race, deadline_workflow(LAG_AFTER, LAG_WORKFLOW)]

    async def setup(
        self, engine: Engine, key: str, params: Params, rng: random.Random
    ) -> RoundPlan:
        ids = [f"{key}-{i}" for i in range(params.workers * params.ops)]
        await create_together(engine, RACE_WORKFLOW, ids)
        armed = await _timers_of(engine, ids)
        offset = await clock_offset(engine)
        dues: dict[str, float] = {}
        unarmed: list[str] = []
        calls: list[CallSpec] = []
        for i, iid in enumerate(ids):
            expiries = [t for t in armed.get(iid, []) if t.event == "expire"]
            at: float | None = None
            if len(expiries) == 1 and expiries[0].stay == 1:
                dues[iid] = expiries[0].due_at.timestamp()
                at = dues[iid] - offset + rng.uniform(-JITTER, JITTER)
            else:
                unarmed.append(iid)
            calls.append(CallSpec(iid, "approve", actor=f"approver-{i}", at=at))
        return RoundPlan(
            dict.fromkeys(ids, "pending"),
            tuple(calls),
            extra={"due": dues, "unarmed": unarmed, "offset": offset},
        )

    async def readback(
        self, session: Session, plan: RoundPlan
    ) -> tuple[dict[str, Instance], dict[str, list[HistoryEntry]], dict[str, Any]]:
        # A caller's answer does not end the round: an approval that failed leaves the expiry
        # to fire, and a firing may still be on its way. Wait until nothing is pending.
        dues: Mapping[str, float] = plan.extra.get("due", {})
        last_due = max(dues.values(), default=time.time())
        deadline = time.monotonic() + max(0.0, last_due - time.time()) + SETTLE_BOUND
        while True:
            finals, histories, _ = await super().readback(session, plan)
            pending = [i for i, inst in finals.items() if inst.state == "pending"]
            if not pending or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        armed = await _timers_of(session.engine, list(plan.instances))
        return finals, histories, {"timers": {iid: ts for iid, ts in armed.items() if ts}}

    def checked(self) -> bool:
        # The judge runs the checker itself: the expiry's row has no caller, so the number of
        # rows expected is the callers' applied answers plus the timer's firing; and it gives
        # the checker each instance's armed timers (none may be left from the ended stay).
        return False

    def judge(self, record: RoundRecord, params: Params) -> Judgement:
        found: list[Violation] = []
        double = False
        applied = record.applied_by_instance()
        armed: Mapping[str, Sequence[Timer]] = record.extra.get("timers", {})
        callers = {r.call.instance_id: r.call.actor for r in record.results}
        for iid in record.plan.extra.get("unarmed", []):
            found.append(
                Violation(TIMER_NOT_ARMED, f"instance {iid!r}: created without its one expiry")
            )
        for iid, initial in record.plan.instances.items():
            final = record.finals[iid]
            rows = record.histories.get(iid, [])
            fired = sum(1 for e in rows if e.actor == TIMER_ACTOR)
            verdict = check(
                final,
                rows,
                initial_state=initial,
                expected_applied=applied[iid] + fired,
                timers=armed.get(iid, ()),
            )
            found.extend(verdict.violations)
            if len(rows) > 1 or applied[iid] > 1:
                double = True
                found.append(
                    Violation(
                        DOUBLE_APPLY,
                        f"instance {iid!r}: {len(rows)} history rows, {applied[iid]} approval(s) "
                        "answered applied; exactly one outcome expected",
                    )
                )
            if final.state == "pending":
                failed = results_for(record, iid, "failed")
                why = f" (its approval failed: {failed[0].error})" if failed else ""
                found.append(
                    Violation(
                        LOST_UPDATE,
                        f"instance {iid!r}: still pending, neither approved nor expired{why}",
                    )
                )
            found.extend(entry_violations(iid, final, rows, callers.get(iid)))
        return Judgement(double, tuple(found))

    def race(
        self, records: Sequence[RoundRecord], params: Params, fired: Sequence[int]
    ) -> RaceFigures | None:
        counts = {"approved": 0, "rejected": 0, "pending": 0}
        exactly_one = True
        dues: list[float] = []
        ends: list[float] = []
        lags: list[float] = []
        left = violations = 0
        for record in records:
            due: Mapping[str, float] = record.plan.extra.get("due", {})
            dues.extend(due.values())
            left += sum(len(ts) for ts in record.extra.get("timers", {}).values())
            violations += len(self.judge(record, params).violations)
            answered = _answers(record)
            for iid in record.plan.instances:
                state = record.finals[iid].state
                counts[state] = counts.get(state, 0) + 1
                rows = record.histories.get(iid, [])
                exactly_one = exactly_one and len(rows) == 1 and state != "pending"
                written = rows[-1].at if rows else None
                if written is not None:
                    ends.append(written.timestamp())
                if state == "approved" and iid in answered:
                    ends.append(answered[iid])
                if state == "rejected" and written is not None and iid in due:
                    lags.append(written.timestamp() - due[iid])
        span = max(ends) - min(dues) if ends and dues else 0.0
        return RaceFigures(
            engines=params.processes,
            instances=sum(len(r.plan.instances) for r in records),
            approved=counts["approved"],
            rejected=counts["rejected"],
            unresolved=sum(counts.values()) - counts["approved"] - counts["rejected"],
            exactly_one=exactly_one,
            span_s=span,
            expiry_lag=Quantiles.of(lags),
            left_armed=left,
            checker_ok=violations == 0,
            violations=violations,
            firings_by_engine=tuple(fired),
        )
