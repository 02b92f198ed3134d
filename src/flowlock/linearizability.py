"""Record what callers saw, and check it is linearizable: a history recorder and a
Wing-Gong-Lowe search over a model of each instance. Pure, no I/O; reached as ``flowlock.checker``.

:func:`flowlock.checker.check` reads the store's own trace. This module judges the store from the
outside, from what the callers were told: each call is recorded as it is invoked and as it
completes, and :func:`check_linearizable` searches for one order of the calls, each placed at a
single instant between its invoke and its completion, in which every answer is what a single,
sequential instance would have given. When no such order exists, some caller saw something no
correct engine could have shown it (two fires applied from one version, a read of a version
already replaced, an update that vanished), and the verdict names the calls.

The model of one instance is (exists, state, version, data):

- ``create`` ok: the instance did not exist; now it does, at version 1 in the state and with the
  data returned.
- ``fire`` ok and applied: the result's version is the current one plus one, and the instance
  takes the result's state and data. Given the workflow, the event must be allowed from the
  current state and lead to the result's state, and an event without an effect keeps the data.
- ``fire`` ok and idempotent (``Outcome.idempotent``): no effect and not compared with the
  current instance. The engine answers a repeated ``request_id`` with the instance as the first
  application left it, which may be older than the current one, so there is nothing sound to
  compare it with.
- ``get`` ok: the instance must be exactly the current (state, version, data).
- fail: the call had no effect (a typed refusal). It is left out: a call with no effect fits
  anywhere in its interval.
- unknown: the call may have taken effect once, at any time after its invoke (with no upper
  bound: a write in flight may commit after the caller gave up), or never. A ``get`` that ended
  unknown observed nothing and is left out. Without the workflow an unknown ``fire`` that takes
  effect leaves the state and data unknown (version + 1) until the next observation pins them;
  with it, the state is the event's target when it has only one, and the data is kept when the
  event has no effect.

An instance whose creation is not in the history starts unknown (as if it may or may not exist,
at any version): the first observation pins it. Pass ``initial={id: instance}`` (or ``None``, for
"does not exist yet") to start from a known point instead.

Calls on different instances never constrain each other (linearizability is compositional), so
the search runs per instance; within one, Lowe's memo of (calls placed, model) prunes every
order already tried. Unknown calls of one kind (same op, and same event when the workflow is
given) are interchangeable, so only the earliest invoked of them is ever placed next; that keeps
a history with many unknown calls linear instead of exponential. A search that needs more than
its step budget (``max_steps``; by default 500 per call of the instance, at least 100,000)
stops with an ``undecided`` violation: never a false ok.

Before the search, definite contradictions are found directly (they hold whatever the order):
two applied fires reporting one version (``double-apply``), one version observed with two
contents (``lost-update``), a call that began after a version was observed and reports an
older one (``stale-read``), and results no workflow step can give (``invalid-result``).

Speed (docs/checker.md): 100,000 calls over 1,000 instances (100 each, about 8 overlapping at any
time, a fifth of them unknown) check in 0.6 to 0.8 s of CPU on the development machine (Python
3.11); 100,000 calls on one instance in about 2 s.
"""

from __future__ import annotations

import bisect
import itertools
import json
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, TypeAlias

