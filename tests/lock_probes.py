"""What the lock tests use to wait for a cause instead of sleeping for it, and to see a waiter's
state on the server instead of guessing it from the time.

- :func:`wait_until` polls a condition with a generous deadline (a slow machine only makes it
  poll longer; a condition that never comes fails the test with a message).
- :class:`Sleepers` counts the Redis backend's waiters and watchers that are asleep (waiting for a
  release, the holder's expiry or their own bound), so a test knows a waiter is queued.
- :class:`Attempts` counts a Redis backend's acquire-script calls (a poller makes many, a woken
  waiter one per wake), and lets a test act just before a given call.
- :func:`advisory_sessions` reads an advisory lock's holder and queue from ``pg_locks`` and
  ``pg_stat_activity``: a waiter in PostgreSQL's lock queue shows as ``granted = false``, and
  its statement's ``query_start`` stays put for as long as that one statement waits.
- :class:`Monotonic` is an injectable monotonic clock the test moves forward, and
  :class:`WallClock` a stand-in for ``time.time`` that jumps (by an hour, say) and records
  which flowlock modules read it.
- :class:`Ticks` stands in for the lease watchdog's sleeps: it renews when the test says so.
"""

from __future__ import annotations

import asyncio
import inspect
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

import asyncpg
import pytest
from redis.commands.core import AsyncScript

import flowlock.locks.base
from flowlock.locks.redis import RedisLocks, wakeups

__all__ = [
    "Attempts",
    "Monotonic",
    "Session",
    "Sleepers",
    "Ticks",
    "WallClock",
    "advisory_sessions",
    "wait_until",
]


async def wait_until(
    check: Callable[[], bool | Awaitable[bool]], *, within: float = 10.0, what: str = "it"
) -> None:
    """Return as soon as ``check()`` is true; fail the test if it is still false after
    ``within`` seconds (a generous bound: the condition is a cause, not a speed). A check may
    also raise AssertionError: it counts as false, and the last one is in the failure."""
    deadline = time.monotonic() + within
    last = ""
    while True:
        try:
            result = check()
            if inspect.isawaitable(result):
                result = await result
        except AssertionError as error:
            result, last = False, f": {error}"
        if result:
            return
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} did not happen within {within:.0f} s{last}")
        await asyncio.sleep(0.01)


class Sleepers:
    """Stands in for ``flowlock.locks.redis.wakeups.wait_for``, through which every waiter
    (``Place.wait``) and watcher (``Watch.wait``) of a Redis backend sleeps, and counts them:
    ``now`` asleep at this moment, ``total`` sleeps begun. Undone with the test's monkeypatch."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 0
        self.total = 0
        self._real = wakeups.wait_for
        monkeypatch.setattr(wakeups, "wait_for", self._wait_for)

    async def _wait_for(self, event: asyncio.Event, seconds: float) -> bool:
        self.now += 1
        self.total += 1
        try:
            return await self._real(event, seconds)
        finally:
            self.now -= 1

    async def settled(self, count: int, *tasks: asyncio.Task[Any]) -> None:
        """Until ``count`` waiters or watchers are asleep; none of ``tasks`` may have ended."""
        await wait_until(lambda: self.now >= count, what=f"{count} waiters asleep")
        assert not any(task.done() for task in tasks), [t for t in tasks if t.done()]


class Attempts:
    """Wraps a backend's acquire script: counts the calls and keeps their replies (status,
    fencing token or the holder's PTTL), and lets a test act around them: ``before[n]`` runs
    just before call ``n`` (it may raise, as a failing call would), ``after`` gets each reply
    as it comes back.

    Attempts that go together through the many-lock script (coalesced calls, or
    ``try_acquire_many``) count one call each and their replies are kept the same way;
    ``before`` applies to the one-lock script's calls only."""

    def __init__(self, locks: RedisLocks) -> None:
        assert locks._scripts is not None and locks._runner is not None
        self._script = locks._scripts[0]
        self.calls = 0
        self.replies: list[tuple[int, int]] = []
        self.before: dict[int, Callable[[], Awaitable[None]]] = {}
        self.after: Callable[[tuple[int, int]], None] | None = None
        # The wrapper stands in for the acquire script: it is called the same way.
        locks._scripts = (cast(AsyncScript, self), *locks._scripts[1:])
        self._many = locks._runner.acquire
        locks._runner.acquire = self._acquire_many  # type: ignore[method-assign]

    async def _acquire_many(self, attempts: Any, **kwargs: Any) -> Any:
        self.calls += len(attempts)
        answers = await self._many(attempts, **kwargs)
        for answer in answers:
            if not isinstance(answer, BaseException):
                self.replies.append((int(answer[0]), int(answer[1])))
                if self.after is not None:
                    self.after(self.replies[-1])
        return answers

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        hook = self.before.get(self.calls)
        if hook is not None:
            await hook()
        reply = await self._script(*args, **kwargs)
        self.replies.append((int(reply[0]), int(reply[1])))
        if self.after is not None:
            self.after(self.replies[-1])
        return reply


