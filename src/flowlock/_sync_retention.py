"""The blocking twins of the engine's retention methods (a mixin of `flowlock.sync.Engine`):
holds, purge and restore, each run on the sync engine's loop like every other call."""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Coroutine
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from flowlock.admin.retention import DEFAULT_PURGE_BATCH
from flowlock.core.retention import Hold, PurgeReport, RestoreReport

if TYPE_CHECKING:
    from flowlock.engine import Engine as AsyncEngine

__all__ = ["SyncRetention"]

T = TypeVar("T")


class SyncRetention:
    """`flowlock.sync.Engine`'s holds, purge and restore; the sync engine is `self`."""

    _engine: AsyncEngine

    def _run(self, coro: Coroutine[Any, Any, T], *, opens: bool = True) -> T:
        raise NotImplementedError  # the sync engine's

    def hold(
        self, instance_id: str, *, reason: str | None = None, actor: str | None = None
    ) -> Hold:
        """Place a legal hold (idempotent); see [`flowlock.Engine.hold`][flowlock.Engine.hold]."""
        return self._run(self._engine.hold(instance_id, reason=reason, actor=actor))

    def unhold(self, instance_id: str, *, actor: str | None = None) -> bool:
        """Lift a hold; see [`flowlock.Engine.unhold`][flowlock.Engine.unhold]."""
        return self._run(self._engine.unhold(instance_id, actor=actor))

    def holds(self, *, after: str | None = None, limit: int = 100) -> list[Hold]:
        """A page of holds by instance id; see [`flowlock.Engine.holds`][flowlock.Engine.holds]."""
        return self._run(self._engine.holds(after=after, limit=limit))

    def purge(
        self,
        workflow: str,
        *,
        older_than: timedelta,
        final: bool = True,
        states: Collection[str] | None = None,
        archive: str | os.PathLike[str] | None = None,
        batch: int = DEFAULT_PURGE_BATCH,
        dry_run: bool = False,
        progress: Callable[[int], None] | None = None,
    ) -> PurgeReport:
        """Delete old instances in batches, archiving them first; see
        [`flowlock.Engine.purge`][flowlock.Engine.purge]. `progress` runs on the engine's
        loop thread."""
        return self._run(
            self._engine.purge(
                workflow,
                older_than=older_than,
                final=final,
                states=states,
                archive=archive,
                batch=batch,
                dry_run=dry_run,
                progress=progress,
            )
        )

    def restore(
        self,
        path: str | os.PathLike[str],
        *,
        verify: bool = True,
        batch: int = DEFAULT_PURGE_BATCH,
        progress: Callable[[int], None] | None = None,
    ) -> RestoreReport:
        """Insert an archive's instances back, verbatim; see
        [`flowlock.Engine.restore`][flowlock.Engine.restore]."""
        return self._run(self._engine.restore(path, verify=verify, batch=batch, progress=progress))
