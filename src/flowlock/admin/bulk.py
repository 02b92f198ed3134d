"""`engine.bulk`: force, pause, resume or fire every instance the `list` filters select, with
a dry run (a mixin of `flowlock.Engine`).

A run counts the selection and reads a sample first (a dry run stops there), then walks the
selection in keyset pages (a selection that shrinks as instances move is still walked once) and
makes one engine call per instance, a few at a time, under the request id
`bulk:<operation_id>:<instance_id>`: a rerun after a crash replays what was done and does the
rest. docs/operations.md ("Bulk operations") is the operator's guide.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final, Literal, Protocol, cast

from flowlock._calls import check_fire_args, check_text
from flowlock.core.admin import UnknownState, check_reason
from flowlock.core.bulk import (
    BULK_ACTIONS,
    BulkAction,
    BulkReport,
    bulk_request_id,
    check_operation_id,
    derive_operation_id,
)
from flowlock.core.errors import (
    FlowlockError,
    InstanceNotFound,
    InvalidInput,
    UnknownWorkflow,
)
from flowlock.core.jsondata import check_object
from flowlock.core.models import Instance, InstanceQuery, Outcome, Page
from flowlock.core.query import MAX_LIMIT, instance_query
from flowlock.core.settings import check_count, check_flag
from flowlock.core.step import NotSelected
from flowlock.core.versions import Registry

__all__ = [
    "DEFAULT_MAX_FAILURES",
    "MAX_CONCURRENCY",
    "MAX_SAMPLE",
    "BulkMethods",
    "Firer",
    "Lister",
    "Result",
    "Tally",
    "classify",
    "walk",
]

log = logging.getLogger("flowlock")

MAX_CONCURRENCY: Final = 256
"""The most engine calls one bulk run makes at once."""
MAX_SAMPLE: Final = MAX_LIMIT
"""The most instances a report's sample holds."""
DEFAULT_MAX_FAILURES: Final = 100
"""A run stops taking new instances after this many failures, unless `max_failures=`."""


class Lister(Protocol):
    """What a walk reads: the engine's `list`."""

    async def list(
        self, workflow: str | None, state: str | Collection[str] | None,
        updated_before: datetime | None, updated_after: datetime | None,
        limit: int, after: str | None,
    ) -> Page: ...  # fmt: skip


class Firer(Lister, Protocol):
    """What a walk reads and fires through: the engine's `list` and `_fire`."""

    async def _fire(
        self, instance_id: str, event: str, actor: str | None, request_id: str | None,
        expected_version: int | None, payload: Mapping[str, Any] | None, strategy: None,
        connection: None, timer: None, /, *, repair: bool = ...,
        where: Callable[[Instance], bool] | None,
    ) -> Outcome: ...  # fmt: skip


class _Engine(Firer, Protocol):
    """The engine calls a run makes (the engine's own; force, pause and resume are the repairs
    of flowlock.admin.repair)."""

    async def count(
        self, workflow: str | None, state: str | Collection[str] | None,
        updated_before: datetime | None, updated_after: datetime | None,
    ) -> int: ...  # fmt: skip

    async def get(self, instance_id: str) -> Instance: ...

    async def _force(
        self, instance_id: str, state: str, data: Mapping[str, Any] | None, reason: str,
        actor: str, expected_version: int | None, request_id: str | None, connection: None,
        where: Callable[[Instance], bool] | None,
    ) -> Outcome: ...  # fmt: skip

    async def pause(
        self, instance_id: str | None, *, reason: str, actor: str | None, request_id: str | None
    ) -> object: ...

    async def resume(
        self, instance_id: str | None, *, reason: str | None, actor: str | None,
        request_id: str | None,
    ) -> object: ...  # fmt: skip


@dataclass(frozen=True)
class _Plan:
    """A run's arguments, checked: what selects, and what is done to each instance."""

    action: BulkAction
    query: InstanceQuery
    operation_id: str
    state: str | None
    event: str | None
    payload: Mapping[str, Any] | None
    data: Mapping[str, Any] | None
    reason: str | None
    actor: str | None


