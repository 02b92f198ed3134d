"""Replaying recorded histories through a new definition, with no I/O.

Steps are pure, so a history row can be decided again: the instance as the rows before it
left it, the row's event, payload and actor, the NEW definition. Where the answer differs from
what was recorded, a deploy of that definition would change behaviour for live instances.

Each row is replayed from the instance as RECORDED before it, not as the replay left it: one
changed transition is reported once, at its row, instead of making every later row diverge.
Operator rows (events starting with "flowlock:": force, pause, resume, migrate) are taken as
recorded, never replayed: they follow no definition.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

from flowlock.core.definition import Workflow
from flowlock.core.errors import (
    FlowlockError,
    GuardRejected,
    InvalidInput,
    StepFailed,
    TransitionRefused,
    UnknownEvent,
)
from flowlock.core.jsondata import DEFAULT_MAX_PAYLOAD, same_json
from flowlock.core.models import TIMER_PREFIX, HistoryEntry, Instance, TimerFiring
from flowlock.core.payloads import InvalidPayload
from flowlock.core.step import Call, Idempotent, _decide

__all__ = [
    "KINDS",
    "OPERATOR_PREFIX",
    "Divergence",
    "DivergenceKind",
    "ReplayReport",
    "Replayed",
    "replay",
]

DivergenceKind: TypeAlias = Literal["refused", "guard", "target", "data", "state", "event"]
KINDS: tuple[DivergenceKind, ...] = ("refused", "guard", "target", "data", "state", "event")
"""Every kind of divergence, in the order a summary lists them."""

OPERATOR_PREFIX = "flowlock:"
"""How the events of operator rows start; replay takes their result as recorded."""


@dataclass(frozen=True, slots=True)
class Divergence:
    """One place where the new definition would not do what the history recorded.

    - `instance_id`, `version`: the history row (the instance's version after it); for a
      "state" divergence of the current state, the instance's current version.
    - `event`: the row's event (None for the current state).
    - `kind`: "refused" (an applied transition the new definition refuses), "guard" (its
      guard now rejects, or raises), "target" (another target state), "data" (other data),
      "state" (a state the new definition lacks), "event" (an event it lacks).
    - `expected`: what the history recorded (a state, or the data); `found`: what the new
      definition gives (None when it applies nothing).
    - `detail`: a sentence for people, with the error's text when a step raised.
    """

    instance_id: str
    version: int
    event: str | None
    kind: DivergenceKind
    expected: Any
    found: Any
    detail: str

    def as_json(self) -> dict[str, Any]:
        """The divergence as a JSON object (`flowlock check-definition --json`)."""
        return {
            "instance_id": self.instance_id,
            "version": self.version,
            "event": self.event,
            "kind": self.kind,
            "expected": self.expected,
            "found": self.found,
            "detail": self.detail,
        }


@dataclass(frozen=True, slots=True)
class ReplayReport:
    """What [`engine.check_definition`][flowlock.Engine.check_definition] found.

    - `checked_instances`: instances whose histories were read.
    - `checked_transitions`: history rows replayed through the new definition.
    - `divergences`: every difference found, by instance id then version.
    - `seconds`: how long the check took.
    - `unreplayed_first`: instances created before flowlock stored creation data, whose first
      transition could not be replayed (later ones were).
    - `operator_rows`: rows of operator repairs (force, pause, resume, migrate), taken as
      recorded.
    """

    workflow: str
    checked_instances: int
    checked_transitions: int
    divergences: tuple[Divergence, ...]
    seconds: float
    unreplayed_first: int = 0
    operator_rows: int = 0

    @property
    def ok(self) -> bool:
        """True when no divergence was found: the new definition replays every history."""
        return not self.divergences

    def counts(self) -> dict[str, int]:
        """How many divergences of each kind (every kind present, 0 when none)."""
        found: dict[str, int] = dict.fromkeys(KINDS, 0)
        for d in self.divergences:
            found[d.kind] += 1
        return found

    def as_json(self) -> dict[str, Any]:
        """The report as a JSON object (`flowlock check-definition --json`)."""
        return {
            "workflow": self.workflow,
            "ok": self.ok,
            "checked_instances": self.checked_instances,
            "checked_transitions": self.checked_transitions,
            "unreplayed_first": self.unreplayed_first,
            "operator_rows": self.operator_rows,
            "seconds": self.seconds,
            "counts": self.counts(),
            "divergences": [d.as_json() for d in self.divergences],
        }


@dataclass(frozen=True, slots=True)
class Replayed:
    """One instance's replay: its divergences and what was replayed or taken as recorded."""

    divergences: tuple[Divergence, ...]
    transitions: int
    unreplayed_first: bool
    operator_rows: int


def replay(
    workflow: Workflow,
    instance: Instance,
    initial_data: Mapping[str, Any] | None,
    history: Sequence[HistoryEntry],
    *,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD,
) -> Replayed:
    """Replay `history` (the instance's rows, oldest first) through `workflow`.

    `initial_data`: the instance's data at creation; None for an instance created before it
    was stored, whose first row is then taken as recorded (`unreplayed_first`). Never raises
    for what a step does: a guard or effect that raises is a divergence with its error's text.
    """
    workflows = {workflow.name: workflow}
    found: list[Divergence] = []
    if instance.state not in workflow.states:
        found.append(
            Divergence(
                instance.id,
                instance.version,
                None,
                "state",
                instance.state,
                None,
                f"the instance is in state {instance.state!r}, which the new definition lacks",
            )
        )
    before: Mapping[str, Any] | None = initial_data
    last_event: str | None = None
    stay = 1
    transitions = operator_rows = 0
    unreplayed = False
    for row in sorted(history, key=lambda r: r.version):
        if row.event.startswith(OPERATOR_PREFIX):
            operator_rows += 1
        elif before is None:
            unreplayed = True  # only the first row: every later one has its row before it
        else:
            transitions += 1
            pre = Instance(
                id=instance.id,
                workflow=workflow.name,
                state=row.from_state,
                version=row.version - 1,
                data=before,
                last_event=last_event,
                stay_version=stay,
            )
            found.extend(_replay_row(workflows, workflow, pre, row, max_payload_bytes))
        before, last_event = row.data, row.event
        if row.from_state != row.to_state:
            stay = row.version  # a new stay begins, as the stores count it
    return Replayed(tuple(found), transitions, unreplayed, operator_rows)


def _timer_of(row: HistoryEntry) -> TimerFiring | None:
    """The timer firing a row's request id names (`timer:<stay>:<event>:<n>`), if any."""
    rid = row.request_id
    if rid is None or not rid.startswith(TIMER_PREFIX):
        return None
    stay, _, rest = rid[len(TIMER_PREFIX) :].partition(":")
    event, _, n = rest.rpartition(":")
    if not (stay.isdigit() and n.isdigit() and event):
        return None
    return TimerFiring(int(stay), event, int(n))


def _replay_row(
    workflows: Mapping[str, Workflow],
    workflow: Workflow,
    pre: Instance,
    row: HistoryEntry,
    limit: int,
) -> list[Divergence]:
    """The divergences of one recorded row, replayed on `pre` (the instance before it)."""

    def diverged(kind: DivergenceKind, found: Any, detail: str) -> list[Divergence]:
        expected = row.data if kind == "data" else row.to_state
        return [Divergence(pre.id, row.version, row.event, kind, expected, found, detail)]

    if row.from_state not in workflow.states:
        return diverged(
            "state",
            None,
            f"event {row.event!r} left state {row.from_state!r}, which the new definition lacks",
        )
    call = Call(
        instance_id=pre.id,
        event=row.event,
        payload=row.payload,
        actor=row.actor,
        request_id=row.request_id,
        expected_version=None,
        strategy=row.strategy,
        timer=_timer_of(row),
    )
    try:
        decided = _decide(workflows, pre, None, call, limit)
    except UnknownEvent:
        return diverged("event", None, f"the new definition has no event {row.event!r}")
    except GuardRejected as exc:
        return diverged("guard", None, f"the guard now rejects it: {exc}")
    except StepFailed as exc:
        kind: DivergenceKind = "guard" if exc.step == "guard" else "refused"
        return diverged(kind, None, f"the {exc.step} raised: {exc.__cause__!r}")
    except TransitionRefused as exc:
        return diverged("refused", None, f"the new definition refuses it: {exc}")
    except InvalidPayload as exc:
        return diverged("refused", None, f"the new payload schema refuses it: {exc}")
    except InvalidInput as exc:
        return diverged("data", None, f"the effect's data is refused: {exc}")
    except FlowlockError as exc:
        return diverged("refused", None, f"the new definition refuses it: {exc}")
    except Exception as exc:  # a replay reports, it never crashes on a step's bug
        return diverged("refused", None, f"replaying it raised {exc!r}")
    if isinstance(decided, Idempotent):
        return diverged(
            "refused",
            None,
            f"the new definition would not apply it: state {pre.state!r} is no source of "
            f"{row.event!r} (it answers the call as already applied)",
        )
    out: list[Divergence] = []
    if decided.to_state != row.to_state:
        out += diverged(
            "target", decided.to_state, f"it now goes to {decided.to_state!r}, not {row.to_state!r}"
        )
    if not same_json(decided.data, row.data):
        out += diverged("data", dict(decided.data), "the effect now returns other data")
    return out
