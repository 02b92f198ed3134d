"""The tests' own PostgreSQL connections, on a server that other clients share.

The suite must pass on a busy server: a stock ``max_connections=100`` while another client holds
60 of them. Two things follow.

- A helper connection of a test (to count rows, hold a row lock, end a session) is not what
  the test is about. :func:`connect` and :func:`create_pool` retry a connection the server
  refuses for want of a slot ("too many clients", SQLSTATE 53300) for up to
  :data:`CONNECT_BOUND` seconds: the other clients' connections come and go. If no slot frees in
  that time, the test is skipped, saying how full the server was.
- A test that needs many connections at once asks for them first with
  :func:`need_connections` (the ``pg_room`` fixture of conftest). It is skipped, saying what it
  needs and what the server has free, rather than failing half-way with "too many clients".

Every test keeps its pools small enough that it needs at most :data:`MOST` connections at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import asyncpg
import pytest

__all__ = [
    "CONNECT_BOUND",
    "MOST",
    "Room",
    "connect",
    "create_pool",
    "need_connections",
    "room",
]

CONNECT_BOUND = 60.0
"""Seconds a helper connection is retried while the server has no free slot."""
MOST = 30
"""The most connections any one test may hold at once (its pools, its helpers, its processes)."""

_PAUSE = (0.05, 1.0)  # the first and the longest pause between two tries

_T = TypeVar("_T")


async def connect(dsn: str | None = None, **kwargs: Any) -> asyncpg.Connection:
    """``asyncpg.connect(dsn, **kwargs)``, retried while the server has no free slot (bounded:
    the test is skipped after :data:`CONNECT_BOUND` seconds, saying so)."""
    return await _retried(lambda: asyncpg.connect(dsn, **kwargs))


async def create_pool(dsn: str, **kwargs: Any) -> asyncpg.Pool:
    """``asyncpg.create_pool(dsn, **kwargs)``, its first connections retried as :func:`connect`
    retries one. A pool of the test's own, sized by the test."""

    async def opened() -> asyncpg.Pool:
        pool = await asyncpg.create_pool(dsn, **kwargs)
        assert pool is not None
        return pool

    return await _retried(opened)


async def _retried(open_it: Callable[[], Awaitable[_T]]) -> _T:
    deadline = time.monotonic() + CONNECT_BOUND
    pause = _PAUSE[0]
    while True:
        try:
            return await open_it()
        except asyncpg.TooManyConnectionsError as exc:
            if time.monotonic() + pause > deadline:
                pytest.skip(
                    f"PostgreSQL had no free connection for this test's helper for "
                    f"{CONNECT_BOUND:.0f} s ({exc}): other clients hold the server's "
                    "max_connections; free some, or raise max_connections"
                )
        await asyncio.sleep(pause)
        pause = min(2 * pause, _PAUSE[1])


class Room:
    """How many more sessions the server takes now, as read on one connection."""

    def __init__(self, max_connections: int, reserved: int, in_use: int, superuser: bool) -> None:
        self.max_connections = max_connections
        self.reserved = reserved
        self.in_use = in_use
        self.superuser = superuser

    @property
    def free(self) -> int:
        """Slots left for this role (a superuser may also take the reserved ones), not counting
        the connection that read them, which is closed by then."""
        limit = self.max_connections - (0 if self.superuser else self.reserved)
        return max(0, limit - self.in_use + 1)

    def __str__(self) -> str:
        return (
            f"{self.free} free (max_connections={self.max_connections}, {self.in_use} in use, "
            f"{self.reserved} reserved for superusers)"
        )


async def room(dsn: str) -> Room:
    """The server's free connection slots now."""
    conn = await connect(dsn)
    try:
        row = await conn.fetchrow(
            "SELECT current_setting('max_connections')::int AS most,"
            " current_setting('superuser_reserved_connections')::int AS reserved,"
            " (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')"
            "   AS in_use,"
            " (SELECT rolsuper FROM pg_roles WHERE rolname = current_user) AS superuser"
        )
    finally:
        await conn.close()
    assert row is not None
    return Room(row["most"], row["reserved"], row["in_use"], bool(row["superuser"]))


async def need_connections(dsn: str, count: int, why: str) -> None:
    """Skip the test unless the server has ``count`` free connection slots now: the test opens
    that many at once (``why`` says for what)."""
    free = await room(dsn)
    if free.free < count:
        pytest.skip(f"needs {count} PostgreSQL connections at once ({why}); the server has {free}")