@dataclass(frozen=True)
class Session:
    """A PostgreSQL session holding or queued for an advisory lock."""

    pid: int
    granted: bool
    query_start: datetime
    wait_event_type: str | None


async def advisory_sessions(conn: asyncpg.Connection, lock_id: int) -> list[Session]:
    """The sessions holding (``granted``) or queued for the bigint advisory lock ``lock_id`` in
    this database, read on ``conn`` (a plain connection of the test's own)."""
    unsigned = lock_id & 0xFFFF_FFFF_FFFF_FFFF
    rows = await conn.fetch(
        "SELECT l.pid, l.granted, a.query_start, a.wait_event_type"
        "  FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
        " WHERE l.locktype = 'advisory'"
        "   AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        "   AND l.classid = $1::bigint::oid AND l.objid = $2::bigint::oid AND l.objsubid = 1"
        " ORDER BY l.granted DESC, a.query_start",
        unsigned >> 32,
        unsigned & 0xFFFF_FFFF,
    )
    return [Session(r["pid"], r["granted"], r["query_start"], r["wait_event_type"]) for r in rows]


class Monotonic:
    """An injected monotonic clock: real monotonic time plus what the test moves it by."""

    def __init__(self) -> None:
        self.moved = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.moved


class WallClock:
    """A stand-in for ``time.time`` (set it with the test's monkeypatch): the real wall clock
    shifted by ``offset``, which :meth:`jump` moves; ``readers`` names every flowlock module that
    read it."""

    def __init__(self, real: Callable[[], float]) -> None:
        self._real = real
        self.offset = 0.0
        self.readers: set[str] = set()

    def __call__(self) -> float:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith("flowlock"):
            self.readers.add(caller)
        return self._real() + self.offset

    def jump(self, seconds: float) -> None:
        self.offset += seconds


class Ticks:
    """Stands in for the ``asyncio`` module inside ``flowlock.locks.base`` (set with
    :meth:`install`): each of the lease watchdog's sleeps waits for one :meth:`tick` of the
    test, and ``delays`` keeps what each asked for. Everything else is asyncio's."""

    def __init__(self) -> None:
        self._ticks = asyncio.Semaphore(0)
        self.delays: list[float] = []

    @classmethod
    def install(cls, monkeypatch: pytest.MonkeyPatch) -> Ticks:
        ticks = cls()
        monkeypatch.setattr(flowlock.locks.base, "asyncio", ticks)
        return ticks

    def __getattr__(self, name: str) -> Any:
        return getattr(asyncio, name)

    async def sleep(self, delay: float) -> None:
        self.delays.append(delay)
        await self._ticks.acquire()

    def tick(self) -> None:
        self._ticks.release()
