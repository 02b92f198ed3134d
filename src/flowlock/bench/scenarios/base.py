"""The base of every scenario: what the callers of one round fire, and what "correct" means.

A scenario is a small object, kept free of timing and rendering, with these jobs:

- `workflows(params)`: the definitions to register (built from `flowlock.examples`, plus
  the bench's own `counter`);
- `setup(engine, key, params, rng)`: create the fresh instance(s) of one round and return its
  plan: the callers, each a lane of calls fired one after another (one call per lane for the
  "everybody at once" scenarios), all released at the same instant by the runner;
- `fire(session, call)`: how one call is made; by default `session.fire(call)` (an
  `engine.fire` with the pair's strategy, or the raw floor); `singleton` runs a job instead;
- `readback(session, plan)`: what the store holds afterwards (each instance and its history);
- `judge(record, params)`: after the round, say whether it double-advanced and list every
  scenario-specific violation the generic [`flowlock.checker.check`][flowlock.checker.check] cannot
  see (it knows nothing about storms, quorums, stock or ticks).

`floor` names how the `raw` strategy (the bare-asyncpg floor, `flowlock.bench.raw`)
does the scenario's calls, so the report can say what flowlock is measured against:

=========== ===================================================================================
statement   one conditional UPDATE (plus its history row, in the same statement): storm. Not a
            must-apply call: losers of the race are simply "already done".
locked      one row-locked read-modify-write transaction (BEGIN, SELECT ... FOR UPDATE, step,
            UPDATE, COMMIT): countersign, inventory, hot, the must-apply scenarios where every
            call must land.
cas         an unlocked read, the step, a version compare-and-swap, retried at once on a lost
            race until it lands: spread and cluster (low conflict, must apply).
claim       one `INSERT ... ON CONFLICT DO NOTHING` of the (job, tick) row: singleton.
=========== ===================================================================================

This module holds the base class, the session a scenario fires through, and the judging helpers
the families share; each family has a module of its own (storm, countersign, inventory, steps,
singleton) and registers in `flowlock.bench.scenarios.SCENARIOS`. A new one subclasses
`Scenario` and calls `register_scenario`.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import asyncpg

from flowlock._pg.rows import read_history, read_instances
from flowlock.bench.results import (
    CallResult,
    CallSpec,
    Judgement,
    Kind,
    Params,
    RoundPlan,
    RoundRecord,
)
from flowlock.checker import DOUBLE_APPLY, INVARIANT, LOST_UPDATE, Invariant, Violation
from flowlock.core.definition import Workflow
from flowlock.core.errors import InstanceNotFound
from flowlock.core.models import HistoryEntry, Instance
from flowlock.engine import Engine

__all__ = ["Fired", "Floor", "Scenario", "Session", "actors_match", "results_for"]

Floor = Literal["statement", "locked", "cas", "claim"]
"""How the raw floor does a scenario's calls (see the module docstring)."""


@dataclass(frozen=True, slots=True)
class Fired:
    """What a session says one call came to (failures are raised instead). `batch_size`: the
    engine's `Outcome.batch_size`; None when no engine answered (the raw floor, a job run by
    `RunOnce`)."""

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
        """Run `fn` for `(job, tick)` unless another caller (any process) has: True when this
        call ran it; None when the session has no run-once runner of its own (the caller then
        claims the tick through the engine)."""
        ...


# -- the base class -------------------------------------------------------------------------


class Scenario:
    """What the runner needs from a scenario; subclasses set the class attributes and override
    `setup` and `judge` (and, when they need to, the other hooks)."""

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
        """Create this round's fresh instance(s); ids start with `key`, unique per round."""
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
        """Scenario-specific correctness of one finished round."""
        return Judgement(False)

    def rounds(self, quick: bool) -> int:
        return self.quick_rounds if quick else self.default_rounds

    def ops(self, quick: bool) -> int:
        return self.quick_ops if quick else self.default_ops


def results_for(record: RoundRecord, iid: str, kind: Kind) -> list[CallResult]:
    return [r for r in record.results if r.call.instance_id == iid and r.kind == kind]


def actors_match(
    iid: str, history: Sequence[HistoryEntry], record: RoundRecord, what: str
) -> list[Violation]:
    """Every call that answered applied has its row in history (by actor), and no row exists
    that no caller was told about."""
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
