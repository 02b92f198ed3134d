"""The outbox dispatcher: delivers an engine's outbox messages to their handlers.

Every open engine with handlers runs one (unless `outbox=False`), as every engine runs a
timer service. Due messages are claimed by one engine for a lease, in runs (an instance's
next messages of one kind, taken together), handed to the handler of their kind one after
another in order, and marked done, retried later with backoff, or dead. Delivery is at least
once: a claimer that dies mid-handler loses its claim when the lease runs out, and another
engine delivers the message again, under the same key. The outbox guide says more.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import random
import socket
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

from flowlock import tracing
from flowlock.core.admin import InstancePaused
from flowlock.core.errors import (
    ConcurrencyError,
    DefinitionError,
    DeliveryFailed,
    DeliveryRefused,
    EngineClosed,
    FlowlockError,
    IdempotencyKeyReused,
    InstanceNotFound,
    InvalidInput,
    StepFailed,
    StoreError,
    TransitionRefused,
    UnknownWorkflow,
)
from flowlock.core.models import Outcome
from flowlock.core.outbox import Message, Then
from flowlock.core.settings import check_seconds
from flowlock.stores.base import OutboxStore

if TYPE_CHECKING:
    from flowlock.metrics import Metrics

__all__ = [
    "BACKOFF",
    "CLOSE_GRACE",
    "COUNT_EVERY",
    "DEFAULT_LEASE",
    "IDLE_BOUND",
    "OUTCOMES",
    "PURGE_BATCH",
    "PURGE_EVERY",
    "RUN",
    "Dispatcher",
    "Handler",
    "HandlerFn",
    "backoff_delay",
]

log = logging.getLogger("flowlock.outbox")

HandlerFn: TypeAlias = Callable[[Message], "Awaitable[Then | None] | Then | None"]
"""A handler: takes the message, returns None (done) or a `Then`; async, or sync (run in a
worker thread)."""
FireThen = Callable[[Message, Then], Awaitable[Outcome]]

DEFAULT_LEASE = 60.0
"""Seconds a claimed message is this engine's before another engine may deliver it again."""
BACKOFF = (1.0, 300.0)
"""Seconds before the first retry of a failed delivery, and the most between two: the wait
doubles with each attempt up to the cap, and a random part of it is taken (full jitter)."""
IDLE_BOUND = 300.0
"""The longest the dispatcher sleeps without looking at the store: a safety net only. A commit
that writes a message wakes it (NOTIFY on PostgreSQL)."""
COUNT_EVERY = 60.0
"""Seconds between two counts of the messages for the pending and dead gauges."""
PURGE_EVERY = 60.0
"""Seconds between two purges of done messages older than `outbox_retention`."""
PURGE_BATCH = 1000
"""Done messages deleted by one statement of a purge (it repeats while it gets as many)."""
CLOSE_GRACE = 10.0
"""Seconds a closing engine waits for the deliveries in flight; those still running are
cancelled and their claims given back, so another engine delivers them at once."""
RUN = 32
"""The most messages of one instance one claim takes (a run): they are delivered in order, one
after another, by one lane of their kind. A hot instance's backlog then costs a claim per run,
not per message. A failure ends the run: its later messages are given back at once."""
MAX_ERROR = 2000
"""The longest `last_error` kept, in characters."""
_LOOK_AGAIN = (0.05, 2.0)

OUTCOMES = ("done", "then", "retried", "dead")
"""The `outcome` label of `flowlock_outbox_deliveries_total`:

- done: the handler returned None; the message is done;
- then: it returned a `Then`, which was fired (or had been: a redelivery); done;
- retried: it raised or timed out, or its Then failed for a reason that may pass; the
  message is due again after a backoff (a Then into a paused instance too, without counting
  an attempt);
- dead: it was refused for good (DeliveryRefused, a Then the workflow refuses), or failed
  `max_attempts` times; kept until `engine.retry_message` or `drop_message`.
"""

# What the workflow answers a Then that can never apply as it is: trying again cannot help.
_REFUSED_THEN = (TransitionRefused, InvalidInput, StepFailed, InstanceNotFound, DefinitionError)
# What may pass: a lost race, the store, a workflow this engine has not registered (yet, or
# in a rolling deploy another engine knows it). A Then into an instance an operator paused
# waits instead (see Dispatcher._wait): a pause may last longer than every attempt.
_RETRIED_THEN = (ConcurrencyError, StoreError, EngineClosed, UnknownWorkflow)


