"""`engine.migrate`: move a workflow's instances to another definition version while the
application runs (a mixin of `flowlock.Engine`).

A run first reads the whole selection, counting it by (definition version, state): a state
that maps to none of the target version's states refuses the run before anything is written
(the dry run stops after this read and reports it). It then walks the selection as a bulk run
does (flowlock.admin.bulk: keyset pages, a few calls at once, the request id
`bulk:<operation_id>:<instance_id>`), firing one `migrated` row at each instance through the
engine's compare-and-swap. The selection and the data function apply to the read each row is
decided on, so live traffic is no hazard and a rerun resumes. docs/migration.md is the guide.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, replace
from typing import Protocol, cast

from flowlock._calls import check_text
from flowlock.admin.bulk import (
    DEFAULT_MAX_FAILURES,
    MAX_CONCURRENCY,
    MAX_SAMPLE,
    Firer,
    Lister,
    Result,
    Tally,
    classify,
    walk,
)
from flowlock.core.bulk import bulk_request_id, check_operation_id, derive_operation_id
from flowlock.core.definition import Workflow
from flowlock.core.errors import DefinitionMismatch, InvalidInput, UnknownWorkflow
from flowlock.core.migration import (
    MIGRATE_EVENT,
    DataFn,
    MigrationMove,
    MigrationRefused,
    MigrationReport,
    MigrationSelection,
    migration_payload,
)
from flowlock.core.models import Instance, InstanceQuery, Outcome
from flowlock.core.query import MAX_LIMIT, instance_query
from flowlock.core.settings import check_count, check_flag
from flowlock.core.versions import Registry

__all__ = ["MigrateMethods"]

log = logging.getLogger("flowlock")


@dataclass(frozen=True)
class _Plan:
    """A migration's arguments, checked."""

    workflow: str
    to_version: int
    target: Workflow
    renames: Mapping[str, str]
    query: InstanceQuery
    where: Callable[[Instance], bool] | None
    data: DataFn | None
    operation_id: str
    actor: str | None

    def wanted(self, inst: Instance) -> bool:
        """The caller's `where`, its failure a typed error (nothing written for it)."""
        if self.where is None:
            return True
        try:
            return bool(self.where(inst))
        except Exception as exc:
            raise InvalidInput(
                f"the migration's where= raised {type(exc).__name__}: {exc} on instance "
                f"{inst.id!r}; nothing was written for it. Fix the function"
            ) from exc

    def selects(self, inst: Instance) -> bool:
        """Whether the run migrates `inst` as it is now: in the selection, not on the target."""
        return (
            self.query.matches(inst)
            and inst.definition_version != self.to_version
            and self.wanted(inst)
        )

    def moved_to(self, state: str) -> str:
        return self.renames.get(state, state)


@dataclass
class _Survey:
    """The selection as the run's first read found it."""

    counts: Counter[tuple[int | None, str]]
    already: int
    sample: list[Instance]

    def moves(self, plan: _Plan) -> tuple[MigrationMove, ...]:
        ordered = sorted(self.counts.items(), key=lambda kv: (kv[0][0] or 0, kv[0][1]))
        return tuple(
            MigrationMove(version, state, plan.moved_to(state), n)
            for (version, state), n in ordered
        )

    def stranded(self, plan: _Plan) -> dict[str, int]:
        found: Counter[str] = Counter()
        for (_, state), n in self.counts.items():
            if plan.moved_to(state) not in plan.target.states:
                found[state] += n
        return dict(sorted(found.items()))


def _name(fn: object) -> str | None:
    """A function as the derived operation id sees it: the same in every process."""
    if fn is None:
        return None
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"


