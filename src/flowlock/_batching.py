"""Per-key batching of concurrent calls: many `fire` calls, one read and one write.

A call on an idle key runs at once, in its caller's task. Calls that arrive while the key is
busy queue; one driver task then runs them as the next batch. There is no timer.
A driver task, not the first waiter, runs a batch: a cancelled caller only leaves it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Generic, TypeVar

__all__ = ["Batcher"]

C = TypeVar("C")
R = TypeVar("R")

One = Callable[[C], Awaitable[R]]
Many = Callable[[Sequence[C]], Awaitable[Sequence[R | BaseException]]]


class _Waiter(Generic[C, R]):
    __slots__ = ("call", "future")

    def __init__(self, call: C, future: asyncio.Future[R]) -> None:
        self.call = call
        self.future = future


def _take(queue: deque[_Waiter[C, R]], most: int) -> list[_Waiter[C, R]]:
    """At most `most` waiters off the front of `queue`, skipping cancelled callers."""
    taken: list[_Waiter[C, R]] = []
    while queue and len(taken) < most:
        waiter = queue.popleft()
        if not waiter.future.done():
            taken.append(waiter)
    return taken


async def _answer(taken: list[_Waiter[C, R]], many: Many[C, R]) -> None:
    """Run `many` over the calls of `taken` and hand each waiter its own answer. A failure of
    the whole (a round trip, or a bug below) is every call's answer; a cancelled run cancels
    them (the engine or store is closing)."""
    try:
        answers = await many([w.call for w in taken])
    except asyncio.CancelledError:
        for w in taken:
            w.future.cancel()
        raise
    except Exception as exc:
        answers = [exc] * len(taken)
    for waiter, answer in zip(taken, answers, strict=True):
        if waiter.future.done():  # its caller was cancelled meanwhile: the answer is dropped
            continue
        if isinstance(answer, BaseException):
            waiter.future.set_exception(answer)
        else:
            waiter.future.set_result(answer)


class _Lane(Generic[C, R]):
    """One key's work: whether it is busy, and the calls waiting for it."""

    __slots__ = ("many", "queue")

    def __init__(self, many: Many[C, R]) -> None:
        self.many = many
        self.queue: deque[_Waiter[C, R]] = deque()


class Batcher(Generic[C, R]):
    """Runs calls per key: alone when the key is idle, in batches while it is busy.

    `submit` answers each call with its own result, or raises its own error.
    """

    def __init__(self, max_batch: int) -> None:
        self._max = max_batch
        self._lanes: dict[Hashable, _Lane[C, R]] = {}
        self._drivers: set[asyncio.Task[None]] = set()
        self._idle: asyncio.Event | None = None  # made on the loop by drain()

    @property
    def busy(self) -> int:
        """How many keys have work in flight."""
        return len(self._lanes)

    async def submit(self, key: Hashable, call: C, one: One[C, R], many: Many[C, R]) -> R:
        """`call`'s result: `one(call)` when `key` is idle, otherwise its place in the next
        `many(batch)` (whose answers come in the batch's order: a result, or an exception
        raised to that caller alone)."""
        lane = self._lanes.get(key)
        if lane is not None:
            future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
            lane.queue.append(_Waiter(call, future))
            # Cancelling this await cancels the future: the driver skips it if it has not been
            # taken yet, and drops its answer if it has.
            return await future
        lane = self._lanes[key] = _Lane(many)
        try:
            return await one(call)
        finally:
            # No await between this check and the hand-over: a call queued meanwhile is either
            # seen here or found the lane gone and ran alone.
            if lane.queue:
                self._start(key, lane)
            else:
                self._done(key)

    def _start(self, key: Hashable, lane: _Lane[C, R]) -> None:
        task = asyncio.get_running_loop().create_task(self._drive(key, lane))
        self._drivers.add(task)
        task.add_done_callback(self._drivers.discard)

    async def _drive(self, key: Hashable, lane: _Lane[C, R]) -> None:
        try:
            while lane.queue:
                taken = _take(lane.queue, self._max)
                if taken:
                    await _answer(taken, lane.many)
        finally:
            # Reached with an empty queue (no await since the last check), or when the driver is
            # cancelled (the engine is closing): nobody may be left waiting on a lane that is gone.
            for waiter in lane.queue:
                waiter.future.cancel()
            lane.queue.clear()
            self._done(key)

    def _done(self, key: Hashable) -> None:
        del self._lanes[key]
        if not self._lanes and self._idle is not None:
            self._idle.set()

    async def drain(self) -> None:
        """Wait until every call in flight, alone or queued, has been answered (each is bounded
        by its strategy's and its store's own bounds)."""
        while self._lanes:
            self._idle = asyncio.Event()
            await self._idle.wait()


class Coalescer(Generic[C, R]):
    """Runs calls of one kind (reads, writes) on any keys with at most `depth` round trips in
    flight: a call goes at once, alone, while fewer are in flight; otherwise it queues, and the
    next free slot takes everything queued (at most `max_batch`) as one `many(batch)` round
    trip. Why a depth and not one round trip at a time: a statement that waits (a row lock held
    elsewhere) then holds up one slot, not every call of the process."""

    def __init__(self, many: Many[C, R], *, depth: int, max_batch: int) -> None:
        self._many = many
        self._depth = depth
        self._max = max_batch
        self._in_flight = 0
        self._queue: deque[_Waiter[C, R]] = deque()
        self._drivers: set[asyncio.Task[None]] = set()

    async def submit(self, call: C, one: One[C, R]) -> R:
        """`call`'s result: `one(call)` when a slot is free, else its place in a batch."""
        if self._in_flight < self._depth and not self._queue:
            self._in_flight += 1
            try:
                return await one(call)
            finally:
                self._in_flight -= 1
                self._next()
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._queue.append(_Waiter(call, future))
        return await future

    def _next(self) -> None:
        """Start a batch for every free slot while calls are queued."""
        while self._queue and self._in_flight < self._depth:
            taken = _take(self._queue, self._max)
            if not taken:
                continue
            self._in_flight += 1
            task = asyncio.get_running_loop().create_task(self._run(taken))
            self._drivers.add(task)
            task.add_done_callback(self._drivers.discard)

    async def _run(self, taken: list[_Waiter[C, R]]) -> None:
        try:
            await _answer(taken, self._many)
        finally:
            self._in_flight -= 1
            self._next()

    async def drain(self) -> None:
        """Wait for the batches already sent to be answered. Calls still queued are not waited
        for: a store closing after this answers them EngineClosed when their turn comes, as it
        answers any call made once closing began."""
        while self._drivers:
            await asyncio.gather(*self._drivers, return_exceptions=True)
