"""Check that an instance's history shows every transition applied exactly once.

The engine promises that each transition is applied by exactly one ``fire`` call, however many
callers race on the same instance. That promise leaves a precise trace in the store, and this
module reads it back: given the final :class:`~flowlock.core.models.Instance` and its
:class:`~flowlock.core.models.HistoryEntry` rows, :func:`check` reports *every* way the
trace departs from an exactly-once history. Pure functions, no I/O: the tests, the benchmark and
the fault suites all call it on what they read from a store.

What is checked, and why:

- ``version-gap``: versions run 2, 3, 4... with no hole, no repeat and in order. An instance is
  created at version 1 with no history row and every applied transition adds exactly one. A hole
  means a write was lost or skipped; a repeat means two writers both believed they moved the
  instance from the same version (a lost compare-and-swap that still wrote).
- ``double-apply``: the same ``request_id`` appears on two rows (a retried request applied twice),
  or, given ``expected_applied``, there are more rows than calls that answered ``applied=True``.
- ``lost-update``: given ``expected_applied``, fewer rows than calls that answered
  ``applied=True``: a caller was told its transition happened and the store does not show it.
- ``broken-chain``: each row starts where the previous one ended (``from_state`` equals the
  previous ``to_state``; the first starts at ``initial_state`` when given). A break means some
  transition was decided on a stale read of the state.
- ``final-mismatch``: the stored instance is what its history says it should be: version
  ``1 + len(history)``, and state, data and ``last_event`` equal to the last row's.
- ``foreign-entry``: a row that belongs to another instance id. Such rows are reported and left
  out of every other check.
- ``invariant`` (or the caller's ``invariant_kind``, e.g. ``oversell``): a business invariant the
  caller supplies, run on the data after every row and on the final instance, such as "stock
  never goes below zero".

Rows are taken in version order (stably, so repeats stay in the given order) for the chain, final
and invariant checks; the order they were given in is checked separately, as ``version-gap``.

The other check here works from the callers' side: a :class:`Recorder` records each call as it
is invoked and as it completes (ok, fail or unknown), and :func:`check_linearizable` searches
for an order of those calls that a single, sequential instance would have answered the same way
(see :mod:`flowlock.linearizability`, where it lives; every name is exported from here).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from flowlock.core.errors import FlowlockError
from flowlock.core.models import HistoryEntry, Instance
from flowlock.linearizability import (
    DOUBLE_APPLY,
    INVALID_RESULT,
    LINEARIZABILITY_KINDS,
    LOST_UPDATE,
    NOT_LINEARIZABLE,
    OPS,
    OUTCOMES,
    STALE_READ,
    UNDECIDED,
    CallHandle,
    CallRecord,
    LinearizabilityVerdict,
    LinearizabilityViolation,
    NotLinearizable,
    Recorder,
    check_linearizable,
    outcome_of,
)

__all__ = [
    "BROKEN_CHAIN",
    "DOUBLE_APPLY",
    "FINAL_MISMATCH",
    "FOREIGN_ENTRY",
    "INVALID_RESULT",
    "INVARIANT",
    "KINDS",
    "LINEARIZABILITY_KINDS",
    "LOST_UPDATE",
    "NOT_LINEARIZABLE",
    "OPS",
    "OUTCOMES",
    "OVERSELL",
    "STALE_READ",
    "UNDECIDED",
    "VERSION_GAP",
    "CallHandle",
    "CallRecord",
    "CheckFailed",
    "Invariant",
    "LinearizabilityVerdict",
    "LinearizabilityViolation",
    "NotLinearizable",
    "Recorder",
    "Verdict",
    "Violation",
    "check",
    "check_linearizable",
    "check_many",
    "outcome_of",
]

# DOUBLE_APPLY and LOST_UPDATE are the linearizability check's kinds too (one meaning each).
VERSION_GAP = "version-gap"
BROKEN_CHAIN = "broken-chain"
FINAL_MISMATCH = "final-mismatch"
FOREIGN_ENTRY = "foreign-entry"
INVARIANT = "invariant"
OVERSELL = "oversell"
"""Kind for a failed stock invariant: pass ``invariant_kind=OVERSELL`` to :func:`check`."""

KINDS: tuple[str, ...] = (
    VERSION_GAP,
    DOUBLE_APPLY,
    BROKEN_CHAIN,
    FINAL_MISMATCH,
    LOST_UPDATE,
    FOREIGN_ENTRY,
    INVARIANT,
    OVERSELL,
)

Invariant: TypeAlias = Callable[[Mapping[str, Any]], str | None]
"""Takes an instance's data; returns None when it holds, or a message saying what is wrong."""