Result = Literal["applied", "skipped", "replayed"]


@dataclass
class Tally:
    """What a run has done so far (touched on the run's event loop only)."""

    applied: int = 0
    skipped: int = 0
    replayed: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    stopped: str | None = None

    @property
    def done(self) -> int:
        return self.applied + self.skipped + self.replayed + len(self.failed)

    def count(self, result: Result) -> None:
        if result == "applied":
            self.applied += 1
        elif result == "replayed":
            self.replayed += 1
        else:
            self.skipped += 1

    def fail(self, instance_id: str, error: FlowlockError, max_failures: int | None) -> None:
        self.failed[instance_id] = f"{type(error).__name__}: {error}"
        if max_failures is not None and len(self.failed) >= max_failures:
            self.stopped = (
                f"stopped after {len(self.failed)} failures (max_failures); fix the cause and "
                "run again under the same operation id to do the rest"
            )


class BulkMethods:
    """`flowlock.Engine.bulk`; the engine is `self`."""

    _workflows: Registry
    _max_payload: int

    def _check_open(self) -> None: ...  # the engine's

    def _bulk_payload(
        self, workflow: str | None, event: str, body: Mapping[str, Any]
    ) -> None: ...  # PayloadChecks'

    async def bulk(
        self,
        action: BulkAction,
        *,
        workflow: str | None = None,
        states: str | Collection[str] | None = None,
        updated_before: datetime | None = None,
        updated_after: datetime | None = None,
        state: str | None = None,
        event: str | None = None,
        payload: Mapping[str, Any] | None = None,
        data: Mapping[str, Any] | None = None,
        reason: str | None = None,
        actor: str | None = None,
        operation_id: str | None = None,
        dry_run: bool = False,
        batch: int = 500,
        concurrency: int = 16,
        sample: int = 10,
        max_failures: int | None = DEFAULT_MAX_FAILURES,
        progress: Callable[[int], None] | None = None,
    ) -> BulkReport:
        """Force, pause, resume or fire every instance the filters select; a
        [`BulkReport`][flowlock.BulkReport] says what was done.

        The filters are `list`'s (`workflow`, `states`, `updated_before`, `updated_after`,
        checked the same way). `action` takes its own arguments: "force" `state` (the target),
        `reason`, `actor`, optional `data`; "pause" `reason`, optional `actor`; "resume" optional
        `reason` and `actor`; "fire" `event`, optional `payload` and `actor`. An argument the
        action does not take is refused.

        It counts the selection and reads the first `sample` instances; with `dry_run` it
        stops there and writes nothing. Otherwise it walks the selection in pages of `batch`
        (keyset on the id, so each instance is met once however the selection moves), making
        up to `concurrency` calls at once, each under the request id
        `bulk:<operation_id>:<instance_id>`. `operation_id` defaults to one derived from the
        arguments: the same call run again after a crash replays what was done (counted in
        `replayed`, not done again) and does the rest. So the same call made again later, to
        pause again what was resumed since, does nothing: give a new `operation_id` for that.
        Force and fire check the selection on the read their write is decided on: an instance
        that moved out of it since its page was read is skipped, one that still matches is done.
        A refused instance is recorded in `failed` and the run goes on; after `max_failures`
        failures (None: never) it stops taking new ones. `progress(n)` is called with the
        number of instances done so far after each one.

        InvalidInput (or UnknownWorkflow), before anything is read, for a bad argument; such
        as InvalidPayload for a payload the event's `payload=` schema refuses.
        """
        self._check_open()
        plan = self._bulk_plan(
            action, workflow, states, updated_before, updated_after, state, event, payload,
            data, reason, actor, operation_id,
        )  # fmt: skip
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
        engine = cast(_Engine, self)  # the engine's list, count, get and calls (see _Engine)
        q = plan.query
        filters = (q.workflow, q.states, q.updated_before, q.updated_after)
        matched = await engine.count(*filters)
        shown = (await engine.list(*filters, sample, None)).instances if sample else ()
        report = BulkReport(plan.operation_id, plan.action, dry_run, matched, sample=shown)
        if dry_run:
            return report
        log.info(
            "flowlock bulk %s %s: %d instance(s) match", plan.action, plan.operation_id, matched
        )
        tally = Tally()

        def one(inst: Instance) -> Awaitable[Result]:
            return _one(engine, plan, inst)

        await walk(engine, q, one, tally, batch, concurrency, max_failures, progress)
        log.info(
            "flowlock bulk %s %s: %d applied, %d skipped, %d replayed, %d failed%s",
            plan.action, plan.operation_id, tally.applied, tally.skipped, tally.replayed,
            len(tally.failed),
            f" ({tally.stopped})" if tally.stopped else "",
        )  # fmt: skip
        return BulkReport(
            plan.operation_id,
            plan.action,
            False,
            matched,
            tally.applied,
            tally.skipped,
            dict(tally.failed),
            shown,
            tally.stopped,
            tally.replayed,
        )

    def _bulk_plan(
        self,
        action: object,
        workflow: str | None,
        states: str | Collection[str] | None,
        updated_before: datetime | None,
        updated_after: datetime | None,
        state: str | None,
        event: str | None,
        payload: Mapping[str, Any] | None,
        data: Mapping[str, Any] | None,
        reason: str | None,
        actor: str | None,
        operation_id: str | None,
    ) -> _Plan:
        """The run's arguments checked, and its operation id (given or derived)."""
        if action not in BULK_ACTIONS:
            raise InvalidInput(
                f"bulk action must be one of {', '.join(BULK_ACTIONS)}, not {action!r}"
            )
        act = cast(BulkAction, action)
        query = instance_query(workflow, states, updated_before, updated_after)
        given = {"state": state, "event": event, "payload": payload, "data": data, "reason": reason}
        takes = _TAKES[act]
        stray = [name for name, value in given.items() if value is not None and name not in takes]
        if stray:
            raise InvalidInput(
                f"bulk {act} does not take {', '.join(stray)} (it takes "
                f"{', '.join(sorted(takes))}); nothing was read or written"
            )
        self._bulk_arguments(act, query, state, event, reason, actor)
        body = None if payload is None else check_object(payload, "payload", self._max_payload)
        if act == "fire":
            self._bulk_payload(query.workflow, str(event), {} if body is None else body)
        new = None if data is None else check_object(data, "data", self._max_payload)
        if operation_id is None:
            operation_id = derive_operation_id(
                act,
                {"workflow": query.workflow, "states": query.states,
                 "updated_before": query.updated_before, "updated_after": query.updated_after,
                 **given, "actor": actor},
            )  # fmt: skip
        else:
            check_operation_id(operation_id)
        return _Plan(act, query, operation_id, state, event, body, new, reason, actor)

    def _bulk_arguments(
        self,
        action: BulkAction,
        query: InstanceQuery,
        state: str | None,
        event: str | None,
        reason: str | None,
        actor: str | None,
    ) -> None:
        """What each action needs, checked as its engine call would check it."""
        if actor is not None:
            check_text(actor, "actor")
        if reason is not None:
            check_reason(reason)
        elif action in ("force", "pause"):
            raise InvalidInput(f"bulk {action} needs a reason (it is kept in each history row)")
        if action == "force":
            if actor is None:
                raise InvalidInput(
                    "bulk force needs an actor (who forces; kept in each history row)"
                )
            if state is None:
                raise InvalidInput("bulk force needs state=, the state to force each instance to")
            check_text(state, "state")
        if action == "fire":
            if event is None:
                raise InvalidInput("bulk fire needs event=, the event to fire at each instance")
            check_fire_args("bulk", event, actor, None, None)
        if query.workflow is not None and action in ("force", "fire"):
            wf = self._workflows.get(query.workflow)
            if wf is None:
                raise UnknownWorkflow(query.workflow, tuple(self._workflows))
            if action == "force" and state not in wf.states:
                raise UnknownState(wf.name, str(state), tuple(wf.states))


