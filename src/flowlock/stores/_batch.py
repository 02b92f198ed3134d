"""Checks every store makes on a batch write before touching its data, so the stores refuse the
same inputs with the same messages: several instances' batches (`commit_many`) and what a
`plan` returned under the row lock (`apply_locked`)."""

from __future__ import annotations

from collections.abc import Sequence

from flowlock.core.errors import InvalidInput
from flowlock.core.models import HistoryEntry, Snapshot
from flowlock.stores.base import entries_of

__all__ = ["distinct_batches", "entering", "planned_entries", "refused_plan"]


def distinct_batches(batches: Sequence[Sequence[HistoryEntry]]) -> list[tuple[HistoryEntry, ...]]:
    """Each batch of `commit_many` checked by [`entries_of`][flowlock.stores.base.entries_of], and
    no instance twice (two batches of one instance would race each other inside one call).
    InvalidInput says what is wrong; the store has written nothing yet."""
    checked = [entries_of(batch) for batch in batches]
    seen: set[str] = set()
    for batch in checked:
        instance_id = batch[0].instance_id
        if instance_id in seen:
            raise InvalidInput(
                f"commit_many got two batches for instance {instance_id!r}; put all of one "
                "instance's entries in one batch. Nothing was written"
            )
        seen.add(instance_id)
    return checked


def planned_entries(
    instance_id: str, planned: Sequence[HistoryEntry] | None
) -> tuple[HistoryEntry, ...]:
    """What a plan returned, as a checked batch of `instance_id` (the instance locked), or
    `()` when it asked for no write (None or an empty sequence)."""
    if not planned:
        return ()
    checked = entries_of(planned)
    if checked[0].instance_id != instance_id:
        raise InvalidInput(
            f"plan returned an entry for instance {checked[0].instance_id!r} while "
            f"{instance_id!r} was locked; nothing was written"
        )
    return checked


def refused_plan(
    instance_id: str, batch: tuple[HistoryEntry, ...], snapshot: Snapshot
) -> InvalidInput:
    """The error for a planned batch whose compare-and-swap lost under the row lock: only a
    plan's bug can make it lose there (a version other than read + 1, a request id that was
    already applied, or a fencing token below the floor)."""
    first, last = batch[0], batch[-1]
    if len(batch) == 1:
        what = f"version {first.version} (request_id {first.request_id!r})"
    else:
        rids = [e.request_id for e in batch]
        what = f"versions {first.version} to {last.version} (request ids {rids!r})"
    return InvalidInput(
        f"plan returned {what} for instance {instance_id!r}, which was at version "
        f"{snapshot.instance.version} under the lock: the entries must start at read version + 1 "
        "with request ids not yet applied (and a fencing token not below the last one written); "
        "nothing was written"
    )


def entering(batch: Sequence[HistoryEntry]) -> HistoryEntry | None:
    """The entry that begins the stay a committed batch leaves its instance in: its last entry
    that changes the state (None: the stay goes on). Its version is the new `stay_version`, its
    `arm` the timers to arm."""
    for entry in reversed(batch):
        if entry.enters:
            return entry
    return None
