"""The blocking twin of `flowlock.Engine.bulk` (a mixin of `flowlock.sync.Engine`, kept apart
so the sync module stays small)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Coroutine, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

from flowlock.admin.bulk import DEFAULT_MAX_FAILURES
from flowlock.core.bulk import BulkAction, BulkReport

if TYPE_CHECKING:
    from flowlock.engine import Engine as AsyncEngine

__all__ = ["SyncBulkMethods"]

T = TypeVar("T")


class SyncBulkMethods:
    """`flowlock.sync.Engine.bulk`; the sync engine is `self`."""

    _engine: AsyncEngine

    def _run(self, coro: Coroutine[Any, Any, T], *, opens: bool = True) -> T:  # the engine's
        raise NotImplementedError

    def bulk(
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
        """Force, pause, resume or fire every instance the filters select; see
        [`flowlock.Engine.bulk`][flowlock.Engine.bulk]. It blocks until the run ends.

        `progress` is called on the engine's own thread, not the caller's: keep it short and
        thread-safe (a counter, a progress bar's update)."""
        return self._run(
            self._engine.bulk(
                action,
                workflow=workflow,
                states=states,
                updated_before=updated_before,
                updated_after=updated_after,
                state=state,
                event=event,
                payload=payload,
                data=data,
                reason=reason,
                actor=actor,
                operation_id=operation_id,
                dry_run=dry_run,
                batch=batch,
                concurrency=concurrency,
                sample=sample,
                max_failures=max_failures,
                progress=progress,
            )
        )
