"""The definition-version rules of the exactly-once check. Pure, no I/O.

Each row records the definition version it was decided with. Only a migration
(`flowlock:migrate`, a `migrated` row) changes it: every other row runs under the version the
row before it left. A row of no version (written before versions existed, or by a store that
keeps none) is unknown: it neither breaks the run nor sets it, and the first versioned row
after it may have any version (such an instance runs the newest version, and keeps the first
it is stamped with). The instance's own version is its last versioned row's. Given the stored
definitions (their canonical forms, as `flowlock check` reads them), each row is also held to
the rules of the version it names: a row applied under other rules than its stamp says (a
transition, a source or a target that version lacks) is flagged. docs/checker.md says more.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from flowlock.checker.verdicts import DEFINITION_VERSION, Violation
from flowlock.core.errors import InvalidInput
from flowlock.core.migration import migration_target
from flowlock.core.models import RESERVED_EVENTS, HistoryEntry, Instance

__all__ = ["check_versions"]


def check_versions(
    name: str,
    instance: Instance,
    ordered: Sequence[HistoryEntry],
    definitions: Mapping[int, Mapping[str, Any]] | None = None,
) -> list[Violation]:
    """The definition-version rules over `ordered` (the instance's rows in version order).

    `definitions`: the canonical form of each stored version of the instance's workflow, by
    version number (None: the rows are not held to the rules)."""
    found: list[Violation] = []
    current: int | None = None
    last: HistoryEntry | None = None
    for entry in ordered:
        version = entry.definition_version
        if version is None:
            continue  # unknown (no versions when written): it neither breaks nor sets the run
        if definitions is not None and version in definitions:
            found.extend(_ruled(name, entry, definitions[version]))
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


def _ruled(name: str, entry: HistoryEntry, form: Mapping[str, Any]) -> list[Violation]:
    """`entry` held to the rules of the version it names (`form`, its canonical form): a
    fired row is one of its transitions, from a source to a target; any row ends in one of
    its states. A force, pause or resume row is an operator's, outside the transitions."""
    version = entry.definition_version
    rule: Mapping[str, Any] | None = None
    if entry.event not in RESERVED_EVENTS:
        rules = {t.get("name"): t for t in form.get("transitions") or ()}
        rule = rules.get(entry.event)
    problem: str | None = None
    if entry.event not in RESERVED_EVENTS and rule is None:
        problem = f"applied {entry.event!r}, a transition definition version {version} lacks"
    elif rule is not None and entry.from_state not in (rule.get("sources") or ()):
        problem = (
            f"applied {entry.event!r} from {entry.from_state!r}, not one of its sources in "
            f"definition version {version}"
        )
    elif rule is not None and entry.to_state not in (rule.get("targets") or ()):
        problem = (
            f"applied {entry.event!r} to {entry.to_state!r}, not one of its targets in "
            f"definition version {version}"
        )
    elif entry.to_state not in (form.get("states") or ()):
        problem = f"went to {entry.to_state!r}, a state definition version {version} lacks"
    if problem is None:
        return []
    return [
        Violation(
            DEFINITION_VERSION,
            f"{name}: row {entry.version} {problem}: it ran under other rules than the "
            "version it records",
            entry.version,
        )
    ]