_CREATED_VERSION = 1


@dataclass(frozen=True, slots=True)
class Violation:
    """One way a history departs from exactly-once; ``version`` is the row or instance version
    it was found at, when there is one."""

    kind: str
    message: str
    version: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """``{"kind": ..., "message": ..., "version": ...}``, ready for JSON."""
        return {"kind": self.kind, "message": self.message, "version": self.version}

    def __str__(self) -> str:
        at = "" if self.version is None else f" (version {self.version})"
        return f"[{self.kind}]{at} {self.message}"


@dataclass(frozen=True, slots=True)
class Verdict:
    """The result of a check: ``ok`` exactly when there are no violations. Truthy when ok."""

    ok: bool
    violations: tuple[Violation, ...] = ()

    def __post_init__(self) -> None:
        if self.ok != (not self.violations):
            raise ValueError(
                f"inconsistent verdict: ok={self.ok} with {len(self.violations)} violation(s)"
            )

    @classmethod
    def of(cls, violations: Iterable[Violation]) -> Verdict:
        """The verdict for these violations (ok when there are none)."""
        found = tuple(violations)
        return cls(ok=not found, violations=found)

    def __bool__(self) -> bool:
        return self.ok

    def kinds(self) -> frozenset[str]:
        """The distinct kinds of violation found."""
        return frozenset(v.kind for v in self.violations)

    def to_dict(self) -> dict[str, Any]:
        """``{"ok": bool, "violations": [{"kind", "message", "version"}, ...]}``, ready for JSON."""
        return {"ok": self.ok, "violations": [v.to_dict() for v in self.violations]}

    def describe(self) -> str:
        """A readable, multi-line summary."""
        if self.ok:
            return "history is exactly-once: no violations"
        lines = [f"history check found {len(self.violations)} violation(s):"]
        lines.extend(f"  - {v}" for v in self.violations)
        return "\n".join(lines)

    def raise_for_violations(self) -> None:
        """Raise :class:`CheckFailed` listing every violation, unless the verdict is ok."""
        if not self.ok:
            raise CheckFailed(self)


class CheckFailed(FlowlockError):
    """A history is not exactly-once; ``verdict`` lists every violation found."""

    def __init__(self, verdict: Verdict, message: str | None = None) -> None:
        self.verdict = verdict
        super().__init__(message or verdict.describe())


def check(
    instance: Instance,
    history: Sequence[HistoryEntry],
    *,
    initial_state: str | None = None,
    expected_applied: int | None = None,
    invariant: Invariant | None = None,
    invariant_kind: str = INVARIANT,
) -> Verdict:
    """Check ``history`` against ``instance`` and report every violation found.

    ``initial_state``: the state the instance was created in (the first row must start there).
    ``expected_applied``: how many ``fire`` calls answered ``applied=True`` for this instance.
    ``invariant``: run on the data after every row and on the final instance; a returned string
    is a violation of kind ``invariant_kind``.
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
) -> Verdict:
    """Check each ``(instance, history)`` pair and merge the verdicts (messages name the id).

    ``expected_applied`` is either one count for every instance or a count per instance id
    (instances missing from the mapping get no count check).
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
    """A request id (when given) is applied at most once."""
    found: list[Violation] = []
    first: dict[str, int] = {}
    for entry in entries:
        rid = entry.request_id
        if rid is None:
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
