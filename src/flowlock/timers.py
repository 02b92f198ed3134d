"""The timer service: fires an engine's due timers through the engine, once each.

Every engine runs one (unless `timers=False`). Each due timer is claimed by one engine for a
lease, fired like any call (the workflow's strategy, batching included) under the request id
of its firing, and given up if the firing may succeed later. The timers guide says what a
stay is and how timers behave across deploys, downtime and clock changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from flowlock import tracing
from flowlock.core.admin import InstancePaused
from flowlock.core.errors import (
    ConcurrencyError,
    DefinitionError,
    DefinitionMismatch,
    EngineClosed,
    FlowlockError,
    GuardRejected,
    InstanceNotFound,
    InvalidInput,
    StaleTimer,
    StepFailed,
    StoreError,
    TransitionNotAllowed,
    UnknownEvent,
    UnknownWorkflow,
)
from flowlock.core.models import Outcome, Timer
from flowlock.core.settings import check_count, check_seconds
from flowlock.stores.base import ArmedSignal, TimerStore

if TYPE_CHECKING:
    from flowlock.metrics import Metrics

__all__ = [
    "DEFAULT_LEASE",
    "DEFAULT_TIMER_BATCH",
    "IDLE_BOUND",
    "OUTCOMES",
    "TimerService",
]

log = logging.getLogger("flowlock.timers")

DEFAULT_LEASE = 30.0
"""Seconds an engine holds a timer it claimed before another engine may claim it again."""
DEFAULT_TIMER_BATCH = 64
"""The most firings one engine has in flight at once."""
IDLE_BOUND = 300.0
"""The longest the service sleeps without looking at the store: a safety net only. A timer
armed earlier wakes it (NOTIFY on PostgreSQL), and it otherwise sleeps until the next due time."""
_RETRY_BACKOFF = (0.05, 2.0)
COUNT_EVERY = 60.0
"""Seconds between two counts of the armed timers for the metrics gauge."""
RETRY_FIRING = 0.25
"""Seconds between a firing that failed for a reason that may pass (a lock, a lost race, the
store; its claim given back) and the service's next look: soon, but no tight loop while the
reason lasts."""

OUTCOMES = ("applied", "idempotent", "stale", "refused", "cancelled", "paused", "failed")
"""The `outcome` label of `flowlock_timer_firings_total`:

