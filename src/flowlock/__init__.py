"""flowlock: a workflow engine whose every transition is atomic and applied exactly once.

`flowlock.Engine` is async; `flowlock.sync.Engine` is its blocking twin. The public API is
what `__all__` lists. Names load on first use, so `import flowlock` loads no driver.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# The error tree's names; the module is pure and small.
from flowlock.errors import __all__ as _ERROR_NAMES

if TYPE_CHECKING:
    from flowlock import checker, errors, http, jobs, outbox, sync
    from flowlock import examples as examples
    from flowlock.core.admin import (
        FORCE_EVENT,
        PAUSE_EVENT,
        RESUME_EVENT,
        InstancePaused,
        UnknownState,
        WorkflowPause,
    )
    from flowlock.core.bulk import BulkReport
    from flowlock.core.constraints import (
        Capacity,
        CapacityReached,
        CapacityUsage,
        ConstraintRefused,
        Rate,
        RateLimited,
        State,
        Unique,
        UniqueViolation,
    )
    from flowlock.core.definition import Step, Transition, Workflow
    from flowlock.core.errors import (
        ConcurrencyError,
        ConflictRetriesExhausted,
        ConnectionLost,
        CreateKeyReused,
        DefinitionError,
        DefinitionMismatch,
        DeliveryFailed,
        DeliveryRefused,
        EngineClosed,
        ExtraNotInstalled,
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
        MessageNotFound,
        MigrationError,
        OutcomeUnknown,
        PayloadTooLarge,
        StaleTimer,
        StepFailed,
        StoreBusy,
        StoreError,
        SyncCallInEventLoop,
        TooManyConnections,
        TransitionNotAllowed,
        TransitionRefused,
        UnknownEvent,
        UnknownWorkflow,
        VersionMismatch,
    )
    from flowlock.core.migration import MIGRATE_EVENT, MigrationRefused, MigrationReport
    from flowlock.core.models import HistoryEntry, Instance, Outcome, Page, Timer
    from flowlock.core.outbox import Emit, Message, Then
    from flowlock.core.payloads import InvalidPayload
    from flowlock.core.replay import Divergence, ReplayReport
    from flowlock.core.retention import ArchiveInvalid, Hold, PurgeReport, RestoreReport
    from flowlock.core.versions import DefinitionVersion
    from flowlock.engine import Engine, connect
    from flowlock.jobs import RunOnce
    from flowlock.metrics import Metrics
    from flowlock.stores.base import Store
    from flowlock.strategies.adaptive import Adaptive
    from flowlock.strategies.base import Strategy
    from flowlock.strategies.distributed import Distributed, fencing_token
    from flowlock.strategies.monitor import ConflictMonitor
    from flowlock.strategies.optimistic import Optimistic
    from flowlock.strategies.pessimistic import Pessimistic


# Where each public name lives: imported on first use (PEP 562).
_WHERE: dict[str, str] = {
    **dict.fromkeys(_ERROR_NAMES, "flowlock.core.errors"),
    **dict.fromkeys(("Step", "Transition", "Workflow"), "flowlock.core.definition"),
    **dict.fromkeys(
        (
            "FORCE_EVENT",
            "PAUSE_EVENT",
            "RESUME_EVENT",
            "InstancePaused",
            "UnknownState",
            "WorkflowPause",
        ),
        "flowlock.core.admin",
    ),
    "InvalidPayload": "flowlock.core.payloads",
    **dict.fromkeys(
        (
            "Capacity",
            "CapacityReached",
            "CapacityUsage",
            "ConstraintRefused",
            "Rate",
            "RateLimited",
            "State",
            "Unique",
            "UniqueViolation",
        ),
        "flowlock.core.constraints",
    ),
    **dict.fromkeys(
        ("HistoryEntry", "Instance", "Outcome", "Page", "Timer"), "flowlock.core.models"
    ),
    **dict.fromkeys(
        ("MIGRATE_EVENT", "MigrationRefused", "MigrationReport"), "flowlock.core.migration"
    ),
    **dict.fromkeys(("Emit", "Message", "Then"), "flowlock.core.outbox"),
    **dict.fromkeys(
        ("ArchiveInvalid", "Hold", "PurgeReport", "RestoreReport"), "flowlock.core.retention"
    ),
    **dict.fromkeys(("Engine", "connect"), "flowlock.engine"),
    **dict.fromkeys(("Distributed", "fencing_token"), "flowlock.strategies.distributed"),
    "Adaptive": "flowlock.strategies.adaptive",
    "BulkReport": "flowlock.core.bulk",
    **dict.fromkeys(("Divergence", "ReplayReport"), "flowlock.core.replay"),
    "ConflictMonitor": "flowlock.strategies.monitor",
    "DefinitionVersion": "flowlock.core.versions",
    "Metrics": "flowlock.metrics",
    "Optimistic": "flowlock.strategies.optimistic",
    "Pessimistic": "flowlock.strategies.pessimistic",
    "RunOnce": "flowlock.jobs",
    "Store": "flowlock.stores.base",
    "Strategy": "flowlock.strategies.base",
}
# Submodules reachable as attributes after a plain ``import flowlock``.
_SUBMODULES = frozenset({"checker", "errors", "examples", "http", "jobs", "outbox", "sync"})

__all__ = [
    "FORCE_EVENT",
    "MIGRATE_EVENT",
    "PAUSE_EVENT",
    "RESUME_EVENT",
    "Adaptive",
    "ArchiveInvalid",
    "BulkReport",
    "Capacity",
    "CapacityReached",
    "CapacityUsage",
    "ConcurrencyError",
    "ConflictMonitor",
    "ConflictRetriesExhausted",
    "ConnectionLost",
    "ConstraintRefused",
    "CreateKeyReused",
    "DefinitionError",
    "DefinitionMismatch",
    "DefinitionVersion",
    "DeliveryFailed",
    "DeliveryRefused",
    "Distributed",
    "Divergence",
    "Emit",
    "Engine",
    "EngineClosed",
    "ExtraNotInstalled",
    "FlowlockError",
    "GuardRejected",
    "HistoryEntry",
    "Hold",
    "IdempotencyKeyReused",
    "Instance",
    "InstanceExists",
    "InstanceNotFound",
    "InstancePaused",
    "InvalidInput",
    "InvalidPayload",
    "LockBusy",
    "LockError",
    "LockLost",
    "LockNotOwned",
    "LockTimeout",
    "LockUnavailable",
    "Message",
    "MessageNotFound",
    "Metrics",
    "MigrationError",
    "MigrationRefused",
    "MigrationReport",
    "Optimistic",
    "Outcome",
    "OutcomeUnknown",
    "Page",
    "PayloadTooLarge",
    "Pessimistic",
    "PurgeReport",
    "Rate",
    "RateLimited",
    "ReplayReport",
    "RestoreReport",
    "RunOnce",
    "StaleTimer",
    "State",
    "Step",
    "StepFailed",
    "Store",
    "StoreBusy",
    "StoreError",
    "Strategy",
    "SyncCallInEventLoop",
    "Then",
    "Timer",
    "TooManyConnections",
    "Transition",
    "TransitionNotAllowed",
    "TransitionRefused",
    "Unique",
    "UniqueViolation",
    "UnknownEvent",
    "UnknownState",
    "UnknownWorkflow",
    "VersionMismatch",
    "Workflow",
    "WorkflowPause",
    "__version__",
    "checker",
    "connect",
    "errors",
    "fencing_token",
    "http",
    "jobs",
    "outbox",
    "sync",
]


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is not None:
        value = getattr(importlib.import_module(where), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"flowlock.{name}")
    elif name == "__version__":
        value = _version()
    else:
        raise AttributeError(f"module 'flowlock' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flowlock")
    except PackageNotFoundError:  # pragma: no cover - a source tree that was never installed
        return "0.0.0"
