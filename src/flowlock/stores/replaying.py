"""The replay check's port: whole histories, many instances at a time (every store is one)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeAlias, runtime_checkable

from flowlock.core.models import HistoryEntry, Instance

__all__ = ["ReplayRow", "ReplayStore", "replay_row"]

ReplayRow: TypeAlias = tuple[Instance, Mapping[str, Any] | None, list[HistoryEntry]]
"""One instance as replay reads it: the instance, its data at creation (None when it was created
before flowlock stored it, or restored from an archive), and its whole history, oldest first."""


@runtime_checkable
class ReplayStore(Protocol):
    """The reads of `engine.check_definition`: whole histories, many instances at a time (every
    store is one). A batch is one consistent read on the SQL stores."""

    async def replay_batch(self, workflow: str, after: str | None, limit: int) -> list[ReplayRow]:
        """At most `limit` instances of `workflow` whose id comes after `after` (None: from the
        first), in code point order of the id, each with its creation data and its history up
        to the version read (see [`replay_row`][flowlock.stores.replaying.replay_row])."""
        ...

    async def replay_instances(self, instance_ids: Sequence[str]) -> list[ReplayRow]:
        """The instances of `instance_ids` that exist (of any workflow), in code point order of
        the id, each with its creation data and history."""
        ...


def replay_row(
    instance: Instance, initial: Mapping[str, Any] | None, history: Sequence[HistoryEntry]
) -> ReplayRow | None:
    """`instance` with its creation data and its history up to its version, oldest first, when
    the history holds every version from 2 to it; else None (a purge deleted it between the reads
    of a batch). Rows above the version belong to a move committed after the instance was read."""
    rows = sorted((h for h in history if h.version <= instance.version), key=lambda h: h.version)
    if [h.version for h in rows] != list(range(2, instance.version + 1)):
        return None
    return instance, initial, rows
