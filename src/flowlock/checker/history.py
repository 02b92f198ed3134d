"""The exactly-once check: read an instance's stored history back and find every flaw.

Pure, no I/O. docs/checker.md lists each kind of violation and why it matters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeAlias

from flowlock.checker.outbox import check_messages
from flowlock.checker.repairs import check_repairs
from flowlock.checker.timers import check_timers, firing_of
from flowlock.checker.verdicts import (
    BROKEN_CHAIN,
    DOUBLE_APPLY,
    FINAL_MISMATCH,
    FOREIGN_ENTRY,
    INVARIANT,
    LOST_UPDATE,
    VERSION_GAP,
    Verdict,
    Violation,
)
from flowlock.checker.versions import check_versions
from flowlock.core.models import HistoryEntry, Instance, Timer
from flowlock.core.outbox import Message

Invariant: TypeAlias = Callable[[Mapping[str, Any]], str | None]
"""Takes an instance's data; returns None when it holds, or a message saying what is wrong."""

_CREATED_VERSION = 1


def check(
    instance: Instance,
    history: Sequence[HistoryEntry],
    *,
    initial_state: str | None = None,
    expected_applied: int | None = None,
    invariant: Invariant | None = None,
    invariant_kind: str = INVARIANT,
    timers: Sequence[Timer] | None = None,
    messages: Sequence[Message] | None = None,
    definitions: Mapping[int, Mapping[str, Any]] | None = None,
) -> Verdict:
    """Check `history` against `instance` and report every violation found.

    `initial_state`: the state the instance was created in (the first row must start there).
    `expected_applied`: how many `fire` calls answered `applied=True` for this instance.
    `invariant`: run on the data after every row and on the final instance; a returned string
    is a violation of kind `invariant_kind`.
    `timers`: the instance's armed timers (`engine.timers(id)`), read with it; each must
    belong to its current stay. Timer firings in the history are always checked: each applied
    in the stay that armed it, and once.
    `messages`: the instance's outbox messages (`engine.messages(id)`), read with it; each
    must belong to a transition in the history under its own key, none may be done without
    an attempt, and a row fired under a message's key must come after that message's version.
    `definitions`: the canonical form of each stored version of the instance's workflow by
    number (`DefinitionVersion.definition`); each versioned row must follow its version's rules.
    """
    found: list[Violation] = []
    name = f"instance {instance.id!r}"

    own: list[HistoryEntry] = []
    for entry in history:
        if entry.instance_id == instance.id:
            own.append(entry)
        else:
            found.append(
                Violation(
                    FOREIGN_ENTRY,
                    f"{name}: history holds a row of instance {entry.instance_id!r}",
                    entry.version,
                )
            )

    found.extend(_check_versions(name, own))
    found.extend(_check_request_ids(name, own))
    if expected_applied is not None:
        found.extend(_check_count(name, len(own), expected_applied))

    ordered = sorted(own, key=lambda e: e.version)
    found.extend(_check_chain(name, ordered, initial_state))
    found.extend(_check_final(name, instance, ordered, initial_state))
    found.extend(check_timers(name, instance, ordered, initial_state, timers))
    found.extend(check_repairs(name, instance, ordered))
    found.extend(check_versions(name, instance, ordered, definitions))
    if messages is not None:
        found.extend(check_messages(name, instance, ordered, messages))
    if invariant is not None:
        found.extend(_check_invariant(name, instance, ordered, invariant, invariant_kind))
    return Verdict.of(found)


def check_many(
    pairs: Iterable[tuple[Instance, Sequence[HistoryEntry]]],
    *,
    initial_state: str | None = None,
    expected_applied: int | Mapping[str, int] | None = None,
    invariant: Invariant | None = None,
    invariant_kind: str = INVARIANT,
    timers: Mapping[str, Sequence[Timer]] | None = None,
    messages: Mapping[str, Sequence[Message]] | None = None,
    definitions: Mapping[str, Mapping[int, Mapping[str, Any]]] | None = None,
) -> Verdict:
    """Check each `(instance, history)` pair and merge the verdicts (messages name the id).

    `expected_applied` is one count for all, or a count per instance id.
    Instances missing from the mapping get no count check.
    `timers`: each instance's armed timers by id (an instance missing from it: not checked).
    `messages`: each instance's outbox messages by id (missing: not checked).
    `definitions`: by workflow name, each stored version's canonical form by number.
    """
    found: list[Violation] = []
    for instance, history in pairs:
        if isinstance(expected_applied, Mapping):
            expected = expected_applied.get(instance.id)
        else:
            expected = expected_applied
        verdict = check(
            instance,
            history,
            initial_state=initial_state,
            expected_applied=expected,
            invariant=invariant,
            invariant_kind=invariant_kind,
            timers=None if timers is None else timers.get(instance.id),
            messages=None if messages is None else messages.get(instance.id),
            definitions=None if definitions is None else definitions.get(instance.workflow),
        )
        found.extend(verdict.violations)
    return Verdict.of(found)


def _check_versions(name: str, entries: Sequence[HistoryEntry]) -> list[Violation]:
    """Versions, in the order given, must be exactly 2, 3, ... len + 1."""
    found: list[Violation] = []
    seen: set[int] = set()
    highest = _CREATED_VERSION
    for entry in entries:
        v = entry.version
        if v <= _CREATED_VERSION:
            found.append(
                Violation(
                    VERSION_GAP,
                    f"{name}: row at version {v}, but versions start at "
                    f"{_CREATED_VERSION + 1} (creation is version {_CREATED_VERSION}, no row)",
                    v,
                )
            )
        elif v in seen:
            found.append(Violation(VERSION_GAP, f"{name}: version {v} appears more than once", v))
        elif v < highest:
            found.append(
                Violation(
                    VERSION_GAP,
                    f"{name}: version {v} comes after version {highest} (out of order)",
                    v,
                )
            )
        seen.add(v)
        highest = max(highest, v)
    for start, end in _runs(sorted(set(range(_CREATED_VERSION + 1, highest)) - seen)):
        missing = f"version {start}" if start == end else f"versions {start}..{end}"
        found.append(Violation(VERSION_GAP, f"{name}: {missing} missing from history", start))
    return found


