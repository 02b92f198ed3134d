"""The engine's repairs: force a state, pause and resume an instance or a whole workflow (a
mixin of `flowlock.Engine`).

Force, pause and resume of one instance are calls of reserved events fired through the
engine's own firing path: the same strategies, compare-and-swap, fencing, request-id replay and
timers as `fire`, and a history row each. They run alone, never batched with other calls: the
store sets the instance's `paused` from a batch's last entry. A workflow's pause is one row of its
own (see `flowlock.stores.base.PauseStore`), read with every instance of it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from flowlock._calls import caller_request_id, check_text
from flowlock.core.admin import (
    FORCE_EVENT,
    PAUSE_EVENT,
    RESUME_EVENT,
    WorkflowPause,
    check_reason,
    repair_payload,
)
from flowlock.core.errors import InvalidInput, UnknownWorkflow
from flowlock.core.models import Instance, InstanceQuery, Outcome, TimerFiring
from flowlock.core.versions import Registry
from flowlock.stores.base import PauseStore, Store

__all__ = ["RepairMethods"]


def _one_target(instance_id: str | None, workflow: str | None, what: str) -> None:
    if (instance_id is None) == (workflow is None):
        raise InvalidInput(
            f"{what} takes exactly one of instance_id (one instance) or workflow= (every "
            f"instance of it), not {'both' if instance_id is not None else 'neither'}; nothing "
            "was read or written"
        )


class RepairMethods:
    """`flowlock.Engine`'s repairs; the engine is `self`."""

    _store: Store
    _workflows: Registry

    def _check_open(self) -> None: ...  # the engine's

    def _check_data(self, data: object, what: str) -> Mapping[str, Any]:  # the engine's
        raise NotImplementedError

    async def _fire(  # the engine's
        self, instance_id: str, event: str, actor: str | None, request_id: str | None,
        expected_version: int | None, payload: Mapping[str, Any] | None, strategy: Any,
        connection: Any, timer: TimerFiring | None, /, *, repair: bool = False,
        where: Callable[[Instance], bool] | None = None,
    ) -> Outcome:  # fmt: skip
        raise NotImplementedError

    async def force(
        self,
        instance_id: str,
        state: str,
        *,
        data: Mapping[str, Any] | None = None,
        reason: str,
        actor: str,
        expected_version: int | None = None,
        request_id: str | None = None,
        connection: Any = None,
    ) -> Outcome:
        """Move the instance to `state`, any state of its workflow, whatever the definition's
        transitions say: an operator's repair, written as a history row of its own kind
        (`HistoryEntry.forced`, with `reason` and `actor`) through the same compare-and-swap
        as every transition. Works on a paused instance too, and leaves it paused.

        `data` replaces the instance's data (None: kept). Like `fire`, it is exactly-once by
        `request_id`, refused (VersionMismatch) when `expected_version` is stale, and may join
        your transaction (`connection=`, PostgreSQL). A move to another state begins a new stay:
        the left state's timers are void and the new state's armed; pending outbox messages are
        kept. UnknownState when the workflow has no such state; InvalidInput for a blank reason
        or a bad argument; either way nothing is written."""
        return await self._force(
            instance_id, state, data, reason, actor, expected_version, request_id, connection
        )

    async def _force(
        self, instance_id: str, state: str, data: Mapping[str, Any] | None, reason: str,
        actor: str, expected_version: int | None, request_id: str | None, connection: Any,
        where: Callable[[Instance], bool] | None = None,
    ) -> Outcome:  # fmt: skip
        # where: a bulk run's selection (flowlock.admin.bulk), checked on the decided read.
        self._check_open()
        check_text(instance_id, "instance_id")
        check_text(state, "state")
        why = check_reason(reason)
        check_text(actor, "actor")
        rid = caller_request_id(request_id, instance_id)
        body = None if data is None else self._check_data(data, "data")
        payload = repair_payload(FORCE_EVENT, why, state, body)
        args = (actor, rid, expected_version, payload, None, connection, None)
        return await self._fire(instance_id, FORCE_EVENT, *args, repair=True, where=where)

    async def pause(
        self,
        instance_id: str | None = None,
        *,
        workflow: str | None = None,
        reason: str,
        actor: str | None = None,
        request_id: str | None = None,
    ) -> Outcome | WorkflowPause:
        """Pause one instance, or every instance of `workflow`: `fire` at it is then refused
        with InstancePaused until `resume`; `force` still works.

        One instance: a history row (`HistoryEntry.kind` "pause") and an Outcome; pausing a
        paused instance writes nothing (`idempotent`). A workflow: ONE row, however many
        instances it has, none of which is written; the WorkflowPause (the pause in place when
        it was paused already: a workflow's pause is idempotent by itself, so `request_id` is
        only checked). Exactly one of `instance_id` and `workflow`; a `reason` is required."""
        self._check_open()
        _one_target(instance_id, workflow, "pause()")
        why = check_reason(reason)
        if actor is not None:
            check_text(actor, "actor")
        if workflow is not None:
            if request_id is not None:
                check_text(request_id, "request_id")
            store = await self._pauses_of(workflow)
            assert why is not None
            return await store.pause_workflow(workflow, why, actor)
        assert instance_id is not None
        return await self._toggle(instance_id, PAUSE_EVENT, why, actor, request_id)

    async def resume(
        self,
        instance_id: str | None = None,
        *,
        workflow: str | None = None,
        reason: str | None = None,
        actor: str | None = None,
        request_id: str | None = None,
    ) -> Outcome | WorkflowPause | None:
        """Lift a pause of one instance (a history row, kind "resume"; nothing written when it
        was not paused) or of `workflow` (the pause lifted, or None when it was not paused).
        An instance paused on its own and through its workflow takes events once both are
        lifted. Exactly one of `instance_id` and `workflow`; `reason` is optional."""
        self._check_open()
        _one_target(instance_id, workflow, "resume()")
        why = check_reason(reason, required=False)
        if actor is not None:
            check_text(actor, "actor")
        if workflow is not None:
            if request_id is not None:
                check_text(request_id, "request_id")
            store = await self._pauses_of(workflow)
            return await store.resume_workflow(workflow)
        assert instance_id is not None
        return await self._toggle(instance_id, RESUME_EVENT, why, actor, request_id)

    async def workflow_pauses(self) -> list[WorkflowPause]:
        """Every paused workflow, by name (empty: none)."""
        self._check_open()
        return await self._pause_store().workflow_pauses()

    async def _toggle(
        self,
        instance_id: str,
        event: str,
        reason: str | None,
        actor: str | None,
        request_id: str | None,
    ) -> Outcome:
        check_text(instance_id, "instance_id")
        rid = caller_request_id(request_id, instance_id)
        payload = repair_payload(event, reason)
        args = (actor, rid, None, payload, None, None, None)
        return await self._fire(instance_id, event, *args, repair=True)

    def _pause_store(self) -> PauseStore:
        store = self._store
        if not isinstance(store, PauseStore):
            raise InvalidInput(
                f"this engine's store ({type(store).__name__}) cannot pause workflows; pause "
                "its instances one by one. Nothing was read or written"
            )
        return store

    async def _pauses_of(self, workflow: str) -> PauseStore:
        """The store, once `workflow` is known to exist: registered here, or with an instance
        stored (an operator's engine may not register every definition). UnknownWorkflow for
        a name that is neither, a typo most likely, which would pause nothing."""
        check_text(workflow, "workflow")
        store = self._pause_store()
        if workflow not in self._workflows:
            found = await self._store.list_instances(
                InstanceQuery(workflow=workflow), after=None, limit=1
            )
            if not found:
                raise UnknownWorkflow(workflow, tuple(self._workflows))
        return store
