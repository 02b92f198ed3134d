"""Frozen values that cross the engine's boundary, and those the layers hand each other.

They move forward with `instance.evolve(...)` (`dataclasses.replace`), never by
mutation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, overload

from flowlock.core.constraints import Claim
from flowlock.core.outbox import Emit

__all__ = [
    "FORCE_EVENT",
    "MIGRATE_EVENT",
    "PAUSE_EVENT",
    "RESERVED_EVENTS",
    "RESUME_EVENT",
    "TIMER_ACTOR",
    "TIMER_PREFIX",
    "Escalation",
    "HistoryEntry",
    "Instance",
    "InstanceQuery",
    "Outcome",
    "Page",
    "Snapshot",
    "Timer",
    "TimerFiring",
    "Timing",
    "paused_after",
    "timer_request_id",
]

TIMER_ACTOR = "flowlock:timer"
"""The `actor` of every history row a timer wrote."""
TIMER_PREFIX = "timer:"
"""How the request id of every timer firing starts (callers may not use it)."""
# The operator's repairs are history rows of their own events. A user's event name never holds
# a ':' (see flowlock._calls), so these never clash with one. Re-exported by flowlock.core.admin.
FORCE_EVENT = "flowlock:force"
PAUSE_EVENT = "flowlock:pause"
RESUME_EVENT = "flowlock:resume"
# A migration's row (`engine.migrate`): moves the instance to another definition version.
MIGRATE_EVENT = "flowlock:migrate"
RESERVED_EVENTS = frozenset({FORCE_EVENT, PAUSE_EVENT, RESUME_EVENT, MIGRATE_EVENT})
_KINDS = {
    FORCE_EVENT: "forced",
    PAUSE_EVENT: "pause",
    RESUME_EVENT: "resume",
    MIGRATE_EVENT: "migrated",
}


def paused_after(paused: bool, event: str) -> bool:
    """Whether an instance is paused once a row of `event` is applied to it (it was `paused`):
    a pause row pauses it, a resume row resumes it, any other row leaves it as it was."""
    if event == PAUSE_EVENT:
        return True
    return False if event == RESUME_EVENT else paused


@dataclass(frozen=True, slots=True)
class Instance:
    """One workflow instance as stored: its state, its data and its version.

    `version` starts at 1 and grows by one per applied transition. `last_event` is the
    last applied event, None until the first. `stay_version` is the version at which the
    instance entered its current state (its stay; timers belong to one stay). `next_timer` is
    its earliest armed timer, filled in by `engine.get` (None elsewhere, or with none armed).
    `paused`: an operator paused this instance (`engine.pause`); `workflow_paused`: its whole
    workflow is paused, read with the instance (a commit's answer may leave it False). Either
    way `fire` refuses it with InstancePaused; `force` still works. `definition_version`: the
    version of its workflow's definition it runs under (its last history row's); None when
    created before versions or on a store without them: it runs the newest registered version.
    """

    id: str
    workflow: str
    state: str
    version: int
    data: Mapping[str, Any]
    last_event: str | None = None
    created_at: datetime | None = None
    updated_at: datetime | None = None
    stay_version: int | None = None
    next_timer: Timer | None = dataclasses.field(default=None, compare=False)
    paused: bool = False
    workflow_paused: bool = dataclasses.field(default=False, compare=False)
    definition_version: int | None = None

    def evolve(self, **changes: Any) -> Instance:
        """A copy with `changes` applied."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True, slots=True)
class HistoryEntry:
    """One applied transition, which took the instance to `version`.

    - `from_state` and `to_state`: the move.
    - `data`: the instance's data after it.
    - `fencing_token`: the lease's token when the distributed strategy wrote it, else None.
    - `payload`: the call's payload, kept even if no effect copied it into `data`. A
      retry of the same `request_id` must carry the same payload.
    - `definition_version`: the version of the workflow's definition the row was decided with
      (None: unknown, written before versions or by an engine without them).
    """

    instance_id: str
    version: int
    event: str
    from_state: str
    to_state: str
    actor: str | None
    request_id: str | None
    strategy: str
    data: Mapping[str, Any]
    at: datetime | None = None
    fencing_token: int | None = None
    payload: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    definition_version: int | None = None
    # What the commit does to timers, in the same transaction (not stored with the row):
    # `arm`, the timers of the stay this entry begins (when it changes the state); `voids`,
    # whether it ends a stay that may hold timers; `timer`, the timer this entry fired.
    arm: tuple[Timing, ...] = dataclasses.field(default=(), compare=False, repr=False)
    voids: bool = dataclasses.field(default=False, compare=False, repr=False)
    timer: TimerFiring | None = dataclasses.field(default=None, compare=False, repr=False)
    # The messages the commit writes to the outbox (message n has key instance:version:n), and
    # the W3C traceparent of the call's span, which each delivery's span links to.
    emits: tuple[Emit, ...] = dataclasses.field(default=(), compare=False, repr=False)
    trace: str | None = dataclasses.field(default=None, compare=False, repr=False)
    # What the commit does to capacities, uniqueness and rate limits (flowlock.core.constraints).
    claims: tuple[Claim, ...] = dataclasses.field(default=(), compare=False, repr=False)

    @property
    def enters(self) -> bool:
        """Whether this entry begins a new stay (it changes the state)."""
        return self.from_state != self.to_state

    @property
    def forced(self) -> bool:
        """Whether an operator forced this move (`engine.force`), outside the definition."""
        return self.event == FORCE_EVENT

    @property
    def migrated(self) -> bool:
        """Whether a migration moved the instance to another definition version here
        (`engine.migrate`); `definition_version` is then the version it moved to."""
        return self.event == MIGRATE_EVENT

    @property
    def kind(self) -> str:
        """ "forced", "pause", "resume", "migrated" (an operator's repair) or "transition" (a
        fired event)."""
        return _KINDS.get(self.event, "transition")

    @property
    def reason(self) -> str | None:
        """The operator's reason of a repair row; None for a transition (or a bare resume)."""
        if self.event not in _KINDS:
            return None
        reason = self.payload.get("reason")
        return reason if isinstance(reason, str) else None


