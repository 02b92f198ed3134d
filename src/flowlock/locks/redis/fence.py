"""The floor under a fencing counter that Redis lost, fetched once per key however many
acquirers need it at the same time.

Fencing and Redis data loss
    The fencing counter is a plain Redis key, so a Redis that restarts empty (no persistence, a
    failover to a replica that had not seen the INCR, an eviction under ``maxmemory``) loses it.
    When the counter is missing the acquire script says so instead of starting again at 1, and
    the client asks ``fence_floor(key)`` (the engine passes a function returning the highest
    fencing token PostgreSQL has recorded for that key; the concurrent acquirers of one key in
    this process share one call) and retries with that floor plus ``fence_gap``; the script
    then does ``SET fence floor NX`` before the INCR. The gap is there because a token can be
    issued and never written anywhere (the holder crashed, or has not committed yet, or is still
    running and will commit): the floor alone would hand the same numbers out again, and a stale
    holder carrying one of them could pass a fencing check.
    Jumping ``fence_gap`` (default one million) past the floor puts new tokens above every token
    issued since the last one that was recorded, as long as fewer than ``fence_gap`` were issued
    in between. Without ``fence_floor``, tokens restart at 1 after a Redis data loss: they are
    then only increasing for as long as Redis keeps its data.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from flowlock.errors import InvalidInput, LockUnavailable
from flowlock.locks.redis.connection import BACKEND

__all__ = ["FenceFloors"]

log = logging.getLogger("flowlock")

Spawn = Callable[[Coroutine[Any, Any, int]], "asyncio.Task[int]"]


class FenceFloors:
    """Single-flight ``fence_floor`` calls: the first acquirer of a key whose counter is missing
    starts the call, every acquirer of that key that comes while it runs shares it, and its
    answer (or its error) goes to each of them. ``spawn`` starts the call as a task its owner
    waits for on close."""

    __slots__ = ("_fetch", "_gap", "_spawn", "in_flight")

    def __init__(
        self, fetch: Callable[[str], Awaitable[int]] | None, *, gap: int, spawn: Spawn
    ) -> None:
        self._fetch = fetch
        self._gap = gap
        self._spawn = spawn
        self.in_flight: dict[str, asyncio.Task[int]] = {}  # by the user's key

    @property
    def unknown(self) -> str:
        """The floor to send before one is known: "" (the script then says when the counter is
        missing), or "0" without ``fence_floor`` (a missing counter restarts at 1)."""
        return "" if self._fetch is not None else "0"

    async def floor(self, key: str, bound: float) -> int:
        """The floor for ``key``'s missing counter: the highest token recorded outside Redis,
        plus the gap for tokens issued but never recorded. Waits at most ``bound`` seconds (a
        call already in flight keeps the bound it started with)."""
        flight = self.in_flight.get(key)
        if flight is None:
            flight = self._spawn(self._ask(key, bound))
            flight.add_done_callback(_retrieve)
            flight.add_done_callback(lambda done: self._landed(key, done))
            self.in_flight[key] = flight
        try:
            # Shielded: a sharer that is cancelled or gives up leaves the call to the others.
            async with asyncio.timeout(bound):
                return await asyncio.shield(flight)
        except TimeoutError as exc:
            raise LockUnavailable(
                BACKEND, f"fence_floor({key!r}) did not answer within {bound:.1f} s"
            ) from exc

    def _landed(self, key: str, flight: asyncio.Task[int]) -> None:
        if self.in_flight.get(key) is flight:
            del self.in_flight[key]

    async def _ask(self, key: str, bound: float) -> int:
        assert self._fetch is not None
        try:
            async with asyncio.timeout(bound):
                highest = await self._fetch(key)
        except TimeoutError as exc:
            raise LockUnavailable(
                BACKEND, f"fence_floor({key!r}) did not answer within {bound:.1f} s"
            ) from exc
        if isinstance(highest, bool) or not isinstance(highest, int) or highest < 0:
            raise InvalidInput(
                f"fence_floor({key!r}) must return a non-negative integer, not {highest!r}"
            )
        if highest:
            log.warning(
                "flowlock: the Redis fencing counter for %r was missing (Redis lost its data?); "
                "restarting it above %d + %d",
                key,
                highest,
                self._gap,
            )
        return highest + self._gap


def _retrieve(task: asyncio.Future[Any]) -> None:
    # A shared call whose every sharer gave up: its error is nobody's to raise (no "never
    # retrieved" warning).
    if not task.cancelled():
        task.exception()
