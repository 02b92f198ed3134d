"""Restart a fencing counter Redis does not have, once per key.

A counter goes missing when Redis loses its data or the key is new. How it restarts
(fencing epochs, a floor, or neither) is in docs/redis-ha.md.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from flowlock.core.errors import InvalidInput, LockUnavailable
from flowlock.locks.base import FenceEpochs
from flowlock.locks.redis.connection import BACKEND

__all__ = ["EPOCH_BITS", "MAX_EPOCH", "FenceFloors"]

log = logging.getLogger("flowlock")

Spawn = Callable[[Coroutine[Any, Any, int]], "asyncio.Task[int]"]
Start = Callable[[str, int, float], Awaitable[None]]

EPOCH_BITS = 32
"""A token is `epoch << EPOCH_BITS` plus its place in the epoch (1 to 2^32 - 1)."""
MAX_EPOCH = (1 << (53 - EPOCH_BITS)) - 1
"""The last epoch whose tokens stay below 2^53."""
_SPAN = str(1 << EPOCH_BITS)


class FenceFloors:
    """Single-flight restarts of missing fencing counters.

    The first acquirer of a key with a missing counter starts it with `start(key, floor,
    bound)`. Acquirers that come meanwhile share that work, and its answer or error.
    `spawn` runs the work as a task its owner awaits on close. `epochs` are used when
    given, or when lent with `lend`. `fetch` is `fence_floor`.
    """

    __slots__ = (
        "_epochs",
        "_fetch",
        "_gap",
        "_lent",
        "_namespace",
        "_spawn",
        "_start",
        "in_flight",
    )

    def __init__(
        self,
        fetch: Callable[[str], Awaitable[int]] | None,
        *,
        gap: int,
        spawn: Spawn,
        start: Start,
        namespace: str,
        epochs: FenceEpochs | None = None,
    ) -> None:
        self._fetch = fetch
        self._gap = gap
        self._spawn = spawn
        self._start = start
        self._namespace = namespace
        self._epochs = epochs
        self._lent: list[FenceEpochs] = []
        self.in_flight: dict[str, asyncio.Future[int]] = {}  # by the user's key

    @property
    def epochs(self) -> FenceEpochs | None:
        """The epochs in use: the backend's own, else the first ones still lent."""
        if self._epochs is not None:
            return self._epochs
        return self._lent[0] if self._lent else None

    def lend(self, epochs: FenceEpochs) -> Callable[[], None]:
        """Use `epochs` while the backend has none of its own.

        An earlier lender's epochs win while still lent. Returns the call that takes them back.
        """
        self._lent.append(epochs)

        def give_back() -> None:
            if epochs in self._lent:
                self._lent.remove(epochs)

        return give_back

    @property
    def unknown(self) -> str:
        """The acquire script's ARGV[3].

        "" reports a missing counter, when there is something to start it from. "0" restarts
        a missing counter at 1.
        """
        return "" if self._fetch is not None or self.epochs is not None else "0"

    @property
    def span(self) -> str:
        """The acquire script's ARGV[4]: the span of an epoch, "" without epochs."""
        return _SPAN if self.epochs is not None else ""

    async def floor(self, key: str, bound: float, seen: int = 0) -> int:
        """Start `key`'s counter and return the floor it was started at.

        The counter is missing, or is `seen` at the end of its epoch. Waits at most `bound`
        seconds; work already in flight keeps the bound it started with.
        """
        flight = self.in_flight.get(key)
        if flight is None:
            flight = asyncio.get_running_loop().create_future()
            flight.add_done_callback(_retrieve)
            flight.add_done_callback(lambda done: self._landed(key, done))
            self.in_flight[key] = flight
            self._spawn(self._ask(key, seen, bound, flight)).add_done_callback(_retrieve)
        try:
            # Shielded: a sharer that is cancelled or gives up leaves the work to the others.
            async with asyncio.timeout(bound):
                return await asyncio.shield(flight)
        except TimeoutError as exc:
            raise LockUnavailable(
                BACKEND, f"the fencing counter of {key!r} was not started within {bound:.1f} s"
            ) from exc

    def _landed(self, key: str, flight: asyncio.Future[int]) -> None:
        if self.in_flight.get(key) is flight:
            del self.in_flight[key]

    async def _ask(self, key: str, seen: int, bound: float, started: asyncio.Future[int]) -> int:
        """Start the counter and pass the floor, or the error, to `started`.

        `started` is set as soon as the counter is started. Sharers go on while the epoch's
        lock is let go.
        """
        try:
            floor = await self._work(key, seen, bound, started)
        except BaseException as exc:
            if not started.done():
                if isinstance(exc, asyncio.CancelledError):
                    started.cancel()
                else:
                    started.set_exception(exc)
            raise
        if not started.done():
            started.set_result(floor)
        return floor

    async def _work(self, key: str, seen: int, bound: float, started: asyncio.Future[int]) -> int:
        try:
            async with asyncio.timeout(bound):
                highest = await self._highest(key)
                epochs = self.epochs
                if epochs is None:
                    floor = highest + self._gap
                    await self._start(key, floor, bound)
                else:
                    floor = await self._advance(epochs, key, highest, seen, bound, started)
        except TimeoutError as exc:
            raise LockUnavailable(
                BACKEND, f"the fencing counter of {key!r} was not started within {bound:.1f} s"
            ) from exc
        if highest and epochs is None:
            log.warning(
                "flowlock: the Redis fencing counter for %r was missing (Redis lost its data?); "
                "restarting it above %d + %d",
                key,
                highest,
                self._gap,
            )
        return floor

    async def _advance(
        self,
        epochs: FenceEpochs,
        key: str,
        highest: int,
        seen: int,
        bound: float,
        started: asyncio.Future[int],
    ) -> int:
        # Above the tokens the floor scheme may have handed out before an upgrade to epochs. And
        # above the counter seen at the end of its epoch.
        at_least = ((highest + self._gap) >> EPOCH_BITS) + 1 if self._fetch is not None else 0
        at_least = max(at_least, (seen >> EPOCH_BITS) + 1 if seen else 0)
        if at_least > MAX_EPOCH:
            # Refused before the bump: an epoch past the end, once committed, would leave the
            # key unlockable for good.
            raise _used_up(key, at_least)
        async with epochs.advance(self._namespace, key, at_least=at_least, bound=bound) as epoch:
            if not 0 < epoch <= MAX_EPOCH:
                raise _used_up(key, epoch)
            floor = epoch << EPOCH_BITS
            await self._start(key, floor, bound)
            # The counter is started: acquirers need not wait for the lock to be let go.
            started.set_result(floor)
        if epoch > 1:
            log.warning(
                "flowlock: the Redis fencing counter for %r was missing (Redis lost its data?) "
                "or its epoch was full; started it at epoch %d",
                key,
                epoch,
            )
        return floor

    async def _highest(self, key: str) -> int:
        if self._fetch is None:
            return 0
        highest = await self._fetch(key)
        if isinstance(highest, bool) or not isinstance(highest, int) or highest < 0:
            raise InvalidInput(
                f"fence_floor({key!r}) must return a non-negative integer, not {highest!r}"
            )
        return highest


def _retrieve(task: asyncio.Future[Any]) -> None:
    # A shared call whose every sharer gave up: its error is nobody's to raise (no "never
    # retrieved" warning).
    if not task.cancelled():
        task.exception()


def _used_up(key: str, epoch: int) -> LockUnavailable:
    return LockUnavailable(
        BACKEND,
        f"the fencing epochs of {key!r} are used up (epoch {epoch}; tokens would pass 2^53): "
        "lock another key",
    )