@dataclass(slots=True)
class _Run:
    """One claim's messages of one instance, delivered in order by one lane."""

    kind: str
    messages: list[Message]
    claimed_at: float  # monotonic, read before the claim was sent: its lease runs from there
    begun: int = 0  # how many have begun; the last of them may be in flight


def _runs(claimed: list[Message], claimed_at: float) -> list[_Run]:
    """A claim's messages cut into runs: the store returns each instance's together, in order."""
    runs: list[_Run] = []
    for message in claimed:
        last = runs[-1] if runs else None
        if last is not None and last.messages[-1].instance_id == message.instance_id:
            last.messages.append(message)
        else:
            runs.append(_Run(message.kind, [message], claimed_at))
    return runs


@dataclass(frozen=True, slots=True)
class Handler:
    """What `engine.on_emit(kind, fn, ...)` registered."""

    kind: str
    fn: HandlerFn
    concurrency: int
    max_attempts: int
    timeout: float
    is_async: bool

    @classmethod
    def of(
        cls, kind: str, fn: HandlerFn, *, concurrency: int, max_attempts: int, timeout: float
    ) -> Handler:
        # An object with an async __call__ (a webhook) is async too.
        is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, "__call__", None)  # noqa: B004 - the method itself, not callable()
        )
        return cls(kind, fn, concurrency, max_attempts, timeout, is_async)


def backoff_delay(
    attempt: int,
    backoff: tuple[float, float],
    retry_after: float | None = None,
    draw: Callable[[], float] = random.random,
) -> float:
    """Seconds before delivery `attempt` + 1: a random part (`draw()`, 0 to 1) of base x
    2^(attempt - 1), capped; never less than the receiver's `retry_after`, itself capped."""
    base, cap = backoff
    delay = draw() * min(cap, base * 2.0 ** min(attempt - 1, 64))
    if retry_after is not None and retry_after > 0:
        delay = max(delay, min(retry_after, cap))
    return delay


