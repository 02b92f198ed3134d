"""The pure core: what firing an event at an instance means, with no I/O.

`decide` may run again after a conflict, or under a row lock. `decide_batch` decides
calls in order, as if run one by one; its answers stand only once the batch commits.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from flowlock.core.admin import decide_repair, refuse_paused
from flowlock.core.constraints import checked_claims
from flowlock.core.definition import SYNC_STEPS, Step, Transition, Workflow
from flowlock.core.errors import (
    DefinitionError,
    DefinitionMismatch,
    FlowlockError,
    GuardRejected,
    IdempotencyKeyReused,
    InvalidInput,
    StaleTimer,
    StepFailed,
    TransitionNotAllowed,
    UnknownEvent,
    UnknownWorkflow,
    VersionMismatch,
)
from flowlock.core.jsondata import DEFAULT_MAX_PAYLOAD, check_object, same_json
from flowlock.core.migration import decide_migration
from flowlock.core.models import (
    FORCE_EVENT,
    MIGRATE_EVENT,
    RESERVED_EVENTS,
    HistoryEntry,
    Instance,
    Snapshot,
    TimerFiring,
    paused_after,
)
from flowlock.core.outbox import Emit
from flowlock.core.payloads import PayloadSchema
from flowlock.core.versions import Registry

__all__ = ["Batched", "Call", "Decision", "Idempotent", "NotSelected", "decide", "decide_batch"]


@dataclass(frozen=True, slots=True)
class Call:
    """One validated `engine.fire` call."""

    instance_id: str
    event: str
    payload: Mapping[str, Any]
    actor: str | None
    request_id: str | None
    expected_version: int | None
    strategy: str
    timer: TimerFiring | None = None
    trace: str | None = None
    where: Callable[[Instance], bool] | None = None
    """A bulk run's selection, checked on the very read the write is decided on."""
    parsed: tuple[object, Any] | None = None
    """The payload as the engine parsed it before any read, with its schema's key."""


class NotSelected(FlowlockError):
    """A bulk run's call found the instance moved out of the run's selection; nothing written."""

    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        super().__init__(f"instance {instance_id!r} no longer matches the bulk run's selection")


@dataclass(frozen=True, slots=True)
class Idempotent:
    """Nothing to write: the call was answered before.

    `instance` is what to report. `replayed`: the request id was applied before, so the
    answer is that first application's.
    """

    instance: Instance
    replayed: bool = False


def _from_entry(current: Instance, entry: HistoryEntry) -> Instance:
    """The instance as `entry` left it (to answer a repeated request with its first outcome)."""
    return current.evolve(
        state=entry.to_state,
        version=entry.version,
        data=entry.data,
        last_event=entry.event,
        updated_at=entry.at,
        paused=paused_after(current.paused, entry.event),
        definition_version=_version_after(current, entry),
    )


def _version_after(inst: Instance, entry: HistoryEntry) -> int | None:
    """The instance's definition version once `entry` is applied (a row without one keeps it)."""
    return inst.definition_version if entry.definition_version is None else entry.definition_version


def _pinned(
    workflows: Mapping[str, Workflow], inst: Instance
) -> tuple[Workflow | None, int | None]:
    """The definition `inst` runs under and its version number (None: unknown). A Registry
    answers the instance's own version, or raises DefinitionMismatch when it lacks it."""
    if not isinstance(workflows, Registry):
        return workflows.get(inst.workflow), inst.definition_version
    pinned = inst.definition_version
    wf = workflows.pinned(inst.workflow, pinned, instance_id=inst.id)
    return wf, pinned if pinned is not None else workflows.newest_version(inst.workflow)


def _run_step(
    fn: Callable[[Instance, Mapping[str, Any], str | None], Any],
    step: str,
    workflow: str,
    inst: Instance,
    call: Call,
    payload: Any,
) -> Any:
    """Run the guard or effect `step` and return its result, or the typed error.

    GuardRejected is bound to the instance; InvalidInput passes as it is. Any other
    exception becomes StepFailed, with it as the cause. An awaitable result is closed unrun
    and refused: an async step slipped past the definition's check.
    """
    try:
        result = fn(inst, payload, call.actor)
    except GuardRejected as exc:
        raise exc.bind(inst.id, call.event, inst.state, inst.version) from None
    except InvalidInput:
        raise
    except Exception as exc:
        raise StepFailed(
            workflow=workflow,
            event=call.event,
            instance_id=inst.id,
            step=step,
            state=inst.state,
            version=inst.version,
            error=exc,
        ) from exc
    if inspect.isawaitable(result):
        close = getattr(result, "close", None)
        if callable(close):
            close()  # never awaited on purpose: no "coroutine was never awaited" warning
        raise DefinitionError(
            f"the {step} of event {call.event!r} (workflow {workflow!r}) returned "
            f"{type(result).__name__}, an awaitable, on instance {inst.id!r}; nothing was "
            f"written. {SYNC_STEPS}"
        )
    return result


