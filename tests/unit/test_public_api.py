"""The public surface: what ``flowlock`` exports, its types, and the layering of its modules.

mypy checks this file too (``.ci/run``), so the ``assert_type`` lines are type tests.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import assert_type

import flowlock
from flowlock.stores import MemoryStore

SRC = Path(flowlock.__file__).parent

PUBLIC = {
    "Adaptive", "BulkReport", "ConcurrencyError", "ConflictMonitor", "ConflictRetriesExhausted",
    "ConnectionLost", "CreateKeyReused", "DefinitionError",
    "DefinitionMismatch", "DefinitionVersion", "DeliveryFailed", "DeliveryRefused",
    "Distributed", "Emit", "Engine",
    "EngineClosed", "Message", "MessageNotFound", "Then", "outbox",
    "ExtraNotInstalled", "FlowlockError", "GuardRejected", "HistoryEntry", "IdempotencyKeyReused",
    "Instance", "InstanceExists", "InstanceNotFound", "InvalidInput", "LockBusy", "LockError",
    "LockLost", "LockNotOwned", "LockTimeout", "LockUnavailable", "Metrics", "MigrationError",
    "Optimistic", "Outcome", "OutcomeUnknown", "Page", "PayloadTooLarge", "Pessimistic", "RunOnce",
    "StaleTimer", "Step", "StepFailed", "Store", "StoreBusy", "StoreError", "Strategy",
    "SyncCallInEventLoop", "Timer", "TooManyConnections", "Transition", "TransitionNotAllowed",
    "TransitionRefused", "UnknownEvent", "UnknownWorkflow", "VersionMismatch", "Workflow",
    "__version__", "checker", "connect", "errors", "fencing_token", "http", "jobs", "sync",
    "FORCE_EVENT", "PAUSE_EVENT", "RESUME_EVENT", "InstancePaused", "UnknownState",
    "WorkflowPause",
    "ArchiveInvalid", "Hold", "PurgeReport", "RestoreReport",
    "InvalidPayload",
    "Divergence", "ReplayReport",
    "MIGRATE_EVENT", "MigrationRefused", "MigrationReport",
    "Capacity", "CapacityReached", "CapacityUsage", "ConstraintRefused", "Rate", "RateLimited",
    "State", "Unique", "UniqueViolation",
}  # fmt: skip


def test_all_is_the_curated_public_api() -> None:
    """__all__ lists exactly the public names, and each of them exists."""
    assert set(flowlock.__all__) == PUBLIC
    for name in flowlock.__all__:
        assert hasattr(flowlock, name), name
    assert set(flowlock.__all__) <= set(dir(flowlock))


def test_test_tooling_is_not_public() -> None:
    """The embedded servers' error, examples and the lab's errors are not in the public API."""
    for name in ("EmbeddedServerError", "HostsError", "HostsUnavailable", "runner", "examples"):
        assert name not in flowlock.__all__, name
    for name in ("EmbeddedServerError", "HostsError", "HostsUnavailable"):
        assert not hasattr(flowlock.errors, name), name


def test_the_exported_names_are_the_documented_classes() -> None:
    """The names users are told to use are the classes the modules define."""
    from flowlock.engine import connect
    from flowlock.metrics import Metrics
    from flowlock.stores.base import Store
    from flowlock.strategies.adaptive import Adaptive
    from flowlock.strategies.monitor import ConflictMonitor

    assert flowlock.Metrics is Metrics and flowlock.ConflictMonitor is ConflictMonitor
    assert flowlock.Adaptive is Adaptive and flowlock.Store is Store
    assert flowlock.connect is connect
    from flowlock.core.errors import StaleTimer
    from flowlock.core.models import Timer

    assert flowlock.Timer is Timer and flowlock.StaleTimer is StaleTimer
    assert issubclass(flowlock.StaleTimer, flowlock.TransitionNotAllowed)


def test_every_error_is_a_flowlock_error() -> None:
    """Every exception class exported derives from FlowlockError (one hierarchy to catch)."""
    for name in flowlock.__all__:
        obj = getattr(flowlock, name)
        if isinstance(obj, type) and issubclass(obj, BaseException):
            assert issubclass(obj, flowlock.FlowlockError), name
            assert (obj.__doc__ or "").strip(), f"{name} needs a docstring (its default message)"


async def test_public_types() -> None:
    """The engine's methods return the documented types (checked by mypy and at run time)."""
    async with flowlock.Engine(MemoryStore()) as engine:
        assert_type(engine, flowlock.Engine)
        await engine.register(flowlock.examples.approval())
        inst = await engine.create("approval", instance_id="i")
        assert_type(inst, flowlock.Instance)
        out = await engine.fire("i", "approve")
        assert_type(out, flowlock.Outcome)
        assert_type(out.applied, bool)
        assert_type(out.attempts, int)
        history = await engine.history("i")
        assert_type(history, list[flowlock.HistoryEntry])
        assert isinstance(history[0], flowlock.HistoryEntry)
        armed = await engine.timers("i")
        assert_type(armed, list[flowlock.Timer])
        assert_type(inst.next_timer, flowlock.Timer | None)


def _flowlock_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("flowlock"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("flowlock"))
    return found


CORE = (
    *(f"core/{path.name}" for path in (SRC / "core").glob("*.py")),
    *(f"checker/{path.name}" for path in (SRC / "checker").glob("*.py")),
)
ADAPTERS_AND_UP = ("flowlock.stores", "flowlock.locks", "flowlock.strategies", "flowlock.engine")
PORTS = ("flowlock.stores.base", "flowlock.locks.base")


def _importing(path: Path, prefixes: tuple[str, ...]) -> set[str]:
    return {m for m in _flowlock_imports(path) if m.startswith(prefixes)}


def test_layering() -> None:
    """Arrows point one way: definitions, models and the step know no store, strategy or engine;
    strategies see only the store and lock ports; stores know no strategy, monitor or engine;
    only connect (and the CLI and bench through it) composes concrete backends."""
    for module in CORE:
        assert not _importing(SRC / module, ADAPTERS_AND_UP), module
    for path in (SRC / "strategies").glob("*.py"):
        concrete = _importing(path, ("flowlock.stores.", "flowlock.locks.")) - set(PORTS)
        assert not concrete, (path.name, concrete)
    for path in (SRC / "stores").glob("*.py"):
        upward = _importing(path, ("flowlock.strategies", "flowlock.engine", "flowlock.connect"))
        assert not upward, (path.name, upward)
    assert not (SRC / "monitor.py").exists()
    assert _flowlock_imports(SRC / "core" / "errors.py") == set()