class MigrateMethods:
    """`flowlock.Engine.migrate`; the engine is `self`."""

    _workflows: Registry

    def _check_open(self) -> None: ...  # the engine's

    async def migrate(
        self,
        workflow: str,
        to_version: int,
        *,
        state_map: Mapping[str, str] | None = None,
        data: DataFn | None = None,
        where: Callable[[Instance], bool] | None = None,
        state: str | Collection[str] | None = None,
        dry_run: bool = False,
        batch: int = 500,
        operation_id: str | None = None,
        actor: str | None = None,
        concurrency: int = 16,
        sample: int = 10,
        max_failures: int | None = DEFAULT_MAX_FAILURES,
        progress: Callable[[int], None] | None = None,
    ) -> MigrationReport:
        """Move the instances of `workflow` to definition version `to_version`, one `migrated`
        history row each; a [`MigrationReport`][flowlock.MigrationReport] says what was done.

        `to_version` must be registered in this engine (DefinitionMismatch otherwise). Each
        instance goes to the state `state_map` maps its state to (a state it does not name
        keeps its name), with the data `data(instance)` returns (None: kept), and runs
        `to_version` from then on. `state` (one or a list) and `where(instance)` narrow the
        selection; instances on `to_version` already are left alone.

        Before anything is written the run reads the whole selection and counts it by
        (version, state): MigrationRefused, listing each state and its count, when a state
        maps to none of `to_version`'s states. `dry_run` stops after that read and reports
        the counts, a sample and what would be stranded. Otherwise it walks the selection in
        pages of `batch`, making up to `concurrency` calls at once under the request id
        `bulk:<operation_id>:<instance_id>` (`operation_id` defaults to one derived from the
        arguments, so the same call run again after a crash resumes). The selection, the map
        and `data` apply to the read each row is decided on: live fires never race it. `data`
        and `where` must be pure functions of the instance; they may run more than once.
        `max_failures` and `progress` are `bulk`'s.

        InvalidInput (UnknownWorkflow, DefinitionMismatch) before anything is read, for a bad
        argument."""
        started = time.perf_counter()
        self._check_open()
        plan = self._migration_plan(
            workflow, to_version, state_map, data, where, state, operation_id, actor
        )
        check_flag("dry_run", dry_run)
        check_count("batch", batch, most=MAX_LIMIT, unit="instances")
        check_count("concurrency", concurrency, most=MAX_CONCURRENCY, unit="calls")
        check_count("sample", sample, least=0, most=MAX_SAMPLE, unit="instances")
        if max_failures is not None:
            check_count("max_failures", max_failures, most=10**9, unit="failures")
        if progress is not None and not callable(progress):
            raise InvalidInput(
                f"progress must be a callable progress(done) or None, not {progress!r}"
            )
        engine = cast(_Engine, self)  # the engine's list, get and _fire
        survey = await _survey(engine, plan, batch, sample)
        stranded = survey.stranded(plan)
        matched = sum(survey.counts.values())
        report = MigrationReport(
            plan.workflow, plan.to_version, plan.operation_id, dry_run, matched,
            already=survey.already, moves=survey.moves(plan), stranded=stranded,
            sample=tuple(survey.sample),
        )  # fmt: skip
        if dry_run:
            return _timed(report, started)
        if stranded:
            raise MigrationRefused(
                plan.workflow, plan.to_version, stranded, tuple(plan.target.states)
            )
        log.info(
            "flowlock migrate %s to version %d (%s): %d instance(s) to migrate",
            plan.workflow, plan.to_version, plan.operation_id, matched,
        )  # fmt: skip
        tally = Tally()
        payload = migration_payload(plan.to_version, plan.renames)
        selection = MigrationSelection(plan.selects, plan.data)

        async def fire(inst: Instance) -> Outcome:
            rid = bulk_request_id(plan.operation_id, inst.id)
            args = (plan.actor, rid, None, payload, None, None, None)
            done = await engine._fire(inst.id, MIGRATE_EVENT, *args, repair=True, where=selection)
            if done.replayed and (await engine.get(inst.id)).definition_version != to_version:
                raise _left(inst.id, plan)
            return done

        def one(inst: Instance) -> Awaitable[Result | None]:
            if not plan.selects(inst):
                return _nothing()  # on the target already, or not wanted: not in the run
            return classify(fire(inst))

        await walk(engine, plan.query, one, tally, batch, concurrency, max_failures, progress)
        done = MigrationReport(
            plan.workflow, plan.to_version, plan.operation_id, False, matched,
            already=survey.already, moves=report.moves, applied=tally.applied,
            skipped=tally.skipped, replayed=tally.replayed, failed=dict(tally.failed),
            stopped=tally.stopped, sample=report.sample,
        )  # fmt: skip
        done = _timed(done, started)
        log.info(
            "flowlock migrate %s to version %d (%s): %d migrated, %d skipped, %d replayed, "
            "%d failed in %.1f s%s",
            plan.workflow, plan.to_version, plan.operation_id, done.applied, done.skipped,
            done.replayed, len(done.failed), done.seconds,
            f" ({done.stopped})" if done.stopped else "",
        )  # fmt: skip
        return done

    def _migration_plan(
        self,
        workflow: str,
        to_version: int,
        state_map: Mapping[str, str] | None,
        data: DataFn | None,
        where: Callable[[Instance], bool] | None,
        states: str | Collection[str] | None,
        operation_id: str | None,
        actor: str | None,
    ) -> _Plan:
        """The run's arguments checked, before anything is read."""
        check_text(workflow, "workflow")
        check_count("to_version", to_version, most=2**31 - 1)
        try:
            target = self._workflows.pinned(workflow, to_version)
        except DefinitionMismatch as exc:
            raise _unregistered(exc) from None
        if target is None:
            raise UnknownWorkflow(workflow, tuple(self._workflows))
        renames = _renames(state_map, target, to_version)
        for name, fn in (("data", data), ("where", where)):
            if fn is not None and not callable(fn):
                raise InvalidInput(
                    f"{name} must be a function of the instance, or None, not {fn!r}; "
                    "nothing was read or written"
                )
        if actor is not None:
            check_text(actor, "actor")
        query = instance_query(workflow, states, None, None)
        if operation_id is None:
            operation_id = derive_operation_id(
                "migrate",
                {"workflow": workflow, "to_version": to_version, "state_map": renames,
                 "states": query.states, "data": _name(data), "where": _name(where),
                 "actor": actor},
            )  # fmt: skip
        else:
            check_operation_id(operation_id)
        return _Plan(workflow, to_version, target, renames, query, where, data, operation_id, actor)


