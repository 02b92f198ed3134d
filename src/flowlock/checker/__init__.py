"""Judge a run: exactly-once from the store's history, linearizable from what callers saw.

Pure, no I/O. `check` reads the history; `Recorder` and `check_linearizable` judge calls.
"""

from flowlock.checker.calls import OPS, OUTCOMES, CallRecord
from flowlock.checker.history import Invariant, check, check_many
from flowlock.checker.linearizable import check_linearizable
from flowlock.checker.recorder import CallHandle, Recorder, outcome_of
from flowlock.checker.verdicts import (
    BROKEN_CHAIN,
    DOUBLE_APPLY,
    FINAL_MISMATCH,
    FOREIGN_ENTRY,
    INVALID_RESULT,
    INVARIANT,
    KINDS,
    LINEARIZABILITY_KINDS,
    LOST_UPDATE,
    NOT_LINEARIZABLE,
    OVERSELL,
    STALE_READ,
    STALE_TIMER,
    STRAY_TIMER,
    UNDECIDED,
    VERSION_GAP,
    CheckFailed,
    LinearizabilityVerdict,
    LinearizabilityViolation,
    NotLinearizable,
    Verdict,
    Violation,
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
    "STALE_TIMER",
    "STRAY_TIMER",
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
