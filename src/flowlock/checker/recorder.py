"""Record calls as code under test makes them, for ``check_linearizable``."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any, Literal

from flowlock.checker.calls import OPS, CallRecord, Op
from flowlock.core.errors import (
    ConcurrencyError,
    DefinitionError,
    EngineClosed,
    InstanceExists,
    InstanceNotFound,
    InvalidInput,
    OutcomeUnknown,
    StepFailed,
    StoreError,
    TransitionRefused,
    VersionMismatch,
)
from flowlock.core.models import Instance, Outcome

# Errors that mean "refused before anything was written": each leaves the instance untouched.
# Every StoreError says its transaction was rolled back, except OutcomeUnknown.
# OutcomeUnknown is raised exactly when a commit may have landed.
# Any other exception (a timeout, a cancellation, a crash) may have left a write behind.
_NO_EFFECT: tuple[type[BaseException], ...] = (
    InvalidInput,
    InstanceNotFound,
    InstanceExists,
    TransitionRefused,
    VersionMismatch,
    StepFailed,
    DefinitionError,
    ConcurrencyError,
    EngineClosed,
    StoreError,
)


def outcome_of(error: BaseException) -> Literal["fail", "unknown"]:
    """How a call that raised ``error`` is recorded: "fail" or "unknown".

    "fail" is for a flowlock refusal made before anything was written.
    "unknown" is for OutcomeUnknown, timeouts, cancellation and errors not flowlock's.
    docs/checker.md lists the refusals."""
    if isinstance(error, OutcomeUnknown):
        return "unknown"
    return "fail" if isinstance(error, _NO_EFFECT) else "unknown"


def _error_text(error: BaseException | str | None) -> str | None:
    if error is None or isinstance(error, str):
        return error
    text = str(error)
    return type(error).__name__ if not text else f"{type(error).__name__}: {text}"


class CallHandle:
    """One call in progress: complete it once with ``ok``, ``fail`` or ``unknown``.

    Until then it is reported unknown: a call whose task died may still have taken effect.
    As a context manager it completes the call if the block did not.
    An exception is recorded by ``outcome_of`` and passed on.
    A block that ends normally without completing the call records it unknown.

    ::

        with recorder.invoke(iid, "fire", event="approve") as call:
            call.ok(await engine.fire(iid, "approve"))
    """

    __slots__ = ("_lock", "_record", "event", "instance_id", "invoked_at", "op", "recorder")

    def __init__(
        self, recorder: Recorder, instance_id: str, op: str, event: str | None, invoked_at: float
    ) -> None:
        self.recorder = recorder
        self.instance_id = instance_id
        self.op = op
        self.event = event
        self.invoked_at = invoked_at
        self._record: CallRecord | None = None
        self._lock = threading.Lock()

    @property
    def done(self) -> bool:
        """Whether the call was completed (ok, fail or unknown)."""
        return self._record is not None

    @property
    def record(self) -> CallRecord:
        """The record: the completed one, or an unknown one while the call is in progress."""
        if self._record is not None:
            return self._record
        return CallRecord(self.instance_id, self.op, self.event, self.invoked_at, None, "unknown")

    def ok(self, result: Instance | Outcome) -> CallRecord:
        """The call returned ``result``: an Instance, or a fire's Outcome.

        A fire that applied may pass ``outcome.instance``.
        A fire answered idempotent must pass its Outcome."""
        idempotent = False
        if isinstance(result, Outcome):
            if self.op != "fire":
                raise InvalidInput(
                    f"a {self.op} returns an Instance, not an Outcome; pass the Instance"
                )
            idempotent = result.idempotent and not result.applied
            result = result.instance
        if not isinstance(result, Instance):
            raise InvalidInput(
                f"ok() takes the Instance or Outcome the call returned, not {type(result).__name__}"
            )
        if result.id != self.instance_id:
            raise InvalidInput(
                f"the call was recorded on instance {self.instance_id!r} but returned instance "
                f"{result.id!r}"
            )
        return self._complete(
            "ok",
            None,
            state=result.state,
            version=result.version,
            data=dict(result.data),
            idempotent=idempotent,
            workflow=result.workflow,
        )

    def fail(self, error: BaseException | str | None = None) -> CallRecord:
        """The call surely had no effect (a typed refusal such as TransitionNotAllowed)."""
        return self._complete("fail", _error_text(error))

    def unknown(self, error: BaseException | str | None = None) -> CallRecord:
        """The call may or may not have taken effect (OutcomeUnknown, a timeout).

        The checker lets it take effect once, any time after its invoke, or never."""
        return self._complete("unknown", _error_text(error))

    def _complete(self, outcome: str, error: str | None, **result: Any) -> CallRecord:
        with self._lock:
            if self._record is not None:
                raise InvalidInput(
                    f"{self.record.label()} on {self.instance_id!r} was already completed; "
                    "complete each call once"
                )
            completed = None if outcome == "unknown" else self.recorder.clock()
            self._record = CallRecord(
                self.instance_id,
                self.op,
                self.event,
                self.invoked_at,
                completed,
                outcome,
                error=error,
                **result,
            )
            return self._record

    def __enter__(self) -> CallHandle:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._record is not None:
            return
        if exc is None:
            self.unknown("the call's block ended without completing it")
        elif outcome_of(exc) == "fail":
            self.fail(exc)
        else:
            self.unknown(exc)


class Recorder:
    """Records calls for ``check_linearizable``: ``invoke``, then complete the handle.

    Safe to share between tasks and threads.
    The default clock, ``time.monotonic``, is shared by every process on a Linux host.
    So histories from several worker processes can be merged. Inject another for tests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._handles: list[CallHandle] = []
        self._added: list[CallRecord] = []
        self._lock = threading.Lock()

    def invoke(self, instance_id: str, op: Op, event: str | None = None) -> CallHandle:
        """Record that a call starts now: "create", "fire" (with its ``event``) or "get"."""
        if op not in OPS:
            raise InvalidInput(f"op must be one of {OPS}, not {op!r}")
        if op == "fire" and not isinstance(event, str):
            raise InvalidInput("a fire is recorded with its event: invoke(id, 'fire', event=...)")
        if not isinstance(instance_id, str):
            raise InvalidInput(f"instance_id must be a string, not {type(instance_id).__name__}")
        handle = CallHandle(self, instance_id, op, event, self.clock())
        with self._lock:
            self._handles.append(handle)
        return handle

    @property
    def calls(self) -> list[CallRecord]:
        """Every call so far in invoke order, then those added by ``extend``.

        A call not completed yet is reported unknown."""
        with self._lock:
            handles = list(self._handles)
            added = list(self._added)
        return [h.record for h in handles] + added

    def extend(self, records: Iterable[CallRecord]) -> None:
        """Add records made elsewhere (another process's recorder, say)."""
        fresh = list(records)
        for r in fresh:
            if not isinstance(r, CallRecord):
                raise InvalidInput(f"extend() takes CallRecords, not {type(r).__name__}")
        with self._lock:
            self._added.extend(fresh)

    @staticmethod
    def merge(*histories: Iterable[CallRecord]) -> list[CallRecord]:
        """One history from several (one per worker process, say), in invoke order."""
        return sorted(itertools.chain.from_iterable(histories), key=lambda r: r.invoked_at)

    def __len__(self) -> int:
        with self._lock:
            return len(self._handles) + len(self._added)
