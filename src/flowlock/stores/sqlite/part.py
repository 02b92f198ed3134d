"""What the SQLite store's mixins (`timer_methods`, `outbox`) use of the store itself: its path,
its write bound and the way it runs a read or a write transaction."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from flowlock.stores.sqlite.txn import Wake

if TYPE_CHECKING:
    from flowlock.stores.sqlite.pool import Pool

__all__ = ["StorePart"]

T = TypeVar("T")


class StorePart:
    """A part of [`SqliteStore`][flowlock.stores.sqlite.SqliteStore]; the store defines these."""

    path: str
    busy_timeout: float

    if TYPE_CHECKING:

        def _live(self) -> Pool: ...

        async def _read(self, txn: Callable[..., T], *args: Any, what: str) -> T: ...

        async def _write(
            self,
            key: str,
            txn: Callable[[sqlite3.Connection, Wake], T],
            *,
            bound: float,
            nowait: bool,
            what: str,
        ) -> T: ...

    async def _write_now(
        self, key: str, txn: Callable[[sqlite3.Connection, Wake], T], what: str
    ) -> T:
        """`txn` in a write transaction, waiting at most `busy_timeout` for the write lock."""
        return await self._write(key, txn, bound=self.busy_timeout, nowait=False, what=what)