def _runs(numbers: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted distinct integers as (first, last) runs of consecutive values."""
    runs: list[tuple[int, int]] = []
    for n in numbers:
        if runs and runs[-1][1] == n - 1:
            runs[-1] = (runs[-1][0], n)
        else:
            runs.append((n, n))
    return runs


def _check_request_ids(name: str, entries: Sequence[HistoryEntry]) -> list[Violation]:
    """A request id (when given) is applied at most once. A timer firing applied twice is
    reported by the timer rules (naming its stay and firing), not again here."""
    found: list[Violation] = []
    first: dict[str, int] = {}
    timer_rows: set[str] = set()
    for entry in entries:
        rid = entry.request_id
        if rid is None:
            continue
        if rid in timer_rows and firing_of(entry) is not None:
            continue
        if rid in first:
            found.append(
                Violation(
                    DOUBLE_APPLY,
                    f"{name}: request {rid!r} applied again at version {entry.version} "
                    f"(first applied at version {first[rid]})",
                    entry.version,
                )
            )
        else:
            first[rid] = entry.version
            if firing_of(entry) is not None:
                timer_rows.add(rid)
    return found


def _check_count(name: str, rows: int, expected: int) -> list[Violation]:
    """One row per call that answered applied=True, no more and no fewer."""
    if rows > expected:
        return [
            Violation(
                DOUBLE_APPLY,
                f"{name}: {rows} transitions in history but only {expected} call(s) reported "
                f"applied; {rows - expected} applied without a caller knowing",
            )
        ]
    if rows < expected:
        return [
            Violation(
                LOST_UPDATE,
                f"{name}: {expected} call(s) reported applied but history holds only {rows} "
                f"transition(s); {expected - rows} lost",
            )
        ]
    return []


def _check_chain(
    name: str, ordered: Sequence[HistoryEntry], initial_state: str | None
) -> list[Violation]:
    """Each row starts in the state the previous one ended in."""
    found: list[Violation] = []
    previous: HistoryEntry | None = None
    for entry in ordered:
        if previous is None:
            if initial_state is not None and entry.from_state != initial_state:
                found.append(
                    Violation(
                        BROKEN_CHAIN,
                        f"{name}: first transition (version {entry.version}, {entry.event!r}) "
                        f"starts from {entry.from_state!r}, not the initial state "
                        f"{initial_state!r}",
                        entry.version,
                    )
                )
        elif entry.from_state != previous.to_state:
            found.append(
                Violation(
                    BROKEN_CHAIN,
                    f"{name}: version {entry.version} ({entry.event!r}) starts from "
                    f"{entry.from_state!r}, but version {previous.version} ended in "
                    f"{previous.to_state!r}",
                    entry.version,
                )
            )
        previous = entry
    return found


def _check_final(
    name: str,
    instance: Instance,
    ordered: Sequence[HistoryEntry],
    initial_state: str | None,
) -> list[Violation]:
    """The stored instance is what its history says it is."""
    found: list[Violation] = []
    v = instance.version

    def mismatch(message: str) -> None:
        found.append(Violation(FINAL_MISMATCH, f"{name}: {message}", v))

    expected_version = _CREATED_VERSION + len(ordered)
    if v != expected_version:
        mismatch(
            f"instance is at version {v}, but {len(ordered)} transition(s) in history "
            f"mean version {expected_version}"
        )
    if not ordered:
        if instance.last_event is not None:
            mismatch(f"last_event is {instance.last_event!r} but history is empty")
        if initial_state is not None and instance.state != initial_state:
            mismatch(
                f"state is {instance.state!r} but history is empty, so it should still be "
                f"the initial state {initial_state!r}"
            )
        return found

    last = ordered[-1]
    if v != last.version and v == expected_version:
        mismatch(f"instance is at version {v}, but the last row is version {last.version}")
    if instance.state != last.to_state:
        mismatch(
            f"state is {instance.state!r}, but the last transition (version {last.version}) "
            f"ended in {last.to_state!r}"
        )
    if dict(instance.data) != dict(last.data):
        mismatch(
            f"data is {dict(instance.data)!r}, but after the last transition "
            f"(version {last.version}) it was {dict(last.data)!r}"
        )
    if instance.last_event != last.event:
        mismatch(
            f"last_event is {instance.last_event!r}, but the last transition "
            f"(version {last.version}) was {last.event!r}"
        )
    return found


def _check_invariant(
    name: str,
    instance: Instance,
    ordered: Sequence[HistoryEntry],
    invariant: Invariant,
    kind: str,
) -> list[Violation]:
    """The caller's invariant holds after every row and on the final instance.

    The final instance is skipped when its data is the last row's, already checked.
    """
    found: list[Violation] = []
    for entry in ordered:
        problem = invariant(entry.data)
        if problem is not None:
            found.append(
                Violation(
                    kind,
                    f"{name}: after version {entry.version} ({entry.event!r}): {problem}",
                    entry.version,
                )
            )
    if not ordered or dict(instance.data) != dict(ordered[-1].data):
        problem = invariant(instance.data)
        if problem is not None:
            found.append(
                Violation(
                    kind,
                    f"{name}: final instance (version {instance.version}): {problem}",
                    instance.version,
                )
            )
    return found
