"""The benchmark's scenarios: what the callers of one round fire, and what "correct" means.

A scenario is a small object, kept free of timing and rendering, with these jobs:

- ``workflows(params)``: the definitions to register (built from :mod:`flowlock.examples`, plus
  the bench's own :func:`counter`);
- ``setup(engine, key, params, rng)``: create the fresh instance(s) of one round and return its
  plan: the callers, each a lane of calls fired one after another (one call per lane for the
  "everybody at once" scenarios), all released at the same instant by the runner;
- ``fire(session, call)``: how one call is made; by default ``session.fire(call)`` (an
  ``engine.fire`` with the pair's strategy, or the raw floor); ``singleton`` runs a job instead;
- ``readback(session, plan)``: what the store holds afterwards (each instance and its history);
- ``judge(record, params)``: after the round, say whether it double-advanced and list every
  scenario-specific violation the generic :func:`flowlock.checker.check` cannot see (it knows
  nothing about storms, quorums, stock or ticks).

``floor`` names how the ``raw`` strategy (the bare-asyncpg floor, :mod:`flowlock.bench.raw`)
does the scenario's calls, so the report can say what flowlock is measured against:

=========== ===================================================================================
statement   one conditional UPDATE (plus its history row, in the same statement): storm. Not a
            must-apply call: losers of the race are simply "already done".
locked      one row-locked read-modify-write transaction (BEGIN, SELECT ... FOR UPDATE, step,
            UPDATE, COMMIT): countersign, inventory, hot, the must-apply scenarios where every
            call must land.
cas         an unlocked read, the step, a version compare-and-swap, retried at once on a lost
            race until it lands: spread and cluster (low conflict, must apply).
claim       one ``INSERT ... ON CONFLICT DO NOTHING`` of the (job, tick) row: singleton.
=========== ===================================================================================

Scenarios register themselves in :data:`SCENARIOS` by name, in the order ``flowlock bench``
runs them; a new one subclasses :class:`Scenario` and calls :func:`register_scenario`.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

import asyncpg

from flowlock import examples
from flowlock.checker import DOUBLE_APPLY, INVARIANT, LOST_UPDATE, OVERSELL, Invariant, Violation
from flowlock.definition import Transition, Workflow
from flowlock.engine import Engine
from flowlock.errors import InstanceNotFound
from flowlock.models import HistoryEntry, Instance
from flowlock.stores.postgres import entry_from_row, instance_from_row

__all__ = [
    "SCENARIOS",
    "CallResult",
    "CallSpec",
    "Cluster",
    "Countersign",
    "Fired",
    "Floor",
    "Hot",
    "Inventory",
    "Judgement",
    "Kind",
    "Params",
    "RoundPlan",
    "RoundRecord",
    "Scenario",
    "Session",
    "Singleton",
    "Spread",
    "Storm",
    "counter",
    "register_scenario",
]

Kind = Literal["applied", "idempotent", "refused", "failed"]
"""How one call ended: it applied the transition (or ran the job), was answered idempotently
(already done), was refused by the workflow (a business rule: TransitionRefused), or failed
(lost to concurrency, a lock timeout, a store error...)."""

Floor = Literal["statement", "locked", "cas", "claim"]
"""How the raw floor does a scenario's calls (see the module docstring)."""


@dataclass(frozen=True, slots=True)
class Params:
    """The knobs of one run that a scenario sees."""

    workers: int = 100
    """Concurrent callers (across all processes, for the multi-process scenarios)."""
    ops: int = 1
    """Calls each caller makes one after another in a round (the sustained-load scenarios)."""
    processes: int = 1
    """OS processes the multi-process scenarios spread their callers over."""
    warmup: bool = False
    """The untimed warm-up round: it only has to fill the pools, so it may do less."""

    def evolve(self, **changes: Any) -> Params:
        """A copy with ``changes`` applied."""
        return replace(self, **changes)