def _check_guard(
    transition: Transition, workflow: str, inst: Instance, call: Call, payload: Any
) -> None:
    """Raise GuardRejected (bound to the instance) unless the transition's guard lets it run."""
    if transition.guard is None:
        return
    ok = _run_step(transition.guard, "guard", workflow, inst, call, payload)
    if not ok:
        raise GuardRejected(
            f"guard of {call.event!r} returned {ok!r}",
            instance_id=inst.id,
            event=call.event,
            state=inst.state,
            version=inst.version,
        )


def _apply_effect(
    transition: Transition, workflow: str, inst: Instance, call: Call, payload: Any, limit: int
) -> tuple[str, Mapping[str, Any], Any]:
    """The target state, the new data and the messages a Step emitted (unchecked).

    Without an effect: the transition's target and the instance's data. Otherwise what the
    effect returned, checked: JSON data within `limit` bytes, or a Step to a declared target.
    """
    if transition.effect is None:
        return transition.target, inst.data, ()
    result = _run_step(transition.effect, "effect", workflow, inst, call, payload)
    target = transition.target
    emitted: Any = ()
    if isinstance(result, Step):
        emitted = result.emit
        if result.target is not None:
            if result.target not in transition.targets:
                raise DefinitionError(
                    f"effect of {call.event!r} chose target {result.target!r}, which is not "
                    f"one of the transition's targets {transition.targets}"
                )
            target = result.target
        result = result.data
    if not isinstance(result, Mapping):
        raise DefinitionError(
            f"effect of {call.event!r} returned {type(result).__name__}; "
            "it must return a mapping (the new data) or flowlock.Step"
        )
    # Checked here, in the pure step, so every strategy and store refuses the same data before
    # writing. A store never answers bad data with a StoreError.
    what = f"the data the effect of {call.event!r} returned for instance {inst.id!r}"
    return target, check_object(result, what, limit), emitted


def _emits(
    transition: Transition,
    workflow: str,
    after: Instance,
    call: Call,
    payload: Any,
    stepped: Any,
    limit: int,
) -> tuple[Emit, ...]:
    """The messages the transition emits: those of the effect's Step, then those of the
    transition's `emit` function (run on the instance as the transition leaves it), each
    checked (an Emit, its payload JSON within `limit` bytes)."""
    found: list[Any] = list(_listed(stepped, "the Step of the effect", call))
    if transition.emit is not None:
        listed = _run_step(transition.emit, "emit", workflow, after, call, payload)
        found.extend(_listed(listed, "the emit function", call))
    checked: list[Emit] = []
    for n, item in enumerate(found):
        if not isinstance(item, Emit):
            raise DefinitionError(
                f"message {n} emitted by {call.event!r} is {type(item).__name__}; "
                "emit flowlock.Emit(kind, payload) values"
            )
        what = f"the payload of message {n} ({item.kind!r}) emitted by {call.event!r}"
        checked.append(Emit(item.kind, check_object(item.payload, what, limit)))
    return tuple(checked)


def _listed(value: Any, where: str, call: Call) -> tuple[Any, ...]:
    if value is None:
        return ()
    if isinstance(value, Emit):
        return (value,)
    if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__iter__"):
        raise DefinitionError(
            f"{where} of {call.event!r} gave {type(value).__name__}; give a list of flowlock.Emit"
        )
    return tuple(value)


def _parsed(schema: PayloadSchema, workflow: str, call: Call) -> Any:
    """The call's payload parsed by `schema`: the engine's parse when it used the same schema
    (it checked before reading), else parsed here (InvalidPayload, nothing written)."""
    early = call.parsed
    if early is not None and early[0] == schema.key:
        return early[1]
    return schema.parse(call.payload, workflow=workflow, event=call.event)


