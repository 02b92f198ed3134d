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

__all__ = ["Escalation", "HistoryEntry", "Instance", "InstanceQuery", "Outcome", "Page", "Snapshot"]


@dataclass(frozen=True, slots=True)
class Instance:
    """One workflow instance as stored: its state, its data and its version.

    `version` starts at 1 and grows by one per applied transition. `last_event` is the
    last applied event, None until the first.
    """

    id: str
    workflow: str
    state: str
    version: int
    data: Mapping[str, Any]
    last_event: str | None = None
    created_at: datetime | None = None
    updated_at: datetime | None = None

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
