"""The engine's outbox methods: register handlers, run the dispatcher, read and repair
messages (a mixin of `flowlock.Engine`)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from flowlock._calls import check_text
from flowlock.core.errors import InvalidInput, MessageNotFound
from flowlock.core.models import Outcome, TimerFiring
from flowlock.core.outbox import (
    MESSAGE_STATUSES,
    OUTBOX_ACTOR,
    Message,
    Then,
    check_kind,
    parse_key,
)
from flowlock.core.settings import MAX_SECONDS, check_count, check_flag, check_seconds
from flowlock.core.versions import Registry
from flowlock.options import EngineOptions
from flowlock.outbox.dispatcher import (
    BACKOFF,
    DEFAULT_LEASE,
    Dispatcher,
    Handler,
    HandlerFn,
)
from flowlock.stores.base import OutboxStore, Store

if TYPE_CHECKING:
    from flowlock.metrics import Metrics

__all__ = [
    "DEFAULT_RETENTION",
    "MAX_ATTEMPTS",
    "MAX_CONCURRENCY",
    "MAX_PAGE",
    "OutboxMethods",
]

MAX_PAGE = 10_000
"""The most messages one `find_messages` call returns."""
DEFAULT_RETENTION = timedelta(days=7)
"""How long done messages are kept, unless `outbox_retention`."""
MAX_CONCURRENCY = 10_000
"""The most deliveries of one kind an engine runs at once."""
MAX_ATTEMPTS = 1000
"""The most deliveries of one message before it is dead."""


def _retention(value: object) -> float | None:
    if value is None:
        return None
    if not isinstance(value, timedelta) or value <= timedelta(0):
        raise InvalidInput(
            f"outbox_retention must be a positive datetime.timedelta (how long done messages "
            f"are kept) or None (keep them), not {value!r}"
        )
    return value.total_seconds()


def _backoff(value: object) -> tuple[float, float]:
    if not isinstance(value, tuple) or len(value) != 2:
        raise InvalidInput(
            f"outbox_backoff must be a pair (first retry, cap) of seconds, not {value!r}"
        )
    base = check_seconds("outbox_backoff's first retry", value[0])
    cap = check_seconds("outbox_backoff's cap", value[1], most=MAX_SECONDS)
    if cap < base:
        raise InvalidInput(
            f"outbox_backoff's cap ({cap:g} s) is below its first retry ({base:g} s)"
        )
    return base, cap


class OutboxMethods:
    """`flowlock.Engine`'s outbox reads and repairs; the engine is `self`."""

    _store: Store
    _open: bool
    _workflows: Registry
    _handlers: dict[str, Handler]
    _dispatcher: Dispatcher | None
    _outbox_lease: float

    def _check_open(self) -> None: ...  # the engine's

    def _start_timers(self) -> None: ...  # the engine's

    async def _fire(  # the engine's
        self, instance_id: str, event: str, actor: str | None, request_id: str | None,
        expected_version: int | None, payload: Mapping[str, Any] | None, strategy: Any,
        connection: Any, timer: TimerFiring | None, /,
    ) -> Outcome:  # fmt: skip
        raise NotImplementedError

    def _init_outbox(self, options: EngineOptions, metrics: Metrics | None) -> None:
        """Check the outbox options; make the dispatcher (it starts with the first handler)."""
        dispatch = check_flag("outbox", options.get("outbox", True))
        lease = check_seconds("outbox_lease", options.get("outbox_lease", DEFAULT_LEASE))
        retention = _retention(options.get("outbox_retention", DEFAULT_RETENTION))
        backoff = _backoff(options.get("outbox_backoff", BACKOFF))
        self._handlers = {}
        self._outbox_lease = lease
        self._dispatcher = None
        store = self._store
        if dispatch and isinstance(store, OutboxStore):
            self._dispatcher = Dispatcher(
                store,
                self._fire_then,
                self._handlers,
                lease=lease,
                retention=retention,
                backoff=backoff,
                metrics=metrics,
            )

    def on_emit(
        self,
        kind: str,
        handler: HandlerFn,
        *,
        concurrency: int = 8,
        max_attempts: int = 10,
        timeout: float = 30.0,
    ) -> None:
        """Deliver the messages of `kind` to `handler`, at least once each, in order per
        instance.

        `handler(message)` is async, or sync (run in a worker thread). It returns None (the
        message is done) or `flowlock.Then(event, payload)`: that event is fired on the
        message's instance under the request id of the message key, so a redelivery never
        fires it twice. Raising (or taking longer than `timeout` seconds) retries it with
        backoff; after `max_attempts` deliveries, or at once on `flowlock.DeliveryRefused`,
        it is dead. At most `concurrency` messages of `kind` are delivered at once by this
        engine, each lane taking an instance's next messages of `kind` together (a run) and
        delivering them one after another. Registering a kind again replaces its handler
        (deliveries in flight finish with the old one). Works before or after `open()`; with
        `outbox=False` the handler is kept but this engine delivers nothing. InvalidInput for
        a bad argument, a `timeout` not below `outbox_lease`, or a store without an outbox.
        """
        check_kind(kind, "kind")
        if not callable(handler):
            raise InvalidInput(
                f"on_emit({kind!r}, ...) takes a callable handler(message), not {handler!r}"
            )
        check_count("concurrency", concurrency, most=MAX_CONCURRENCY, unit="deliveries")
        check_count("max_attempts", max_attempts, most=MAX_ATTEMPTS, unit="attempts")
        check_seconds("timeout", timeout)
        if timeout >= self._outbox_lease:
            raise InvalidInput(
                f"on_emit({kind!r}) timeout is {timeout:g} s, not below outbox_lease "
                f"({self._outbox_lease:g} s): another engine could deliver the message again "
                "while this handler still runs. Lower the timeout or raise outbox_lease"
            )
        self._outbox_store()
        self._handlers[kind] = Handler.of(
            kind, handler, concurrency=concurrency, max_attempts=max_attempts, timeout=timeout
        )
        self._start_dispatcher()

    @property
    def dispatcher(self) -> Dispatcher | None:
        """This engine's outbox dispatcher (None with `outbox=False`, or a store without an
        outbox)."""
        return self._dispatcher

    def _start_services(self) -> None:
        """Start (or wake) the timer service and the dispatcher, once there is work for them
        (the engine opened, or a workflow was registered)."""
        self._start_timers()
        self._start_dispatcher()

    def _start_dispatcher(self) -> None:
        """Run the dispatcher once the engine is open and has a handler (a delivery-only
        worker needs no workflow: a Then of a workflow it does not know is retried); a handler
        registered later makes it look again at once."""
        dispatcher = self._dispatcher
        if dispatcher is None or not self._open or not self._handlers:
            return
        if dispatcher.running:
            dispatcher.wake()
        else:
            dispatcher.start()

    async def _stop_dispatcher(self) -> None:
        if self._dispatcher is not None:
            await self._dispatcher.stop()

    async def _fire_then(self, message: Message, then: Then) -> Outcome:
        """Fire a handler's `then` on the message's instance, under the message key."""
        actor = OUTBOX_ACTOR if then.actor is None else then.actor
        args = (actor, message.key, None, then.payload, None, None, None)
        return await self._fire(message.instance_id, then.event, *args)

    def _outbox_store(self) -> OutboxStore:
        store = self._store
        if not isinstance(store, OutboxStore):
            raise InvalidInput(f"the store {type(store).__name__} keeps no outbox")
        return store

    async def messages(self, instance_id: str) -> list[Message]:
        """The instance's outbox messages in the order they were emitted: kind, key, status
        (pending / running / done / dead), attempts, last error, next attempt. Empty when it
        emitted none (or does not exist)."""
        self._check_open()
        check_text(instance_id, "instance_id")
        return await self._outbox_store().messages(instance_id)

    async def find_messages(
        self,
        *,
        status: str | None = None,
        kind: str | None = None,
        after: str | None = None,
        limit: int = 100,
    ) -> list[Message]:
        """At most `limit` messages of any instance, by instance id (code point order), version
        and place, after the key `after` (or after every message of the instance id `after`), of
        `status` and `kind` when given (what `flowlock outbox list` shows)."""
        self._check_open()
        if status is not None and status not in MESSAGE_STATUSES:
            raise InvalidInput(f"status {status!r} is not one of {MESSAGE_STATUSES}")
        if kind is not None:
            check_kind(kind)
        if after is not None:
            check_text(after, "after")
        check_count("limit", limit, most=MAX_PAGE, unit="messages")
        store = self._outbox_store()
        return await store.find_messages(status=status, kind=kind, after=after, limit=limit)

    async def message(self, key: str) -> Message:
        """The message of `key`. Raises MessageNotFound."""
        self._check_open()
        parse_key(key)
        found = await self._outbox_store().get_message(key)
        if found is None:
            raise MessageNotFound(key)
        return found

    async def retry_message(self, key: str) -> Message:
        """Deliver a dead (or waiting) message again now, with a fresh count of attempts.
        Raises MessageNotFound, or InvalidInput for a message already done or being delivered
        now (running); nothing is changed then."""
        self._check_open()
        parse_key(key)
        found = await self._outbox_store().retry_message(key)
        if found is None:
            raise MessageNotFound(key)
        if found.status == "done":
            raise InvalidInput(
                f"message {key!r} was delivered already (done); a done message is never sent again"
            )
        if found.status == "running":
            # Clearing its claim under the delivery in flight would deliver it twice at once.
            until = found.claimed_until.isoformat() if found.claimed_until else "soon"
            raise InvalidInput(
                f"message {key!r} is being delivered now (its claim runs out at {until}); retry "
                "it if that delivery ends dead, or once its claim has run out"
            )
        return found

    async def drop_message(self, key: str) -> None:
        """Delete a message that will not be delivered (an operator gives up on it); later
        messages of its instance may then go. Raises MessageNotFound."""
        self._check_open()
        parse_key(key)
        if not await self._outbox_store().drop_message(key):
            raise MessageNotFound(key)
