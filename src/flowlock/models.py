"""Frozen values that cross the engine's boundary: Instance, HistoryEntry, Outcome, and the values
the layers hand each other: Snapshot (what a store read) and Escalation (an adaptive decision).

They are moved forward with :func:`dataclasses.replace` (``instance.evolve(...)``), never mutated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

__all__ = ["Escalation", "HistoryEntry", "Instance", "Outcome", "Snapshot"]


@dataclass(frozen=True, slots=True)
class Instance:
    """One workflow instance as stored: its state, its data and its version.

    ``version`` starts at 1 on creation and grows by exactly one per applied transition.
    ``last_event`` is the event of the last applied transition (None until the first).
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
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True, slots=True)
class HistoryEntry:
    """One applied transition: the instance moved from ``from_state`` to ``to_state`` and
    reached ``version``; ``data`` is the instance's data after it. ``fencing_token`` is the
    lease's fencing token when the distributed strategy wrote it (None otherwise). ``payload``
    is the payload of the call that applied it (an approver's comment, say), kept whether or not
    an effect copied it into ``data``; a retry of the same ``request_id`` must carry the same
    one."""

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
    """The instance as read, and the history entry that already carries the caller's
    ``request_id`` (None when the request is new or no request id was given)."""

    instance: Instance
    prior: HistoryEntry | None = None


@dataclass(frozen=True, slots=True)
class Escalation:
    """Key ``key`` runs under ``strategy`` until ``until`` (wall-clock epoch seconds) because of
    ``reason``."""

    key: str
    strategy: str
    until: float
    reason: str


@dataclass(frozen=True, slots=True)
class Outcome:
    """The answer to ``engine.fire``.

    - ``applied``: this call applied the transition (exactly one call per transition does).
    - ``idempotent``: nothing was applied because the same request (same ``request_id``, or the
      same event that was last applied, for the two-admins case) was applied before; ``instance``
      is then the instance as that first application left it (``request_id``) or as it is now.
    - ``attempts``: how many times the step ran (optimistic retries count).
    - ``strategy``: the concurrency strategy that ran (for "adaptive", the one it ran as);
      ``reason``: why, when the engine decided (adaptive: escalated or not, and the figures).
    - ``elapsed``: seconds spent in ``fire``.
    """

    applied: bool
    idempotent: bool
    instance: Instance
    attempts: int
    strategy: str
    elapsed: float
    event: str
    request_id: str | None = None
    reason: str | None = None