def _renames(
    state_map: Mapping[str, str] | None, target: Workflow, to_version: int
) -> dict[str, str]:
    """The state map checked: text to a state of the target version; identities dropped."""
    if state_map is None:
        return {}
    if not isinstance(state_map, Mapping):
        raise InvalidInput(
            f"state_map must map old state names to new ones, not {state_map!r}; nothing was "
            "read or written"
        )
    renames: dict[str, str] = {}
    for old, new in state_map.items():
        check_text(old, "a state_map key")
        check_text(new, "a state_map value")
        if new not in target.states:
            raise InvalidInput(
                f"state_map maps {old!r} to {new!r}, but version {to_version} of workflow "
                f"{target.name!r} has no state {new!r}; its states are "
                f"{', '.join(target.states)}. Nothing was read or written"
            )
        if old != new:
            renames[old] = new
    return renames


async def _survey(engine: Lister, plan: _Plan, batch: int, sample: int) -> _Survey:
    """Read the whole selection once, counting it by (version, state)."""
    survey = _Survey(Counter(), 0, [])
    q = plan.query
    cursor: str | None = None
    while True:
        page = await engine.list(q.workflow, q.states, None, None, batch, cursor)
        for inst in page:
            if not plan.wanted(inst):
                continue
            if inst.definition_version == plan.to_version:
                survey.already += 1
                continue
            survey.counts[(inst.definition_version, inst.state)] += 1
            if len(survey.sample) < sample:
                survey.sample.append(inst)
        cursor = page.next_cursor
        if cursor is None:
            return survey


def _unregistered(exc: DefinitionMismatch) -> DefinitionMismatch:
    """The target version is not registered here: said as a migration's refusal (no instance
    runs it yet, as the default message would say)."""
    has = list(exc.registered) or "none"
    return DefinitionMismatch(
        None, exc.workflow, exc.version, exc.registered,
        message=f"cannot migrate workflow {exc.workflow!r} to version {exc.version}: this "
        f"engine has not registered that version (it has {has}); nothing was read or written. "
        "Register the target version's Workflow in this engine (flowlock admin migrate: the "
        "--app module must name it), or migrate to a version it has",
    )  # fmt: skip


class _Engine(Firer, Protocol):
    """The engine calls a migration makes (the engine's own)."""

    async def get(self, instance_id: str) -> Instance: ...


def _left(instance_id: str, plan: _Plan) -> InvalidInput:
    """A replayed migration of an instance that has left the target version since (migrated
    back): its request id answers the first migration, so this run cannot move it again."""
    return InvalidInput(
        f"instance {instance_id!r} was migrated to version {plan.to_version} under operation "
        f"{plan.operation_id!r} before and has left that version since, so its request id "
        "replays that first migration; nothing was written for it. Run again under another "
        "operation id (operation_id=, or --operation-id)"
    )


async def _nothing() -> None:
    return None


def _timed(report: MigrationReport, started: float) -> MigrationReport:
    return replace(report, seconds=time.perf_counter() - started)
