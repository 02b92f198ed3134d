"""Every error flowlock raises, in one hierarchy.

Each class's docstring is its default message. Instances carry the facts a caller needs
as attributes: the current state, the current version, the attempts made.


    FlowlockError
    ├── DefinitionError              a Workflow / Transition is malformed (raised at construction)
    ├── InvalidInput                 bad argument; nothing was read or written
    │   ├── PayloadTooLarge
    │   ├── InvalidPayload           a payload or data its schema refuses (flowlock.core.payloads)
    │   ├── UnknownWorkflow
    │   ├── UnknownEvent
    │   ├── UnknownState             force to a state the workflow lacks (flowlock.core.admin)
    │   └── IdempotencyKeyReused     a request_id sent again with another event or payload
    │       └── CreateKeyReused      a create's request_id sent again with another create
    ├── InstanceNotFound
    ├── InstanceExists
    ├── MessageNotFound              no outbox message with that key
    ├── ArchiveInvalid               a retention archive fails its manifest (core.retention)
    ├── DeliveryFailed               an outbox handler could not deliver: tried again later
    │   └── DeliveryRefused          the receiver refused the message for good: dead at once
    ├── TransitionRefused            the instance is fine, the event does not apply
    │   ├── TransitionNotAllowed     not allowed from the current state
    │   │   └── StaleTimer           a timer fired after the stay that armed it ended
    │   ├── GuardRejected            a guard said no (business rule: "out of stock")
    │   └── ConstraintRefused        a rule across instances (flowlock.core.constraints)
    │       ├── CapacityReached      every slot of the key is held
    │       ├── UniqueViolation      another instance holds the key
    │       └── RateLimited          the key's rate limit is reached: retry_after
    ├── InstancePaused               an operator paused it or its workflow (flowlock.core.admin)
    ├── VersionMismatch              expected_version / If-Match is stale
    ├── DefinitionMismatch           the instance runs a definition version this engine lacks
    ├── StepFailed                   a guard or effect raised an exception of its own
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
    │   │   └── TooManyConnections   the server refused a new one: max_connections in use
    │   ├── ConnectionLost           the connection died before the write: nothing written, retry
    │   ├── OutcomeUnknown           the connection died after the write was sent: maybe written
    │   └── MigrationError
    ├── EngineClosed                 the engine (or store) is not open
    ├── SyncCallInEventLoop          flowlock.sync.Engine called where an event loop runs
    └── ExtraNotInstalled            an optional dependency is missing: install the extra named

Driver errors never escape: each driver's are translated in one place (`flowlock._pg.errors`,
`flowlock.locks.redis.connection`), `raise ... from exc`; a failed connection leaves its pool.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


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
    """The payload is larger than the engine's max_payload_bytes.

    Send less, or raise the limit. `what` names the value measured: "payload", "data",
    or the data an effect returned.
    """

    def __init__(self, size: int, limit: int, what: str = "payload") -> None:
        self.size, self.limit, self.what = size, limit, what
        super().__init__(
            f"{what} is {size} bytes encoded as JSON, over the limit of {limit} bytes; nothing "
            "was written. Send (or keep) less data, or raise Engine(max_payload_bytes=...)"
        )


class UnknownWorkflow(InvalidInput):
    """No workflow of that name is registered; call engine.register(workflow) first."""

    def __init__(self, name: str, known: Sequence[str] = ()) -> None:
        self.name, self.known = name, tuple(known)
        listed = ", ".join(self.known) or "none"
        super().__init__(
            f"no workflow named {name!r} is registered (registered: {listed}); "
            "call engine.register(workflow) first"
        )


class UnknownEvent(InvalidInput):
    """The workflow has no transition of that name."""

    def __init__(self, workflow: str, event: str, known: Sequence[str] = ()) -> None:
        self.workflow, self.event, self.known = workflow, event, tuple(known)
        super().__init__(
            f"workflow {workflow!r} has no event {event!r}; its events are: {', '.join(self.known)}"
        )


class IdempotencyKeyReused(InvalidInput):
    """A request_id was sent again with another event or payload; nothing was written.

    An idempotency key names one request, so a retry must repeat it exactly. Retrying this
    call cannot succeed: send the new request under a new request_id.
    `original_event` and `original_payload` are what the key was first used with.
    `event` and `payload` are this call's. `mismatch` says which differs: "event" or
    "payload".
    """

    def __init__(
        self,
        request_id: str,
        *,
        instance_id: str,
        original_event: str,
        event: str,
        original_payload: Mapping[str, Any],
        payload: Mapping[str, Any],
        version: int,
    ) -> None:
        self.request_id, self.instance_id, self.version = request_id, instance_id, version
        self.original_event, self.event = original_event, event
        self.original_payload, self.payload = original_payload, payload
        self.mismatch = "event" if original_event != event else "payload"
        if self.mismatch == "event":
            differs = f"event {original_event!r}, not {event!r}"
        else:
            differs = f"event {original_event!r} with another payload"
        super().__init__(
            f"request_id {request_id!r} on instance {instance_id!r} was first used for "
            f"{differs} (applied at version {version}); nothing was written. A request_id may "
            "only be retried with the same event and payload: send a new request under a new "
            "request_id"
        )


class CreateKeyReused(IdempotencyKeyReused):
    """A create's request_id was sent again with another instance id, workflow or data; nothing
    was written.

    The key names the first create, so a retry must repeat it exactly. Retrying this call
    cannot succeed: create the new instance under a new request_id. `original_instance_id`,
    `original_workflow` and `original_data` are what the key was first used with;
    `instance_id`, `workflow` and `data` are this call's. `mismatch` says which differs first:
    "instance_id", "workflow" or "data". A create has no event: `original_event` and `event`
    are empty, `original_payload` and `payload` are the two data, and `version` is 1.
    """

    def __init__(
        self,
        request_id: str,
        *,
        original_instance_id: str,
        instance_id: str,
        original_workflow: str,
        workflow: str,
        original_data: Mapping[str, Any],
        data: Mapping[str, Any],
    ) -> None:
        self.request_id, self.version = request_id, 1
        self.original_instance_id, self.instance_id = original_instance_id, instance_id
        self.original_workflow, self.workflow = original_workflow, workflow
        self.original_data, self.data = original_data, data
        self.original_event = self.event = ""
        self.original_payload, self.payload = original_data, data
        if original_instance_id != instance_id:
            self.mismatch = "instance_id"
            differs = f"instance {original_instance_id!r}, not {instance_id!r}"
        elif original_workflow != workflow:
            self.mismatch = "workflow"
            differs = f"workflow {original_workflow!r}, not {workflow!r}"
        else:
            self.mismatch = "data"
            differs = f"instance {instance_id!r} with other data"
        InvalidInput.__init__(
            self,
            f"request_id {request_id!r} was first used to create {differs}; nothing was "
            "written. A create's request_id may only be retried with the same instance id, "
            "workflow and data: create a new instance under a new request_id",
        )


class InstanceNotFound(FlowlockError):
    """No instance with that id exists; create it first."""

    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        super().__init__(f"no instance with id {instance_id!r}; create it with engine.create()")


class MessageNotFound(FlowlockError):
    """No outbox message with that key exists; list them with engine.messages(instance_id)."""

    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(
            f"no outbox message with key {key!r}; list an instance's messages with "
            "engine.messages(instance_id) or `flowlock outbox list`"
        )


class DeliveryFailed(FlowlockError):
    """An outbox handler could not deliver its message; the dispatcher tries it again later.

    A handler raises it (any other exception means the same) to pass `retry_after`: the
    seconds the receiver asked to wait (an HTTP Retry-After), honoured up to the backoff's cap.
    """

    def __init__(self, message: str | None = None, *, retry_after: float | None = None) -> None:
        self.retry_after = retry_after
        super().__init__(message)


class DeliveryRefused(DeliveryFailed):
    """The receiver refused the outbox message for good; it is dead at once, not retried.

    Raise it from a handler when trying again cannot help (an HTTP 400, a payload the
    receiver rejects). The message stays visible; `engine.retry_message(key)` sends it again.
    """

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message)


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


class StaleTimer(TransitionNotAllowed):
    """A timer fired after its stay ended: the instance left the state that armed it (and may
    be back in it, in a new stay). Nothing was written; the timer is void."""

    def __init__(
        self,
        instance_id: str,
        event: str,
        state: str,
        allowed: Sequence[str],
        version: int,
        *,
        stay: int,
        current_stay: int | None,
    ) -> None:
        super().__init__(instance_id, event, state, allowed, version)
        self.stay = stay
        self.current_stay = current_stay
        self.args = (
            f"the timer {event!r} armed by the stay that began at version {stay} of instance "
            f"{instance_id!r} is void: the instance left that stay (it is in state {state!r}, "
            f"version {version}, a stay that began at version {current_stay}); nothing was "
            "written",
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
        self.instance_id, self.expected = instance_id, expected
        self.current, self.state = current, state
        super().__init__(
            f"instance {instance_id!r} is at version {current} (state {state!r}), "
            f"not the expected version {expected}; re-read it and decide again"
        )


class DefinitionMismatch(FlowlockError):
    """The instance runs a definition version this engine has not registered; nothing written."""

    def __init__(
        self, instance_id: str | None, workflow: str, version: int, registered: Sequence[int],
        *, message: str | None = None,
    ) -> None:  # fmt: skip
        self.instance_id, self.workflow, self.version = instance_id, workflow, version
        self.registered = tuple(registered)
        what = "it" if instance_id is None else f"instance {instance_id!r}"
        super().__init__(
            message
            or f"{what} runs version {version} of workflow {workflow!r}, which this engine has "
            f"not registered (it has {list(self.registered) or 'none'}); nothing was written. "
            "Register that version's Workflow here too (the newest last), or migrate the "
            "instances to a version it has (engine.migrate)"
        )


class StepFailed(FlowlockError):
    """A guard or effect raised an exception; nothing was written.

    That is a bug in the step, or a step that did I/O. The step's exception is `__cause__`.
    `step` is "guard" or "effect". `workflow`, `event`, `instance_id`, `state` and
    `version` say where it ran. Steps must be pure: they may run again on a retry, and run
    under a row lock. To refuse a call, a step raises GuardRejected (InvalidInput for a bad
    payload). Anything else it raises ends up here.
    """

    def __init__(
        self,
        *,
        workflow: str,
        event: str,
        instance_id: str,
        step: str,
        state: str,
        version: int,
        error: BaseException,
    ) -> None:
        self.workflow = workflow
        self.event = event
        self.instance_id = instance_id
        self.step = step
        self.state = state
        self.version = version
        super().__init__(
            f"the {step} of event {event!r} (workflow {workflow!r}) raised "
            f"{type(error).__name__}: {error} on instance {instance_id!r} in state {state!r} "
            f"(version {version}); nothing was written. Fix the {step}; to refuse a call on "
            "purpose it should raise flowlock.GuardRejected"
        )


class ConcurrencyError(FlowlockError):
    """Other callers won the race; nothing was written. Retrying later is safe."""


class ConflictRetriesExhausted(ConcurrencyError):
    """Every optimistic attempt lost its compare-and-swap to another writer."""

    def __init__(self, instance_id: str, event: str, attempts: int) -> None:
        self.instance_id, self.event, self.attempts = instance_id, event, attempts
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
    """The lease is no longer held by this owner.

    It expired, and someone else may hold it now.
    """

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


class TooManyConnections(StoreBusy):
    """PostgreSQL refused a new connection: all of its `max_connections` are in use.

    Nothing was written. The server's other clients hold its connections, or this process's
    pools together ask for more than it allows. Retry later. To stop it for good: free the
    connections that other clients hold, lower `max_size` (here or in the other clients), put
    a connection pooler in front of the server, or raise its `max_connections`.
    `detail` is the server's word; `size` the pool's bound, when a pool was growing (else 0).
    """

    def __init__(self, detail: str, *, size: int = 0, waited: float = 0.0) -> None:
        self.detail = detail
        self.size = size
        self.waited = waited
        pool = f" for a pool of {size} that had room for it" if size else ""
        # Not StoreBusy's message: raising the pool size, its advice, would make this worse.
        StoreError.__init__(
            self,
            f"PostgreSQL refused a new connection{pool} ({detail}): all of the server's "
            "max_connections are in use; nothing was written. Retry later. To stop it: free "
            "connections that other clients hold, lower max_size (here or in the other "
            "clients), put a connection pooler in front, or raise max_connections",
        )


class ConnectionLost(StoreError):
    """The database connection was lost before the write was sent or committed.

    The transaction was rolled back and nothing was written. Retry: the broken connection
    was dropped, and the next call gets a fresh one.
    """

    def __init__(self, key: str | None, detail: str) -> None:
        self.key = key
        self.detail = detail
        about = "" if key is None else f" while working on {key!r}"
        super().__init__(
            f"lost the connection to PostgreSQL{about}: {detail}; the transaction was rolled "
            "back, nothing was written. Retry: the broken connection was dropped and the next "
            "call gets a fresh one"
        )


class OutcomeUnknown(StoreError):
    """The connection was lost after a write was sent, before its answer came.

    The write (a COMMIT, a one-statement compare-and-swap) may or may not be committed.
    Retry with the same `request_id`: if it was committed, the retry answers
    `idempotent=True`.
    """

    def __init__(self, key: str | None, detail: str) -> None:
        self.key = key
        self.detail = detail
        about = "" if key is None else f" for {key!r}"
        super().__init__(
            f"lost the connection to PostgreSQL after the write{about} was sent and before its "
            f"answer came ({detail}): it may or may not have been committed. Retry with the "
            "same request_id (a committed write then answers idempotent=True), or read the "
            "instance before deciding again; the broken connection was dropped"
        )


class MigrationError(StoreError):
    """The database schema could not be brought up to date."""


class EngineClosed(FlowlockError):
    """The engine is closed; open it with `async with Engine.connect(...)` before use."""


class SyncCallInEventLoop(FlowlockError, RuntimeError):
    """A flowlock.sync.Engine was called from a thread running an event loop.

    Nothing was done. Blocking there would stall that loop, or deadlock the engine's own.
    In async code, use flowlock.Engine and await it.
    """

    def __init__(self, method: str) -> None:
        self.method = method
        super().__init__(
            f"flowlock.sync.Engine.{method}() was called from a thread that is running an event "
            "loop; nothing was done. Blocking here would stall that loop (or deadlock the "
            "engine's own). In async code use flowlock.Engine and await its methods; from async "
            "code that must call a blocking function, run it in a worker thread "
            "(asyncio.to_thread)"
        )


class ExtraNotInstalled(FlowlockError, ImportError):
    """A feature needs an optional dependency that is not installed.

    `extra` names the flowlock extra that brings it; `feature` what needed it. The message
    ends with `command`, the pip command that installs the extra from where flowlock was
    installed (its checkout or wheel), which `flowlock.core.extras.require` works out.
    """

    def __init__(self, extra: str, feature: str, module: str, command: str | None = None) -> None:
        self.extra = extra
        self.feature = feature
        self.module = module
        self.command = command or f"pip install 'flowlock[{extra}]'"
        super().__init__(f"{feature} needs {module}, which is not installed: {self.command}")
