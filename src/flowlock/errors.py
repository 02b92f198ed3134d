"""Every error flowlock raises, in one hierarchy.

Each class's docstring is its default message; instances carry the facts a caller needs
(the current state, the current version, how many attempts were made...) as attributes.

::

    FlowlockError
    ├── DefinitionError              a Workflow / Transition is malformed (raised at construction)
    ├── InvalidInput                 bad argument; nothing was read or written
    │   ├── PayloadTooLarge
    │   ├── UnknownWorkflow
    │   └── UnknownEvent
    ├── InstanceNotFound
    ├── InstanceExists
    ├── TransitionRefused            the instance is fine, the event does not apply
    │   ├── TransitionNotAllowed     not allowed from the current state
    │   └── GuardRejected            a guard said no (business rule: "out of stock")
    ├── VersionMismatch              expected_version / If-Match is stale
    ├── ConcurrencyError             lost to other callers; safe to retry later
    │   ├── ConflictRetriesExhausted optimistic compare-and-swap lost max_attempts times
    │   └── LockError
    │       ├── LockTimeout          waited the whole bound for a lock
    │       ├── LockBusy             NOWAIT and the lock was held
    │       ├── LockNotOwned         release / extend of a lease that is no longer yours
    │       ├── LockLost             the lease expired or could not be renewed before commit
    │       └── LockUnavailable      the lock backend (Redis, PostgreSQL) could not be reached
    ├── StoreError                   the database failed or answered something unexpected
    │   ├── StoreBusy                no database connection came free within the bound
    │   └── MigrationError
    ├── EngineClosed                 the engine (or store) is not open
    ├── SyncCallInEventLoop          flowlock.sync.Engine called where an event loop runs
    └── EmbeddedServerError          an embedded PostgreSQL or Redis did not start or stop

Driver errors never escape: stores translate them at their edge with ``raise ... from exc``.
"""

from __future__ import annotations

from collections.abc import Sequence


class FlowlockError(Exception):
    """A flowlock operation failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class DefinitionError(FlowlockError):
    """The workflow definition is invalid; fix it before registering it."""

    def __init__(self, message: str | None = None, *, problems: Sequence[str] = ()) -> None:
        self.problems = tuple(problems)
        if message is None and self.problems:
            message = "invalid workflow definition: " + "; ".join(self.problems)
        super().__init__(message)


class InvalidInput(FlowlockError, ValueError):
    """An argument is invalid; nothing was read or written. Correct the argument and call again."""


class PayloadTooLarge(InvalidInput):
    """The payload is larger than the engine's max_payload_bytes; send less or raise the limit."""

    def __init__(self, size: int, limit: int) -> None:
        self.size = size
        self.limit = limit
        super().__init__(
            f"payload is {size} bytes encoded as JSON, over the limit of {limit} bytes; "
            "send less data or raise Engine(max_payload_bytes=...)"
        )


class UnknownWorkflow(InvalidInput):
    """No workflow of that name is registered; call engine.register(workflow) first."""

    def __init__(self, name: str, known: Sequence[str] = ()) -> None:
        self.name = name
        self.known = tuple(known)
        super().__init__(
            f"no workflow named {name!r} is registered "
            f"(registered: {', '.join(self.known) or 'none'}); "
            "call engine.register(workflow) first"
        )


class UnknownEvent(InvalidInput):
    """The workflow has no transition of that name."""

    def __init__(self, workflow: str, event: str, known: Sequence[str] = ()) -> None:
        self.workflow = workflow
        self.event = event
        self.known = tuple(known)
        super().__init__(
            f"workflow {workflow!r} has no event {event!r}; its events are: {', '.join(self.known)}"
        )


class InstanceNotFound(FlowlockError):
    """No instance with that id exists; create it first."""

    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        super().__init__(f"no instance with id {instance_id!r}; create it with engine.create()")


class InstanceExists(FlowlockError):
    """An instance with that id already exists; pick another id or fetch it with engine.get()."""

    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        super().__init__(
            f"an instance with id {instance_id!r} already exists; use engine.get() to read it"
        )


class TransitionRefused(FlowlockError):
    """The event does not apply to the instance as it is now; nothing was written."""


class TransitionNotAllowed(TransitionRefused):
    """The event is not allowed from the instance's current state."""

    def __init__(
        self, instance_id: str, event: str, state: str, allowed: Sequence[str], version: int
    ) -> None:
        self.instance_id = instance_id
        self.event = event
        self.state = state
        self.allowed = tuple(allowed)
        self.version = version
        super().__init__(
            f"event {event!r} is not allowed on instance {instance_id!r} in state {state!r} "
            f"(version {version}); "
            f"allowed events: {', '.join(self.allowed) or 'none (final state)'}"
        )


class GuardRejected(TransitionRefused):
    """A guard refused the transition (a business rule); nothing was written."""

    def __init__(
        self,
        reason: str,
        *,
        instance_id: str | None = None,
        event: str | None = None,
        state: str | None = None,
        version: int | None = None,
    ) -> None:
        self.reason = reason
        self.instance_id = instance_id
        self.event = event
        self.state = state
        self.version = version
        where = ""
        if instance_id is not None:
            where = f" on instance {instance_id!r} in state {state!r} (version {version})"
        super().__init__(f"event {event!r} refused{where}: {reason}")

    def bind(self, instance_id: str, event: str, state: str, version: int) -> GuardRejected:
        """The same rejection, with the instance facts filled in by the engine."""
        return GuardRejected(
            self.reason, instance_id=instance_id, event=event, state=state, version=version
        )


