"""Per-instance conflict monitor and the escalation decisions of the adaptive strategy.

The seed's advice: default to optimistic, watch the conflict-retry rate, and when it passes 5 %
for a resource, escalate that resource to a lock. The monitor keeps, for each *hot* key only (a
key is tracked from its first conflict; the least recently used are evicted past `max_keys`),
a sliding window of its last `window` optimistic attempts no older than `window_seconds`,
with running sums so recording is O(1). A key escalates when, with at least `min_samples`
attempts in its window, the conflict rate is above `threshold` with confidence: the lower Wilson
bound of the rate (`z` = 3, about 99.9 % one-sided) exceeds it. Why a bound and not the
raw rate: at a steady 3 % conflict rate a 20-attempt window holds 2 or more conflicts (10 %)
about one time in eight, so a raw-rate rule flaps; the bound needs more evidence from a small
window and little from a storm (19 conflicts in 20 attempts escalates at once).

Hysteresis: an escalated key stays escalated until `cooldown` seconds have passed with no
contention seen on it (a conflict, or a call that found another call on the same key in flight);
every contended call pushes that moment back. So a key under steady pressure never flaps, and a
key steps back down once its storm is over.

Escalations are shared through an [`EscalationBoard`][flowlock.stores.base.EscalationBoard]
(PostgreSQL in production): an [`EscalationSync`][flowlock.strategies.monitor.EscalationSync] per
engine publishes the monitor's decisions there and adopts the others' about twice a second, so a
fleet escalates together.

Clocks: every deadline here is on the monotonic clock. What an escalation shares with other
engines, its end (`Escalation.until`), is counted on the board's clock (the database server's
for PostgreSQL), which each sync reads: `until` is that clock's time at the sync plus what is
left of the local monotonic deadline, and an adopted escalation's deadline is the local
monotonic time plus what is left of its `until`. The local wall clock is never read, so a host
whose clock is changed by an hour neither ends an escalation early nor keeps it an hour longer,
and hosts whose clocks disagree agree on when it ends. (A change of the database server's own
clock moves every escalation's end by as much; an escalation only picks the strategy, every
strategy applies each transition exactly once, so the cost is an instance escalated longer or
shorter than its cool-down.)
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from flowlock.core.errors import FlowlockError
from flowlock.core.models import Escalation
from flowlock.core.settings import check_count, check_number, check_seconds, check_text
from flowlock.stores.base import EscalationBoard

__all__ = ["ConflictMonitor", "EscalationRecorder", "EscalationSync"]

log = logging.getLogger("flowlock")

# Ceilings that catch a mistake, far above any useful setting: a window is a few hundred
# attempts, the keys tracked a bounded share of memory, z a number of standard deviations.
_MAX_WINDOW = 1_000_000
_MAX_KEYS = 100_000_000
_MAX_Z = 100.0


@dataclass(slots=True)
class _Window:
    events: deque[tuple[float, bool]] = field(default_factory=deque)
    attempts: int = 0
    conflicts: int = 0

    def add(self, now: float, conflict: bool, size: int, horizon: float) -> None:
        self.events.append((now, conflict))
        self.attempts += 1
        self.conflicts += conflict
        while self.events and (len(self.events) > size or self.events[0][0] < now - horizon):
            _, old = self.events.popleft()
            self.attempts -= 1
            self.conflicts -= old


class ConflictMonitor:
    """Decides, per key, whether calls should run optimistic or escalated.

    `escalate_to` is the strategy name escalated keys run under ("pessimistic", or
    "distributed" for cross-service workflows). `clock` is monotonic seconds, the clock of
    every deadline. `wall` is the clock an escalation's `until` is counted on when shared;
    by default the board's own clock, as the last sync read it (see
    [`observe_board_time`][flowlock.strategies.monitor.ConflictMonitor.observe_board_time]), carried
    forward on `clock`: the local wall clock is never read. Both injectable for tests.
    """

    def __init__(
        self,
        *,
        threshold: float = 0.05,
        min_samples: int = 20,
        window: int = 200,
        window_seconds: float = 10.0,
        cooldown: float = 5.0,
        max_keys: int = 10_000,
        escalate_to: str = "pessimistic",
        z: float = 3.0,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] | None = None,
    ) -> None:
        check_number("threshold", threshold, above=0, below=1)
        check_count("window", window, most=_MAX_WINDOW, unit="attempts")
        check_count("min_samples", min_samples, most=window, unit="attempts")
        check_seconds("window_seconds", window_seconds)
        check_seconds("cooldown", cooldown)
        check_count("max_keys", max_keys, most=_MAX_KEYS, unit="instances")
        check_number("z", z, least=0, most=_MAX_Z)
        check_text("escalate_to", escalate_to, most=100)
        self.threshold = threshold
        self.min_samples = min_samples
        self.window = window
        self.window_seconds = window_seconds
        self.cooldown = cooldown
        self.max_keys = max_keys
        self.escalate_to = escalate_to
        self.z = z
        self._clock = clock
        self._wall_given = wall
        # The board's clock minus ours, as of the last sync (0 before one: nothing was shared
        # yet, and nothing is published before a sync has read the board's clock).
        self._board_offset = 0.0
        self._windows: OrderedDict[str, _Window] = OrderedDict()
        self._in_flight: dict[str, int] = {}
        # key -> (escalation, local monotonic deadline)
        self._escalated: dict[str, tuple[Escalation, float]] = {}
        self._pending: list[Escalation] = []
        # key -> the ``until`` last published or adopted for it (on the board's clock), and
        # those of keys stepped down here (not to be adopted back from the board).
        self._shared: dict[str, float] = {}
        self._stepped_down: dict[str, float] = {}
        self.escalations = 0
        """Keys escalated here, by this monitor or adopted from the board."""
        self.adopted = 0
        """Of [`escalations`][flowlock.strategies.monitor.ConflictMonitor.escalations], those
        adopted from the board: decided by another engine."""
        self.deescalations = 0

    # -- the hot path ------------------------------------------------------------------------

    def escalated(self, key: str) -> Escalation | None:
        """The escalation `key` is under now, or None (stepping it down if its time is up)."""
        found = self._escalated.get(key)
        if found is None:
            return None
        escalation, deadline = found
        if self._clock() >= deadline:
            del self._escalated[key]
            # The board still holds this escalation until its own deadline (on its clock, a
            # round trip later than ours); do not adopt it back from there as if another engine
            # had decided it.
            self._stepped_down[key] = self._shared.pop(key, escalation.until)
            self.deescalations += 1
            log.info(
                "flowlock: %r steps back down to optimistic: no contention for %.1f s",
                key,
                self.cooldown,
            )
            return None
        return escalation

    def enter(self, key: str) -> bool:
        """A call on `key` starts; True if another call on it is already in flight here."""
        n = self._in_flight.get(key, 0)
        self._in_flight[key] = n + 1
        return n > 0

    def leave(self, key: str) -> None:
        n = self._in_flight.get(key, 1) - 1
        if n:
            self._in_flight[key] = n
        else:
            self._in_flight.pop(key, None)

    def record(self, key: str, *, conflict: bool, escalate: bool = True) -> Escalation | None:
        """One optimistic attempt on `key`; returns the escalation it triggered, if any.
        `escalate=False` only counts it (a constraint's key: no strategy frees a full key)."""
        win = self._windows.get(key)
        if win is None:
            if conflict:
                # Only hot keys are tracked (a quiet key costs one dict lookup). The conflict
                # that makes a key hot is not counted: a window opened by a conflict would
                # otherwise start biased towards conflicts.
                self._windows[key] = _Window()
                if len(self._windows) > self.max_keys:
                    self._windows.popitem(last=False)
            return None
        self._windows.move_to_end(key)
        now = self._clock()
        win.add(now, conflict, self.window, self.window_seconds)
        if not escalate:
            return None
        if conflict and key in self._escalated:
            self.contended(key)
        if key in self._escalated or win.attempts < self.min_samples:
            return None
        rate = win.conflicts / win.attempts
        if _wilson_lower(win.conflicts, win.attempts, self.z) <= self.threshold:
            return None
        reason = (
            f"conflict rate {rate:.1%} over the last {win.attempts} attempts "
            f"exceeds {self.threshold:.0%}"
        )
        return self._escalate(key, reason)

    def contended(self, key: str) -> None:
        """Contention seen on an escalated key: push its step-down back by `cooldown`."""
        found = self._escalated.get(key)
        if found is not None:
            until = self.board_time() + self.cooldown
            refreshed = Escalation(key, found[0].strategy, until, found[0].reason)
            self._escalated[key] = (refreshed, self._clock() + self.cooldown)
            self._pending.append(refreshed)

    def rate(self, key: str) -> tuple[int, int]:
        """(conflicts, attempts) in the key's current window."""
        win = self._windows.get(key)
        return (0, 0) if win is None else (win.conflicts, win.attempts)

    def escalations_now(self) -> list[tuple[Escalation, float]]:
        """Every escalation in force, with the seconds left before it steps down, longest
        first. A read for a console: it steps nothing down (the next call on a key does)."""
        now = self._clock()
        found = [(e, deadline - now) for e, deadline in self._escalated.values() if deadline > now]
        return sorted(found, key=lambda item: -item[1])

    def hot_keys(self, limit: int = 50) -> list[tuple[str, int, int]]:
        """Up to `limit` tracked keys as (key, conflicts, attempts) in their current windows,
        highest conflict rate first (a key is tracked from its first conflict)."""
        check_count("limit", limit, most=_MAX_KEYS, unit="keys")
        rows = [(k, w.conflicts, w.attempts) for k, w in self._windows.items() if w.attempts]
        rows.sort(key=lambda r: (-r[1] / r[2], -r[2], r[0]))
        return rows[:limit]

    def _escalate(self, key: str, reason: str) -> Escalation:
        escalation = Escalation(key, self.escalate_to, self.board_time() + self.cooldown, reason)
        self._escalated[key] = (escalation, self._clock() + self.cooldown)
        self._windows.pop(key, None)  # a fresh window when it steps back down
        self._pending.append(escalation)
        self.escalations += 1
        log.warning("flowlock: escalating %r to %s: %s", key, self.escalate_to, reason)
        return escalation

    # -- sharing -------------------------------------------------------------------------------

    @property
    def active_count(self) -> int:
        return len(self._escalated)

    def board_time(self) -> float:
        """Now on the clock shared escalations are counted on (see the class's `wall`)."""
        if self._wall_given is not None:
            return self._wall_given()
        return self._clock() + self._board_offset

    def observe_board_time(self, now: float) -> None:
        """The board's clock reads `now` (just read from it): from here on, shared `until`
        values are counted on it, carried forward on the monotonic clock."""
        self._board_offset = now - self._clock()

    def take_pending(self) -> list[Escalation]:
        """Escalations decided (or extended) here since the last call, to publish: each with
        `until` on the board's clock, from what is left of its local deadline now.

        An extension waits while the board's copy still has over half a cool-down to run.
        Why: every contended call extends its key, and publishing each key at every sync
        tick costs a statement per escalated key twice a second. The other engines still see
        the key escalated, for at least half a cool-down more, until the refresh goes out.

        Call `published(e)` for each one the board took, and `unpublished(rest)` for the
        ones it did not: the board's copy is known fresh only once a publish succeeded.
        """
        pending, self._pending = self._pending, []
        board, mono = self.board_time(), self._clock()
        latest: dict[str, Escalation] = {}
        later: dict[str, Escalation] = {}
        for e in pending:
            found = self._escalated.get(e.key)
            if found is None or found[1] <= mono:
                continue
            shared = self._shared.get(e.key)
            if shared is not None and shared - board > self.cooldown / 2:
                later[e.key] = e  # kept: published once the board's copy runs low
                continue
            until = board + (found[1] - mono)
            latest[e.key] = Escalation(e.key, found[0].strategy, until, found[0].reason)
        self._pending = [e for key, e in later.items() if key not in latest]
        return list(latest.values())

    def published(self, escalation: Escalation) -> None:
        """The board now holds `escalation` (from `take_pending`): later extensions of its
        key may wait until that copy runs low."""
        key = escalation.key
        self._shared[key] = max(self._shared.get(key, -math.inf), escalation.until)

    def unpublished(self, escalations: Sequence[Escalation]) -> None:
        """The board did not take `escalations` (from `take_pending`): queue them again, for
        the next round. Each goes out then with what is left of its local deadline."""
        self._pending = [*escalations, *self._pending]

    def adopt(self, shared: Mapping[str, Escalation]) -> None:
        """Take escalations decided elsewhere (from the board)."""
        wall, mono = self.board_time(), self._clock()
        self._stepped_down = {k: u for k, u in self._stepped_down.items() if u > wall - 60}
        for key, escalation in shared.items():
            # Within a millisecond: a database keeps timestamps to the microsecond, so the
            # board's copy of our own ``until`` may come back a hair later than we sent it.
            if escalation.until <= self._stepped_down.get(key, -math.inf) + 1e-3:
                continue
            self._shared[key] = max(self._shared.get(key, -math.inf), escalation.until)
            deadline = mono + max(0.0, escalation.until - wall)
            mine = self._escalated.get(key)
            if mine is None:
                self.escalations += 1
                self.adopted += 1
                # INFO, not WARNING: the engine that decided it logged the warning once.
                log.info(
                    "flowlock: escalating %r to %s (decided by another engine: %s)",
                    key,
                    escalation.strategy,
                    escalation.reason,
                )
                self._escalated[key] = (escalation, deadline)
            elif mine[1] < deadline:
                self._escalated[key] = (mine[0], deadline)


class EscalationRecorder(Protocol):
    """Told after every sync tick how many keys are escalated and what changed since the last
    tick
    ([`flowlock.metrics.Metrics.record_escalations`][flowlock.metrics.Metrics.record_escalations] is
    one)."""

    def __call__(self, *, active: int, escalated: int, deescalated: int, to: str) -> None: ...


class EscalationSync:
    """Shares `monitor`'s escalations with the other engines on `board`, every `interval`
    seconds between [`start`][flowlock.strategies.monitor.EscalationSync.start] and
    [`stop`][flowlock.strategies.monitor.EscalationSync.stop]: publish ours, adopt theirs. Each
    round is bounded; a failed one is logged and retried on the next tick (the local monitor keeps
    working without the board). `record`, when given, is told the counts after every tick.
    """

    def __init__(
        self,
        board: EscalationBoard,
        monitor: ConflictMonitor,
        *,
        interval: float = 0.5,
        record: EscalationRecorder | None = None,
    ) -> None:
        check_seconds("escalation_sync", interval)
        self.board = board
        self.monitor = monitor
        self.interval = interval
        self._record = record
        self._seen = (monitor.escalations, monitor.deescalations)
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None

    def start(self) -> None:
        """Start syncing in the background (on the running loop). Idempotent."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="flowlock-sync")

    async def stop(self) -> None:
        """Stop syncing and wait for the loop to end. Idempotent."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.tick()

    async def tick(self) -> None:
        """One round: publish the escalations decided here, adopt the board's, record."""
        board, monitor = self.board, self.monitor
        try:
            async with asyncio.timeout(max(1.0, 4 * self.interval)):
                # The board's clock first: what is published and adopted is counted on it.
                monitor.observe_board_time(await board.now())
                await _publish(board, monitor)
                shared = await board.active(monitor.board_time())
            monitor.adopt({e.key: e for e in shared})
        except Exception as exc:
            # Why every Exception: this loop runs for the engine's whole life, and an error the
            # board failed to translate must not end it (escalations would silently stop being
            # shared). A flowlock error is an expected outage, logged in one line; anything else
            # is a bug, logged with its traceback. (CancelledError, how stop() ends the loop, is
            # not an Exception.)
            log.warning(
                "flowlock: sharing escalations failed, retrying: %s",
                exc if isinstance(exc, FlowlockError) else f"{type(exc).__name__}: {exc}",
                exc_info=not isinstance(exc, FlowlockError | TimeoutError),
            )
        up, down = monitor.escalations, monitor.deescalations
        if self._record is not None:
            self._record(
                active=monitor.active_count,
                escalated=up - self._seen[0],
                deescalated=down - self._seen[1],
                to=monitor.escalate_to,
            )
        self._seen = (up, down)


async def _publish(board: EscalationBoard, monitor: ConflictMonitor) -> None:
    """Publish the monitor's pending escalations. The ones not published (the board failed,
    or the round timed out) are queued again: else the monitor would take the board's copy
    for fresh and hold back the key's extensions while other engines see nothing."""
    pending = monitor.take_pending()
    done = 0
    try:
        for escalation in pending:
            await board.publish(escalation)
            monitor.published(escalation)
            done += 1
    finally:
        if done < len(pending):
            monitor.unpublished(pending[done:])


def _wilson_lower(conflicts: int, attempts: int, z: float) -> float:
    """The lower Wilson score bound of a rate of `conflicts` in `attempts`."""
    p, n, z2 = conflicts / attempts, attempts, z * z
    centre = p + z2 / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return (centre - spread) / (1 + z2 / n)
