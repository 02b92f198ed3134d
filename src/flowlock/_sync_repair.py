"""The blocking twins of the engine's repairs (a mixin of `flowlock.sync.Engine`): force, pause,
resume and the paused workflows, each run on the sync engine's loop like any of its calls."""

from __future__ import annotations

from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

from flowlock.core.admin import WorkflowPause
from flowlock.core.models import Outcome
from flowlock.engine import Engine as AsyncEngine

__all__ = ["SyncRepairMethods"]

T = TypeVar("T")


class SyncRepairMethods:
    """`flowlock.sync.Engine`'s repairs; the engine is `self`."""

    _engine: AsyncEngine

    def _run(self, coro: Coroutine[Any, Any, T], *, opens: bool = True) -> T:  # the engine's
        raise NotImplementedError

    def force(
        self,
        instance_id: str,
        state: str,
        *,
        data: Mapping[str, Any] | None = None,
        reason: str,
        actor: str,
        expected_version: int | None = None,
        request_id: str | None = None,
    ) -> Outcome:
        """Move the instance to any state of its workflow, an audited repair; see
        [`flowlock.Engine.force`][flowlock.Engine.force]."""
        return self._run(
            self._engine.force(
                instance_id,
                state,
                data=data,
                reason=reason,
                actor=actor,
                expected_version=expected_version,
                request_id=request_id,
            )
        )

    def pause(
        self,
        instance_id: str | None = None,
        *,
        workflow: str | None = None,
        reason: str,
        actor: str | None = None,
        request_id: str | None = None,
    ) -> Outcome | WorkflowPause:
        """Pause one instance, or every instance of `workflow`; see
        [`flowlock.Engine.pause`][flowlock.Engine.pause]."""
        return self._run(
            self._engine.pause(
                instance_id, workflow=workflow, reason=reason, actor=actor, request_id=request_id
            )
        )

    def resume(
        self,
        instance_id: str | None = None,
        *,
        workflow: str | None = None,
        reason: str | None = None,
        actor: str | None = None,
        request_id: str | None = None,
    ) -> Outcome | WorkflowPause | None:
        """Lift the pause of one instance or of `workflow`; see
        [`flowlock.Engine.resume`][flowlock.Engine.resume]."""
        return self._run(
            self._engine.resume(
                instance_id, workflow=workflow, reason=reason, actor=actor, request_id=request_id
            )
        )

    def workflow_pauses(self) -> list[WorkflowPause]:
        """Every paused workflow, by name; see
        [`flowlock.Engine.workflow_pauses`][flowlock.Engine.workflow_pauses]."""
        return self._run(self._engine.workflow_pauses())
