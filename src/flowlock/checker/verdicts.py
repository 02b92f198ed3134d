"""The verdicts of both checks, and the kinds of violation they report."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from flowlock.core.errors import FlowlockError

# One meaning per kind: DOUBLE_APPLY and LOST_UPDATE serve both checks.
VERSION_GAP = "version-gap"
BROKEN_CHAIN = "broken-chain"
FINAL_MISMATCH = "final-mismatch"
FOREIGN_ENTRY = "foreign-entry"
INVARIANT = "invariant"
OVERSELL = "oversell"
"""Kind for a failed stock invariant: pass `invariant_kind=OVERSELL` to `check`."""
STALE_TIMER = "stale-timer"
"""A timer's firing was applied outside the stay that armed it (the instance had left the state,
or the row starts from another state)."""
STRAY_TIMER = "stray-timer"
"""A timer is armed for a stay the instance has left: the commit that ended it kept it."""
ORPHAN_MESSAGE = "orphan-message"
"""An outbox message has no transition in the history to belong to (none at its version, or
one written under another fencing token), or its instance does not exist."""
MESSAGE_KEY = "message-key"
"""An outbox message's key is not `<instance_id>:<version>:<n>` of its own transition."""
UNDELIVERED_DONE = "undelivered-done"
"""An outbox message is done after 0 attempts: marked delivered without a delivery."""
EARLY_THEN = "early-then"
"""A row fired under a message's key (its handler's Then) comes at or before the transition
that emitted the message."""
FIRED_WHILE_PAUSED = "fired-while-paused"
"""A fired event's row was applied while the instance was paused: after a pause row, before the
next resume row (`engine.pause`)."""
REPAIR_ROW = "repair-row"
"""An operator's row is malformed: a pause or resume row that moved or changed the data, paused
a paused instance (or resumed one not paused), or a forced row without a reason or that went
elsewhere than its payload asked."""
DEFINITION_VERSION = "definition-version"
"""A row ran under another definition version than its instance's: its `definition_version`
differs from the row before it and it is no `migrated` row (only a migration changes the
version), a `migrated` row's version is not the one its payload names, or the instance's own
version is not its last row's."""
MALFORMED_HOLD = "malformed-hold"
"""A legal hold names no instance id, names one twice, or lacks the time it was placed. (A hold
of an id that does not exist is no violation: a hold is about an id.)"""
SLOT_LOG = "slot-log"
"""A key's slot events do not add up: their sequence numbers are not 1, 2, 3..., the holder
count after one is not the running sum of takes and releases, or an instance took a slot it
held already (released one it did not hold)."""
OVER_CAPACITY = "over-capacity"
"""A take left more holders of a key than the limit it was taken under."""
SLOT_COUNTER = "slot-counter"
"""A key's counter or its slot rows disagree with its replayed events: other holders, another
count, another last sequence number."""
LEAKED_SLOT = "leaked-slot"
"""A slot is held by an instance that does not exist, is in no state of the slot's rule, or
holds two slots of one kind; or a slot was taken at a version whose state has no such rule."""
MISSING_SLOT = "missing-slot"
"""An instance in a state of a rule, with a key, holds no slot of the rule (or one of another
key)."""
ORPHAN_CONSTRAINT_EVENT = "orphan-constraint-event"
"""A slot or rate event names a commit (instance, version) that its instance's history lacks."""
OVER_RATE = "over-rate"
"""More applications of a rate-limited key were timed within one window than its limit."""

DOUBLE_APPLY = "double-apply"
"""Two applied fires reported the same version (or the instance was created twice)."""
LOST_UPDATE = "lost-update"
"""One version was observed with two different contents: one update overwrote another."""
STALE_READ = "stale-read"
"""A call that began after a version was observed reported an older one."""
INVALID_RESULT = "invalid-result"
"""A call reported a result no order can give (a fire to a state its event cannot reach, a
create at a version other than 1, a fire at version 1)."""
NOT_LINEARIZABLE = "not-linearizable"
"""No order of the calls explains what they returned (found by the search)."""
UNDECIDED = "undecided"
"""The search ran out of its step budget: the history is neither proven right nor wrong."""

LINEARIZABILITY_KINDS: tuple[str, ...] = (
    DOUBLE_APPLY,
    LOST_UPDATE,
    STALE_READ,
    INVALID_RESULT,
    NOT_LINEARIZABLE,
    UNDECIDED,
)

KINDS: tuple[str, ...] = (
    VERSION_GAP,
    DOUBLE_APPLY,
    BROKEN_CHAIN,
    FINAL_MISMATCH,
    LOST_UPDATE,
    FOREIGN_ENTRY,
    INVARIANT,
    OVERSELL,
    STALE_TIMER,
    STRAY_TIMER,
    ORPHAN_MESSAGE,
    MESSAGE_KEY,
    UNDELIVERED_DONE,
    EARLY_THEN,
    FIRED_WHILE_PAUSED,
    REPAIR_ROW,
    MALFORMED_HOLD,
    DEFINITION_VERSION,
    SLOT_LOG,
    OVER_CAPACITY,
    SLOT_COUNTER,
    LEAKED_SLOT,
    MISSING_SLOT,
    ORPHAN_CONSTRAINT_EVENT,
    OVER_RATE,
)


