"""Wake lock waiters when a key is released or its holder's lease runs out.

Holds each key's local queue of waiters and watchers, and the pub/sub listener that
hears releases. docs/redis-ha.md explains the waiting rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
from collections.abc import Callable, Iterator

from redis.asyncio.client import PubSub

from flowlock.locks.redis.connection import DRIVER_ERRORS, text

__all__ = ["Listener", "Place", "Wakeups", "Watch", "wait_for"]

log = logging.getLogger("flowlock")

# The holder's-expiry timer fires a random delay up to this (seconds) after the PTTL ran out: a
# margin for the server's expiry, and the processes waiting on one key do not all retry in the
# same millisecond. (A waiter woken by a release retries at once: only one per process is.)
WAKE_JITTER = 0.002
# The pub/sub listener: how often it checks a quiet connection, when it PINGs one to find it dead,
# and its reconnect backoff bounds.
_LISTEN_TICK = 1.0
_PING_AFTER = 5.0
_RECONNECT_MIN = 0.05
_RECONNECT_MAX = 2.0


async def wait_for(event: asyncio.Event, seconds: float) -> bool:
    """Whether `event` was set within `seconds`."""
    try:
        async with asyncio.timeout(seconds):
            await event.wait()
    except TimeoutError:
        return False
    return True


class _Waiter:
    """One acquire waiting in a key's local queue.

    `woken`: it was handed a release or the holder's expiry, and has neither lost a retry
    nor taken the lease yet. If it leaves meanwhile, the wake goes to the next waiter.
    """

    __slots__ = ("event", "woken")

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.woken = False


class _Watcher:
    """One `wait_released` call. `released`: a release of the key was announced."""

    __slots__ = ("event", "released")

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.released = False


class _Queue:
    """The local waiters (oldest first) and watchers of one lock key.

    Also holds the timer that wakes the oldest waiter when the holder's lease runs out.
    """

    __slots__ = ("timer", "timer_at", "waiters", "watchers")

    def __init__(self) -> None:
        self.waiters: dict[_Waiter, None] = {}  # insertion-ordered: a FIFO with O(1) removal
        self.watchers: set[_Watcher] = set()
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = math.inf

    def wake_oldest(self) -> None:
        for waiter in self.waiters:
            waiter.woken = True
            waiter.event.set()
            return

    def announce_release(self) -> None:
        for watcher in self.watchers:
            watcher.released = True
            watcher.event.set()
        self.wake_oldest()

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer, self.timer_at = None, math.inf

    def expired(self) -> None:
        self.timer, self.timer_at = None, math.inf
        self.wake_oldest()


class Wakeups:
    """The queues of every lock key this backend's callers wait on or watch.

    Keyed by lock key, which is also the key's release channel. A queue exists only while
    someone waits or watches.
    """

    __slots__ = ("_queues", "_rng")

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._queues: dict[str, _Queue] = {}

    def jitter(self) -> float:
        """A random delay up to `WAKE_JITTER` seconds after a holder's expiry."""
        return self._rng.uniform(0.0, WAKE_JITTER)

    def join(self, lock_key: str) -> Place:
        """Take a place at the back of `lock_key`'s queue of waiters.

        Always leave it with `Place.leave`, however the wait ends.
        """
        queue = self._queue(lock_key)
        waiter = _Waiter()
        queue.waiters[waiter] = None
        return Place(self, lock_key, queue, waiter)

    @contextlib.contextmanager
    def watch(self, lock_key: str) -> Iterator[Watch]:
        """Watch `lock_key`'s releases for the duration of the `with` block."""
        queue = self._queue(lock_key)
        watcher = _Watcher()
        queue.watchers.add(watcher)
        try:
            yield Watch(watcher)
        finally:
            queue.watchers.discard(watcher)
            self._unqueue(lock_key, queue)

    # --- what the listener and the backend report ----------------------------------------------

    def released(self, channel: str) -> None:
        """A release was announced on `channel`: every watcher and the oldest waiter wake."""
        queue = self._queues.get(channel)
        if queue is not None:
            queue.announce_release()

    def missed(self) -> None:
        """A new subscription: releases may have been missed meanwhile.

        The oldest waiter of each key retries, and every watcher looks again.
        """
        for queue in self._queues.values():
            queue.wake_oldest()
            for watcher in queue.watchers:
                watcher.event.set()

    def wake_all(self) -> None:
        """The backend closed: every waiter and watcher finds out at once."""
        for queue in self._queues.values():
            for waiter in queue.waiters:
                waiter.event.set()
            for watcher in queue.watchers:
                watcher.event.set()

    # --- queues --------------------------------------------------------------------------------

    def _queue(self, lock_key: str) -> _Queue:
        queue = self._queues.get(lock_key)
        if queue is None:
            queue = self._queues[lock_key] = _Queue()
        return queue

    def _unqueue(self, lock_key: str, queue: _Queue) -> None:
        if not queue.waiters:
            queue.disarm()
            if not queue.watchers and self._queues.get(lock_key) is queue:
                del self._queues[lock_key]

    def _arm(self, queue: _Queue, pttl_ms: int) -> None:
        """Wake the oldest waiter of `queue` when the holder's lease runs out.

        `pttl_ms` is the time left, as a failed attempt saw it. An earlier wake-up already set
        wins. One that comes too early (the holder extended) costs one attempt, which sets the next.
        """
        loop = asyncio.get_running_loop()
        at = loop.time() + pttl_ms / 1000 + self.jitter()
        if at < queue.timer_at:
            queue.disarm()
            queue.timer = loop.call_at(at, queue.expired)
            queue.timer_at = at


