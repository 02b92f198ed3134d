"""The timer rules of the exactly-once check: no firing outside its stay, none twice, and
no armed timer left from an ended stay.

Pure, no I/O. A timer's firing is a history row written with actor `flowlock:timer` under
request id `timer:<stay>:<event>:<n>`: the stay is the version at which the instance entered
the state that armed the timer (1 for the state it was created in). docs/checker.md and
docs/timers.md say more.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from flowlock.checker.verdicts import (
    DOUBLE_APPLY,
    STALE_TIMER,
    STRAY_TIMER,
    Violation,
)
from flowlock.core.models import TIMER_ACTOR, HistoryEntry, Instance, Timer, TimerFiring

__all__ = ["check_timers", "firing_of"]

_FIRST_STAY = 1
# Event names are letters, digits, '_', '.' and '-' (no ':'), so the id splits one way only.
_TIMER_ID = re.compile(r"timer:([0-9]+):([^:]+):([0-9]+)")


def firing_of(entry: HistoryEntry) -> TimerFiring | None:
    """The timer firing a history row records, or None when a caller wrote it (its actor is
    not `flowlock:timer`, or its request id is not `timer:<stay>:<event>:<n>`)."""
    if entry.actor != TIMER_ACTOR or entry.request_id is None:
        return None
    match = _TIMER_ID.fullmatch(entry.request_id)
    if match is None:
        return None
    return TimerFiring(int(match[1]), match[2], int(match[3]))


def check_timers(
    name: str,
    instance: Instance,
    ordered: Sequence[HistoryEntry],
    initial_state: str | None,
    timers: Sequence[Timer] | None,
) -> list[Violation]:
    """Every timer rule on one instance's rows, in version order; `timers` (when read) are its
    armed timers, each of which must belong to its current stay (`instance.stay_version`; when
    it is None, the stay its history ends in).

    The stored `stay_version` is not compared with the history: a database migrated to timers
    leaves it None on the instances already there (their stay began before timers existed, so
    none has a timer armed before its next change of state)."""
    found: list[Violation] = []
    stay = _FIRST_STAY
    stay_state = initial_state if initial_state is not None else _first_state(ordered)
    fired: dict[TimerFiring, int] = {}
    for entry in ordered:
        firing = firing_of(entry)
        if firing is not None:
            found.extend(_one_firing(name, entry, firing, stay, stay_state))
            found.extend(_twice(name, entry, firing, fired))
        if entry.enters:
            stay, stay_state = entry.version, entry.to_state
    if timers is not None:
        current = instance.stay_version if instance.stay_version is not None else stay
        found.extend(_stray(name, instance, current, timers))
    return found


def _first_state(ordered: Sequence[HistoryEntry]) -> str | None:
    """The state of the first stay as the first row says (None: no rows, nothing to check)."""
    return ordered[0].from_state if ordered else None


def _one_firing(
    name: str, entry: HistoryEntry, firing: TimerFiring, stay: int, stay_state: str | None
) -> list[Violation]:
    """A firing applies only in the stay that armed it: the instance had not changed state since
    version `firing.stay`, and the row starts from that stay's state, with the timer's event."""
    what = (
        f"{name}: version {entry.version} ({entry.event!r}) was fired by the timer "
        f"{entry.request_id!r}"
    )
    if firing.stay != stay:
        left = (
            "the stay it was armed in had ended" if firing.stay < stay else "no such stay had begun"
        )
        return [
            Violation(
                STALE_TIMER,
                f"{what} of the stay that began at version {firing.stay}, but the instance was "
                f"in the stay that began at version {stay} ({stay_state!r}): {left}, so the "
                "firing should have been refused (StaleTimer) and written nothing",
                entry.version,
            )
        ]
    if stay_state is not None and entry.from_state != stay_state:
        return [
            Violation(
                STALE_TIMER,
                f"{what}, but it starts from {entry.from_state!r}, not {stay_state!r}, the state "
                f"of the stay that armed it (begun at version {stay})",
                entry.version,
            )
        ]
    if firing.event != entry.event:
        return [
            Violation(
                STALE_TIMER,
                f"{what}, whose request id names the event {firing.event!r}, not the row's",
                entry.version,
            )
        ]
    return []


def _twice(
    name: str, entry: HistoryEntry, firing: TimerFiring, fired: dict[TimerFiring, int]
) -> list[Violation]:
    """One timer firing (instance, stay, event, n) applies at most once."""
    first = fired.setdefault(firing, entry.version)
    if first == entry.version:
        return []
    return [
        Violation(
            DOUBLE_APPLY,
            f"{name}: the timer {firing.event!r} of the stay that began at version {firing.stay} "
            f"(firing {firing.n}) applied twice: at version {first} and again at version "
            f"{entry.version}",
            entry.version,
        )
    ]


def _stray(name: str, instance: Instance, stay: int, timers: Sequence[Timer]) -> list[Violation]:
    """An armed timer belongs to the instance's current stay: one of an ended stay should have
    been deleted by the commit that ended it."""
    found: list[Violation] = []
    for timer in timers:
        if timer.instance_id != instance.id:
            found.append(
                Violation(
                    STRAY_TIMER,
                    f"{name}: its timers include {timer.event!r} of instance {timer.instance_id!r}",
                )
            )
        elif timer.stay != stay:
            found.append(
                Violation(
                    STRAY_TIMER,
                    f"{name}: the timer {timer.event!r} (firing {timer.n}) is armed for the stay "
                    f"that began at version {timer.stay}, but the instance is in the stay that "
                    f"began at version {stay} ({instance.state!r}, version {instance.version}): "
                    "the commit that ended its stay should have deleted it",
                    instance.version,
                )
            )
    return found