_TAKES: Final[Mapping[str, frozenset[str]]] = {
    "force": frozenset({"state", "data", "reason"}),
    "pause": frozenset({"reason"}),
    "resume": frozenset({"reason"}),
    "fire": frozenset({"event", "payload"}),
}


async def walk(
    engine: Lister,
    q: InstanceQuery,
    one: Callable[[Instance], Awaitable[Result | None]],
    tally: Tally,
    batch: int,
    concurrency: int,
    max_failures: int | None,
    progress: Callable[[int], None] | None,
) -> None:
    """Walk the instances `q` selects page by page; `concurrency` workers call `one` on each
    (None: not part of the run, neither counted nor reported to `progress`).

    The queue holds at most a page, so the walk reads ahead by one page and no more. Also
    the walk of a migration (flowlock.admin.migrate)."""
    queue: asyncio.Queue[Instance | None] = asyncio.Queue(maxsize=batch)

    async def pages() -> None:
        cursor: str | None = None
        while tally.stopped is None:
            page = await engine.list(
                q.workflow, q.states, q.updated_before, q.updated_after, batch, cursor
            )
            for inst in page:
                await queue.put(inst)
            cursor = page.next_cursor
            if cursor is None:
                break
        # Not in a finally: on a failure or a cancel the task group cancels the workers, and a
        # put into a full queue nobody takes from would never end.
        for _ in range(concurrency):
            await queue.put(None)

    async def work() -> None:
        while (inst := await queue.get()) is not None:
            if tally.stopped is not None:
                continue  # drain what the walk had queued: stopped means no new calls
            try:
                result = await one(inst)
                if result is None:
                    continue
                tally.count(result)
            except FlowlockError as exc:
                tally.fail(inst.id, exc, max_failures)
            if progress is not None:
                progress(tally.done)

    try:
        async with asyncio.TaskGroup() as group:
            group.create_task(pages())
            for _ in range(concurrency):
                group.create_task(work())
    except BaseExceptionGroup as failed:
        # One task failed (a page's read, a progress callback) and the others were cancelled:
        # the caller gets that error as it was raised (a StoreError, say), not a group of one.
        raise failed.exceptions[0] from None


