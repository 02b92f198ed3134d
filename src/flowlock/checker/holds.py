"""The holds check: a legal hold is well formed. Pure, no I/O.

A hold names an instance id, which may or may not exist (a hold placed before a restore, or one
that outlived a purge elsewhere): that is no violation. What is checked is the hold itself:
a non-empty id, held once, with the time it was placed.
"""

from __future__ import annotations

from collections.abc import Iterable

from flowlock.checker.verdicts import MALFORMED_HOLD, Violation
from flowlock.core.retention import Hold

__all__ = ["check_holds"]


def check_holds(holds: Iterable[Hold]) -> list[Violation]:
    """The violations of `holds` (every hold of a store, as `engine.holds` pages them)."""
    found: list[Violation] = []
    seen: set[str] = set()
    for hold in holds:
        iid = hold.instance_id
        if not isinstance(iid, str) or not iid:
            found.append(Violation(MALFORMED_HOLD, f"a hold names no instance id ({iid!r})"))
            continue
        if iid in seen:
            found.append(Violation(MALFORMED_HOLD, f"instance {iid!r} is held twice"))
        seen.add(iid)
        if hold.at is None:
            found.append(
                Violation(MALFORMED_HOLD, f"the hold on {iid!r} has no time it was placed")
            )
    return found