def _repeated(inst: Instance, prior: HistoryEntry, call: Call) -> Idempotent:
    """The first outcome of a repeated request, if the call repeats it exactly.

    Raises IdempotencyKeyReused for a request_id reused with another event or payload.
    """
    if prior.event != call.event or not same_json(prior.payload, call.payload):
        raise IdempotencyKeyReused(
            prior.request_id or "",
            instance_id=inst.id,
            original_event=prior.event,
            event=call.event,
            original_payload=prior.payload,
            payload=call.payload,
            version=prior.version,
        )
    return Idempotent(_from_entry(inst, prior), replayed=True)


def decide(
    workflows: Mapping[str, Workflow],
    snap: Snapshot,
    call: Call,
    *,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD,
) -> HistoryEntry | Idempotent:
    """The history entry to append for `call` on `snap`, or the idempotent answer.

    Raises VersionMismatch, UnknownWorkflow, UnknownEvent, TransitionNotAllowed,
    GuardRejected, IdempotencyKeyReused and StepFailed. Also InvalidInput, when an effect
    returned non-JSON data or data over `max_payload_bytes`. And DefinitionError, when an
    effect returned something other than data, or a step returned an awaitable.

    A refused call leaves no trace: its request_id is not remembered. So a retry under the
    same request_id may apply once the state allows it.
    """
    rid = call.request_id
    prior = None if rid is None else snap.priors.get(rid)
    return _decide(workflows, snap.instance, prior, call, max_payload_bytes)


def _decide(
    workflows: Mapping[str, Workflow],
    inst: Instance,
    prior: HistoryEntry | None,
    call: Call,
    max_payload_bytes: int,
) -> HistoryEntry | Idempotent:
    """`decide` on `inst`, `prior` being the entry of the call's request id, if any; an
    entry carries what it does to the constraints of the definition it leaves the instance
    under."""
    decided = _decide_entry(workflows, inst, prior, call, max_payload_bytes)
    if prior is not None or not isinstance(decided, HistoryEntry):
        return decided
    if isinstance(workflows, Registry):
        wf = workflows.runs(inst.workflow, _version_after(inst, decided))
    else:
        wf = workflows.get(inst.workflow)
    if wf is None or not wf.constraints:
        return decided  # the common case: nothing to count
    claims = checked_claims(wf.name, wf.constraints, inst, _after(inst, decided), call.event)
    return dataclasses.replace(decided, claims=claims) if claims else decided


def _decide_entry(
    workflows: Mapping[str, Workflow],
    inst: Instance,
    prior: HistoryEntry | None,
    call: Call,
    max_payload_bytes: int,
) -> HistoryEntry | Idempotent:
    if prior is not None:
        # Why first: a repeated request answers what the first one did, even if the
        # workflow has moved (or cycled) since; request_id is the caller's idempotency key.
        return _repeated(inst, prior, call)
    if call.expected_version is not None and call.expected_version != inst.version:
        raise VersionMismatch(inst.id, call.expected_version, inst.version, inst.state)
    if call.where is not None and not call.where(inst):
        raise NotSelected(inst.id)
    if call.event == MIGRATE_EVENT:
        # Decided under its target version (flowlock.core.migration), whatever version the
        # instance ran: this engine need not have that one.
        migrated = decide_migration(workflows, inst, call, max_payload_bytes)
        return Idempotent(inst) if migrated is None else migrated
    if call.event in RESERVED_EVENTS:
        return _repair(workflows, inst, call)
    wf, defined = _pinned(workflows, inst)
    if wf is None:
        raise UnknownWorkflow(inst.workflow, tuple(workflows))
    if inst.paused or inst.workflow_paused:
        # After the replay above: a repeated request still answers its first outcome.
        raise refuse_paused(inst)
    transition = wf.transitions.get(call.event)
    if transition is None:
        raise UnknownEvent(wf.name, call.event, tuple(wf.transitions))
    # Before the state is looked at, as the engine's own check before any read would be.
    schema = transition.payload
    payload = call.payload if schema is None else _parsed(schema, wf.name, call)
    timer = call.timer
    if timer is not None and (inst.stay_version or 1) != timer.stay:
        # Checked before the two-admins rule: a timer of an ended stay never answers for it.
        raise StaleTimer(
            inst.id,
            call.event,
            inst.state,
            wf.allowed(inst.state),
            inst.version,
            stay=timer.stay,
            current_stay=inst.stay_version,
        )

    if inst.state not in transition.sources:
        # The two-admins rule: the same event already brought the instance where this call
        # wanted it, so the caller's intent holds. Anything else is a real refusal.
        if inst.last_event == call.event and inst.state in transition.targets:
            return Idempotent(inst)
        raise TransitionNotAllowed(
            inst.id, call.event, inst.state, wf.allowed(inst.state), inst.version
        )

    _check_guard(transition, wf.name, inst, call, payload)
    target, data, stepped = _apply_effect(
        transition, wf.name, inst, call, payload, max_payload_bytes
    )
    moves = target != inst.state
    emits: tuple[Emit, ...] = ()
    if stepped or transition.emit is not None:
        version = inst.version + 1
        stay = version if moves else inst.stay_version
        after = inst.evolve(
            state=target, version=version, data=data, last_event=call.event, stay_version=stay
        )
        emits = _emits(transition, wf.name, after, call, payload, stepped, max_payload_bytes)
    return HistoryEntry(
        instance_id=inst.id,
        version=inst.version + 1,
        event=call.event,
        from_state=inst.state,
        to_state=target,
        actor=call.actor,
        request_id=call.request_id,
        strategy=call.strategy,
        data=data,
        payload=call.payload,
        arm=wf.timers(target) if moves else (),
        # Any state change of a timed workflow ends the stay's timers, also those a former
        # definition armed from a state that has none now; untimed workflows pay nothing.
        voids=moves and wf.has_timers,
        timer=timer,
        emits=emits,
        trace=call.trace if emits else None,
        definition_version=defined,
    )