@dataclass(frozen=True, slots=True)
class CallSpec:
    """One call a caller makes when the round is released (an ``engine.fire``, or for
    ``singleton`` one run of the job: ``instance_id`` is then the job and ``payload`` the tick)."""

    instance_id: str
    event: str
    actor: str | None = None
    payload: Mapping[str, Any] | None = None
    request_id: str | None = None

    def to_json(self) -> dict[str, Any]:
        """For the worker processes' pipe."""
        return {
            "instance_id": self.instance_id,
            "event": self.event,
            "actor": self.actor,
            "payload": None if self.payload is None else dict(self.payload),
            "request_id": self.request_id,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> CallSpec:
        return cls(
            doc["instance_id"], doc["event"], doc["actor"], doc["payload"], doc["request_id"]
        )


@dataclass(frozen=True, slots=True)
class RoundPlan:
    """The instances a round created (with the state they were created in) and its callers.

    ``calls``: one call per caller, all released at once (storm, countersign...). ``lanes``: per
    caller, a sequence fired one after another (hot, spread...). A plan uses one or the other.
    """

    instances: Mapping[str, str]
    """instance id -> initial state"""
    calls: tuple[CallSpec, ...] = ()
    lanes: tuple[tuple[CallSpec, ...], ...] = ()

    def callers(self) -> tuple[tuple[CallSpec, ...], ...]:
        """Every caller's calls, in order."""
        return self.lanes if self.lanes else tuple((c,) for c in self.calls)


@dataclass(frozen=True, slots=True)
class Fired:
    """What a session says one call came to (failures are raised instead)."""

    kind: Kind
    attempts: int = 1


@dataclass(frozen=True, slots=True)
class CallResult:
    """What one call came to. ``latency`` is seconds from the moment the caller could start it
    (the round's release for its first call, the previous call's end after that) to its end."""

    call: CallSpec
    kind: Kind
    latency: float
    attempts: int
    error: str | None = None
    """The exception's class name for refused and failed calls."""
    message: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "call": self.call.to_json(),
            "kind": self.kind,
            "latency": self.latency,
            "attempts": self.attempts,
            "error": self.error,
            "message": self.message,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> CallResult:
        return cls(
            CallSpec.from_json(doc["call"]),
            doc["kind"],
            float(doc["latency"]),
            int(doc["attempts"]),
            doc["error"],
            doc["message"],
        )


@dataclass(frozen=True, slots=True)
class RoundRecord:
    """A finished round: its plan, every call's result, and what the store holds afterwards."""

    plan: RoundPlan
    results: tuple[CallResult, ...]
    finals: Mapping[str, Instance]
    histories: Mapping[str, Sequence[HistoryEntry]]
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Anything else a scenario's readback collected (singleton: the job's runs)."""

    def applied_by_instance(self) -> Counter[str]:
        """How many calls answered applied, per instance id."""
        return Counter(r.call.instance_id for r in self.results if r.kind == "applied")


@dataclass(frozen=True, slots=True)
class Judgement:
    """A scenario's verdict on one round, beyond the generic history check."""

    double_advanced: bool
    violations: tuple[Violation, ...] = field(default=())


class Session(Protocol):
    """One strategy, ready to fire, in one process (see :mod:`flowlock.bench.runner`)."""

    @property
    def strategy(self) -> str:
        """The strategy's name in the bench (``optimistic``, ``raw``, ``distributed-redis``...)."""
        ...

    @property
    def engine(self) -> Engine:
        """An engine on the run's store and schema, for setup and readback."""
        ...

    @property
    def pool(self) -> asyncpg.Pool:
        """The process's connection pool (search_path = the run's schema)."""
        ...

    async def fire(self, call: CallSpec) -> Fired:
        """Fire one event with this strategy; raise whatever the call failed with."""
        ...

    async def run_once(self, job: str, tick: int, fn: Callable[[], Awaitable[None]]) -> bool | None:
        """Run ``fn`` for ``(job, tick)`` unless another caller (any process) has: True when this
        call ran it; None when the session has no run-once runner of its own (the caller then
        claims the tick through the engine)."""
        ...