# -- the exactly-once check's verdict


@dataclass(frozen=True, slots=True)
class Violation:
    """One way a history departs from exactly-once.

    `version` is the row or instance version it was found at, when there is one.
    """

    kind: str
    message: str
    version: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """`{"kind": ..., "message": ..., "version": ...}`, ready for JSON."""
        return {"kind": self.kind, "message": self.message, "version": self.version}

    def __str__(self) -> str:
        at = "" if self.version is None else f" (version {self.version})"
        return f"[{self.kind}]{at} {self.message}"


@dataclass(frozen=True, slots=True)
class Verdict:
    """The result of a check: `ok` exactly when there are no violations. Truthy when ok."""

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
        """`{"ok": bool, "violations": [{"kind", "message", "version"}, ...]}`, ready for JSON."""
        return {"ok": self.ok, "violations": [v.to_dict() for v in self.violations]}

    def describe(self) -> str:
        """A readable, multi-line summary."""
        if self.ok:
            return "history is exactly-once: no violations"
        lines = [f"history check found {len(self.violations)} violation(s):"]
        lines.extend(f"  - {v}" for v in self.violations)
        return "\n".join(lines)

    def raise_for_violations(self) -> None:
        """Raise [`CheckFailed`][flowlock.checker.verdicts.CheckFailed] listing every violation,
        unless the verdict is ok."""
        if not self.ok:
            raise CheckFailed(self)


class CheckFailed(FlowlockError):
    """A history is not exactly-once; `verdict` lists every violation found."""

    def __init__(self, verdict: Verdict, message: str | None = None) -> None:
        self.verdict = verdict
        super().__init__(message or verdict.describe())


# -- the linearizability verdict


@dataclass(frozen=True, slots=True)
class LinearizabilityViolation:
    """What is wrong on one instance.

    `kind` is one of `LINEARIZABILITY_KINDS`; `message` names the calls involved.
    `calls` are their indexes in the history given to
    [`check_linearizable`][flowlock.checker.check_linearizable].
    """

    instance_id: str
    kind: str
    message: str
    calls: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """`{"instance_id", "kind", "message", "calls"}`, ready for JSON."""
        return {
            "instance_id": self.instance_id,
            "kind": self.kind,
            "message": self.message,
            "calls": list(self.calls),
        }

    def __str__(self) -> str:
        return f"[{self.kind}] instance {self.instance_id!r}: {self.message}"


@dataclass(frozen=True, slots=True)
class LinearizabilityVerdict:
    """The result of `check_linearizable`: `ok` exactly when no violation was found.

    A search that ran out of steps is an `undecided` violation, so never ok.
    `instances` and `calls` say how much was checked. Truthy when ok."""

    ok: bool
    instances: int
    calls: int
    violations: list[LinearizabilityViolation] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.ok

    @property
    def undecided(self) -> list[str]:
        """The instances whose search ran out of steps."""
        return [v.instance_id for v in self.violations if v.kind == UNDECIDED]

    def kinds(self) -> frozenset[str]:
        """The distinct kinds of violation found."""
        return frozenset(v.kind for v in self.violations)

    def to_dict(self) -> dict[str, Any]:
        """`{"ok", "instances", "calls", "violations": [...]}`, ready for JSON."""
        return {
            "ok": self.ok,
            "instances": self.instances,
            "calls": self.calls,
            "violations": [v.to_dict() for v in self.violations],
        }

    def describe(self, limit: int = 20) -> str:
        """A readable summary: the first `limit` violations, one paragraph each."""
        checked = f"{self.calls} call(s) on {self.instances} instance(s)"
        if self.ok:
            return f"history is linearizable: {checked}, no violations"
        lines = [f"history is not linearizable: {len(self.violations)} violation(s) in {checked}:"]
        lines.extend(f"  - {v}" for v in self.violations[:limit])
        if len(self.violations) > limit:
            lines.append(f"  ... and {len(self.violations) - limit} more")
        return "\n".join(lines)

    def raise_for_violations(self) -> None:
        """Raise [`NotLinearizable`][flowlock.checker.verdicts.NotLinearizable] naming the
        violations, unless the verdict is ok."""
        if not self.ok:
            raise NotLinearizable(self)


class NotLinearizable(FlowlockError):
    """A recorded history is not linearizable, or could not be decided.

    `verdict` lists every violation.
    """

    def __init__(self, verdict: LinearizabilityVerdict) -> None:
        self.verdict = verdict
        super().__init__(verdict.describe())