class Place:
    """One acquire's place in its key's queue of waiters.

    Held from before the first attempt to the end of the acquire. So a release during an
    attempt is not missed.
    """

    __slots__ = ("_lock_key", "_queue", "_waiter", "_wakeups")

    def __init__(self, wakeups: Wakeups, lock_key: str, queue: _Queue, waiter: _Waiter) -> None:
        self._wakeups = wakeups
        self._lock_key = lock_key
        self._queue = queue
        self._waiter = waiter

    def attempting(self) -> None:
        """An attempt is about to be sent: a wake from now on means "try again"."""
        self._waiter.event.clear()

    def held(self, pttl_ms: int) -> None:
        """The attempt found the key held with `pttl_ms` left (-1: no expiry).

        Makes sure the oldest waiter wakes at the holder's expiry.
        """
        if pttl_ms >= 0:
            self._wakeups._arm(self._queue, pttl_ms)

    @property
    def woken(self) -> bool:
        """Whether this waiter was woken since its attempt was sent."""
        return self._waiter.event.is_set()

    async def wait(self, seconds: float) -> None:
        """Wait for a wake, at most `seconds`.

        A waiter that lost its retry to another holder keeps its place at the head.
        """
        self._waiter.woken = False
        await wait_for(self._waiter.event, seconds)

    def leave(self, *, with_lease: bool) -> None:
        """Leave the queue.

        A waiter that holds the key's wake and leaves without the lease passes the wake on.
        Otherwise the next waiter would sleep while the key is free.
        """
        waiter = self._waiter
        del self._queue.waiters[waiter]
        if not with_lease and (waiter.woken or waiter.event.is_set()):
            self._queue.wake_oldest()
        self._wakeups._unqueue(self._lock_key, self._queue)


class Watch:
    """One `wait_released` call's view of its key."""

    __slots__ = ("_watcher",)

    def __init__(self, watcher: _Watcher) -> None:
        self._watcher = watcher

    @property
    def released(self) -> bool:
        """Whether a release of the key was announced since the watch began."""
        return self._watcher.released

    def looking(self) -> None:
        """The key is about to be looked at: a wake from now on means "look again"."""
        self._watcher.event.clear()

    async def wait(self, seconds: float) -> bool:
        """Whether a release, a new subscription or closing woke the watch within `seconds`."""
        return await wait_for(self._watcher.event, seconds)