# -- the base class -------------------------------------------------------------------------


class Scenario:
    """What the runner needs from a scenario; subclasses set the class attributes and override
    :meth:`setup` and :meth:`judge` (and, when they need to, the other hooks)."""

    name: str = ""
    summary: str = ""
    default_rounds: int = 3
    quick_rounds: int = 1
    default_ops: int = 1
    """Calls per caller per round (``--ops``); 1 for the everybody-at-once scenarios."""
    quick_ops: int = 1
    uses_ops: bool = False
    """Whether ``--ops`` means anything to this scenario."""
    multiprocess: bool = False
    """Runs its callers in ``--processes`` OS processes instead of this one."""
    floor: Floor = "locked"
    invariant_kind: str = INVARIANT

    def workflows(self, params: Params) -> Sequence[Workflow]:
        """The workflow definitions the scenario's instances use."""
        return []

    def invariant(self, params: Params) -> Invariant | None:
        """A data invariant the checker runs after every history row, if any."""
        return None

    async def prepare(self, pool: asyncpg.Pool) -> None:
        """Once per run, before any round: create what the scenario needs besides flowlock's
        tables (in the run's schema)."""

    async def setup(
        self, engine: Engine, key: str, params: Params, rng: random.Random
    ) -> RoundPlan:
        """Create this round's fresh instance(s); ids start with ``key``, unique per round."""
        raise NotImplementedError

    async def fire(self, session: Session, call: CallSpec) -> Fired:
        """Make one call."""
        return await session.fire(call)

    async def readback(
        self, session: Session, plan: RoundPlan
    ) -> tuple[dict[str, Instance], dict[str, list[HistoryEntry]], dict[str, Any]]:
        """Every instance of the round as stored, and its history: two statements for the whole
        round (a thousand instances read one by one would take longer than the round)."""
        ids = list(plan.instances)
        finals = {
            row["id"]: instance_from_row(row) for row in await session.pool.fetch(_FINALS, ids)
        }
        histories: dict[str, list[HistoryEntry]] = {i: [] for i in ids}
        for row in await session.pool.fetch(_HISTORIES, ids):
            histories[row["instance_id"]].append(entry_from_row(row))
        missing = [i for i in ids if i not in finals]
        if missing:
            raise InstanceNotFound(missing[0])
        return finals, histories, {}

    def checked(self) -> bool:
        """Whether the generic history checker applies (every instance has a history)."""
        return True

    def judge(self, record: RoundRecord, params: Params) -> Judgement:
        """Scenario-specific correctness of one finished round."""
        return Judgement(False)

    def rounds(self, quick: bool) -> int:
        return self.quick_rounds if quick else self.default_rounds

    def ops(self, quick: bool) -> int:
        return self.quick_ops if quick else self.default_ops


_FINALS = """
SELECT id, workflow, state, version, data, last_event, created_at, updated_at
  FROM flowlock_instances WHERE id = ANY($1::text[])
"""
_HISTORIES = """
SELECT instance_id, version, event, from_state, to_state, actor, request_id, strategy, data, at,
       fencing_token
  FROM flowlock_history WHERE instance_id = ANY($1::text[]) ORDER BY instance_id, version
"""


def _results_for(record: RoundRecord, iid: str, kind: Kind) -> list[CallResult]:
    return [r for r in record.results if r.call.instance_id == iid and r.kind == kind]


# -- storm ----------------------------------------------------------------------------------


