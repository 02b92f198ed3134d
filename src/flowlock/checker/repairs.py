"""The repair rules of the exactly-once check: an operator's forced, pause, resume and
migrated rows.

Pure, no I/O. A forced row (`flowlock:force`) is a transition of its own kind: any state to any
state, no definition edge needed, with a reason. A pause or resume row keeps the state and the
data, and switches the instance's own pause; while it is paused (from a pause row to the next
resume row) no fired event may be applied. A migrated row (`flowlock:migrate`) goes where its
payload's state map takes its state (its version is checked by checker/versions.py).
docs/checker.md says more.
"""

from __future__ import annotations

from collections.abc import Sequence

from flowlock.checker.verdicts import FINAL_MISMATCH, FIRED_WHILE_PAUSED, REPAIR_ROW, Violation
from flowlock.core.migration import mapped_state
from flowlock.core.models import HistoryEntry, Instance

__all__ = ["check_repairs"]


def check_repairs(
    name: str, instance: Instance, ordered: Sequence[HistoryEntry]
) -> list[Violation]:
    """The repair rules over `ordered` (the instance's rows in version order), and the stored
    pause against what its rows say. A history from before a pause was ever written has none of
    these rows and passes."""
    found: list[Violation] = []
    paused = False
    previous: HistoryEntry | None = None
    for entry in ordered:
        kind = entry.kind
        if kind == "transition":
            if paused:
                found.append(
                    Violation(
                        FIRED_WHILE_PAUSED,
                        f"{name}: version {entry.version} ({entry.event!r}) was applied while "
                        "the instance was paused (after a pause row, before a resume row)",
                        entry.version,
                    )
                )
        elif kind == "forced":
            found.extend(_forced(name, entry))
        elif kind == "migrated":
            found.extend(_migrated(name, entry))
        else:
            found.extend(_toggle(name, entry, previous, paused))
            paused = kind == "pause"
        previous = entry
    if instance.paused != paused:
        found.append(
            Violation(
                FINAL_MISMATCH,
                f"{name}: paused is {instance.paused}, but its history "
                f"{'pauses it last' if paused else 'leaves it not paused'}",
                instance.version,
            )
        )
    return found


def _forced(name: str, entry: HistoryEntry) -> list[Violation]:
    problems = []
    if not entry.reason or not entry.reason.strip():
        problems.append("carries no reason")
    if entry.payload.get("state") != entry.to_state:
        problems.append(
            f"went to {entry.to_state!r}, but its payload asked for {entry.payload.get('state')!r}"
        )
    if "data" in entry.payload and dict(entry.payload["data"]) != dict(entry.data):
        problems.append("left other data than its payload gave")
    return [
        Violation(REPAIR_ROW, f"{name}: forced row {entry.version} {p}", entry.version)
        for p in problems
    ]


def _migrated(name: str, entry: HistoryEntry) -> list[Violation]:
    """A migrated row goes where its payload's state map takes its state; it may run on a
    paused instance (a repair), and leaves the pause as it was."""
    wanted = mapped_state(entry.payload, entry.from_state)
    if entry.to_state == wanted:
        return []
    return [
        Violation(
            REPAIR_ROW,
            f"{name}: migrated row {entry.version} went to {entry.to_state!r}, but its payload "
            f"maps {entry.from_state!r} to {wanted!r}",
            entry.version,
        )
    ]


def _toggle(
    name: str, entry: HistoryEntry, previous: HistoryEntry | None, paused: bool
) -> list[Violation]:
    """A pause or resume row: it keeps the state and the data, and changes the pause."""
    what = f"{name}: {entry.kind} row {entry.version}"
    problems = []
    if entry.from_state != entry.to_state:
        problems.append(f"moved from {entry.from_state!r} to {entry.to_state!r}")
    if previous is not None and dict(previous.data) != dict(entry.data):
        problems.append("changed the data")
    if (entry.kind == "pause") == paused:
        problems.append(f"was written while the instance was {'' if paused else 'not '}paused")
    if entry.kind == "pause" and not entry.reason:
        problems.append("carries no reason")
    return [Violation(REPAIR_ROW, f"{what} {p}", entry.version) for p in problems]