def _repair(
    workflows: Mapping[str, Workflow], inst: Instance, call: Call
) -> HistoryEntry | Idempotent:
    """An operator's repair (flowlock.core.admin): it works on a paused instance too. Only a
    force needs the definition (its states, of the instance's own version); pause and resume
    keep state and data, so an engine that has not registered the workflow, or the instance's
    version (an operator's CLI), can do them."""
    try:
        wf, version = _pinned(workflows, inst)
    except DefinitionMismatch:
        if call.event == FORCE_EVENT:
            raise
        wf, version = None, inst.definition_version
    if wf is None and call.event == FORCE_EVENT:
        raise UnknownWorkflow(inst.workflow, tuple(workflows))
    repair = decide_repair(wf, inst, call)
    if repair is None:
        return Idempotent(inst)
    if repair.definition_version is not None:
        return repair  # a row that names its own version (a migration's: its target)
    return dataclasses.replace(repair, definition_version=version)


Decision = HistoryEntry | Idempotent | FlowlockError
"""What one call of a batch comes to: its history entry, its idempotent answer, or its error."""


@dataclass(frozen=True, slots=True)
class Batched:
    """A batch decided on one read: each call's decision, and the entries to write.

    Entries have versions read + 1 to read + k; empty when nothing is to be written.
    """

    read: Instance
    decisions: tuple[Decision, ...]
    entries: tuple[HistoryEntry, ...]


def _after(inst: Instance, entry: HistoryEntry) -> Instance:
    """The instance as `entry` leaves it, before it is committed (its time is the commit's)."""
    return inst.evolve(
        state=entry.to_state,
        version=entry.version,
        data=entry.data,
        last_event=entry.event,
        stay_version=entry.version if entry.enters else inst.stay_version,
        paused=paused_after(inst.paused, entry.event),
        definition_version=_version_after(inst, entry),
    )


def decide_batch(
    workflows: Mapping[str, Workflow],
    snap: Snapshot,
    calls: tuple[Call, ...],
    *,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD,
) -> Batched:
    """Decide every call of `calls` in order, each on the state the earlier ones left.

    The decisions, entries and errors equal running the calls one after the other. A
    request id applied earlier in the batch answers as one found in `snap.priors` would.
    A call's error is its own decision; the others go on.
    """
    state = snap.instance
    applied: dict[str, HistoryEntry] = {}
    decisions: list[Decision] = []
    entries: list[HistoryEntry] = []
    for call in calls:
        rid = call.request_id
        prior = None if rid is None else applied.get(rid) or snap.priors.get(rid)
        try:
            decided: Decision = _decide(workflows, state, prior, call, max_payload_bytes)
        except FlowlockError as exc:
            decided = exc
        if isinstance(decided, HistoryEntry):
            if rid is not None:
                applied[rid] = decided
            entries.append(decided)
            state = _after(state, decided)
        decisions.append(decided)
    return Batched(snap.instance, tuple(decisions), tuple(entries))