class Storm(Scenario):
    """The seed's two-admins incident, scaled up: N callers fire ``approve`` at one pending
    instance at once. Correct when exactly one call applies and the rest are idempotent."""

    name = "storm"
    summary = "N callers fire approve at one pending instance at once"
    default_rounds = 10
    quick_rounds = 2
    floor: Floor = "statement"

    def workflows(self, params: Params) -> Sequence[Workflow]:
        return [examples.approval()]

    async def setup(
        self, engine: Engine, key: str, params: Params, rng: random.Random
    ) -> RoundPlan:
        inst = await engine.create("approval", instance_id=key, data={"amount": 120})
        calls = tuple(
            CallSpec(inst.id, "approve", actor=f"admin-{i}") for i in range(params.workers)
        )
        return RoundPlan({inst.id: inst.state}, calls)

    def judge(self, record: RoundRecord, params: Params) -> Judgement:
        found: list[Violation] = []
        double = False
        applied = record.applied_by_instance()
        for iid in record.plan.instances:
            rows = len(record.histories.get(iid, ()))
            # Why both counts: the seed's bug showed up as several callers told "applied"
            # (and several history rows); either alone is a double advance.
            if applied[iid] > 1 or rows > 1:
                double = True
                found.append(
                    Violation(
                        DOUBLE_APPLY,
                        f"instance {iid!r}: storm double-advanced ({applied[iid]} calls applied, "
                        f"{rows} history rows; exactly one of each expected)",
                    )
                )
            idempotent = len(_results_for(record, iid, "idempotent"))
            final = record.finals.get(iid)
            if idempotent and final is not None and final.state != "approved":
                # An idempotent answer claims the approval happened; the store must agree.
                found.append(
                    Violation(
                        LOST_UPDATE,
                        f"instance {iid!r}: {idempotent} call(s) answered idempotent but the "
                        f"instance is still {final.state!r}",
                    )
                )
        return Judgement(double, tuple(found))


# -- countersign ----------------------------------------------------------------------------


class Countersign(Scenario):
    """One document needs N distinct signatures (quorum N); N callers each sign once, at once.
    Correct when every applied signature is in history exactly once and the state moves to
    approved exactly once, at quorum (and not before)."""

    name = "countersign"
    summary = "one instance with quorum N; N callers each sign once at once"
    default_rounds = 3
    quick_rounds = 1
    floor: Floor = "locked"

    def workflows(self, params: Params) -> Sequence[Workflow]:
        return [examples.countersign(quorum=params.workers)]

    def invariant(self, params: Params) -> Invariant | None:
        def signers_unique(data: Mapping[str, Any]) -> str | None:
            signers = list(data.get("signers", []))
            twice = sorted(s for s, n in Counter(signers).items() if n > 1)
            return f"signed more than once: {', '.join(twice)}" if twice else None

        return signers_unique

    async def setup(
        self, engine: Engine, key: str, params: Params, rng: random.Random
    ) -> RoundPlan:
        inst = await engine.create("countersign", instance_id=key, data={"signers": []})
        calls = tuple(CallSpec(inst.id, "sign", actor=f"signer-{i}") for i in range(params.workers))
        return RoundPlan({inst.id: inst.state}, calls)

    def judge(self, record: RoundRecord, params: Params) -> Judgement:
        found: list[Violation] = []
        double = False
        for iid in record.plan.instances:
            history = record.histories.get(iid, ())
            found.extend(_actors_match(iid, history, record, "signature"))
            advances = [
                e for e in history if e.to_state == "approved" and e.from_state != "approved"
            ]
            if len(advances) > 1:
                double = True
                found.append(
                    Violation(
                        DOUBLE_APPLY,
                        f"instance {iid!r}: moved to 'approved' {len(advances)} times",
                    )
                )
            for e in history:
                n = len(e.data.get("signers", []))
                if (e.to_state == "approved") != (n >= params.workers):
                    found.append(
                        Violation(
                            INVARIANT,
                            f"instance {iid!r}: state {e.to_state!r} with {n} of "
                            f"{params.workers} signatures",
                            e.version,
                        )
                    )
        return Judgement(double, tuple(found))


