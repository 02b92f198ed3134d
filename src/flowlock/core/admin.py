"""Repairs as transitions: what `engine.force`, `pause` and `resume` write, with no I/O.

Each repair is a history row of a reserved event, decided by the same pure step as `fire` and
written by the same compare-and-swap, so every strategy, the request-id replay and the timers
hold for it as for any transition. The operations guide says how an operator uses them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal

from flowlock.core.definition import Workflow
from flowlock.core.errors import FlowlockError, InvalidInput
from flowlock.core.models import (
    FORCE_EVENT,
    PAUSE_EVENT,
    RESERVED_EVENTS,
    RESUME_EVENT,
    HistoryEntry,
    Instance,
)
from flowlock.core.settings import check_text

if TYPE_CHECKING:
    from flowlock.core.step import Call

__all__ = [
    "FORCE_EVENT",
    "MAX_REASON",
    "PAUSE_EVENT",
    "RESERVED_EVENTS",
    "RESUME_EVENT",
    "InstancePaused",
    "UnknownState",
    "WorkflowPause",
    "check_reason",
    "decide_repair",
    "refuse_paused",
    "repair_payload",
]

MAX_REASON = 2000
"""The longest reason an operator may give, in characters."""


class InstancePaused(FlowlockError):
    """The instance, or its whole workflow, is paused by an operator: `fire` is refused and
    nothing was written. Retry once it is resumed (`engine.resume`); `force` still works.

    `scope` is "instance" (its own pause) or "workflow" (its workflow's); `reason` the pause's
    reason when the engine knew it, else None (`engine.history` and `engine.workflow_pauses`
    tell it)."""

    def __init__(
        self,
        instance_id: str,
        workflow: str,
        scope: Literal["instance", "workflow"],
        reason: str | None,
        version: int,
    ) -> None:
        self.instance_id = instance_id
        self.workflow = workflow
        self.scope = scope
        self.reason = reason
        self.version = version
        why = f" ({reason})" if reason else ""
        if scope == "instance":
            what = f"instance {instance_id!r} (version {version}) is paused{why}: it"
        else:
            what = (
                f"workflow {workflow!r} is paused{why}: its instance {instance_id!r} "
                f"(version {version})"
            )
        super().__init__(
            f"{what} takes no events; nothing was written. Fire again once it is resumed "
            f"(engine.resume({'instance_id' if scope == 'instance' else 'workflow'}=...))"
        )


class UnknownState(InvalidInput):
    """The workflow has no state of that name; nothing was written."""

    def __init__(self, workflow: str, state: str, known: tuple[str, ...]) -> None:
        self.workflow = workflow
        self.state = state
        self.known = known
        super().__init__(
            f"workflow {workflow!r} has no state {state!r}; its states are: "
            f"{', '.join(known)}. Nothing was written"
        )


@dataclass(frozen=True, slots=True)
class WorkflowPause:
    """A whole workflow paused by an operator: one row, however many instances it has.

    `at` is when it was paused, on the database's clock."""

    workflow: str
    reason: str
    actor: str | None
    at: datetime


def check_reason(reason: object, *, required: bool = True) -> str | None:
    """An operator's reason: non-empty text (not only spaces) of at most MAX_REASON
    characters; None only when not `required`."""
    if reason is None and not required:
        return None
    text = check_text("reason", reason, most=MAX_REASON)
    if not text.strip():
        raise InvalidInput("reason must say why, not be blank; nothing was read or written")
    return text


def refuse_paused(inst: Instance) -> InstancePaused:
    """The error for a `fire` at `inst` while it (or its workflow) is paused."""
    scope: Literal["instance", "workflow"] = "instance" if inst.paused else "workflow"
    return InstancePaused(inst.id, inst.workflow, scope, None, inst.version)


def decide_repair(wf: Workflow | None, inst: Instance, call: Call) -> HistoryEntry | None:
    """The history entry of a repair `call` on `inst`, or None when there is nothing to write
    (pausing a paused instance, resuming one that is not). UnknownState for a force to a state
    `wf` does not have. The call's payload was built by the engine (see `repair_payload`).

    `wf` is None when the engine has not registered the instance's workflow: pause and resume
    keep the state and data, so they need no definition (an operator's engine pauses any
    instance); a force does (the caller refuses it first)."""
    assert call.event in RESERVED_EVENTS
    payload = call.payload
    data: Mapping[str, Any] = inst.data
    target = inst.state
    if call.event == FORCE_EVENT:
        assert wf is not None  # the step refuses a force without the definition
        target = str(payload.get("state"))
        if target not in wf.states:
            raise UnknownState(wf.name, target, wf.states)
        given = payload.get("data")
        if isinstance(given, Mapping):
            data = given
    elif (call.event == PAUSE_EVENT) == inst.paused:
        return None  # already as asked: idempotent, nothing written
    moves = target != inst.state
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
        payload=payload,
        # A forced move begins a new stay as any transition does: the old stay's timers are
        # void, the new state's armed. Pending outbox messages stay: they belong to commits.
        arm=wf.timers(target) if moves and wf is not None else (),
        voids=moves and wf is not None and wf.has_timers,
    )


def repair_payload(
    event: str, reason: str | None, state: str | None = None, data: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The payload a repair row keeps: the reason, and for a force the state and the data."""
    payload: dict[str, Any] = {} if reason is None else {"reason": reason}
    if event == FORCE_EVENT:
        payload["state"] = state
        if data is not None:
            payload["data"] = data
    return payload