class VersionMismatch(FlowlockError):
    """The instance is not at the expected version; re-read it and decide again."""

    def __init__(self, instance_id: str, expected: int, current: int, state: str) -> None:
        self.instance_id = instance_id
        self.expected = expected
        self.current = current
        self.state = state
        super().__init__(
            f"instance {instance_id!r} is at version {current} (state {state!r}), "
            f"not the expected version {expected}; re-read it and decide again"
        )


class ConcurrencyError(FlowlockError):
    """Other callers won the race; nothing was written. Retrying later is safe."""


class ConflictRetriesExhausted(ConcurrencyError):
    """Every optimistic attempt lost its compare-and-swap to another writer."""

    def __init__(self, instance_id: str, event: str, attempts: int) -> None:
        self.instance_id = instance_id
        self.event = event
        self.attempts = attempts
        super().__init__(
            f"event {event!r} on instance {instance_id!r} lost the version compare-and-swap "
            f"{attempts} times in a row; nothing was written. Retry later, or use the "
            "'pessimistic' strategy for this hot instance"
        )


class LockError(ConcurrencyError):
    """A lock could not be taken; nothing was written."""


class LockTimeout(LockError):
    """Waited the whole bound for a lock held by another caller."""

    def __init__(self, key: str, waited: float) -> None:
        self.key = key
        self.waited = waited
        super().__init__(
            f"lock on {key!r} still held by another caller after {waited * 1000:.0f} ms; "
            "nothing was written. Retry later or raise lock_timeout"
        )


class LockBusy(LockError):
    """The lock was held and the call asked not to wait (NOWAIT)."""

    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(
            f"lock on {key!r} is held by another caller and nowait was requested; "
            "nothing was written. Retry later or allow a wait"
        )


class LockNotOwned(LockError):
    """The lease is no longer held by this owner (it expired, and maybe someone else holds it)."""

    def __init__(self, key: str, action: str) -> None:
        self.key = key
        self.action = action
        super().__init__(
            f"cannot {action} the lock on {key!r}: this lease no longer owns it (it expired, and "
            "another owner may hold it now); nothing of the other owner's was touched"
        )


class LockLost(LockError):
    """The lease was lost before the critical section committed; nothing was written."""

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        self.reason = reason
        super().__init__(
            f"lost the lock on {key!r} before commit ({reason}); nothing was written. "
            "Retry; if steps run long, raise the lease ttl"
        )


class LockUnavailable(LockError):
    """The lock backend could not be reached; nothing was written."""

    def __init__(self, backend: str, detail: str) -> None:
        self.backend = backend
        self.detail = detail
        super().__init__(
            f"the {backend} lock backend is unreachable ({detail}); nothing was written. "
            "Check the server and retry"
        )


class StoreError(FlowlockError):
    """The database failed or answered something unexpected; the transaction was rolled back."""


class StoreBusy(StoreError):
    """No database connection came free within the bound; nothing was written."""

    def __init__(self, waited: float, size: int) -> None:
        self.waited = waited
        self.size = size
        super().__init__(
            f"no database connection came free within {waited:.1f} s (pool of {size}); "
            "nothing was written. Raise pool_size or acquire_timeout, or lower concurrency"
        )


class MigrationError(StoreError):
    """The database schema could not be brought up to date."""


class EngineClosed(FlowlockError):
    """The engine is closed; open it with `async with Engine.connect(...)` before use."""


class SyncCallInEventLoop(FlowlockError, RuntimeError):
    """A flowlock.sync.Engine was called from a thread running an event loop; nothing was done.
    Blocking there would stall that loop (or deadlock the engine's own); in async code use
    flowlock.Engine and await it."""

    def __init__(self, method: str) -> None:
        self.method = method
        super().__init__(
            f"flowlock.sync.Engine.{method}() was called from a thread that is running an event "
            "loop; nothing was done. Blocking here would stall that loop (or deadlock the "
            "engine's own). In async code use flowlock.Engine and await its methods; from async "
            "code that must call a blocking function, run it in a worker thread "
            "(asyncio.to_thread)"
        )


class EmbeddedServerError(FlowlockError):
    """An embedded server (PostgreSQL or Redis) could not be started or stopped, or is not running.

    ``server`` names it ("PostgreSQL", "Redis"), ``problem`` says what went wrong in one line,
    ``details`` holds what the server said (command output, the tail of its log), and ``advice``
    what to do about it. The message puts the problem on its first line, so a command line
    that prints one line per error shows that, with the details below it.
    """

    def __init__(
        self,
        server: str,
        problem: str,
        *,
        details: str = "",
        advice: str = "read the server output above, or point flowlock at a server of your own",
    ) -> None:
        self.server = server
        self.problem = problem
        self.details = details.strip()
        self.advice = advice
        parts = [f"embedded {server}: {problem}"]
        if self.details:
            parts.append(self.details)
        parts.append(f"What to do: {advice}")
        super().__init__("\n".join(parts))
