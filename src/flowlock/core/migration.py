"""Migration of instances to another definition version, with no I/O: the `migrated` row,
the report, and the refusal when an instance would be stranded.

A migration is a repair like a force: a history row of a reserved event (MIGRATE_EVENT),
decided by the pure step on the very read its compare-and-swap writes over. The row moves the
instance to the state the migration maps its state to, sets its data, and stamps the target
version on the instance. From then on the instance runs the target version. The engine's
`migrate` (flowlock.admin.migrate) walks the instances; docs/migration.md is the guide.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from flowlock.core.errors import InvalidInput, StepFailed, UnknownWorkflow
from flowlock.core.jsondata import check_object
from flowlock.core.models import MIGRATE_EVENT, HistoryEntry, Instance
from flowlock.core.versions import Registry

if TYPE_CHECKING:
    from flowlock.core.definition import Workflow
    from flowlock.core.step import Call

__all__ = [
    "MIGRATE_EVENT",
    "DataFn",
    "MigrationMove",
    "MigrationRefused",
    "MigrationReport",
    "MigrationSelection",
    "decide_migration",
    "mapped_state",
    "migration_payload",
    "migration_target",
]

DataFn = Callable[[Instance], Mapping[str, Any]]
"""A migration's data function: the instance as read, to the data it has once migrated."""

_SHOWN: Final = 20  # stranded states named in a refusal's message; the field holds them all


class MigrationRefused(InvalidInput):
    """A migration would leave instances in states the target version lacks; nothing was
    written. Map each such state to a state of the target version (`state_map=`, or
    `--map OLD=NEW`) and run it again.

    `stranded` maps each such state to how many selected instances are in it (a run refuses
    a single instance that moved into one meanwhile with a count of 1). `states` are the
    target version's states."""

    def __init__(
        self,
        workflow: str,
        to_version: int,
        stranded: Mapping[str, int],
        states: tuple[str, ...],
        *,
        instance_id: str | None = None,
    ) -> None:
        self.workflow = workflow
        self.to_version = to_version
        self.stranded = dict(stranded)
        self.states = states
        self.instance_id = instance_id
        named = sorted(self.stranded.items(), key=lambda kv: (-kv[1], kv[0]))
        listed = ", ".join(f"{state!r} ({n})" for state, n in named[:_SHOWN])
        if len(named) > _SHOWN:
            listed += f" and {len(named) - _SHOWN} more"
        who = (
            f"instance {instance_id!r} is in a state"
            if instance_id is not None
            else "instances are in states"
        )
        super().__init__(
            f"cannot migrate workflow {workflow!r} to version {to_version}: {who} that version "
            f"lacks, and the state map does not map: {listed}. Version {to_version} has the "
            f"states {', '.join(states)}. Nothing was written; map each of them "
            "(state_map={'old': 'new'}, or --map OLD=NEW) and run again"
        )


@dataclass(frozen=True, slots=True)
class MigrationMove:
    """How many selected instances go from `from_state` (under `from_version`, None for an
    instance from before versions) to `to_state`."""

    from_version: int | None
    from_state: str
    to_state: str
    count: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "from_version": self.from_version,
            "from_state": self.from_state,
            "to_state": self.to_state,
            "count": self.count,
        }


