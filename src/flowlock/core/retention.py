"""Retention's values: legal holds, what a purge selects and reports, an instance as archived,
and the archive's error. docs/operations.md says how purge, archive and restore fit together."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from flowlock.core.errors import FlowlockError
from flowlock.core.models import HistoryEntry, Instance

__all__ = [
    "ArchiveInvalid",
    "ArchivedInstance",
    "CreateRecord",
    "Hold",
    "PurgeReport",
    "PurgeSelection",
    "RestoreReport",
]


@dataclass(frozen=True, slots=True)
class Hold:
    """A legal hold: `instance_id` is never purged while it stands. It may name an instance
    that does not exist (yet, or any more): a hold is a promise about an id, not a row of it.
    `at` is when it was placed, on the store's clock.

    `instance_found`, on the hold `engine.hold` returns: whether the instance existed when the
    hold was placed. False means it came too late for a purge that deleted the instance (or
    before the instance was created or restored). None on holds read back with `engine.holds`."""

    instance_id: str
    reason: str | None = None
    actor: str | None = None
    at: datetime | None = None
    # What one call saw, not part of the hold: holds that differ only by it are equal.
    instance_found: bool | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class CreateRecord:
    """The idempotency key of the create that made an instance, and the state and data that
    create recorded (so a restored instance answers a retried create as before)."""

    request_id: str
    state: str
    data: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class ArchivedInstance:
    """One instance as a purge reads it and a restore writes it back, verbatim: its row (with
    the fencing token the row carries, which `Instance` does not show), its history oldest
    first, and its create's record when it was made under a key."""

    instance: Instance
    history: tuple[HistoryEntry, ...]
    fencing_token: int | None = None
    created: CreateRecord | None = None


@dataclass(frozen=True, slots=True)
class PurgeSelection:
    """What a purge deletes: instances of `workflow` in one of `states` (None: any state) whose
    `updated_at` is more than `older_than` seconds before now on the store's clock, that are not
    held and have no outbox message still to deliver."""

    workflow: str
    states: tuple[str, ...] | None
    older_than: float


@dataclass(frozen=True, slots=True)
class PurgeReport:
    """What `engine.purge` did (or, with `dry_run`, would do).

    - `matched`: instances the selection found when the purge began (held ones excluded).
    - `held`: instances the selection would take but a hold exempts.
    - `purged`: instances deleted, with their history, timers, messages and create record
      (0 on a dry run), each written to `archive` first when one was given.
    - `kept`: instances read for deletion that moved (or were held) before their batch's
      delete, and so were left alone.
    - `batches`: delete transactions run; `longest_batch`: the longest one, in seconds, from
      its first statement to its commit (the most any row lock of a purge is held).
    """

    workflow: str
    states: tuple[str, ...] | None
    older_than: float
    dry_run: bool
    matched: int
    held: int
    purged: int = 0
    kept: int = 0
    batches: int = 0
    longest_batch: float = 0.0
    archive: Path | None = None


@dataclass(frozen=True, slots=True)
class RestoreReport:
    """What `engine.restore` did: `restored` instances inserted with their history, `skipped`
    the ids that already existed (left as they are), out of `lines` in the archive."""

    path: Path
    lines: int
    restored: int
    skipped: tuple[str, ...] = field(default=())


class ArchiveInvalid(FlowlockError):
    """A retention archive cannot be used: its manifest is missing or does not match it, or a
    line is not an archived instance. Nothing was restored from it."""

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        self.path = Path(path)
        self.problem = problem
        super().__init__(f"archive {str(self.path)!r}: {problem}; nothing was restored")