def _owner() -> str:
    """This engine's name on the claims it takes: host, process, a random part."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _text(exc: BaseException) -> str:
    said = str(exc)
    text = f"{type(exc).__name__}: {said}" if said else type(exc).__name__
    return text[:MAX_ERROR]


class Dispatcher:
    """Claims due messages of the kinds in `handlers` and runs their handlers, until stopped.

    `handlers` is the engine's live mapping (a kind registered later is claimed from the next
    look on); `fire_then` fires a handler's `Then` through the engine; `wake()` makes the
    dispatcher look again at once.
    """

    def __init__(
        self,
        store: OutboxStore,
        fire_then: FireThen,
        handlers: Mapping[str, Handler],
        *,
        lease: float = DEFAULT_LEASE,
        retention: float | None = None,
        backoff: tuple[float, float] = BACKOFF,
        metrics: Metrics | None = None,
        draw: Callable[[], float] = random.random,
        run: int = RUN,
    ) -> None:
        self._store = store
        self._fire_then = fire_then
        self._handlers = handlers
        self.lease = check_seconds("outbox_lease", lease)
        if run < 1:
            raise InvalidInput(f"a run takes at least 1 message, not {run}: pass run >= 1")
        self.run = run
        self.retention = retention
        self.backoff = backoff
        self._metrics = metrics
        self._draw = draw
        self.owner = _owner()
        self.count_every = COUNT_EVERY
        self.purge_every = PURGE_EVERY
        self.close_grace = CLOSE_GRACE
        self.delivered = 0
        """Deliveries that came to an outcome (see OUTCOMES), for tests and the bench."""
        self._task: asyncio.Task[None] | None = None
        self._purging: asyncio.Task[int] | None = None
        self._flights: dict[asyncio.Task[None], _Run] = {}
        self._closing = False
        self._busy: Counter[str] = Counter()
        self._done: list[str] = []
        self._poke = asyncio.Event()
        self._counted = -float("inf")
        self._purged = -float("inf")

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def in_flight(self) -> int:
        """Runs being delivered now (each one message at a time)."""
        return len(self._flights)

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._closing = False
            self._task = asyncio.get_running_loop().create_task(self._run(), name="flowlock-outbox")

    def wake(self) -> None:
        self._poke.set()

    async def stop(self) -> None:
        """Stop claiming; deliveries in flight get `close_grace` seconds to finish, the rest
        are cancelled and their claims given back; a run's messages not begun are given back
        at once (their attempts counted back down); the done marks are written."""
        self._closing = True  # lanes begin no further message of their runs
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception:  # its own failure must not fail the engine's close
                log.exception("flowlock outbox: the dispatcher had stopped on an error")
        purging, self._purging = self._purging, None
        if purging is not None:
            purging.cancel()
            await asyncio.gather(purging, return_exceptions=True)
        if self._flights:
            flights = dict(self._flights)
            _, late = await asyncio.wait(set(flights), timeout=self.close_grace)
            for flight in late:
                flight.cancel()
            await asyncio.gather(*late, return_exceptions=True)
            for flight in late:
                run = flights[flight]
                await self._give_back_unbegun(run)
                if run.begun:  # the one cancelled mid-delivery: its attempt stays counted
                    await self._give_back(run.messages[run.begun - 1])
        try:
            await self._flush()
        except FlowlockError as exc:
            # Not lost: their claims run out, and they are delivered again (at least once).
            log.warning("flowlock outbox: %d done marks not written: %s", len(self._done), exc)
            self._done.clear()
        await self._close_handlers()

    async def _give_back(self, message: Message, *, begun: bool = True) -> None:
        try:
            await self._store.release_message(message, self.owner, begun=begun)
        except FlowlockError as exc:
            log.warning("flowlock outbox: claim of %s not given back: %s", message.key, exc)

    async def _give_back_unbegun(self, run: _Run) -> None:
        """Give back the run's messages whose delivery never began, last first: the ones
        given back stay behind one still held until the last, so the next claim takes them
        together again, in order."""
        while len(run.messages) > run.begun:
            await self._give_back(run.messages.pop(), begun=False)

    async def _close_handlers(self) -> None:
        """Close what handlers hold open (a webhook's HTTP client)."""
        for handler in list(self._handlers.values()):
            close = getattr(handler.fn, "aclose", None)
            if close is not None:
                try:
                    await close()
                except Exception:
                    log.exception("flowlock outbox: closing the %r handler failed", handler.kind)

    # -- the loop ----------------------------------------------------------------------------

    async def _run(self) -> None:
        store = self._store
        pause = _LOOK_AGAIN[0]
        async with store.pending() as pending:
            while True:
                pending.clear()
                self._poke.clear()
                try:
                    await self._flush()
                    room = self._room()
                    claimed_at = time.monotonic()
                    claimed = (
                        await store.claim_messages(
                            room, lease=self.lease, owner=self.owner, run=self.run
                        )
                        if room
                        else []
                    )
                    runs = _runs(claimed, claimed_at)
                    for run in runs:
                        self._launch(run)
                    await self._housekeep()
                    got = Counter(run.kind for run in runs)
                    if any(got[kind] >= n for kind, n in room.items()):
                        continue  # a kind got all it had room for: more may be due
                    free = list(self._room())
                    delay = await store.next_message_due(free) if free else None
                except EngineClosed:
                    return
                except Exception as exc:
                    if isinstance(exc, FlowlockError):
                        log.warning("flowlock outbox: %s; looking again in %.2fs", exc, pause)
                    else:
                        log.exception("flowlock outbox: looking again in %.2fs", pause)
                    await asyncio.sleep(pause)
                    pause = min(pause * 2, _LOOK_AGAIN[1])
                    continue
                if delay is not None and delay <= 0:
                    # Due, yet not claimed: held back by an earlier message of its instance
                    # that is in flight (here: its landing wakes us; or in another engine), or
                    # locked by a transaction still open. Look again after a growing pause.
                    await self._sleep(pending, pause)
                    if not claimed:
                        pause = min(pause * 2, _LOOK_AGAIN[1])
                    continue
                pause = _LOOK_AGAIN[0]
                wait = IDLE_BOUND if delay is None else min(delay, IDLE_BOUND)
                await self._sleep(pending, wait)

    def _room(self) -> dict[str, int]:
        """How many more runs each kind may start now (its concurrency bounds its lanes)."""
        room: dict[str, int] = {}
        for kind, handler in list(self._handlers.items()):
            free = handler.concurrency - self._busy[kind]
            if free > 0:
                room[kind] = free
        return room

    async def _sleep(self, pending: asyncio.Event, seconds: float) -> None:
        """Sleep `seconds`, or less: until a message is written, or `wake()`, or a delivery
        lands (it frees a slot, and its done mark may let the next message of its instance go)."""
        waits = [asyncio.ensure_future(pending.wait()), asyncio.ensure_future(self._poke.wait())]
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def _flush(self) -> None:
        """Mark done, in one statement, the messages whose handlers returned since the last."""
        if not self._done:
            return
        keys, self._done = self._done, []
        try:
            await self._store.finish_messages(keys)
        except BaseException:
            self._done[:0] = keys
            raise

    async def _housekeep(self) -> None:
        """Count the messages for the gauges and start a purge, each at most every so often
        and only while the dispatcher is awake (an idle one sends nothing)."""
        now = time.monotonic()
        if self._metrics is not None and now - self._counted >= self.count_every:
            self._counted = now
            counts = await self._store.count_messages()
            pending = counts.get("pending", 0) + counts.get("running", 0)
            self._metrics.record_outbox_counts(pending=pending, dead=counts.get("dead", 0))
        if self.retention is not None and now - self._purged >= self.purge_every:
            self._purged = now
            if self._purging is None or self._purging.done():
                # Apart from the loop: a purge of a large backlog never holds deliveries up.
                self._purging = asyncio.get_running_loop().create_task(
                    self._purge_logged(), name="flowlock-outbox-purge"
                )

    async def _purge_logged(self) -> int:
        try:
            return await self.purge()
        except FlowlockError as exc:
            log.warning("flowlock outbox: purging done messages failed: %s", exc)
        except Exception:
            log.exception("flowlock outbox: purging done messages failed")
        return 0

    async def purge(self) -> int:
        """Delete the done messages older than the retention, `PURGE_BATCH` a statement.
        Returns how many (0 when the retention is None: they are kept)."""
        if self.retention is None:
            return 0
        total = 0
        while True:
            n = await self._store.purge_messages(self.retention, PURGE_BATCH)
            total += n
            if n < PURGE_BATCH:
                return total
            await asyncio.sleep(0)  # let deliveries run between two batches

    # -- one delivery -----------------------------------------------------------------------

    def _launch(self, run: _Run) -> None:
        self._busy[run.kind] += 1
        if self._metrics is not None:
            for message in run.messages:
                if message.attempts == 1:
                    # The lag of a first delivery only: a retry's would add its backoff.
                    self._metrics.record_outbox_claim(message.kind, message.lag)
        head = run.messages[0]
        flight = asyncio.get_running_loop().create_task(
            self._lane(run), name=f"flowlock-outbox {head.key} (+{len(run.messages) - 1})"
        )
        self._flights[flight] = run
        flight.add_done_callback(self._landed)

    def _landed(self, flight: asyncio.Task[None]) -> None:
        run = self._flights.pop(flight)
        self._busy[run.kind] -= 1
        self._poke.set()

    async def _lane(self, run: _Run) -> None:
        """Deliver a run's messages in order, one at a time. One that does not end done (retried,
        dead, or a crash) ends the run: the rest are given back at once, still behind it (or
        free to go, when it is dead), with their attempts counted back down."""
        handler = self._handlers[run.kind]
        for i, message in enumerate(run.messages):
            if i and not self._may_begin(run, handler):
                break
            run.begun = i + 1
            label = await self._deliver(handler, message)
            if label not in ("done", "then"):
                break
        if run.begun < len(run.messages):
            await self._give_back_unbegun(run)

    def _may_begin(self, run: _Run, handler: Handler) -> bool:
        """Whether the next message of a run may begin: not while closing, nor when its claim
        could run out before the handler's timeout (another engine could then deliver it at
        the same time)."""
        if self._closing:
            return False
        return time.monotonic() + handler.timeout <= run.claimed_at + self.lease

    async def _deliver(self, handler: Handler, message: Message) -> str | None:
        """Deliver one claimed message and record how it went: its outcome (see OUTCOMES), or
        None when the delivery crashed (a bug, logged)."""
        span = tracing.deliver_span(message) if tracing.AVAILABLE else None
        try:
            with span if span is not None else contextlib.nullcontext() as current:
                label = await self._outcome(handler, message)
                if current is not None:
                    current.set_attribute("flowlock.outbox.outcome", label)
        except Exception:  # a bug: logged, never kills the dispatcher
            log.exception("flowlock outbox: delivering %s crashed", message.key)
            return None
        self.delivered += 1
        if self._metrics is not None:
            self._metrics.record_outbox_delivery(message.kind, label)
        return label

    async def _outcome(self, handler: Handler, message: Message) -> str:
        try:
            async with asyncio.timeout(handler.timeout) as limit:
                result = await self._call(handler, message)
        except DeliveryRefused as exc:
            return await self._dead(message, f"refused by the handler: {_text(exc)}")
        except TimeoutError as exc:
            said = _text(exc)
            if limit.expired():
                said = f"the handler took more than its timeout ({handler.timeout:g} s)"
            return await self._failed(handler, message, said)
        except Exception as exc:
            after = exc.retry_after if isinstance(exc, DeliveryFailed) else None
            return await self._failed(handler, message, _text(exc), after)
        if result is None:
            self._finished(message)
            return "done"
        if isinstance(result, Then):
            return await self._then(handler, message, result)
        return await self._dead(
            message,
            f"the handler returned {type(result).__name__}; a handler returns None (done) or "
            "flowlock.Then (an event to fire)",
        )

    async def _call(self, handler: Handler, message: Message) -> object:
        if handler.is_async:
            result: object = await handler.fn(message)  # type: ignore[misc]
        else:
            # A sync handler runs in a worker thread, so it cannot stall the event loop. A
            # thread cannot be cancelled: past its timeout it runs on, its result unused.
            result = await asyncio.to_thread(handler.fn, message)
        if inspect.isawaitable(result):  # a sync callable that returned a coroutine
            result = await result
        return result

    async def _then(self, handler: Handler, message: Message, then: Then) -> str:
        """Fire the handler's `Then` under the message key: a redelivery answers idempotent."""
        what = f"its Then({then.event!r})"
        try:
            await self._fire_then(message, then)
        except IdempotencyKeyReused as exc:
            # A redelivery whose handler built another Then (a new id, a timestamp): the first
            # one's Then applied under this key, so the message is done; its payload stands.
            log.info(
                "flowlock outbox: %s was applied by an earlier delivery of %s (%s); done",
                what,
                message.key,
                exc,
            )
        except InstancePaused as exc:
            return await self._wait(message, f"{what} waits: {_text(exc)}")
        except _RETRIED_THEN as exc:
            return await self._failed(handler, message, f"{what} failed: {_text(exc)}")
        except _REFUSED_THEN as exc:
            return await self._dead(message, f"{what} was refused: {_text(exc)}")
        self._finished(message)
        return "then"

    def _finished(self, message: Message) -> None:
        self._done.append(message.key)  # marked done by the loop's next round, with others

    async def _failed(
        self, handler: Handler, message: Message, error: str, retry_after: float | None = None
    ) -> str:
        if message.attempts >= handler.max_attempts:
            return await self._dead(
                message, f"{error} (attempt {message.attempts} of {handler.max_attempts})"
            )
        delay = backoff_delay(message.attempts, self.backoff, retry_after, self._draw)
        log.info(
            "flowlock outbox: %s (%s) attempt %d failed, again in %.2fs: %s",
            message.key, message.kind, message.attempts, delay, error,
        )  # fmt: skip
        await self._mark(message, error, delay)
        return "retried"

    async def _wait(self, message: Message, error: str) -> str:
        """Due again in half the backoff's cap to the cap, its attempt not counted: a paused
        instance is no failure, so however long the pause, the message never dies of it."""
        delay = self.backoff[1] * (0.5 + self._draw() / 2)
        log.info("flowlock outbox: %s waits %.2fs for its paused instance", message.key, delay)
        await self._mark(message, error, delay, counted=False)
        return "retried"

    async def _dead(self, message: Message, error: str) -> str:
        log.warning("flowlock outbox: %s (%s) is dead: %s", message.key, message.kind, error)
        await self._mark(message, error, None)
        return "dead"

    async def _mark(
        self, message: Message, error: str, retry_in: float | None, *, counted: bool = True
    ) -> None:
        try:
            held = await self._store.fail_message(
                message, self.owner, error[:MAX_ERROR], retry_in, counted=counted
            )
        except FlowlockError as exc:
            # Its claim runs out and it is delivered again: at least once holds.
            log.warning("flowlock outbox: %s not marked failed: %s", message.key, exc)
            return
        if not held:
            log.info("flowlock outbox: %s was taken over by another claimer", message.key)
