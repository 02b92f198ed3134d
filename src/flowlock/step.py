"""The pure core: what firing an event at an instance means, with no I/O.

``decide`` is a function of (workflows, what was read, the call). The optimistic strategy may run it
again after a conflict, the pessimistic one runs it under a row lock, and hypothesis tests it alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flowlock.definition import Step, Transition, Workflow
from flowlock.errors import (
    DefinitionError,
    GuardRejected,
    TransitionNotAllowed,
    UnknownEvent,
    UnknownWorkflow,
    VersionMismatch,
)
from flowlock.models import HistoryEntry, Instance, Snapshot

__all__ = ["Call", "Idempotent", "decide"]


@dataclass(frozen=True, slots=True)
class Call:
    """One ``engine.fire`` call, validated."""

    instance_id: str
    event: str
    payload: Mapping[str, Any]
    actor: str | None
    request_id: str | None
    expected_version: int | None
    strategy: str


@dataclass(frozen=True, slots=True)
class Idempotent:
    """Nothing to write: the call was answered before. ``instance`` is what to report."""

    instance: Instance


def _from_entry(current: Instance, entry: HistoryEntry) -> Instance:
    """The instance as ``entry`` left it (to answer a repeated request with its first outcome)."""
    return current.evolve(
        state=entry.to_state,
        version=entry.version,
        data=entry.data,
        last_event=entry.event,
        updated_at=entry.at,
    )


def _check_guard(transition: Transition, inst: Instance, call: Call) -> None:
    """Raise GuardRejected (bound to the instance) unless the transition's guard lets it run."""
    if transition.guard is None:
        return
    try:
        ok = transition.guard(inst, call.payload, call.actor)
    except GuardRejected as exc:
        raise exc.bind(inst.id, call.event, inst.state, inst.version) from None
    if not ok:
        raise GuardRejected(
            f"guard of {call.event!r} returned {ok!r}",
            instance_id=inst.id,
            event=call.event,
            state=inst.state,
            version=inst.version,
        )


def _apply_effect(
    transition: Transition, inst: Instance, call: Call
) -> tuple[str, Mapping[str, Any]]:
    """The target state and the new data: the transition's default target and the instance's
    data, or what its effect returned (checked: a mapping, or a Step to a declared target)."""
    if transition.effect is None:
        return transition.target, inst.data
    try:
        result = transition.effect(inst, call.payload, call.actor)
    except GuardRejected as exc:
        raise exc.bind(inst.id, call.event, inst.state, inst.version) from None
    target = transition.target
    if isinstance(result, Step):
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
    return target, result


def decide(
    workflows: Mapping[str, Workflow], snap: Snapshot, call: Call
) -> HistoryEntry | Idempotent:
    """The history entry to append for ``call`` on ``snap``, or the idempotent answer.

    Raises VersionMismatch, UnknownWorkflow, UnknownEvent, TransitionNotAllowed, GuardRejected.
    """
    inst = snap.instance
    if snap.prior is not None:
        # Why first: a repeated request answers what the first one did, even if the
        # workflow has moved (or cycled) since; request_id is the caller's idempotency key.
        return Idempotent(_from_entry(inst, snap.prior))
    if call.expected_version is not None and call.expected_version != inst.version:
        raise VersionMismatch(inst.id, call.expected_version, inst.version, inst.state)
    wf = workflows.get(inst.workflow)
    if wf is None:
        raise UnknownWorkflow(inst.workflow, tuple(workflows))
    transition = wf.transitions.get(call.event)
    if transition is None:
        raise UnknownEvent(wf.name, call.event, tuple(wf.transitions))

    if inst.state not in transition.sources:
        # The two-admins rule: the same event already brought the instance where this call
        # wanted it, so the caller's intent holds. Anything else is a real refusal.
        if inst.last_event == call.event and inst.state in transition.targets:
            return Idempotent(inst)
        raise TransitionNotAllowed(
            inst.id, call.event, inst.state, wf.allowed(inst.state), inst.version
        )

    _check_guard(transition, inst, call)
    target, data = _apply_effect(transition, inst, call)

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
    )
