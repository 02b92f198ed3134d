"""The base of every scenario, the session it fires through, and shared judging helpers.

A scenario knows no timing or rendering. Its hooks are on `Scenario`.
`floor` names how the raw floor makes its calls (see docs/benchmarks.md).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import asyncpg

from flowlock._pg.rows import read_history, read_instances
from flowlock.bench.capacity_results import CapacityFigures
from flowlock.bench.outbox_results import DeliveryFigures
from flowlock.bench.results import (
    CallResult,
    CallSpec,
    Judgement,
    Kind,
    Params,
    RoundPlan,
    RoundRecord,
)
from flowlock.bench.timer_results import RaceFigures
from flowlock.checker import DOUBLE_APPLY, INVARIANT, LOST_UPDATE, Invariant, Violation
from flowlock.core.definition import Workflow
from flowlock.core.errors import InstanceNotFound
from flowlock.core.models import HistoryEntry, Instance
from flowlock.engine import Engine

__all__ = ["Fired", "Floor", "Scenario", "Session", "actors_match", "results_for"]

Floor = Literal["statement", "locked", "cas", "claim", "counter"]
"""How the raw floor does a scenario's calls (see the module docstring)."""


@dataclass(frozen=True, slots=True)
class Fired:
    """What a session says one call came to; failures are raised instead.

    `batch_size` is the engine's `Outcome.batch_size`.
    It is None when no engine answered (the raw floor, or `RunOnce`).
    """

    kind: Kind
    attempts: int = 1
    batch_size: int | None = None


class Session(Protocol):
    """One strategy, ready to fire, in one process (see `flowlock.bench.session`)."""

    @property
    def strategy(self) -> str:
        """The strategy's name in the bench (`optimistic`, `raw`, `distributed-redis`...)."""
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
        """Run `fn` for `(job, tick)` unless a caller in any process already has.

        Returns True when this call ran it. Returns None when the session has no run-once runner;
        the caller then claims the tick through the engine.
        """
        ...


# -- the base class -------------------------------------------------------------------------


class Scenario:
    """What the runner needs from a scenario.

    Subclasses set the class attributes and override `setup` and `judge`.
    They may override the other hooks: `workflows`, `fire`, `readback` and `prepare`.
    `judge` lists the violations the generic checker cannot see, such as quorums or stock.
    """

    name: str = ""
    summary: str = ""
    default_rounds: int = 3
    quick_rounds: int = 1
    default_ops: int = 1
    """Calls per caller per round (`--ops`); 1 for the everybody-at-once scenarios."""
    quick_ops: int = 1
    uses_ops: bool = False
    """Whether `--ops` means anything to this scenario."""
    multiprocess: bool = False
    """Runs its callers in `--processes` OS processes instead of this one."""
    floor: Floor = "locked"
    has_floor: bool = True
    """Whether the raw floor can run it (`deadline`'s expiries need the engines' timers)."""
    timed: bool = False
    """Its workflows have timed transitions: the engines of the worker processes fire them,
    with the pair's strategy, and the runner's own engine runs no timer service."""
    invariant_kind: str = INVARIANT
    emits: bool = False
    """Its transitions emit outbox messages, which the session's engine dispatches to a
    handler the scenario registers (`attach`)."""
    baseline: str | None = None
    """The scenario it is compared with, the same without messages (`hot` for `hot-outbox`)."""
    full_by_default: bool = True
    """Whether a full run that names no scenario runs it (`--quick` runs every scenario). The
    capacity scenarios' 1,000 callers take minutes a strategy: they run when named."""
    tallied: bool = False
    """Its `fire` tallies what its callers saw in the bench's own process (the capacity
    scenarios' refusals), so its callers cannot run in worker processes or through HTTP."""

    def callers(self, workers: int, quick: bool) -> int:
        """Its concurrent callers for `--workers` (the capacity scenarios run 10 times more)."""
        return workers

    def workflows(self, params: Params) -> Sequence[Workflow]:
        """The workflow definitions the scenario's instances use."""
        return []

    def invariant(self, params: Params) -> Invariant | None:
        """A data invariant the checker runs after every history row, if any."""
        return None

    def attach(self, engine: Engine) -> None:
        """Before the session's engine opens: register what the scenario needs on it beyond its
        workflows (the outbox pairs' handler)."""

    async def prepare(self, pool: asyncpg.Pool) -> None:
        """Once per run, before any round: create what the scenario needs in the run's schema."""

    async def setup(
        self, engine: Engine, key: str, params: Params, rng: random.Random
    ) -> RoundPlan:
        """Create this round's fresh instances and return its plan of callers.

        Ids start with `key`, unique per round. The runner releases all callers at once.
        """
        raise NotImplementedError

    async def fire(self, session: Session, call: CallSpec) -> Fired:
        """Make one call; by default `session.fire` (`singleton` runs a job instead)."""
        return await session.fire(call)

    async def readback(
        self, session: Session, plan: RoundPlan
    ) -> tuple[dict[str, Instance], dict[str, list[HistoryEntry]], dict[str, Any]]:
        """Every instance of the round as stored, with its history.

        Two statements read the whole round; one read per instance would outlast the round.
        """
        ids = list(plan.instances)
        finals = await read_instances(session.pool, ids)
        histories = await read_history(session.pool, ids)
        missing = [i for i in ids if i not in finals]
        if missing:
            raise InstanceNotFound(missing[0])
        return finals, histories, {}

    def checked(self) -> bool:
        """Whether the generic history checker applies (every instance has a history)."""
        return True

    def judge(self, record: RoundRecord, params: Params) -> Judgement:
        """Scenario-specific correctness of one finished round.

        Say whether it double-advanced, and list what
        [`flowlock.checker.check`][flowlock.checker.check] cannot see.
        """
        return Judgement(False)

    def race(
        self, records: Sequence[RoundRecord], params: Params, fired: Sequence[int]
    ) -> RaceFigures | None:
        """The timers section's figures of this pair (`deadline`); None for other scenarios.

        `fired`: how many timers each worker process's engine fired.
        """
        return None

    def delivery(self, records: Sequence[RoundRecord]) -> DeliveryFigures | None:
        """The outbox section's figures of this pair (the emitting scenarios); None otherwise."""
        return None

    def capacity(self, records: Sequence[RoundRecord]) -> CapacityFigures | None:
        """The capacity scenarios' figures of this pair (holders, refusals, fairness); None
        for the others."""
        return None

    def rounds(self, quick: bool) -> int:
        return self.quick_rounds if quick else self.default_rounds

    def ops(self, quick: bool) -> int:
        return self.quick_ops if quick else self.default_ops


def results_for(record: RoundRecord, iid: str, kind: Kind) -> list[CallResult]:
    return [r for r in record.results if r.call.instance_id == iid and r.kind == kind]


def actors_match(
    iid: str, history: Sequence[HistoryEntry], record: RoundRecord, what: str
) -> list[Violation]:
    """Every applied call has its history row (by actor), and no row lacks a caller."""
    in_history = Counter(e.actor for e in history)
    applied = Counter(r.call.actor for r in results_for(record, iid, "applied"))
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