class Listener:
    """The one pattern subscription on a namespace's channels.

    A task keeps it up from `start` to `stop`. Each release heard wakes that
    key's queue in `wakeups`. `pubsubs` makes a new pub/sub for each try, so after a
    failover the next one reaches the new primary or another node.
    """

    def __init__(
        self,
        pubsubs: Callable[[], PubSub],
        pattern: str,
        wakeups: Wakeups,
        *,
        bound: float,
        rng: random.Random,
    ) -> None:
        self._pubsubs = pubsubs  # a fresh pub/sub per try (a cluster's: on the next node)
        self._pattern = pattern
        self._wakeups = wakeups
        self._bound = bound  # for the subscribe and for an answer to PING
        self._rng = rng
        self._task: asyncio.Task[None] | None = None
        self.listening = False

    async def start(self, *, name: str, wait: float) -> None:
        """Start listening, and wait up to `wait` seconds for the first subscription.

        Also returns on the first failure. Waiting means waiters are woken from the start when
        Redis is up.
        """
        first_try = asyncio.Event()
        self._task = asyncio.create_task(self._run(first_try), name=name)
        try:
            async with asyncio.timeout(wait):
                await first_try.wait()
        except TimeoutError:
            log.warning("flowlock: the Redis pub/sub subscription is not up yet; retrying")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self, first_try: asyncio.Event) -> None:
        """Subscribe and pump messages; on failure log it and reconnect with backoff."""
        delay = _RECONNECT_MIN
        failing = False
        while True:
            pubsub = self._pubsubs()
            try:
                await self._subscribe(pubsub)
                self.listening = True
                first_try.set()
                self._wakeups.missed()
                if failing:
                    log.warning("flowlock: the Redis pub/sub subscription is back")
                failing = False
                delay = _RECONNECT_MIN
                await self._pump(pubsub)
            except Exception as exc:  # any failure: log it, reconnect, never die silently
                if not failing:
                    log.warning(
                        "flowlock: the Redis pub/sub subscription failed (%s); waiters fall back "
                        "to the holder's expiry until it is back",
                        exc,
                    )
                failing = True
            finally:
                self.listening = False
                first_try.set()
                # A connection killed under it may fail to say goodbye: that must not end the
                # listener (a failure here would escape the loop).
                with contextlib.suppress(*DRIVER_ERRORS):
                    await asyncio.shield(pubsub.aclose())  # type: ignore[no-untyped-call, unused-ignore]
            await asyncio.sleep(delay * (0.5 + self._rng.random()))
            delay = min(delay * 2, _RECONNECT_MAX)

    async def _subscribe(self, pubsub: PubSub) -> None:
        """PSUBSCRIBE and wait for the server's confirmation, within the bound."""
        async with asyncio.timeout(self._bound):
            await pubsub.psubscribe(self._pattern)
            while True:
                message = await pubsub.get_message(timeout=self._bound)
                if message is not None and message["type"] == "psubscribe":
                    return

    async def _pump(self, pubsub: PubSub) -> None:
        # Housekeeping time, not a lease deadline: the loop's own clock, not the injected one.
        clock = asyncio.get_running_loop().time
        last_heard = clock()
        pinged: float | None = None
        while True:
            message = await pubsub.get_message(timeout=_LISTEN_TICK)
            now = clock()
            if message is not None:
                last_heard, pinged = now, None
                if message["type"] == "pmessage":
                    channel = text(message["channel"])
                    if channel is not None:
                        self._wakeups.released(channel)
            elif pinged is not None:
                if now - pinged > self._bound:
                    raise TimeoutError("no answer to PING on the pub/sub connection")
            elif now - last_heard >= _PING_AFTER:
                await pubsub.ping()
                pinged = now