@dataclass(frozen=True, slots=True)
class Timing:
    """A timed transition as a store arms it: fire `event` `after` seconds into the stay,
    then every `every` seconds (None: once), at most `limit` firings (None: no limit)."""

    event: str
    after: float
    every: float | None = None
    limit: int | None = None


@dataclass(frozen=True, slots=True)
class TimerFiring:
    """Which armed timer a call fires: the stay that armed it, its event, its firing number
    (0 for the first). Together they make the call's request id."""

    stay: int
    event: str
    n: int = 0

    @property
    def request_id(self) -> str:
        return timer_request_id(self.stay, self.event, self.n)


def timer_request_id(stay: int, event: str, n: int) -> str:
    """The request id of a timer's firing: `timer:<stay version>:<event>:<n>`. Every engine
    firing the same timer uses the same one, so it applies once."""
    return f"{TIMER_PREFIX}{stay}:{event}:{n}"


@dataclass(frozen=True, slots=True)
class Timer:
    """One armed timer: `event` fires at `instance_id` at `due_at` (the database's clock).

    - `stay`: the version at which the instance entered the state that armed it; void once the
      instance leaves that state.
    - `n`: firings done so far (a reminder with `every` counts up; `limit` caps them).
    - `every`: seconds between a reminder's firings, None for one firing.
    - `claimed_until`: when an engine firing it now gives up its claim, None when unclaimed.
    - `lag`: seconds past due when read (0 when not due yet), on the database's clock.
    """

    instance_id: str
    workflow: str
    event: str
    stay: int
    due_at: datetime
    n: int = 0
    every: float | None = None
    limit: int | None = None
    claimed_until: datetime | None = None
    lag: float = 0.0

    @property
    def firing(self) -> TimerFiring:
        return TimerFiring(self.stay, self.event, self.n)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The instance as read, and the entries that already carry the request ids asked for.

    `priors` maps each request id found to its entry; a new request id is absent.
    """

    instance: Instance
    priors: Mapping[str, HistoryEntry] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Escalation:
    """Key `key` runs under `strategy` until `until` because of `reason`.

    `until` is wall-clock epoch seconds.
    """

    key: str
    strategy: str
    until: float
    reason: str


@dataclass(frozen=True, slots=True)
class Outcome:
    """The answer to `engine.fire`.

    - `applied`: this call applied the transition. Exactly one call per transition does.
    - `idempotent`: nothing was applied, because the same request was applied before. That
      is the same `request_id`, or the same event last applied (two admins clicking).
      `instance` is then as that first application left it, or as it is now.
    - `attempts`: how many times the step ran, optimistic retries included.
    - `strategy`: the strategy that ran; for "adaptive", the one it ran as.
    - `reason`: why, when the engine decided (adaptive: escalated or not, with figures).
    - `elapsed`: seconds spent in `fire`.
    - `batch_size`: calls on the instance decided and written together with this one.
      1 means it ran alone; see `Engine(batching=...)`.
    - `replayed`: idempotent because this `request_id` was applied before. `instance`
      is then exactly what that first application answered.
    """

    applied: bool
    instance: Instance
    attempts: int
    strategy: str
    elapsed: float
    event: str
    request_id: str | None = None
    reason: str | None = None
    batch_size: int = 1
    replayed: bool = False

    @property
    def idempotent(self) -> bool:
        """Answered without applying: a replayed request, or the same event applied before."""
        return self.replayed or not self.applied


@dataclass(frozen=True, slots=True)
class InstanceQuery:
    """Which instances a query wants: every filter given must hold; None is no filter.

    - `workflow`: the instance's workflow name.
    - `states`: the instance's state is one of these.
    - `updated_before` / `updated_after`: `updated_at` is strictly before or after
      (timezone-aware datetimes).

    The engine builds and checks it ([`flowlock.Engine.list`][flowlock.Engine.list]); stores only
    apply it.
    """

    workflow: str | None = None
    states: tuple[str, ...] | None = None
    updated_before: datetime | None = None
    updated_after: datetime | None = None

    def matches(self, instance: Instance) -> bool:
        """Whether `instance` passes every filter (what the SQL stores' WHERE clauses say)."""
        if self.workflow is not None and instance.workflow != self.workflow:
            return False
        if self.states is not None and instance.state not in self.states:
            return False
        updated = instance.updated_at
        if self.updated_before is not None and not (
            updated is not None and updated < self.updated_before
        ):
            return False
        return self.updated_after is None or (updated is not None and updated > self.updated_after)


@dataclass(frozen=True, slots=True)
class Page(Sequence[Instance]):
    """One page of [`flowlock.Engine.list`][flowlock.Engine.list]: instances in id order, and where
    the next starts.

    A Page is a read-only sequence: iterate it, take `len(page)`, index it. `next_cursor`
    is None on the last page. Otherwise pass it as `after=page.next_cursor` for the next
    one. A cursor is an opaque position in id order, not a server-side result. It never
    expires, and works from any engine on the same database.
    """

    instances: tuple[Instance, ...]
    next_cursor: str | None = None

    def __len__(self) -> int:
        return len(self.instances)

    def __iter__(self) -> Iterator[Instance]:
        return iter(self.instances)

    @overload
    def __getitem__(self, index: int) -> Instance: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Instance]: ...

    def __getitem__(self, index: int | slice) -> Instance | Sequence[Instance]:
        return self.instances[index]