def _actors_match(
    iid: str, history: Sequence[HistoryEntry], record: RoundRecord, what: str
) -> list[Violation]:
    """Every call that answered applied has its row in history (by actor), and no row exists
    that no caller was told about."""
    in_history = Counter(e.actor for e in history)
    applied = Counter(r.call.actor for r in _results_for(record, iid, "applied"))
    if in_history == applied:
        return []
    extra = in_history - applied
    lost = applied - in_history
    found: list[Violation] = []
    if extra:
        found.append(
            Violation(
                DOUBLE_APPLY,
                f"instance {iid!r}: {sum(extra.values())} {what}(s) in history that no caller "
                f"was told applied (by {', '.join(sorted(str(a) for a in extra)[:5])})",
            )
        )
    if lost:
        found.append(
            Violation(
                LOST_UPDATE,
                f"instance {iid!r}: {sum(lost.values())} {what}(s) answered applied but missing "
                f"from history (by {', '.join(sorted(str(a) for a in lost)[:5])})",
            )
        )
    return found


# -- inventory ------------------------------------------------------------------------------


class Inventory(Scenario):
    """Stock S = N / 2; N callers each ``reserve`` one unit at once. Correct when the stock never
    goes below zero, every reservation is in history once, stock + reserved stays S, and a
    caller is refused "out of stock" only when the stock really ran out."""

    name = "inventory"
    summary = "stock N/2; N callers reserve one unit each at once (never oversell)"
    default_rounds = 5
    quick_rounds = 1
    floor: Floor = "locked"
    invariant_kind = OVERSELL

    @staticmethod
    def stock(params: Params) -> int:
        return max(1, params.workers // 2)

    def workflows(self, params: Params) -> Sequence[Workflow]:
        return [examples.inventory()]

    def invariant(self, params: Params) -> Invariant | None:
        total = self.stock(params)

        def never_oversold(data: Mapping[str, Any]) -> str | None:
            stock, reserved = int(data.get("stock", 0)), int(data.get("reserved", 0))
            if stock < 0:
                return f"stock is {stock}: oversold by {-stock}"
            if stock + reserved != total:
                return f"stock {stock} + reserved {reserved} is not the initial {total}"
            return None

        return never_oversold

    async def setup(
        self, engine: Engine, key: str, params: Params, rng: random.Random
    ) -> RoundPlan:
        data = {"stock": self.stock(params), "reserved": 0}
        inst = await engine.create("inventory", instance_id=key, data=data)
        calls = tuple(
            CallSpec(inst.id, "reserve", actor=f"buyer-{i}", payload={"qty": 1})
            for i in range(params.workers)
        )
        return RoundPlan({inst.id: inst.state}, calls)

    def judge(self, record: RoundRecord, params: Params) -> Judgement:
        found: list[Violation] = []
        for iid in record.plan.instances:
            found.extend(_actors_match(iid, record.histories.get(iid, ()), record, "reservation"))
            final = record.finals.get(iid)
            refused = _results_for(record, iid, "refused")
            left = int(final.data.get("stock", 0)) if final is not None else 0
            if refused and left > 0:
                # Stock only goes down, so a true "out of stock" leaves it at zero for good.
                found.append(
                    Violation(
                        INVARIANT,
                        f"instance {iid!r}: {len(refused)} caller(s) refused although "
                        f"{left} unit(s) are still in stock",
                    )
                )
        return Judgement(False, tuple(found))


# -- hot, spread, cluster: must-apply read-modify-write steps ---------------------------------


def counter(name: str = "counter") -> Workflow:
    """A counter: ``step`` adds one to ``data["n"]``, a read-modify-write that must apply every
    time (no guard, the state never changes, so nothing is ever "already done")."""

    def add(inst: Instance, payload: Mapping[str, Any], actor: str | None) -> dict[str, Any]:
        return {**inst.data, "n": int(inst.data.get("n", 0)) + 1}

    return Workflow(
        name,
        states=["open"],
        initial="open",
        transitions=[Transition("step", source="open", target="open", effect=add)],
    )


def _counter_never_skips(data: Mapping[str, Any]) -> str | None:
    n = data.get("n")
    return None if isinstance(n, int) and n >= 0 else f"counter is {n!r}"


class _Steps(Scenario):
    """N callers x M ``step`` calls over ``instances(params)`` counters: the shared part of hot,
    spread and cluster. Correct when every applied step is in history exactly once (by caller)
    and each counter equals its number of history rows (no lost update)."""

    default_rounds = 1
    quick_rounds = 1
    default_ops = 20
    quick_ops = 3
    uses_ops = True

    def instances(self, params: Params) -> int:
        raise NotImplementedError

    def workflows(self, params: Params) -> Sequence[Workflow]:
        return [counter()]

    def invariant(self, params: Params) -> Invariant | None:
        return _counter_never_skips

    async def setup(
        self, engine: Engine, key: str, params: Params, rng: random.Random
    ) -> RoundPlan:
        count = self.instances(params)
        if params.warmup:
            count = min(count, params.workers)
        ids = [f"{key}-{k}" for k in range(count)]
        # Created concurrently (not timed): a thousand sequential round trips would dominate.
        sem = asyncio.Semaphore(64)

        async def create(iid: str) -> None:
            async with sem:
                await engine.create("counter", instance_id=iid, data={"n": 0})

        await asyncio.gather(*(create(i) for i in ids))
        lanes = tuple(
            tuple(
                CallSpec(ids[0] if count == 1 else rng.choice(ids), "step", actor=f"w{w}-{j}")
                for j in range(params.ops)
            )
            for w in range(params.workers)
        )
        return RoundPlan(dict.fromkeys(ids, "open"), lanes=lanes)

    def judge(self, record: RoundRecord, params: Params) -> Judgement:
        found: list[Violation] = []
        for iid in record.plan.instances:
            history = record.histories.get(iid, ())
            found.extend(_actors_match(iid, history, record, "step"))
            for e in history:
                if e.data.get("n") != e.version - 1:
                    found.append(
                        Violation(
                            LOST_UPDATE,
                            f"instance {iid!r}: counter is {e.data.get('n')!r} after "
                            f"{e.version - 1} step(s): a step was decided on a stale read",
                            e.version,
                        )
                    )
        return Judgement(False, tuple(found))


class Hot(_Steps):
    """N callers x M must-apply read-modify-write steps on ONE instance: the worst contention."""

    name = "hot"
    summary = "N callers x M must-apply read-modify-write steps on one instance"
    floor: Floor = "locked"

    def instances(self, params: Params) -> int:
        return 1


class Spread(_Steps):
    """N callers x M steps over 10 N instances (1,000 for 100 callers): low conflict."""

    name = "spread"
    summary = "N callers x M steps over 10 N instances (low conflict)"
    floor: Floor = "cas"
    # Thousands of calls a second: enough of them for a throughput that holds still.
    default_ops = 60

    def instances(self, params: Params) -> int:
        return 10 * params.workers


class Cluster(_Steps):
    """The same steps from P OS processes sharing N instances through PostgreSQL (and Redis):
    callers of different processes collide on the same instances."""

    name = "cluster"
    summary = "P OS processes x N/P callers x M steps over N shared instances"
    multiprocess = True
    floor: Floor = "cas"
    default_ops = 40

    def instances(self, params: Params) -> int:
        return params.workers


# -- singleton ------------------------------------------------------------------------------

_RUNS_TABLE = "flowlock_bench_runs"
_CLAIMS_TABLE = "flowlock_bench_claims"


class Singleton(Scenario):
    """P processes (N callers in all) run the same scheduled job at each tick; correct when the
    job ran exactly once per tick, by the one caller that was told it ran it.

    The job records each run in ``flowlock_bench_runs`` (no unique constraint, so a double run
    is visible). The distributed strategies use :class:`flowlock.runner.RunOnce`; the others
    claim the tick through the engine (``approve`` on a per-tick instance: applied = run it);
    raw inserts the (job, tick) claim row."""

    name = "singleton"
    summary = "P OS processes run the same scheduled job each tick; exactly once per tick"
    default_rounds = 10
    quick_rounds = 2
    multiprocess = True
    floor: Floor = "claim"

    def workflows(self, params: Params) -> Sequence[Workflow]:
        return [examples.approval()]

    async def prepare(self, pool: asyncpg.Pool) -> None:
        await pool.execute(
            f"""
            CREATE TABLE IF NOT EXISTS {_RUNS_TABLE} (
                job text NOT NULL, tick bigint NOT NULL, runner text NOT NULL,
                at timestamptz NOT NULL DEFAULT clock_timestamp());
            CREATE TABLE IF NOT EXISTS {_CLAIMS_TABLE} (
                job text NOT NULL, tick bigint NOT NULL, PRIMARY KEY (job, tick));
            """
        )

    async def setup(
        self, engine: Engine, key: str, params: Params, rng: random.Random
    ) -> RoundPlan:
        # The tick is the round's instance: its id is the job, created pending ("due").
        inst = await engine.create("approval", instance_id=key)
        tick = rng.getrandbits(40)  # the job id is unique to the round; the tick is any number
        calls = tuple(
            CallSpec(inst.id, "approve", actor=f"runner-{i}", payload={"tick": tick})
            for i in range(params.workers)
        )
        return RoundPlan({inst.id: inst.state}, calls)

    async def fire(self, session: Session, call: CallSpec) -> Fired:
        payload = call.payload or {}
        tick = int(payload["tick"])
        pool = session.pool
        runner = str(call.actor)

        async def job() -> None:
            await pool.execute(
                f"INSERT INTO {_RUNS_TABLE} (job, tick, runner) VALUES ($1, $2, $3)",
                call.instance_id,
                tick,
                runner,
            )

        ran = await session.run_once(call.instance_id, tick, job)
        if ran is not None:
            return Fired("applied" if ran else "idempotent")
        # No runner of its own: claim the tick with the strategy (applied = ours to run).
        claimed = await session.fire(call)
        if claimed.kind == "applied":
            await job()
        return claimed

    async def readback(
        self, session: Session, plan: RoundPlan
    ) -> tuple[dict[str, Instance], dict[str, list[HistoryEntry]], dict[str, Any]]:
        runs: dict[str, list[str]] = {}
        for job in plan.instances:
            rows = await session.pool.fetch(
                f"SELECT runner FROM {_RUNS_TABLE} WHERE job = $1 ORDER BY at", job
            )
            runs[job] = [r["runner"] for r in rows]
        return {}, {}, {"runs": runs}

    def checked(self) -> bool:
        # RunOnce and the raw claim keep their own records; the per-tick instance only has a
        # history under the engine strategies, so the judge below is the whole check.
        return False

    def judge(self, record: RoundRecord, params: Params) -> Judgement:
        found: list[Violation] = []
        double = False
        runs: Mapping[str, list[str]] = record.extra.get("runs", {})
        for job in record.plan.instances:
            ran = runs.get(job, [])
            told = sorted(str(r.call.actor) for r in _results_for(record, job, "applied"))
            if len(ran) > 1:
                double = True
                found.append(
                    Violation(
                        DOUBLE_APPLY,
                        f"job {job!r}: ran {len(ran)} times in one tick (by {', '.join(ran[:5])})",
                    )
                )
            if sorted(ran) != told:
                found.append(
                    Violation(
                        DOUBLE_APPLY if len(told) > len(ran) else LOST_UPDATE,
                        f"job {job!r}: callers told they ran it: {told[:5] or 'none'}; "
                        f"runs recorded: {ran[:5] or 'none'}",
                    )
                )
            failed = _results_for(record, job, "failed")
            if not ran and not failed:
                found.append(
                    Violation(
                        LOST_UPDATE,
                        f"job {job!r}: nobody ran the tick although no caller failed",
                    )
                )
        return Judgement(double, tuple(found))


SCENARIOS: dict[str, Scenario] = {}
"""Every known scenario by name, in the order ``flowlock bench`` runs them by default."""


def register_scenario(scenario: Scenario) -> Scenario:
    """Add ``scenario`` to :data:`SCENARIOS` (replacing one of the same name)."""
    SCENARIOS[scenario.name] = scenario
    return scenario


for _scenario in (Storm(), Countersign(), Inventory(), Hot(), Spread(), Cluster(), Singleton()):
    register_scenario(_scenario)
