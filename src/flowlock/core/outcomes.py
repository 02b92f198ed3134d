"""The outcome label of a call: what metrics, logs and spans call each ending."""

from __future__ import annotations

from flowlock.core.admin import InstancePaused
from flowlock.core.errors import (
    ConflictRetriesExhausted,
    FlowlockError,
    InstanceNotFound,
    InvalidInput,
    LockError,
    TransitionRefused,
)

__all__ = ["OUTCOMES", "failure_outcome"]

OUTCOMES = ("applied", "idempotent", "refused", "conflict", "lock_error", "invalid", "error")
"""The `outcome` label: applied / idempotent (the two successes), refused (a business rule,
a state that does not allow the event, or a pause), conflict (optimistic retries exhausted),
lock_error (timeout, busy, lost, backend down), invalid (bad input, unknown instance), error
(the rest)."""


def failure_outcome(exc: FlowlockError) -> str:
    """The `outcome` label of a `fire` call that raised `exc`."""
    if isinstance(exc, TransitionRefused | InstancePaused):
        return "refused"
    if isinstance(exc, ConflictRetriesExhausted):
        return "conflict"
    if isinstance(exc, LockError):
        return "lock_error"
    if isinstance(exc, InvalidInput | InstanceNotFound):
        return "invalid"
    return "error"
