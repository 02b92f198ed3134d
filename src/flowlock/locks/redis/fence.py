"""Starting a fencing counter that Redis does not have (a new key, or Redis lost its data), once
per key however many acquirers need it at the same time.

The fencing counter is a plain Redis key, so a Redis that restarts empty (no persistence, a
failover to a replica that had not seen the key, `FLUSHALL`, an eviction under `maxmemory`)
loses it. The acquire script reports a missing counter instead of counting from 0 (when the
backend has something to start it from), the first acquirer of the key in this process starts it
(its concurrent acquirers share that work, and its answer or error), and every one of them runs
the acquire script again. How the counter is started depends on what the backend was given:

Fencing epochs (`fence_epochs`: PostgreSQL, the engine's and RunOnce's default)
    The key's epoch in PostgreSQL is bumped and committed, and the counter is started at
    `epoch * 2^32`: every token of a later epoch is above every token of an earlier one, so
    tokens strictly increase per key across any number of losses, whether or not a holder ever
    wrote anything. An epoch holds 2^32 - 1 tokens: the acquire script reports a counter about
    to cross into the next epoch as missing too, and a new epoch is taken (so no count of
    acquires breaks the guarantee). The bump and the start of the counter are done under the
    key's lock in PostgreSQL (see `flowlock._pg.fence`), so a stale epoch can never start a
    counter after a later one did. Tokens stay below 2^53 (2^21 - 1 epochs per key; past that
    acquire raises LockUnavailable), exact in Lua, JSON and JavaScript.

    Cost: nothing while the counter exists; the first acquire of a key after Redis started
    without it costs two PostgreSQL round trips (bump, release of the lock) and one Redis round
    trip more, plus a `fence_floor` call when one is given too. One row per key in
    `flowlock_fence_epochs`, never deleted.

    With `fence_floor` too, a new epoch is also above `fence_floor(key) + fence_gap`: tokens
    handed out before the upgrade to epochs (the floor scheme below) stay below the new ones.

    Failovers: Redis replication is asynchronous, so a replica promoted by Sentinel or by a
    Redis Cluster may hold a counter behind the tokens its dead primary handed out. The
    counter is therefore stamped, when started, with the replication id of the server it was
    started on (`...:fence:replid`, beside it in the same slot); a promoted replica has a new
    replication id, so the first acquire of each key after a failover finds the stamp foreign
    and takes a new epoch, as for a lost counter (one PostgreSQL round trip per key, once).
    Reading the id costs the acquire script an `INFO replication` (a few microseconds).

    Not covered: Redis coming back with the counter at an older value and the same replication
    id (a restart from an old snapshot that kept its id): the counter is not missing then, and
    repeats what it handed out since. Run Redis so that it does not go back (`appendfsync
    always`), or treat such a restart as a loss (`FLUSHALL` before use). And a script the
    client gave up on (timed out) that Redis runs later anyway, after that key was lost on the
    same server (`FLUSHALL` or an eviction; a restart closes the connection it came on), may
    start the counter at the epoch before the last one. The epochs'
    lock is session-level (see `flowlock._pg.fence`): they need a direct connection to
    PostgreSQL or session pooling, not a transaction-pooling proxy.

A floor only (`fence_floor` without epochs: the SQLite store's, or a function of the user's)
    `fence_floor(key)` returns the highest token recorded outside Redis for the key, and the
    counter is started at that plus `fence_gap`. The gap is there because a token can be
    issued and never written anywhere (its holder crashed, or has not committed yet): the floor
    alone would hand the same numbers out again. This holds only while fewer than `fence_gap`
    tokens were issued after the last recorded one, and a key whose holders never wrote has a
    floor of 0 each time: after two losses its tokens repeat. Use epochs where they exist.

Neither (a RedisLocks of its own)
    A missing counter restarts at 1: tokens only increase while Redis keeps its data.
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
    """Single-flight starts of missing fencing counters: the first acquirer of a key whose counter
    is missing starts it (with `start(key, floor, bound)`, which raises the Redis counter to the
    floor), every acquirer of that key that comes while it runs shares that, and its answer (or its
    error) goes to each of them. `spawn` starts the work as a task its owner waits for on close.

    `epochs` (durable, see the module docstring) are used when given, or when lent with
    `lend` while none were given; `fetch` is `fence_floor`."""

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
        """The epochs in use: the backend's own, else the first lent ones still lent."""
        if self._epochs is not None:
            return self._epochs
        return self._lent[0] if self._lent else None

    def lend(self, epochs: FenceEpochs) -> Callable[[], None]:
        """Use `epochs` while none of the backend's own are given (and no earlier lender's are
        still lent); returns the call that takes them back."""
        self._lent.append(epochs)

        def give_back() -> None:
            if epochs in self._lent:
                self._lent.remove(epochs)

        return give_back

    @property
    def unknown(self) -> str:
        """The acquire script's ARGV[3]: "" (report a missing counter) when there is something
        to start it from, "0" when there is not (a missing counter restarts at 1)."""
        return "" if self._fetch is not None or self.epochs is not None else "0"

    @property
    def span(self) -> str:
        """The acquire script's ARGV[4]: the span of an epoch, "" without epochs."""
        return _SPAN if self.epochs is not None else ""

    async def floor(self, key: str, bound: float, seen: int = 0) -> int:
        """Start `key`'s counter (missing, or `seen`: about to cross into the next epoch)
        and return the floor it was started at. Waits at most `bound` seconds (work already
        in flight keeps the bound it started with)."""
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
        """Start the counter; `started` gets the floor as soon as the counter is started (the
        sharers go on then, while the epoch's lock is let go), or the error."""
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
        # Above the tokens the floor scheme may have handed out (an upgrade: it started counters
        # at the floor plus the gap, also at a floor of 0), and above the counter seen at the
        # end of its epoch.
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