from flowlock.core.definition import Transition, Workflow
from flowlock.core.errors import (
    ConcurrencyError,
    DefinitionError,
    EngineClosed,
    FlowlockError,
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

__all__ = [
    "DOUBLE_APPLY",
    "INVALID_RESULT",
    "LINEARIZABILITY_KINDS",
    "LOST_UPDATE",
    "NOT_LINEARIZABLE",
    "OPS",
    "OUTCOMES",
    "STALE_READ",
    "UNDECIDED",
    "CallHandle",
    "CallRecord",
    "LinearizabilityVerdict",
    "LinearizabilityViolation",
    "NotLinearizable",
    "Recorder",
    "check_linearizable",
    "outcome_of",
]

Op: TypeAlias = Literal["create", "fire", "get"]
OutcomeName: TypeAlias = Literal["ok", "fail", "unknown"]
OPS: tuple[str, ...] = ("create", "fire", "get")
OUTCOMES: tuple[str, ...] = ("ok", "fail", "unknown")

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

_STEPS_PER_CALL = 500
_MIN_STEPS = 100_000
_CREATED_VERSION = 1


# -- the record ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CallRecord:
    """One recorded call: what was asked (``instance_id``, ``op``, ``event``), when
    (``invoked_at``, ``completed_at`` on the recorder's clock; ``completed_at`` is None for a
    call that never completed, and the checker ignores it for an unknown one), how it ended
    (``outcome``: "ok", "fail" or "unknown") and, when ok, what it returned (``state``,
    ``version``, ``data``, and ``workflow``, the instance's workflow name). ``idempotent``: a fire
    answered ``Outcome.idempotent`` (nothing applied). ``error``: what the call raised, as text.

    Frozen and picklable (worker processes send theirs back), and :meth:`to_dict` /
    :meth:`from_dict` carry it through JSON."""

    instance_id: str
    op: str
    event: str | None
    invoked_at: float
    completed_at: float | None
    outcome: str
    state: str | None = None
    version: int | None = None
    data: Mapping[str, Any] | None = None
    error: str | None = None
    idempotent: bool = False
    workflow: str | None = None

    def __post_init__(self) -> None:
        problem = _record_problem(self)
        if problem is not None:
            raise InvalidInput(f"bad call record ({problem}): {self!r}")

    def to_dict(self) -> dict[str, Any]:
        """Every field, ready for JSON (``data`` as a plain dict)."""
        return {
            "instance_id": self.instance_id,
            "op": self.op,
            "event": self.event,
            "invoked_at": self.invoked_at,
            "completed_at": self.completed_at,
            "outcome": self.outcome,
            "state": self.state,
            "version": self.version,
            "data": None if self.data is None else dict(self.data),
            "error": self.error,
            "idempotent": self.idempotent,
            "workflow": self.workflow,
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> CallRecord:
        """The record :meth:`to_dict` gave; InvalidInput for a field missing or wrong."""
        try:
            return cls(**{name: raw[name] for name in _REQUIRED}, **_optional(raw))
        except KeyError as exc:
            raise InvalidInput(f"call record is missing {exc.args[0]!r}: {dict(raw)!r}") from None

    def label(self) -> str:
        """A short description: op, event, outcome and what it returned."""
        what = self.op if self.event is None else f"{self.op} {self.event!r}"
        if self.outcome != "ok":
            return f"{what} {self.outcome}"
        seen = f"v{self.version} {self.state!r}"
        return f"{what} ok{' (idempotent)' if self.idempotent else ''} -> {seen}"


_REQUIRED = ("instance_id", "op", "event", "invoked_at", "completed_at", "outcome")
_OPTIONAL = ("state", "version", "data", "error", "idempotent", "workflow")


def _optional(raw: Mapping[str, Any]) -> dict[str, Any]:
    return {name: raw[name] for name in _OPTIONAL if name in raw}


def _record_problem(r: CallRecord) -> str | None:
    """What is wrong with a record's fields, or None."""
    if not isinstance(r.instance_id, str):
        return "instance_id must be a string"
    if r.op not in OPS:
        return f"op must be one of {OPS}"
    if r.outcome not in OUTCOMES:
        return f"outcome must be one of {OUTCOMES}"
    if r.op == "fire" and not isinstance(r.event, str):
        return "a fire needs its event"
    if not isinstance(r.invoked_at, int | float):
        return "invoked_at must be a number"
    if r.outcome == "unknown":
        return None
    if not isinstance(r.completed_at, int | float):
        return f"a call that ended {r.outcome} needs completed_at"
    if r.completed_at < r.invoked_at:
        return "completed_at is before invoked_at"
    if r.outcome == "ok":
        return _result_problem(r)
    return None


def _result_problem(r: CallRecord) -> str | None:
    if not isinstance(r.state, str):
        return "an ok call needs the state it returned"
    if not isinstance(r.version, int) or isinstance(r.version, bool) or r.version < 1:
        return "an ok call needs the version it returned (an integer, 1 or more)"
    if not isinstance(r.data, Mapping):
        return "an ok call needs the data it returned (a mapping)"
    if r.idempotent and r.op != "fire":
        return "only a fire can be idempotent"
    return None


# -- the recorder ----------------------------------------------------------------------------


# Errors that mean "refused before anything was written": the engine promises each of them
# leaves the instance untouched. Every StoreError says its transaction was rolled back
# (ConnectionLost: the connection went before the write was sent or committed), except
# OutcomeUnknown, raised exactly when a commit may have landed. Any other exception (a timeout,
# a cancellation, a crash, an error that is not flowlock's) may have left a write behind.
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
    """How a call that raised ``error`` is recorded: "fail" for a flowlock refusal made before
    anything was written (InvalidInput and its subclasses, InstanceNotFound, InstanceExists,
    TransitionRefused, VersionMismatch, StepFailed, DefinitionError, ConcurrencyError (conflicts
    and every lock error), EngineClosed, and every StoreError but OutcomeUnknown: StoreBusy,
    ConnectionLost and the rest promise their transaction was rolled back); "unknown" for
    OutcomeUnknown, timeouts, cancellation and errors not flowlock's."""
    if isinstance(error, OutcomeUnknown):
        return "unknown"
    return "fail" if isinstance(error, _NO_EFFECT) else "unknown"


def _error_text(error: BaseException | str | None) -> str | None:
    if error is None or isinstance(error, str):
        return error
    text = str(error)
    return type(error).__name__ if not text else f"{type(error).__name__}: {text}"


class CallHandle:
    """One call in progress, from :meth:`Recorder.invoke`: complete it once with :meth:`ok`,
    :meth:`fail` or :meth:`unknown`. Until then the recorder reports it as unknown (a call that
    never completes, because its task or process died, may still have taken effect).

    As a context manager it completes the call from how the block ends, when the block did not:
    an exception is recorded by :func:`outcome_of` (and not swallowed); a block that ends
    normally without completing the call records it unknown.

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
        """The call returned ``result``: the Instance a create or get returned, or what a fire
        returned (its Outcome, which says whether it applied, or ``outcome.instance`` for one
        that applied). A fire answered idempotent must be given as its Outcome."""
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
        """The call definitely had no effect (a typed refusal: TransitionNotAllowed,
        GuardRejected, ConflictRetriesExhausted, LockTimeout, InvalidInput...)."""
        return self._complete("fail", _error_text(error))

    def unknown(self, error: BaseException | str | None = None) -> CallRecord:
        """The call may or may not have taken effect (OutcomeUnknown, a
        timeout, a cancellation): the checker lets it take effect at any time after its invoke,
        or never."""
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
    """Records calls for :func:`check_linearizable`: ``invoke`` before the call, then complete
    the handle it returns. Safe to share between tasks and threads.

    ``clock`` gives the times; the default, :func:`time.monotonic`, is one clock for every
    process on a host (Linux's CLOCK_MONOTONIC), so histories recorded by several worker
    processes can be merged and compared. Inject another for tests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._handles: list[CallHandle] = []
        self._added: list[CallRecord] = []
        self._lock = threading.Lock()

    def invoke(self, instance_id: str, op: Op, event: str | None = None) -> CallHandle:
        """Record that a call starts now: ``op`` is "create", "fire" (with its ``event``) or
        "get"."""
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
        """Every call so far, in invoke order, then those added by :meth:`extend`; a call not
        completed yet is reported unknown."""
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


# -- the verdict -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LinearizabilityViolation:
    """What is wrong on one instance: ``kind`` (one of :data:`LINEARIZABILITY_KINDS`), a
    ``message`` naming the calls involved, and ``calls``, their indexes in the history given to
    :func:`check_linearizable`."""

    instance_id: str
    kind: str
    message: str
    calls: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """``{"instance_id", "kind", "message", "calls"}``, ready for JSON."""
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
    """The result of :func:`check_linearizable`: ``ok`` exactly when no violation was found
    (an instance whose search ran out of steps is an ``undecided`` violation, so it is never
    ok). ``instances`` and ``calls`` say how much was checked. Truthy when ok."""

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
        """``{"ok", "instances", "calls", "violations": [...]}``, ready for JSON."""
        return {
            "ok": self.ok,
            "instances": self.instances,
            "calls": self.calls,
            "violations": [v.to_dict() for v in self.violations],
        }

    def describe(self, limit: int = 20) -> str:
        """A readable summary: the first ``limit`` violations, one paragraph each."""
        checked = f"{self.calls} call(s) on {self.instances} instance(s)"
        if self.ok:
            return f"history is linearizable: {checked}, no violations"
        lines = [f"history is not linearizable: {len(self.violations)} violation(s) in {checked}:"]
        lines.extend(f"  - {v}" for v in self.violations[:limit])
        if len(self.violations) > limit:
            lines.append(f"  ... and {len(self.violations) - limit} more")
        return "\n".join(lines)

    def raise_for_violations(self) -> None:
        """Raise :class:`NotLinearizable` naming the violations, unless the verdict is ok."""
        if not self.ok:
            raise NotLinearizable(self)


class NotLinearizable(FlowlockError):
    """A recorded history is not linearizable (or could not be decided); ``verdict`` lists
    every violation."""

    def __init__(self, verdict: LinearizabilityVerdict) -> None:
        self.verdict = verdict
        super().__init__(verdict.describe())


# -- the model -------------------------------------------------------------------------------

# A model is (exists, state, version, data key); None in a place means "unknown": any value is
# possible there until an observation pins it. Data is compared through small integer keys (the
# same JSON gets the same key), which keeps models cheap to hash in the memo.
Model: TypeAlias = tuple[bool | None, str | None, int | None, int | None]
_UNKNOWN_START: Model = (None, None, None, None)
_ABSENT: Model = (False, None, None, None)

_CREATE, _FIRE, _GET, _CREATE_MAYBE, _FIRE_MAYBE = range(5)


@dataclass(slots=True)
class _Op:
    """One call as the search sees it (fails, idempotent fires and unknown gets are left out:
    they have no effect to place)."""

    index: int
    kind: int
    invoked_at: float
    completed_at: float  # inf for a call that may take effect at any later time
    version: int | None = None
    state: str | None = None
    data: int | None = None
    after: Model = _UNKNOWN_START
    # With the workflow: the event's sources, its only target (None for several) and whether
    # it keeps the data (no effect). Without: sources is None.
    sources: frozenset[str] | None = None
    target: str | None = None
    keeps_data: bool = False
    initial: str | None = None
    group: int = -1  # unknown calls: their interchangeable group, and rank in it
    rank: int = 0


def _step(m: Model, o: _Op) -> Model | None:
    """The model after ``o`` takes effect on ``m``, or None when it cannot."""
    exists, state, version, data = m
    kind = o.kind
    if kind == _GET:
        if exists is False:
            return None
        if version is not None and version != o.version:
            return None
        if state is not None and state != o.state:
            return None
        if data is not None and data != o.data:
            return None
        return o.after
    if kind == _FIRE:
        if exists is False or (version is not None and o.version != version + 1):
            return None
        if o.sources is not None:
            if state is not None and state not in o.sources:
                return None
            if o.keeps_data and data is not None and data != o.data:
                return None
        return o.after
    if kind == _FIRE_MAYBE:
        return _maybe_fire(m, o)
    # A create (ok or maybe): only where the instance may not exist yet.
    if exists:
        return None
    return o.after


def _maybe_fire(m: Model, o: _Op) -> Model | None:
    """An unknown fire taking effect: one version more; the state and data its event gives
    when the workflow says (else unknown until observed)."""
    exists, state, version, data = m
    if exists is False:
        return None
    nxt = None if version is None else version + 1
    if o.sources is None:
        return (True, None, nxt, None)
    if state is not None and state not in o.sources:
        return None
    return (True, o.target, nxt, data if o.keeps_data else None)


def _why_not(m: Model, o: _Op, names: _Names) -> str:
    """Why ``o`` cannot take effect on ``m``, in words (for a violation's message)."""
    exists, state, version, data = m
    if o.kind in (_CREATE, _CREATE_MAYBE):
        return "the instance already exists"
    if exists is False:
        return "the instance does not exist yet"
    if version is not None and o.version is not None:
        want = version if o.kind == _GET else version + 1
        if o.version != want:
            return f"it reports version {o.version} where version {want} was due"
    if o.sources is not None and state is not None and state not in o.sources:
        return f"its event is not allowed from state {state!r}"
    if state is not None and o.kind == _GET and o.state != state:
        return f"it reads state {o.state!r} where the instance is in {state!r}"
    if data is not None and o.data != data:
        if o.kind == _FIRE:
            return (
                f"its event has no effect, so it keeps data {names.data(data)}, but it returned "
                f"data {names.data(o.data)}"
            )
        return f"it reads data {names.data(o.data)} where the data is {names.data(data)}"
    return "the instance as it is then does not allow it"


class _Names:
    """Keys for data (the same JSON, the same key) and the way back, for messages."""

    def __init__(self) -> None:
        self._keys: dict[str, int] = {}
        self._by_repr: dict[str, int] = {}
        self._data: list[Mapping[str, Any]] = []

    def key(self, data: Mapping[str, Any]) -> int:
        # Why repr first: it is a few times cheaper than canonical JSON, and the calls that see
        # one version mostly get its data in the same key order. Canonical JSON decides.
        shown = repr(data)
        found = self._by_repr.get(shown)
        if found is not None:
            return found
        try:
            text = json.dumps(data, sort_keys=True, separators=(",", ":"))
        except (TypeError, ValueError):
            text = repr(sorted(data.items(), key=lambda kv: str(kv[0])))
        found = self._keys.get(text)
        if found is None:
            found = self._keys[text] = len(self._data)
            self._data.append(data)
        self._by_repr[shown] = found
        return found

    def data(self, key: int | None) -> str:
        return "unknown" if key is None else json.dumps(self._data[key], sort_keys=True)

    def model(self, m: Model) -> str:
        exists, state, version, data = m
        if exists is False:
            return "not created yet"
        v = "an unknown version" if version is None else f"version {version}"
        s = "an unknown state" if state is None else f"state {state!r}"
        return f"{v}, {s}, data {self.data(data)}"


def _call_name(index: int, r: CallRecord) -> str:
    end = "?" if r.outcome == "unknown" or r.completed_at is None else f"{r.completed_at:.6f}"
    return f"#{index} {r.label()} [{r.invoked_at:.6f}..{end}]"


# -- the checks ------------------------------------------------------------------------------


def check_linearizable(
    calls: Iterable[CallRecord],
    workflow: Workflow | Iterable[Workflow] | None = None,
    *,
    initial: Mapping[str, Instance | None] | None = None,
    max_steps: int | None = None,
) -> LinearizabilityVerdict:
    """Whether the recorded ``calls`` are linearizable, instance by instance.

    ``workflow``: the workflow definition (or several, picked by the workflow name the calls
    returned) used to know where an event leads: an ok fire must be allowed from the state it
    was placed in and reach a target of its event, and an unknown fire takes the event's only
    target. Without it, an unknown fire leaves state and data unknown until the next observation.
    ``initial``: instance id -> the instance as it was before the first call (None: it did not
    exist); by default an instance starts unknown. ``max_steps``: the search budget per
    instance (default: 500 steps per call of the instance, at least 100,000; a step is one
    candidate tried, and an ordinary history needs about as many per call as calls overlap);
    an instance that needs more is reported ``undecided``.

    Every violation names the calls by their index in ``calls``.
    """
    records = list(calls)
    for r in records:
        if not isinstance(r, CallRecord):
            raise InvalidInput(f"check_linearizable() takes CallRecords, not {type(r).__name__}")
    if max_steps is not None and (
        not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps < 1
    ):
        raise InvalidInput(f"max_steps must be a positive integer or None, not {max_steps!r}")
    workflows = _workflows(workflow)
    by_instance: dict[str, list[int]] = {}
    for i, r in enumerate(records):
        by_instance.setdefault(r.instance_id, []).append(i)
    starts = dict(initial or {})
    found: list[LinearizabilityViolation] = []
    for iid, indexes in by_instance.items():
        wf = _workflow_for(workflows, [records[i] for i in indexes])
        found.extend(_check_instance(iid, records, indexes, wf, starts, max_steps))
    return LinearizabilityVerdict(
        ok=not found, instances=len(by_instance), calls=len(records), violations=found
    )


def _workflows(workflow: Workflow | Iterable[Workflow] | None) -> dict[str | None, Workflow]:
    """Workflows by name; a single one is also under None (it applies to every instance)."""
    if workflow is None:
        return {}
    if isinstance(workflow, Workflow):
        return {None: workflow, workflow.name: workflow}
    found: dict[str | None, Workflow] = {}
    for wf in workflow:
        if not isinstance(wf, Workflow):
            raise InvalidInput(f"workflow must be a flowlock Workflow, not {type(wf).__name__}")
        found[wf.name] = wf
    return found


def _workflow_for(
    workflows: Mapping[str | None, Workflow], records: Sequence[CallRecord]
) -> Workflow | None:
    if None in workflows:
        return workflows[None]
    for r in records:
        if r.workflow is not None and r.workflow in workflows:
            return workflows[r.workflow]
    return None


def _start(starts: Mapping[str, Instance | None], iid: str, names: _Names) -> Model:
    """The model before the instance's first call: unknown unless ``initial`` says."""
    if iid not in starts:
        return _UNKNOWN_START
    inst = starts[iid]
    if inst is None:
        return _ABSENT
    if not isinstance(inst, Instance):
        raise InvalidInput(f"initial[{iid!r}] must be an Instance or None")
    return (True, inst.state, inst.version, names.key(inst.data))


def _check_instance(
    iid: str,
    records: Sequence[CallRecord],
    indexes: Sequence[int],
    wf: Workflow | None,
    starts: Mapping[str, Instance | None],
    max_steps: int | None,
) -> list[LinearizabilityViolation]:
    names = _Names()
    ops = _ops(records, indexes, wf, names)
    direct = _direct_violations(iid, records, ops, wf)
    if direct:
        return direct
    first = _start(starts, iid, names)
    budget = max_steps if max_steps is not None else max(_MIN_STEPS, _STEPS_PER_CALL * len(ops))
    search = _Search(ops, first, budget)
    result = search.run()
    if result is True:
        return []
    if result is None:
        definite = sum(1 for o in ops if o.completed_at != _INF)
        return [
            LinearizabilityViolation(
                iid,
                UNDECIDED,
                f"gave up after {budget} search steps over {definite} completed and "
                f"{len(ops) - definite} unknown call(s): the history is neither proven "
                "linearizable nor proven wrong. Raise max_steps, or record fewer overlapping "
                "or unknown calls per instance",
            )
        ]
    return [_explain(iid, records, ops, search, names)]


_INF = float("inf")


def _ops(
    records: Sequence[CallRecord], indexes: Sequence[int], wf: Workflow | None, names: _Names
) -> list[_Op]:
    """The calls that take (or may take) effect, in invoke order, ready for the search."""
    ops: list[_Op] = []
    groups: dict[tuple[int, str | None], int] = {}
    ranks: list[int] = []
    for i in sorted(indexes, key=lambda i: records[i].invoked_at):
        r = records[i]
        o = _op(i, r, wf, names)
        if o is None:
            continue
        if o.completed_at == _INF:
            key = (o.kind, r.event if wf is not None else None)
            o.group = groups.setdefault(key, len(groups))
            if o.group == len(ranks):
                ranks.append(0)
            o.rank = ranks[o.group]
            ranks[o.group] += 1
        ops.append(o)
    return ops


def _op(i: int, r: CallRecord, wf: Workflow | None, names: _Names) -> _Op | None:
    """``r`` as the search sees it, or None when it has no effect to place."""
    if r.outcome == "fail" or r.idempotent or (r.op == "get" and r.outcome == "unknown"):
        return None
    t = wf.transitions.get(r.event or "") if wf is not None and r.op == "fire" else None
    if r.outcome == "unknown":
        if r.op == "create":
            initial = None if wf is None else wf.initial
            return _Op(i, _CREATE_MAYBE, r.invoked_at, _INF, after=(True, initial, 1, None))
        if wf is not None and t is None:
            return None  # an event the workflow does not have never applies
        o = _Op(i, _FIRE_MAYBE, r.invoked_at, _INF)
        _bind(o, t)
        return o
    # Both checked by the record.
    assert r.completed_at is not None
    assert r.data is not None
    kind = {"create": _CREATE, "fire": _FIRE, "get": _GET}[r.op]
    key = names.key(r.data)
    o = _Op(i, kind, r.invoked_at, r.completed_at, r.version, r.state, key)
    o.after = (True, r.state, r.version, key)
    _bind(o, t)
    return o


def _bind(o: _Op, t: Transition | None) -> None:
    if t is None:
        return
    o.sources = frozenset(t.sources)
    o.target = t.targets[0] if len(t.targets) == 1 else None
    o.keeps_data = t.effect is None


def _direct_violations(
    iid: str, records: Sequence[CallRecord], ops: Sequence[_Op], wf: Workflow | None
) -> list[LinearizabilityViolation]:
    """Contradictions that hold whatever the order (cheap, and clearer than the search's)."""
    seen = [o for o in ops if o.completed_at != _INF]
    found = _invalid_results(iid, records, seen, wf)
    found += _double_applies(iid, records, seen)
    found += _conflicting_versions(iid, records, seen)
    found += _stale(iid, records, seen)
    return found


def _invalid_results(
    iid: str, records: Sequence[CallRecord], seen: Sequence[_Op], wf: Workflow | None
) -> list[LinearizabilityViolation]:
    found = []
    for o in seen:
        r = records[o.index]
        problem = _impossible(r, wf)
        if problem is not None:
            found.append(
                LinearizabilityViolation(
                    iid, INVALID_RESULT, f"{_call_name(o.index, r)}: {problem}", (o.index,)
                )
            )
    return found


def _impossible(r: CallRecord, wf: Workflow | None) -> str | None:
    """Why ``r``'s result cannot be right whatever came before it, or None."""
    assert r.version is not None
    if r.op == "create":
        if r.version != _CREATED_VERSION:
            return f"a create answers version {_CREATED_VERSION}, not {r.version}"
        if wf is not None and r.state != wf.initial:
            return f"a create answers the initial state {wf.initial!r}, not {r.state!r}"
        return None
    if wf is not None and r.state not in wf.states:
        return f"state {r.state!r} is not a state of workflow {wf.name!r}"
    if r.op != "fire":
        return None
    if r.version <= _CREATED_VERSION:
        return f"an applied fire answers version {_CREATED_VERSION + 1} or more, not {r.version}"
    if wf is None:
        return None
    t = wf.transitions.get(r.event or "")
    if t is None:
        return f"workflow {wf.name!r} has no event {r.event!r}"
    if r.state not in t.targets:
        return f"event {r.event!r} leads to {', '.join(map(repr, t.targets))}, not {r.state!r}"
    return None


def _double_applies(
    iid: str, records: Sequence[CallRecord], seen: Sequence[_Op]
) -> list[LinearizabilityViolation]:
    found = []
    creates = [o.index for o in seen if o.kind == _CREATE]
    if len(creates) > 1:
        found.append(_violation(iid, DOUBLE_APPLY, records, creates, "created more than once"))
    by_version: dict[int | None, list[int]] = {}
    for o in seen:
        if o.kind == _FIRE:
            by_version.setdefault(o.version, []).append(o.index)
    for version, indexes in by_version.items():
        if len(indexes) > 1:
            found.append(
                _violation(
                    iid,
                    DOUBLE_APPLY,
                    records,
                    indexes,
                    f"{len(indexes)} fires all applied from version {(version or 0) - 1} "
                    f"to version {version}",
                )
            )
    return found


def _conflicting_versions(
    iid: str, records: Sequence[CallRecord], seen: Sequence[_Op]
) -> list[LinearizabilityViolation]:
    found = []
    by_version: dict[int | None, list[_Op]] = {}
    for o in seen:
        by_version.setdefault(o.version, []).append(o)
    for version, group in sorted(by_version.items(), key=lambda kv: kv[0] or 0):
        if sum(1 for o in group if o.kind == _FIRE) > 1:
            continue  # two fires at one version: already a double apply
        contents = {(o.state, o.data) for o in group}
        if len(contents) > 1:
            found.append(
                _violation(
                    iid,
                    LOST_UPDATE,
                    records,
                    [o.index for o in group],
                    f"version {version} was seen with {len(contents)} different contents (state "
                    "and data); one write at that version replaced another",
                )
            )
    return found


def _stale(
    iid: str, records: Sequence[CallRecord], seen: Sequence[_Op]
) -> list[LinearizabilityViolation]:
    """A call that began after another completed must see at least that one's version (a
    fire, a newer one; a create, no instance at all)."""
    done = sorted(seen, key=lambda o: o.completed_at)
    ends = [o.completed_at for o in done]
    newest: list[_Op] = []
    for o in done:
        newer = not newest or (o.version or 0) > (newest[-1].version or 0)
        newest.append(o if newer else newest[-1])
    found = []
    for o in seen:
        before = bisect.bisect_left(ends, o.invoked_at)
        if before == 0:
            continue
        prior = newest[before - 1]
        v, pv = o.version or 0, prior.version or 0
        if o.kind == _CREATE:
            problem = "created although an earlier call had already seen the instance"
            kind = DOUBLE_APPLY
        elif o.kind == _GET and v < pv:
            problem = f"read version {v} after version {pv} had been seen"
            kind = STALE_READ
        elif o.kind == _FIRE and v <= pv:
            problem = f"applied to reach version {v} after version {pv} had been seen"
            kind = STALE_READ
        else:
            continue
        found.append(
            _violation(
                iid,
                kind,
                records,
                [prior.index, o.index],
                f"{problem}: the second call began after the first completed",
            )
        )
    return found


def _violation(
    iid: str, kind: str, records: Sequence[CallRecord], indexes: Sequence[int], what: str
) -> LinearizabilityViolation:
    listed = "; ".join(_call_name(i, records[i]) for i in indexes[:6])
    more = f"; and {len(indexes) - 6} more" if len(indexes) > 6 else ""
    return LinearizabilityViolation(iid, kind, f"{what}: {listed}{more}", tuple(indexes))


# -- the search ------------------------------------------------------------------------------


class _Search:
    """Wing & Gong's search with Lowe's memo over one instance's calls.

    The completed calls are a doubly linked list of invoke and completion entries in time
    order; the candidates to place next are the invokes before the first completion still in
    the list (a call that completed before another began must come first). Placing one lifts
    its two entries; reaching a completion means every candidate failed, so the unknown calls
    are tried, then the last placement is undone. The unknown calls are not in the list: each
    group's next one (earliest invoked first) is a candidate when it was invoked before that
    first completion. Done when every completed call is placed (the unknown calls left over
    never took effect). Two cuts keep ordinary histories linear: a read that sees exactly the
    known instance is placed first with no alternative (:meth:`_place_forced_read`), and an
    unknown call is not placed where a completed call due needs an older version
    (:meth:`_lowest_need`).

    The memo holds (placed completed calls, unknown calls placed per group, model). The placed
    completed calls are kept as ``low`` (every call of index below it is placed) and a bit set
    above it, which stays small: a call placed above ``low`` began before ``low``'s call ended.
    The stack is a linked list of frames, so the deepest point reached is kept for free.
    """

    def __init__(self, ops: Sequence[_Op], start: Model, max_steps: int) -> None:
        self.ops = ops
        self.start = start
        self.max_steps = max_steps
        self.definite = [o for o in ops if o.completed_at != _INF]
        self.groups: list[list[_Op]] = []
        for o in ops:
            if o.completed_at == _INF:
                if o.group == len(self.groups):
                    self.groups.append([])
                self.groups[o.group].append(o)
        self.best: _Frame | None = None
        self.best_depth = 0
        self.best_model: Model = start

    def run(self) -> bool | None:
        """True: linearizable; False: not (``best`` is the deepest point); None: out of steps."""
        definite = self.definite
        n = len(definite)
        if n == 0:
            return True
        # Entries 1..2n; 0 is the head and 2n + 1 the tail. An entry e > 0 is the invoke of
        # definite[op_of[e]] when is_call[e], else its completion.
        events = sorted(
            [(o.invoked_at, 0, k) for k, o in enumerate(definite)]
            + [(o.completed_at, 1, k) for k, o in enumerate(definite)]
        )
        tail = 2 * n + 1
        op_of = [0] * (tail + 1)
        is_call = [False] * (tail + 1)
        at = [_INF] * (tail + 1)
        ret_of = [0] * n
        for e, (t, is_ret, k) in enumerate(events, start=1):
            op_of[e], at[e] = k, t
            if is_ret:
                ret_of[k] = e
            else:
                is_call[e] = True
        self.nxt = list(range(1, tail + 2))
        self.prv = [-1, *range(tail)]
        self.op_of, self.is_call, self.at, self.ret_of = op_of, is_call, at, ret_of
        # What version the model must be at for each call: a read its own, a fire the one
        # before its result, a create none (checked by the model).
        self.needs = [
            o.version if o.kind == _GET else None if o.kind == _CREATE else (o.version or 0) - 1
            for o in definite
        ]
        self.used = [0] * len(self.groups)
        self.ukey: tuple[int, ...] = tuple(self.used)
        self.seen: set[tuple[int, int, tuple[int, ...], Model]] = set()
        self.model, self.low, self.bits, self.placed, self.steps = self.start, 0, 0, 0, 0
        self.frame: _Frame | None = None
        self.e, self.next_group, self.fresh = self.nxt[0], 0, True
        return self._walk()

    def _walk(self) -> bool | None:
        """Place calls until every completed one is placed (True), no order is left (False)
        or the budget is spent (None)."""
        n = len(self.definite)
        while self.placed < n:
            if self.steps > self.max_steps:
                return None
            if not self._place_next() and not self._undo():
                return False
        return True

    def _place_next(self) -> bool:
        """Place the next call that fits at this node, trying candidates from ``self.e`` on
        (then the unknown groups from ``self.next_group``); False when none is left."""
        if self.fresh:
            self.fresh = False
            if None not in self.model and self._place_forced_read():
                return True
        definite, nxt, is_call, op_of = self.definite, self.nxt, self.is_call, self.op_of
        needs, model, seen, ukey = self.needs, self.model, self.seen, self.ukey
        low, bits = self.low, self.bits
        version = model[2]
        e, steps = self.e, 0
        while is_call[e]:
            steps += 1
            k = op_of[e]
            need = needs[k]
            # Most candidates are refused on the version alone: check it before the model.
            if version is None or need is None or need == version:
                after = _step(model, definite[k])
                if after is not None:
                    nlow, nbits = _place(low, bits, k)
                    key = (nlow, nbits, ukey, after)
                    if key not in seen:
                        seen.add(key)
                        self.steps += steps
                        self._push(e, -1, after, nlow, nbits, forced=False)
                        return True
            e = nxt[e]
        self.steps += steps + 1
        self.e = e
        # A completion: every invoke before it was tried. Then the unknown calls.
        return self._place_unknown(self.at[e])

    def _place_forced_read(self) -> bool:
        """Place a read that sees exactly the (fully known) model, if one is a candidate.

        Why it may be forced: such a read changes nothing, and every call that must precede it
        is placed already, so any order that places it later can place it now instead. When
        what follows fails, this node fails: no other candidate is tried here."""
        definite, nxt, is_call, op_of, needs = (
            self.definite,
            self.nxt,
            self.is_call,
            self.op_of,
            self.needs,
        )
        model, version = self.model, self.model[2]
        e = nxt[0]
        while is_call[e]:
            self.steps += 1
            k = op_of[e]
            o = definite[k]
            if o.kind == _GET and needs[k] == version and o.after == model:
                nlow, nbits = _place(self.low, self.bits, k)
                key = (nlow, nbits, self.ukey, model)
                if key in self.seen:
                    return False
                self.seen.add(key)
                self._push(e, -1, model, nlow, nbits, forced=True)
                return True
            e = nxt[e]
        return False

    def _place_unknown(self, limit: float) -> bool:
        """Let the next unknown call of a group (from ``self.next_group``), invoked by
        ``limit``, take effect, at a point not tried before."""
        groups, used = self.groups, self.used
        floor: int | None = -1
        for g in range(self.next_group, len(groups)):
            rank = used[g]
            if rank >= len(groups[g]):
                continue
            o = groups[g][rank]
            if o.invoked_at > limit:
                continue
            after = _step(self.model, o)
            if after is None:
                continue
            if floor == -1:
                floor = self._lowest_need()
            if floor is not None and after[2] is not None and floor < after[2]:
                continue  # a completed call due now needs an older version: it would be lost
            used[g] += 1
            ukey = tuple(used)
            used[g] -= 1
            key = (self.low, self.bits, ukey, after)
            if key in self.seen:
                continue
            self.seen.add(key)
            self._push(self.e, g, after, self.low, self.bits, forced=False)
            used[g] += 1
            self.ukey = ukey
            return True
        return False

    def _lowest_need(self) -> int | None:
        """The lowest version needed by a completed call not placed yet that is a candidate now
        or the first to complete (None when none of them needs one).

        Versions only grow, so an unknown call that would move the instance past it would leave
        that call with no place at all: not worth trying. (Without this, an unknown fire could
        stand in for a completed fire of the same version, and the search would follow it until
        that fire's completion, at every dead end.)"""
        nxt, is_call, op_of, needs = self.nxt, self.is_call, self.op_of, self.needs
        lowest: int | None = None
        e = nxt[0]
        while True:
            need = needs[op_of[e]]
            if need is not None and (lowest is None or need < lowest):
                lowest = need
            if not is_call[e]:
                return lowest
            e = nxt[e]

    def _push(self, e: int, group: int, after: Model, low: int, bits: int, *, forced: bool) -> None:
        op = self.definite[self.op_of[e]] if group < 0 else self.groups[group][self.used[group]]
        depth = 1 if self.frame is None else self.frame.depth + 1
        self.frame = _Frame(
            self.frame, op, depth, e, group, self.model, self.low, self.bits, forced
        )
        self.model, self.low, self.bits = after, low, bits
        if group < 0:
            self.placed += 1
            self._lift(e)

        if depth > self.best_depth:
            self.best, self.best_depth, self.best_model = self.frame, depth, after
        if depth > self.best_depth:
            self.best, self.best_depth, self.best_model = self.frame, depth, after
        self.e, self.next_group, self.fresh = self.nxt[0], 0, True

    def _undo(self) -> bool:
        """Undo the last placement and go on with the candidates after it (a forced one
        undoes its parent too); False when there is nothing to undo."""
        while True:
            frame = self.frame
            if frame is None:
                return False
            self.frame = frame.parent
            self.model, self.low, self.bits = frame.model, frame.low, frame.bits
            if frame.group >= 0:
                self.used[frame.group] -= 1
                self.ukey = tuple(self.used)
                # The same node, at the same completion entry: on to the next group.
                self.e, self.next_group = frame.e, frame.group + 1
            else:
                self.placed -= 1
                self._unlift(frame.e)
                self.e, self.next_group = self.nxt[frame.e], 0
            self.fresh = False
            if not frame.forced:
                return True

    def _lift(self, e: int) -> None:
        nxt, prv = self.nxt, self.prv
        for x in (e, self.ret_of[self.op_of[e]]):
            nxt[prv[x]] = nxt[x]
            prv[nxt[x]] = prv[x]

    def _unlift(self, e: int) -> None:
        nxt, prv = self.nxt, self.prv
        for x in (self.ret_of[self.op_of[e]], e):
            nxt[prv[x]] = x
            prv[nxt[x]] = x

    def deepest(self) -> tuple[list[_Op], Model]:
        """The calls placed at the deepest point reached (in order), and the model there."""
        order: list[_Op] = []
        frame = self.best
        while frame is not None:
            order.append(frame.op)
            frame = frame.parent
        order.reverse()
        return order, self.best_model


def _place(low: int, bits: int, k: int) -> tuple[int, int]:
    """Mark completed call ``k`` placed in the (low, bits) set: every call below ``low`` is
    placed, bit i of ``bits`` says whether call ``low + i`` is."""
    bits |= 1 << (k - low)
    if bits & 1:
        # Shift out the run of placed calls at the bottom.
        run = ((bits + 1) & ~bits).bit_length() - 1
        return low + run, bits >> run
    return low, bits


@dataclass(slots=True)
class _Frame:
    """One placement: the entry (or unknown group) placed and what to restore on undo."""

    parent: _Frame | None
    op: _Op
    depth: int
    e: int
    group: int
    model: Model
    low: int
    bits: int
    forced: bool


def _explain(
    iid: str, records: Sequence[CallRecord], ops: Sequence[_Op], search: _Search, names: _Names
) -> LinearizabilityViolation:
    """The violation for a failed search: how far the deepest explanation got, and why none of
    the calls due next fits there."""
    order, model = search.deepest()
    placed = {o.index for o in order if o.completed_at != _INF}
    maybe = len(order) - len(placed)
    left = [o for o in search.definite if o.index not in placed]
    first_end = min(o.completed_at for o in left)
    due = [o for o in left if o.invoked_at <= first_end]
    head = (
        "no order of its calls explains what they returned. The deepest explanation found "
        f"places {len(placed)} of {len(search.definite)} completed call(s)"
    )
    if maybe:
        head += f" and takes {maybe} unknown call(s) as applied"
    if order:
        tail = "; ".join(_placed_name(o, records) for o in order[-3:])
        head += f", ending with {tail}"
    head += f". The instance is then at {names.model(model)}, and no call due next fits: "
    reasons = [
        f"{_call_name(o.index, records[o.index])}: {_why_not(model, o, names)}" for o in due[:5]
    ]
    if len(due) > 5:
        reasons.append(f"and {len(due) - 5} more")
    involved = tuple(o.index for o in order[-3:]) + tuple(o.index for o in due[:5])
    return LinearizabilityViolation(iid, NOT_LINEARIZABLE, head + "; ".join(reasons), involved)


def _placed_name(o: _Op, records: Sequence[CallRecord]) -> str:
    name = _call_name(o.index, records[o.index])
    return name if o.completed_at != _INF else f"{name} taken as applied"