async def _one(engine: _Engine, plan: _Plan, inst: Instance) -> Result:
    """One instance's call. Force and fire check the selection on the read their write is
    decided on, so the engine's own compare-and-swap and retries serve: an instance that moved
    out of the selection since the page was read is skipped, one that only moved is done.

    Raises the engine's typed error when the instance is refused."""
    rid = bulk_request_id(plan.operation_id, inst.id)
    return await classify(_call(engine, plan, inst, rid))


async def classify(call: Awaitable[object]) -> Result:
    """What one instance's engine call came to: applied, replayed (done before under the run's
    request id) or skipped (deleted, moved out of the selection, or nothing to do)."""
    try:
        outcome = await call
    except (InstanceNotFound, NotSelected):
        return "skipped"  # deleted (a purge) or moved out of the selection: nothing to do
    if isinstance(outcome, Outcome) and outcome.replayed:
        return "replayed"  # done earlier under this operation id: answered, not redone
    if isinstance(outcome, Outcome) and outcome.applied:
        return "applied"
    return "skipped"


def _call(engine: _Engine, plan: _Plan, inst: Instance, rid: str) -> Awaitable[object]:
    where = plan.query.matches
    if plan.action == "force":
        assert plan.state is not None
        assert plan.reason is not None
        assert plan.actor is not None
        return engine._force(
            inst.id, plan.state, plan.data, plan.reason, plan.actor, None, rid, None, where
        )
    if plan.action == "fire":
        assert plan.event is not None
        args = (plan.actor, rid, None, plan.payload, None, None, None)
        return engine._fire(inst.id, plan.event, *args, where=where)
    if plan.action == "pause":
        assert plan.reason is not None
        return engine.pause(inst.id, reason=plan.reason, actor=plan.actor, request_id=rid)
    return engine.resume(inst.id, reason=plan.reason, actor=plan.actor, request_id=rid)
