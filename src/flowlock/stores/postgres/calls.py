"""What the PostgreSQL store's mixins (outbox, timers, pauses, retention) need of the store to
run a call: its `_call`, typed once here (the store, PostgresStore, defines it)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from flowlock.stores.postgres.operations import Operations

__all__ = ["Calls"]

T = TypeVar("T")


class Calls(Protocol):
    """A store that runs `op` where its sessions say (see PostgresStore._call)."""

    async def _call(
        self,
        op: Callable[[Operations], Awaitable[T]],
        key: str = "",
        *,
        waits: bool = True,
        writes: bool = False,
        own: bool = False,
    ) -> T: ...