- applied: this engine's firing wrote the transition;
- idempotent: it was applied already (by another engine, or a caller's same event);
- stale: the instance had left the stay that armed it; nothing written, the timer deleted;
- refused: the guard refused; that firing is cancelled (a reminder's next one stays armed);
- cancelled: the event no longer fires from the state (a changed definition), or the
  instance is gone; the timer is deleted;
- paused: an operator paused the instance or its workflow; the timer is kept, claimed until
  its lease runs out (the back-off), then due again, as often as it takes, until a resume;
- failed: it may succeed later. A lock, a lost race or the store: the claim is given up and
  the timer fires again soon. A step that failed, or an event this engine's definition does
  not know (an older engine in a rolling deploy): the claim runs out, then any engine may
  fire it.
"""

FireTimer = Callable[[Timer], Awaitable[Outcome]]


def _owner() -> str:
    """This engine's name on the claims it takes: host, process, a random part."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class TimerService:
    """Claims due timers from `store` and fires each through `fire`, until stopped.

    `workflows` answers which workflows this engine runs (only their timers are claimed);
    `wake()` makes the service look again at once (a workflow was registered).
    """

    def __init__(
        self,
        store: TimerStore,
        fire: FireTimer,
        workflows: Callable[[], Sequence[str]],
        *,
        lease: float = DEFAULT_LEASE,
        batch: int = DEFAULT_TIMER_BATCH,
        metrics: Metrics | None = None,
    ) -> None:
        self._store = store
        self._fire = fire
        self._workflows = workflows
        self.lease = check_seconds("timer_lease", lease)
        self.batch = check_count("timer_batch", batch, most=10_000, unit="firings")
        self._metrics = metrics
        self.owner = _owner()
        self._task: asyncio.Task[None] | None = None
        self._flights: set[asyncio.Task[None]] = set()
        self._poke = asyncio.Event()
        self.fired = 0
        self._counted = -COUNT_EVERY

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="flowlock-timers")

    def wake(self) -> None:
        self._poke.set()

    async def stop(self) -> None:
        """Stop claiming; firings in flight finish (each is bounded) before it returns."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception:  # its own failure must not fail the engine's close
                log.exception("flowlock timers: the service had stopped on an error")
        if self._flights:
            await asyncio.gather(*self._flights, return_exceptions=True)

    async def _run(self) -> None:
        store = self._store
        backoff = _RETRY_BACKOFF[0]
        async with store.armed() as armed:
            while True:
                names = list(self._workflows())
                armed.clear()
                self._poke.clear()
                if len(self._flights) >= self.batch:
                    # Full: claim more only once a firing lands (what is claimed, fires soon).
                    await asyncio.wait(set(self._flights), return_when=asyncio.FIRST_COMPLETED)
                room = self.batch - len(self._flights)
                try:
                    claimed = (
                        await store.claim_timers(
                            names, limit=room, lease=self.lease, owner=self.owner
                        )
                        if names
                        else []
                    )
                    for timer in claimed:
                        flight = asyncio.create_task(self._one(timer))
                        self._flights.add(flight)
                        flight.add_done_callback(self._flights.discard)
                    await self._count()
                    if claimed and len(claimed) == room:
                        continue  # more may be due
                    delay = await store.next_due(names) if names else None
                except EngineClosed:
                    return
                except Exception as exc:
                    if isinstance(exc, FlowlockError):
                        log.warning("flowlock timers: %s; looking again in %.2fs", exc, backoff)
                    else:
                        log.exception("flowlock timers: looking again in %.2fs", backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, _RETRY_BACKOFF[1])
                    continue
                if not claimed and delay is not None and delay <= 0:
                    # Due, yet nothing could be claimed: rows locked by a transaction still open
                    # (SKIP LOCKED passed them). Look again after a pause that grows, not at once.
                    await self._sleep(armed, backoff)
                    backoff = min(backoff * 2, _RETRY_BACKOFF[1])
                    continue
                backoff = _RETRY_BACKOFF[0]
                wait = IDLE_BOUND if delay is None else min(delay, IDLE_BOUND)
                if wait > 0:
                    await self._sleep(armed, wait)

    async def _sleep(self, armed: ArmedSignal, seconds: float) -> None:
        """Sleep `seconds` (until the next due time), or less: until `wake()`, or until a timer
        is armed that falls due before then. Arms due later leave the sleep alone."""
        loop = asyncio.get_running_loop()
        until = loop.time() + seconds
        while (left := until - loop.time()) > 0:
            await _first_of(armed, self._poke, left)
            if self._poke.is_set():
                return
            if armed.is_set():
                if armed.earliest is None or armed.earliest < until:
                    return
                armed.clear()

    async def _count(self) -> None:
        """Refresh `flowlock_timers_armed`, at most every COUNT_EVERY seconds and only while
        the service is awake (an idle service sends nothing)."""
        if self._metrics is None or time.monotonic() - self._counted < COUNT_EVERY:
            return
        self._counted = time.monotonic()
        self._metrics.record_timers_armed(await self._store.count_timers())

    async def _one(self, timer: Timer) -> None:
        """Fire one claimed timer and record how it went."""
        started = time.monotonic()
        span = tracing.timer_span(timer) if tracing.AVAILABLE else None
        label = "failed"
        try:
            with span if span is not None else contextlib.nullcontext() as current:
                label = await self._outcome(timer)
                if current is not None:
                    current.set_attribute("flowlock.timer.outcome", label)
        except Exception:  # a bug: logged, never kills the service
            log.exception("flowlock timers: firing %s crashed", _name(timer))
        if label != "paused":  # a paused one was not fired: it waits for its lease, then is due
            self.fired += 1
        if timer.every is not None or len(self._flights) <= 1:
            # A reminder moved on, or the last firing in flight landed: the next due time may
            # have changed (a commit elsewhere notifies only when it arms the earliest timer).
            self._poke.set()
        if self._metrics is not None:
            lag = timer.lag + (time.monotonic() - started)
            self._metrics.record_timer(label, lag if label in ("applied", "idempotent") else None)

    async def _outcome(self, timer: Timer) -> str:
        store = self._store
        try:
            outcome = await self._fire(timer)
        except StaleTimer:
            await store.drop_timer(timer)  # its stay ended: no later firing either
            return "stale"
        except InstancePaused as exc:
            # Kept, and left claimed: the lease is the back-off. Given back now, it would be
            # claimed again at once, in a loop as long as the pause.
            log.info("flowlock timers: %s waits: %s", _name(timer), exc)
            return "paused"
        except GuardRejected as exc:
            log.info("flowlock timers: %s refused by its guard: %s", _name(timer), exc.reason)
            await store.cancel_timer(timer)  # this firing only: a reminder's next one stays
            return "refused"
        except (UnknownEvent, UnknownWorkflow, DefinitionMismatch) as exc:
            # This engine's definition does not know the event, or the instance runs a version
            # this engine lacks (a rolling deploy): left claimed, it goes to an engine that has
            # it once the lease runs out.
            log.warning("flowlock timers: %s left to another engine: %s", _name(timer), exc)
            return "failed"
        except (TransitionNotAllowed, InstanceNotFound) as exc:
            # The event no longer fires from this state (a changed definition), or the instance
            # was deleted: this firing can never apply, and neither can a later one.
            log.warning("flowlock timers: %s cancelled: %s", _name(timer), exc)
            await store.drop_timer(timer)
            return "cancelled"
        except (StepFailed, DefinitionError, InvalidInput) as exc:
            # A failing step is a bug to fix, not a race: left claimed, it fires again once
            # the lease runs out rather than at once in a loop.
            log.error("flowlock timers: %s failed: %s; it fires again later", _name(timer), exc)
            return "failed"
        except (ConcurrencyError, StoreError, EngineClosed) as exc:
            log.info("flowlock timers: %s will fire again: %s", _name(timer), exc)
            with contextlib.suppress(FlowlockError):
                await store.release_timer(timer, self.owner)
            # The service may be asleep until this claim's lease runs out (minutes): look
            # again soon, so that the timer fires once the reason passed, not a lease later.
            asyncio.get_running_loop().call_later(RETRY_FIRING, self._poke.set)
            return "failed"
        return "applied" if outcome.applied else "idempotent"


def _name(timer: Timer) -> str:
    return f"timer {timer.event!r} of {timer.instance_id!r} (stay {timer.stay}, firing {timer.n})"


async def _first_of(first: asyncio.Event, second: asyncio.Event, seconds: float) -> None:
    """Wait until either event is set, at most `seconds`."""
    waits = [asyncio.ensure_future(first.wait()), asyncio.ensure_future(second.wait())]
    try:
        await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
