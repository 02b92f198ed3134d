"""The SQLite store's [`ConstraintStore`][flowlock.stores.constraint_store] methods (a mixin of
[`SqliteStore`][flowlock.stores.sqlite.SqliteStore]). Its commits apply their claims with
`constraints_sql.apply_claims` and, once committed, tell `slot_releases` listeners here of the
keys they released.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Final

from flowlock.core.constraints import CapacityUsage
from flowlock.stores.constraint_store import ConstraintRows
from flowlock.stores.sqlite.constraints_sql import consistent, rows_txn, usage_txn
from flowlock.stores.sqlite.part import StorePart

__all__ = ["POLL", "SqliteConstraints"]

Heard = Callable[[str, str], None]

POLL: Final = 1.0
"""Seconds between the `heard("", "")` calls of `slot_releases`: another process's releases
on the same file cannot be heard, so a waiter looks again at least this often."""


class _Poll:
    """Calls `heard("", "")` every POLL seconds until stopped (a loop timer, not a task)."""

    def __init__(self, heard: Heard) -> None:
        self._heard = heard
        self._loop = asyncio.get_running_loop()
        self._handle = self._loop.call_later(POLL, self._tick)

    def _tick(self) -> None:
        self._handle = self._loop.call_later(POLL, self._tick)
        self._heard("", "")

    def stop(self) -> None:
        self._handle.cancel()


class SqliteConstraints(StorePart):
    """SqliteStore's part as a ConstraintStore; its commits call `apply_claims` and, once
    committed, `_heard` with the keys they released."""

    _release_listeners: set[Heard]

    def _init_constraints(self) -> None:
        self._release_listeners = set()

    def _heard(self, released: Iterable[tuple[str, str]]) -> None:
        for kind, key in released:
            for heard in list(self._release_listeners):
                heard(kind, key)

    async def capacity_usage(
        self, kind: str, key: str, window: float | None = None
    ) -> CapacityUsage:
        """Who holds slots of `key` now, oldest first, and the limit last used; with
        `window`, the instances counted by the rate limit in the last `window` seconds."""
        return await self._read(consistent(usage_txn), kind, key, window, what="capacity")

    async def constraint_rows(self) -> ConstraintRows:
        """Every slot event, slot, counter and rate event, in one snapshot."""
        return await self._read(consistent(rows_txn), what="constraint rows")

    @asynccontextmanager
    async def slot_releases(self, heard: Heard) -> AsyncIterator[None]:
        """While inside, `heard(kind, key)` once each release of this store object commits,
        and `heard("", "")` every POLL seconds: releases by another process on the same file
        cannot be heard, so that is how long a waiter here may miss one."""
        poll = _Poll(heard)
        self._release_listeners.add(heard)
        try:
            yield
        finally:
            self._release_listeners.discard(heard)
            poll.stop()
