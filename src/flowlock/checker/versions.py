"""The definition-version rules of the exactly-once check. Pure, no I/O.

Each row records the definition version it was decided with. Only a migration
(`flowlock:migrate`, a `migrated` row) changes it: every other row runs under the version the
row before it left. A row of no version (written before versions existed, or by a store that
keeps none) is unknown: it neither breaks the run nor sets it, and the first versioned row
after it may have any version (such an instance runs the newest version, and keeps the first
it is stamped with). The instance's own version is its last versioned row's. docs/checker.md
says more.
"""

from __future__ import annotations

from collections.abc import Sequence

from flowlock.checker.verdicts import DEFINITION_VERSION, Violation
from flowlock.core.errors import InvalidInput
from flowlock.core.migration import migration_target
from flowlock.core.models import HistoryEntry, Instance

__all__ = ["check_versions"]


def check_versions(
    name: str, instance: Instance, ordered: Sequence[HistoryEntry]
) -> list[Violation]:
    """The definition-version rules over `ordered` (the instance's rows in version order)."""
    found: list[Violation] = []
    current: int | None = None
    last: HistoryEntry | None = None
    for entry in ordered:
        version = entry.definition_version
        if version is None:
            continue  # unknown (no versions when written): it neither breaks nor sets the run
        if entry.migrated:
            found.extend(_migrated(name, entry))
        elif current is not None and version != current:
            found.append(
                Violation(
                    DEFINITION_VERSION,
                    f"{name}: version {entry.version} ({entry.event!r}) was decided under "
                    f"definition version {version}, but the instance ran version {current} "
                    "(only a migrated row changes it)",
                    entry.version,
                )
            )
        current, last = version, entry
    if last is not None and instance.definition_version != current:
        found.append(
            Violation(
                DEFINITION_VERSION,
                f"{name}: runs definition version {instance.definition_version}, but its last "
                f"versioned row (version {last.version}) says {current}",
                instance.version,
            )
        )
    return found


def _migrated(name: str, entry: HistoryEntry) -> list[Violation]:
    try:
        named: int | None = migration_target(entry.payload)
    except InvalidInput:
        named = None
    if named is not None and entry.definition_version == named:
        return []
    return [
        Violation(
            DEFINITION_VERSION,
            f"{name}: migrated row {entry.version} stamps definition version "
            f"{entry.definition_version}, but its payload names "
            f"{'no version' if named is None else f'version {named}'}",
            entry.version,
        )
    ]
