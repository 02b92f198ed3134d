"""The blocking twin of `flowlock.Engine.migrate` (a mixin of `flowlock.sync.Engine`, kept
apart so the sync module stays small)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Coroutine, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from flowlock.admin.bulk import DEFAULT_MAX_FAILURES
from flowlock.core.migration import DataFn, MigrationReport
from flowlock.core.models import Instance

if TYPE_CHECKING:
    from flowlock.engine import Engine as AsyncEngine

__all__ = ["SyncMigrateMethods"]

T = TypeVar("T")


class SyncMigrateMethods:
    """`flowlock.sync.Engine.migrate`; the sync engine is `self`."""

    _engine: AsyncEngine

    def _run(self, coro: Coroutine[Any, Any, T], *, opens: bool = True) -> T:  # the engine's
        raise NotImplementedError

    def migrate(
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
        """Move the instances of `workflow` to definition version `to_version`; see
        [`flowlock.Engine.migrate`][flowlock.Engine.migrate]. It blocks until the run ends.

        `data`, `where` and `progress` run on the engine's own thread, not the caller's:
        keep them pure and short."""
        return self._run(
            self._engine.migrate(
                workflow,
                to_version,
                state_map=state_map,
                data=data,
                where=where,
                state=state,
                dry_run=dry_run,
                batch=batch,
                operation_id=operation_id,
                actor=actor,
                concurrency=concurrency,
                sample=sample,
                max_failures=max_failures,
                progress=progress,
            )
        )