@dataclass(frozen=True)
class MigrationReport:
    """What [`Engine.migrate`][flowlock.Engine.migrate] did, or with `dry_run`, would do.

    - `workflow`, `to_version`, `operation_id`: the run (each instance's request id is
      `bulk:<operation_id>:<instance_id>`: run again under it to finish an interrupted run).
    - `matched`: selected instances not on `to_version` when the run began.
    - `already`: selected instances found on `to_version` already, left alone.
    - `moves`: the matched instances counted by (from version, from state -> to state).
    - `stranded`: state -> count of instances whose state maps to none of the target
      version's (a dry run says it; a run refuses before writing with MigrationRefused).
    - `applied`: instances this run migrated; `replayed`: migrated earlier under this
      operation id; `skipped`: moved out of the selection (or onto `to_version`) meanwhile.
    - `failed`: instance id -> the typed error that refused it; `stopped`: why the run ended
      early (`max_failures`), else None.
    - `sample`: the first selected instances, as read before the run.
    - `seconds`: how long the run (or the dry run's read) took.
    """

    workflow: str
    to_version: int
    operation_id: str
    dry_run: bool
    matched: int
    already: int = 0
    moves: tuple[MigrationMove, ...] = ()
    stranded: Mapping[str, int] = field(default_factory=dict)
    applied: int = 0
    skipped: int = 0
    replayed: int = 0
    failed: Mapping[str, str] = field(default_factory=dict)
    stopped: str | None = None
    sample: tuple[Instance, ...] = ()
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Nothing failed, nothing is stranded, and the run was not stopped."""
        return not self.failed and not self.stranded and self.stopped is None

    @property
    def rate(self) -> float:
        """Instances migrated per second (0 for a dry run)."""
        return self.applied / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        """Every field but the sample, as JSON-ready values."""
        return {
            "workflow": self.workflow,
            "to_version": self.to_version,
            "operation_id": self.operation_id,
            "dry_run": self.dry_run,
            "matched": self.matched,
            "already": self.already,
            "moves": [m.to_dict() for m in self.moves],
            "stranded": dict(self.stranded),
            "applied": self.applied,
            "skipped": self.skipped,
            "replayed": self.replayed,
            "failed": dict(self.failed),
            "stopped": self.stopped,
            "seconds": round(self.seconds, 3),
        }


def migration_payload(to_version: int, state_map: Mapping[str, str]) -> dict[str, Any]:
    """The payload of a `migrated` row: the target version and the state map (only the states
    it renames). The same for every instance of a run, so a retry under the same request id
    replays the first answer."""
    return {"to_version": to_version, "state_map": {k: state_map[k] for k in sorted(state_map)}}


def migration_target(payload: Mapping[str, Any]) -> int:
    """The target version a migration call's payload names."""
    version = payload.get("to_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise InvalidInput(f"a migration's payload names no target version: {dict(payload)!r}")
    return version


def mapped_state(payload: Mapping[str, Any], state: str) -> str:
    """Where a migration with `payload` takes an instance in `state` (unmapped: same name)."""
    renames = payload.get("state_map")
    if isinstance(renames, Mapping):
        target = renames.get(state, state)
        return target if isinstance(target, str) else state
    return state


@dataclass(frozen=True, slots=True)
class MigrationSelection:
    """A migration's selection and data function, handed to the step as the call's `where`:
    both apply to the very read the `migrated` row is decided on, so an instance that moved
    since its page was read is judged, and its data computed, as it is now."""

    matches: Callable[[Instance], bool]
    data: DataFn | None = None

    def __call__(self, inst: Instance) -> bool:
        return self.matches(inst)


def decide_migration(
    workflows: Mapping[str, Workflow], inst: Instance, call: Call, limit: int
) -> HistoryEntry | None:
    """The `migrated` row of `call` on `inst`, or None when `inst` runs the target version
    already (nothing to write).

    DefinitionMismatch when `workflows` lacks the target version; MigrationRefused when the
    instance's state maps to a state the target version lacks (it moved there after the
    run's check); StepFailed when the data function raises; InvalidInput when it returns no
    JSON object within `limit` bytes."""
    version = migration_target(call.payload)
    if inst.definition_version == version:
        return None
    if isinstance(workflows, Registry):
        target = workflows.pinned(inst.workflow, version, instance_id=inst.id)
    else:
        target = workflows.get(inst.workflow)
    if target is None:
        raise UnknownWorkflow(inst.workflow, tuple(workflows))
    state = mapped_state(call.payload, inst.state)
    if state not in target.states:
        raise MigrationRefused(
            target.name, version, {inst.state: 1}, tuple(target.states), instance_id=inst.id
        )
    new: Mapping[str, Any] = inst.data
    selection = call.where
    if isinstance(selection, MigrationSelection) and selection.data is not None:
        new = check_object(_run_data(selection.data, target, inst), _what(inst), limit)
    moves = state != inst.state
    return HistoryEntry(
        instance_id=inst.id,
        version=inst.version + 1,
        event=MIGRATE_EVENT,
        from_state=inst.state,
        to_state=state,
        actor=call.actor,
        request_id=call.request_id,
        strategy=call.strategy,
        data=new,
        payload=call.payload,
        definition_version=version,
        # A move begins a new stay under the target version: the old stay's timers are void,
        # the new state's armed (as a force does). A kept state keeps its stay and timers.
        arm=target.timers(state) if moves else (),
        voids=moves,
    )


def _run_data(data: DataFn, target: Workflow, inst: Instance) -> Any:
    try:
        result = data(inst)
    except InvalidInput:
        raise
    except Exception as exc:
        raise StepFailed(
            workflow=target.name,
            event=MIGRATE_EVENT,
            instance_id=inst.id,
            step="data function",
            state=inst.state,
            version=inst.version,
            error=exc,
        ) from exc
    if inspect.isawaitable(result):
        close = getattr(result, "close", None)
        if callable(close):
            close()  # never awaited on purpose, as the step does with an async guard
        raise InvalidInput(
            f"the migration's data function returned {type(result).__name__}, an awaitable, "
            f"for instance {inst.id!r}; it must be a plain function returning the new data. "
            "Nothing was written"
        )
    return result


def _what(inst: Instance) -> str:
    return f"the data the migration's data function returned for instance {inst.id!r}"
