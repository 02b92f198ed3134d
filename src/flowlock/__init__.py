"""flowlock: a workflow (state-machine) engine whose every transition is atomic and applied
exactly once, with pluggable concurrency control (optimistic, pessimistic).
``flowlock.Engine`` is async; ``flowlock.sync.Engine`` is its blocking twin for threaded code.

The public API is what ``__all__`` lists; everything else is internal.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

# The submodules a user reaches as attributes (``flowlock.checker.check(...)``) without
# importing them one by one.
from flowlock import checker, examples, jobs, runner
from flowlock.core.definition import Step, Transition, Workflow
from flowlock.core.errors import (
    ConcurrencyError,
    ConflictRetriesExhausted,
    ConnectionLost,
    DefinitionError,
    EmbeddedServerError,
    EngineClosed,
    FlowlockError,
    GuardRejected,
    IdempotencyKeyReused,
    InstanceExists,
    InstanceNotFound,
    InvalidInput,
    LockBusy,
    LockError,
    LockLost,
    LockNotOwned,
    LockTimeout,
    LockUnavailable,
    MigrationError,
    OutcomeUnknown,
    PayloadTooLarge,
    StepFailed,
    StoreBusy,
    StoreError,
    SyncCallInEventLoop,
    TransitionNotAllowed,
    TransitionRefused,
    UnknownEvent,
    UnknownWorkflow,
    VersionMismatch,
)
from flowlock.core.models import HistoryEntry, Instance, Outcome, Page
from flowlock.engine import Engine
from flowlock.jobs import RunOnce
from flowlock.strategies.base import Strategy
from flowlock.strategies.distributed import Distributed, fencing_token
from flowlock.strategies.optimistic import Optimistic
from flowlock.strategies.pessimistic import Pessimistic

# After the engine and the errors: the blocking twin of Engine, flowlock.sync.Engine. Importing it
# starts no thread (an engine starts its own on its first call).
from flowlock import sync  # isort: skip

try:
    __version__ = version("flowlock")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without install
    __version__ = "0.0.0"

__all__ = [
    "ConcurrencyError",
    "ConflictRetriesExhausted",
    "ConnectionLost",
    "DefinitionError",
    "Distributed",
    "EmbeddedServerError",
    "Engine",
    "EngineClosed",
    "FlowlockError",
    "GuardRejected",
    "HistoryEntry",
    "IdempotencyKeyReused",
    "Instance",
    "InstanceExists",
    "InstanceNotFound",
    "InvalidInput",
    "LockBusy",
    "LockError",
    "LockLost",
    "LockNotOwned",
    "LockTimeout",
    "LockUnavailable",
    "MigrationError",
    "Optimistic",
    "Outcome",
    "OutcomeUnknown",
    "Page",
    "PayloadTooLarge",
    "Pessimistic",
    "RunOnce",
    "Step",
    "StepFailed",
    "StoreBusy",
    "StoreError",
    "Strategy",
    "SyncCallInEventLoop",
    "Transition",
    "TransitionNotAllowed",
    "TransitionRefused",
    "UnknownEvent",
    "UnknownWorkflow",
    "VersionMismatch",
    "Workflow",
    "__version__",
    "checker",
    "examples",
    "fencing_token",
    "jobs",
    "runner",
    "sync",
]
