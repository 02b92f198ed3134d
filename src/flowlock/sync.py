"""A blocking twin of `flowlock.Engine` for threaded code: Django, Flask, scripts.

Each engine runs one async engine on a private event loop in a daemon thread; a call blocks
its thread until the loop has run it. The sync API guide says how it opens, bounds its waits,
takes interrupts, closes and survives forks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures.thread  # noqa: F401 (its exit hook first: see _register_hooks)
import logging
import os
import threading
from collections.abc import Callable, Collection, Coroutine, Mapping, Sequence
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, TypeVar, Unpack

from flowlock._sync_bulk import SyncBulkMethods
from flowlock._sync_loop import (
    GONE,
    JOIN_TIMEOUT,
    LoopThread,
    refuse_in_event_loop,
    settle,
)
from flowlock._sync_migrate import SyncMigrateMethods
from flowlock._sync_repair import SyncRepairMethods
from flowlock._sync_retention import SyncRetention
from flowlock.core.constraints import CapacityUsage
from flowlock.core.definition import Workflow
from flowlock.core.errors import EngineClosed, InvalidInput
from flowlock.core.models import HistoryEntry, Instance, Outcome, Page, Timer
from flowlock.core.outbox import Message
from flowlock.core.query import DEFAULT_LIMIT
from flowlock.core.replay import ReplayReport
from flowlock.core.versions import DefinitionVersion
from flowlock.engine import Connection
from flowlock.engine import Engine as AsyncEngine
from flowlock.options import ConnectOptions, EngineOptions
from flowlock.outbox.dispatcher import HandlerFn
from flowlock.stores.base import Store
from flowlock.strategies.base import Strategy
from flowlock.strategies.monitor import ConflictMonitor

if TYPE_CHECKING:
    from flowlock.metrics import Metrics

__all__ = ["Engine"]

T = TypeVar("T")
log = logging.getLogger("flowlock")

# Engines whose thread is running: closed at exit, and told when the process forks. A strong
# reference on purpose: an engine dropped without close() still holds a thread and connections.
_running: set[Engine] = set()
# The parent's loops and threads as a forked child inherited them: kept, never used or closed
# (closing them would close the parent's connections), so that nothing tries to at exit either.
_orphans: list[LoopThread] = []


class Engine(SyncRepairMethods, SyncRetention, SyncBulkMethods, SyncMigrateMethods):
    """A blocking [`flowlock.Engine`][flowlock.Engine], safe to share between threads.

    `Engine.connect(database_url, ...)` takes the async `Engine.connect`'s keywords.
    `Engine(store, ...)` takes the async `Engine`'s arguments. In place of the store it
    also takes an unopened, configured `flowlock.Engine`, with no other argument.
    """

    def __init__(self, store: Store | AsyncEngine, **options: Unpack[EngineOptions]) -> None:
        if isinstance(store, AsyncEngine):
            if options:
                raise InvalidInput(
                    "flowlock.sync.Engine(engine) wraps a flowlock.Engine as it is configured; "
                    "pass the options to flowlock.Engine(store, ...) instead, or pass the store"
                )
            if not store.closed:
                raise InvalidInput(
                    "flowlock.sync.Engine(engine) needs a flowlock.Engine that is not open yet: "
                    "its connections would belong to another event loop. Pass it before "
                    "opening it, or pass its store"
                )
            self._engine = store
        else:
            self._engine = AsyncEngine(store, **options)
        self._lock = threading.Lock()
        self._runner: LoopThread | None = None
        self._opened = False  # the async engine was opened on self._runner's loop
        self._closed = False
        self._forked: str | None = None  # why this process may not use the engine, after a fork
        self._calls: set[asyncio.Future[Any]] = set()  # in flight; touched on the loop only

    @classmethod
    def connect(cls, database_url: str | None = None, **options: Unpack[ConnectOptions]) -> Engine:
        """An engine over the database at `database_url`: `flowlock.Engine.connect`'s keywords.

        Nothing is connected until `open()`, `with` or the first call. `pool=` is refused:
        an asyncpg pool belongs to its event loop, and this engine runs on a loop of its own.
        """
        if options.get("pool") is not None:
            raise InvalidInput(
                "flowlock.sync.Engine.connect cannot use an application's asyncpg pool (pool=): "
                "a pool belongs to the event loop that created it, and the sync engine runs on a "
                "private loop of its own. Pass the database URL (and max_size, min_size, "
                "acquire_timeout...) instead"
            )
        return cls(AsyncEngine.connect(database_url, **options))

    # -- lifecycle -------------------------------------------------------------------------

    def open(self) -> Self:
        """Open the store (connect, migrate) and the lock backends now, not on the first call.

        Idempotent. Raises EngineClosed after `close()`.
        """
        refuse_in_event_loop("open")
        with self._lock:
            self._start(opens=True)
        return self

    def close(self) -> None:
        """Refuse new calls, wait for those in flight, close the store and the lock backends,
        stop the loop and join its thread. Idempotent."""
        refuse_in_event_loop("close")
        with self._lock:
            self._closed = True
            runner = self._runner
            if runner is None:
                return
            try:
                future = runner.submit(self._shutdown())
            except EngineClosed:
                # Its loop stopped without close(): nothing runs on it any more, the closing of
                # the connections included (they end with the process). The thread is joined.
                self._runner = None
                _running.discard(self)
                runner.thread.join(JOIN_TIMEOUT)
                return
            try:
                settle(future, runner)
            finally:
                # Interrupted twice: leave the loop to the exit hook rather than cut a call short.
                if future.done():
                    self._runner = None
                    _running.discard(self)
                    runner.stop()

    @property
    def closed(self) -> bool:
        """Whether `close()` was called, the process forked after the engine opened, or the
        engine's loop thread ended without `close()`.

        An engine not opened yet is not closed: its first call opens it.
        """
        runner = self._runner
        return self._closed or self._forked is not None or (runner is not None and runner.ended)

    def __enter__(self) -> Self:
        return self.open()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- what the async engine exposes -----------------------------------------------------

    @property
    def workflows(self) -> Mapping[str, Workflow]:
        """The registered workflows by name."""
        return self._engine.workflows

    @property
    def strategies(self) -> Mapping[str, Strategy]:
        """The strategies this engine runs, by name (the ones given and the presets)."""
        return self._engine.strategies

    @property
    def monitor(self) -> ConflictMonitor:
        """The adaptive strategy's conflict monitor (escalated keys, counts)."""
        return self._engine.monitor

    @property
    def metrics(self) -> Metrics | None:
        return self._engine.metrics

    # -- the calls -------------------------------------------------------------------------

    def register(self, workflow: Workflow) -> DefinitionVersion:
        """Make `workflow` available to `create` and `fire`, and store its definition version
        (see [`flowlock.Engine.register`][flowlock.Engine.register]).

        Before the engine is open it connects nothing, so it is safe at import time, before a
        server forks its workers: it answers version 0 then, and the definition is stored when
        the engine opens.
        """
        return self._run(self._engine.register(workflow), opens=False)

    def definitions(self, workflow: str | None = None) -> list[DefinitionVersion]:
        """The stored definition versions (of `workflow`), each with its instance count."""
        return self._run(self._engine.definitions(workflow))

    def capacity(self, kind: str, key: str) -> CapacityUsage:
        """Who holds the slots of `key` under constraint `kind`, and its limit."""
        return self._run(self._engine.capacity(kind, key))

    def on_emit(
        self,
        kind: str,
        handler: HandlerFn,
        *,
        concurrency: int = 8,
        max_attempts: int = 10,
        timeout: float = 30.0,
    ) -> None:
        """Deliver the messages of `kind` to `handler`; see
        [`flowlock.Engine.on_emit`][flowlock.Engine.on_emit]. An async handler runs on the
        engine's loop thread, a sync one in a worker thread. Connects nothing."""

        async def on_emit() -> None:  # on the loop: a dispatcher already running is woken
            self._engine.on_emit(
                kind, handler, concurrency=concurrency, max_attempts=max_attempts, timeout=timeout
            )

        return self._run(on_emit(), opens=False)

    def create(
        self,
        workflow: str,
        *,
        instance_id: str,
        data: Mapping[str, Any] | None = None,
        connection: object | None = None,
        request_id: str | None = None,
        version: int | None = None,
    ) -> Instance:
        """A new instance of `workflow` in its initial state at version 1, running definition
        `version` (None: the newest registered). Raises InstanceExists when the id is taken.

        `request_id`: the create's idempotency key; a retry with the same key and the same
        create answers the first one, another create under it raises CreateKeyReused (see
        [`flowlock.Engine.create`][flowlock.Engine.create]).

        `connection`: a psycopg 3 connection or Django's (`django.db.connection`) inside a
        transaction you opened: the instance exists once you commit, not at all if you roll
        back (see [`fire`][flowlock.sync.Engine.fire])."""
        if connection is not None:
            return self._joined(
                connection,
                lambda conn: self._engine.create(
                    workflow, instance_id=instance_id, data=data, request_id=request_id,
                    connection=conn, version=version,
                ),
            )  # fmt: skip
        return self._run(
            self._engine.create(
                workflow, instance_id=instance_id, data=data, request_id=request_id, version=version
            )
        )

    def get(self, instance_id: str) -> Instance:
        """The instance as last committed. Raises InstanceNotFound."""
        return self._run(self._engine.get(instance_id))

    def history(
        self, instance_id: str, *, after: int = 0, limit: int | None = None
    ) -> list[HistoryEntry]:
        """The applied transitions of versions above `after`, oldest first; at most `limit`."""
        return self._run(self._engine.history(instance_id, after=after, limit=limit))

    def check_definition(
        self,
        workflow: Workflow,
        *,
        sample: int | None = None,
        instance_ids: Sequence[str] | None = None,
    ) -> ReplayReport:
        """Replay the recorded histories through a new definition and report every divergence;
        see [`flowlock.Engine.check_definition`][flowlock.Engine.check_definition]."""
        return self._run(
            self._engine.check_definition(workflow, sample=sample, instance_ids=instance_ids)
        )

    def timers(self, instance_id: str) -> list[Timer]:
        """The instance's armed timers, earliest due first (event, due time, the stay that
        armed them); see [`flowlock.Engine.timers`][flowlock.Engine.timers]."""
        return self._run(self._engine.timers(instance_id))

    # -- the outbox (before `list`, which would shadow the builtin in their annotations) ----

    def messages(self, instance_id: str) -> list[Message]:
        """The instance's outbox messages in the order they were emitted; see
        [`flowlock.Engine.messages`][flowlock.Engine.messages]."""
        return self._run(self._engine.messages(instance_id))

    def find_messages(
        self,
        *,
        status: str | None = None,
        kind: str | None = None,
        after: str | None = None,
        limit: int = 100,
    ) -> list[Message]:
        """At most `limit` messages of any instance, in message order after the key `after`; see
        [`flowlock.Engine.find_messages`][flowlock.Engine.find_messages]."""
        return self._run(
            self._engine.find_messages(status=status, kind=kind, after=after, limit=limit)
        )

    def message(self, key: str) -> Message:
        """The message of `key`. Raises MessageNotFound."""
        return self._run(self._engine.message(key))

    def retry_message(self, key: str) -> Message:
        """Deliver a dead (or waiting) message again now, with a fresh count of attempts; see
        [`flowlock.Engine.retry_message`][flowlock.Engine.retry_message]."""
        return self._run(self._engine.retry_message(key))

    def drop_message(self, key: str) -> None:
        """Delete a message that will not be delivered; see
        [`flowlock.Engine.drop_message`][flowlock.Engine.drop_message]."""
        return self._run(self._engine.drop_message(key))

    def list(
        self,
        workflow: str | None = None,
        state: str | Collection[str] | None = None,
        updated_before: datetime | None = None,
        updated_after: datetime | None = None,
        limit: int = DEFAULT_LIMIT,
        after: str | None = None,
    ) -> Page:
        """One page of the matching instances in id order; see
        [`flowlock.Engine.list`][flowlock.Engine.list]."""
        return self._run(
            self._engine.list(workflow, state, updated_before, updated_after, limit, after)
        )

    def count(
        self,
        workflow: str | None = None,
        state: str | Collection[str] | None = None,
        updated_before: datetime | None = None,
        updated_after: datetime | None = None,
    ) -> int:
        """How many instances match; see [`flowlock.Engine.count`][flowlock.Engine.count]."""
        return self._run(self._engine.count(workflow, state, updated_before, updated_after))

    def fire(
        self,
        instance_id: str,
        event: str,
        *,
        actor: str | None = None,
        request_id: str | None = None,
        expected_version: int | None = None,
        payload: Mapping[str, Any] | None = None,
        strategy: str | Strategy | None = None,
        connection: object | None = None,
    ) -> Outcome:
        """Fire `event` at the instance; the transition applies at most once.

        The same Outcome and errors as [`flowlock.Engine.fire`][flowlock.Engine.fire].

        `connection`: a `psycopg.Connection` (psycopg 3) or Django's connection
        (`django.db.connection`, or `connections[alias]`) inside a transaction you opened
        (`transaction.atomic()`, `conn.transaction()`, or autocommit off), on the database this
        engine's PostgreSQL store writes to. The transition is written in that transaction, so
        it commits or rolls back with your own rows, as the async engine's `connection=` (an
        asyncpg one) does. InvalidInput, before anything is read, for a connection of another
        kind or outside a transaction. The Django guide shows it in a view.
        """

        def fire(conn: Connection | None) -> Coroutine[Any, Any, Outcome]:
            return self._engine.fire(
                instance_id,
                event,
                actor=actor,
                request_id=request_id,
                expected_version=expected_version,
                payload=payload,
                strategy=strategy,
                connection=conn,
            )

        if connection is not None:
            return self._joined(connection, fire)
        return self._run(fire(None))

    # -- running a coroutine on the engine's loop -----------------------------------------

    def _joined(
        self, connection: object, call: Callable[[Connection], Coroutine[Any, Any, T]]
    ) -> T:
        """`call` on the caller's psycopg connection (`connection`, or the one under a Django
        connection), checked here, in the caller's thread, before anything runs. Its statements
        run on a worker thread while this thread waits, so one thread at a time uses it."""
        refuse_in_event_loop("connection=")
        from flowlock._pg.borrowed import ThreadedPsycopg, psycopg_of  # needs the postgres extra

        borrowed = ThreadedPsycopg(psycopg_of(connection))
        try:
            return self._run(call(borrowed))
        finally:
            borrowed.close()

    def _run(self, coro: Coroutine[Any, Any, T], *, opens: bool = True) -> T:
        """Run `coro` (a call of the async engine) on the engine's loop and wait for it.
        `opens`: open the engine first if it is not open yet."""
        handed = False
        try:
            refuse_in_event_loop(getattr(coro, "__name__", "call"))
            with self._lock:
                runner = self._start(opens=opens)
                future = runner.submit(self._tracked(coro))
                handed = True
        except BaseException:
            # Never ran: closed, so it is not reported as never awaited. One handed to the loop
            # is never closed from here: that would cut it short on the loop's thread.
            if not handed:
                coro.close()
            raise
        return settle(future, runner)

    def _start(self, *, opens: bool) -> LoopThread:
        """The running loop thread (started if need be), with the engine opened on it if
        `opens`. Called with `self._lock` held."""
        if self._forked is not None:
            raise EngineClosed(self._forked)
        if self._closed:
            raise EngineClosed(
                "this flowlock.sync.Engine is closed; build a new one "
                "(flowlock.sync.Engine.connect(...)) to go on"
            )
        runner = self._runner
        if runner is None:
            runner = self._runner = LoopThread()
            _running.add(self)
        elif runner.ended:
            raise EngineClosed(GONE)
        if opens and not self._opened:
            settle(runner.submit(self._engine.open()), runner)
            self._opened = True
        return runner

    async def _tracked(self, coro: Coroutine[Any, Any, T]) -> T:
        """`coro`, counted among the calls in flight that `close()` waits for."""
        task = asyncio.current_task()
        assert task is not None  # a coroutine run by run_coroutine_threadsafe runs in a task
        self._calls.add(task)
        try:
            return await coro
        finally:
            self._calls.discard(task)

    async def _shutdown(self) -> None:
        """Wait for the calls in flight, each bounded, then close the async engine.

        Calls submitted before close() began have started by now: the loop runs callbacks in
        order.
        """
        if self._calls:
            await asyncio.wait(set(self._calls))
        await self._engine.aclose()

    def _after_fork_in_child(self) -> None:
        """This process is a fork: the loop thread is not running here.

        Any connections belong to the parent.
        """
        self._lock = threading.Lock()  # another thread of the parent may have held it
        self._calls = set()
        runner, self._runner = self._runner, None
        if runner is None:
            return
        # Marked closed, not closed. close() would unregister the parent's sockets from the epoll
        # instance both processes share. A loop marked closed is left alone by every clean-up path,
        # which then only closes this process's copies of the file descriptors.
        runner.loop._closed = True  # type: ignore[attr-defined]
        _orphans.append(runner)
        if self._opened and not self._closed:
            self._forked = (
                f"this flowlock.sync.Engine opened its connections in process {runner.pid}, "
                f"which then forked this process ({os.getpid()}); they belong to the parent. "
                "Let each worker open its own: do not call it before the fork (register() is "
                "fine, the first other call opens it), or build it in the worker"
            )


# -- process hooks -----------------------------------------------------------------------------


def _close_all() -> None:
    """Close every engine left open, at interpreter exit."""
    for engine in list(_running):
        try:
            engine.close()
        except Exception:
            log.exception("flowlock: closing a sync engine left open at exit failed")


def _after_fork_in_child() -> None:
    for engine in list(_running):
        engine._after_fork_in_child()
    _running.clear()


def _register_hooks(
    at_exit: Callable[[Callable[[], None]], object] | None,
) -> None:
    """Close engines left open at exit, before the interpreter joins its thread pools.

    Uses the threading module's exit hooks when this Python has them, else `atexit`.
    Hooks run last registered first, so the engine closes while SQLite's connection threads
    can still close their connections. `atexit` hooks run only after those threads stop.
    """
    import atexit

    if at_exit is not None:
        at_exit(_close_all)
    else:  # pragma: no cover - CPython has had threading._register_atexit since 3.9
        atexit.register(_close_all)
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork_in_child)


_register_hooks(getattr(threading, "_register_atexit", None))
