"""The Engine: register workflows, create instances, fire events, read history and query.

It checks every input before any I/O, picks the strategy and hands it the pure step.
It keeps no state about instances between calls, so many engines can share one database.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, TypeAlias, Unpack

from flowlock import tracing
from flowlock._batching import Batcher
from flowlock._calls import (
    caller_request_id,
    check_fire_args,
    check_text,
    first_create,
    transactional,
)
from flowlock._constraints import ConstraintMethods
from flowlock._definitions import DefinitionMethods
from flowlock._firing import Fire, Runner, failure_label
from flowlock._payload_checks import PayloadChecks
from flowlock.admin.bulk import BulkMethods
from flowlock.admin.migrate import MigrateMethods
from flowlock.admin.repair import RepairMethods
from flowlock.admin.replay import ReplayMethods
from flowlock.admin.retention import RetentionMethods
from flowlock.backends import compose
from flowlock.core.definition import Workflow
from flowlock.core.errors import EngineClosed, InvalidInput
from flowlock.core.jsondata import DEFAULT_MAX_PAYLOAD, MAX_PAYLOAD
from flowlock.core.models import (
    TIMER_ACTOR,
    HistoryEntry,
    Instance,
    Outcome,
    Page,
    Timer,
    TimerFiring,
)
from flowlock.core.query import (
    DEFAULT_LIMIT,
    check_limit,
    cursor_after,
    decode_cursor,
    history_range,
    instance_query,
)
from flowlock.core.settings import check_count, check_flag, check_seconds
from flowlock.core.step import Call
from flowlock.core.versions import Registry
from flowlock.locks.base import LockBackend
from flowlock.options import (
    DEFAULT_MAX_BATCH,
    DEFAULT_SYNC,
    MAX_BATCH,
    ConnectOptions,
    EngineOptions,
    check_keywords,
)
from flowlock.outbox._engine import OutboxMethods
from flowlock.stores.base import EscalationBoard, Store, TimerStore
from flowlock.strategies.base import Strategy
from flowlock.strategies.distributed import Distributed
from flowlock.strategies.monitor import ConflictMonitor, EscalationSync
from flowlock.strategies.table import StrategyTable, batchable, unknown_strategy
from flowlock.strategies.transaction import in_transaction
from flowlock.timers import DEFAULT_LEASE, DEFAULT_TIMER_BATCH, TimerService

if TYPE_CHECKING:
    # the type of connection=; asyncpg and psycopg are imported by the store only
    from flowlock._pg.borrowed import CallerConnection
    from flowlock.metrics import Metrics

__all__ = ["Connection", "Engine", "connect"]

log = logging.getLogger("flowlock")
_WORKFLOW_CACHE_SIZE = 100_000

Connection: TypeAlias = "CallerConnection"
"""An asyncpg connection, or a psycopg 3 AsyncConnection, inside a transaction the caller opened
(`connection=`); the sync engine passes its caller's blocking psycopg connection wrapped."""


def connect(database_url: str | None = None, **options: Unpack[ConnectOptions]) -> Engine:
    """An engine over the database at `database_url`: the same as `Engine.connect`."""
    return Engine.connect(database_url, **options)


class Engine(
    PayloadChecks,
    OutboxMethods,
    RepairMethods,
    RetentionMethods,
    BulkMethods,
    ReplayMethods,
    DefinitionMethods,
    MigrateMethods,
    ConstraintMethods,
):
    """A workflow engine over one store.

    Build it with `Engine.connect(database_url, ...)` or `Engine(store, ...)`.
    Open it with `async with` (or `await engine.open()`); `aclose()` closes it.
    The keywords are [EngineOptions][flowlock.options.EngineOptions]; the guides on
    strategies and batching say what each does. A bad one raises InvalidInput.
    """

    def __init__(self, store: Store, **options: Unpack[EngineOptions]) -> None:
        check_keywords(options, EngineOptions, "Engine()")
        batching = options.get("batching", True)
        check_flag("batching", batching)
        max_batch = options.get("max_batch", DEFAULT_MAX_BATCH)
        check_count("max_batch", max_batch, most=MAX_BATCH, unit="calls")
        max_payload = options.get("max_payload_bytes", DEFAULT_MAX_PAYLOAD)
        # At least 2: the empty object '{}'.
        check_count("max_payload_bytes", max_payload, least=2, most=MAX_PAYLOAD, unit="bytes")
        escalation_sync = options.get("escalation_sync", DEFAULT_SYNC)
        check_seconds("escalation_sync", escalation_sync)
        self._store = store
        table = StrategyTable.build(
            options.get("strategies"), options.get("locks"), options.get("monitor")
        )
        self._locks = table.locks
        self._backends = table.backends
        self._monitor = table.monitor
        self._strategies = dict(table.strategies)
        strategy = options.get("strategy", "optimistic")
        if strategy not in self._strategies:
            raise InvalidInput(
                f"unknown default strategy {strategy!r}; use one of {sorted(self._strategies)}"
            )
        self._default = strategy
        metrics = options.get("metrics")
        self._sync: EscalationSync | None = None
        if isinstance(store, EscalationBoard) and "adaptive" in self._strategies:
            record = metrics.record_escalations if metrics is not None else None
            self._sync = EscalationSync(
                store, self._monitor, interval=escalation_sync, record=record
            )
        self._metrics = metrics
        self._max_payload = max_payload
        self._workflows = Registry()
        self._unsaved: list[Workflow] = []
        # Which workflow an instance belongs to never changes; caching it lets a per-workflow or
        # per-transition default strategy be picked without an extra read per call.
        self._instance_workflow: OrderedDict[str, tuple[str, int | None]] = OrderedDict()
        self._per_definition_strategy = False
        self._runner = Runner(self._workflows, max_payload, metrics)
        self._batcher: Batcher[Fire, Outcome] | None = Batcher(max_batch) if batching else None
        timers = options.get("timers", True)
        check_flag("timers", timers)
        self._timer_service: TimerService | None = None
        if timers and isinstance(store, TimerStore):
            self._timer_service = TimerService(
                store,
                self._fire_timer,
                self._registered,
                lease=options.get("timer_lease", DEFAULT_LEASE),
                batch=options.get("timer_batch", DEFAULT_TIMER_BATCH),
                metrics=metrics,
            )
        self._init_outbox(options, metrics)
        self._open = False

    @classmethod
    def connect(cls, database_url: str | None = None, **options: Unpack[ConnectOptions]) -> Engine:
        """An engine over the database at `database_url`, not opened yet.

        `postgresql://...`, `sqlite:///path` or `memory://`; or `pool=` an asyncpg pool.
        The keywords are [`flowlock.options.ConnectOptions`][flowlock.options.ConnectOptions].
        """
        store, engine_options = compose(database_url, options)
        return cls(store, **engine_options)

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def store(self) -> Store:
        """The store this engine writes to."""
        return self._store

    @property
    def closed(self) -> bool:
        return not self._open

    async def open(self) -> Self:
        """Open the store (connect, migrate) and the lock backends. Idempotent."""
        if not self._open:
            await self._store.open()
            opened: list[LockBackend] = []
            try:
                for backend in self._backends:
                    await backend.open()
                    opened.append(backend)
            except BaseException:
                await self._close(opened)
                raise
            self._open = True
            await self._save_unsaved()
            if self._sync is not None:
                self._sync.start()
            self._start_services()
        return self

    async def aclose(self) -> None:
        """Close the lock backends and the store, releasing every connection. Idempotent."""
        if self._open:
            if self._timer_service is not None:
                # While the engine is still open, so firings in flight end well.
                await self._timer_service.stop()
            await self._stop_dispatcher()  # the same: a Then in flight is fired before closing
            await self._stop_slot_listener()
            self._open = False
            if self._batcher is not None:
                # Batches already taken finish (each call is bounded) before the store closes.
                await self._batcher.drain()
            if self._sync is not None:
                await self._sync.stop()
            await self._close(self._backends)

    async def _close(self, backends: Sequence[LockBackend]) -> None:
        """Close `backends` (last opened first), then the store; a failure is raised at the end."""
        async with contextlib.AsyncExitStack() as stack:
            stack.push_async_callback(self._store.aclose)
            for backend in backends:
                stack.push_async_callback(backend.aclose)

    @property
    def monitor(self) -> ConflictMonitor:
        """The adaptive strategy's conflict monitor (escalated keys, counts)."""
        return self._monitor

    @property
    def metrics(self) -> Metrics | None:
        return self._metrics

    @property
    def locks(self) -> LockBackend | None:
        """The lock backend of the "distributed" strategy, if one is configured."""
        return self._locks

    @property
    def strategies(self) -> Mapping[str, Strategy]:
        """The strategies this engine runs, by name (the ones given and the presets)."""
        return dict(self._strategies)

    async def __aenter__(self) -> Self:
        return await self.open()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def _check_open(self) -> None:
        if not self._open:
            raise EngineClosed()

    # -- definitions -----------------------------------------------------------------------

    # register() and definitions(): flowlock._definitions.

    @property
    def workflows(self) -> Mapping[str, Workflow]:
        """The registered workflows by name (the newest version of each)."""
        return dict(self._workflows)

    # -- timers ----------------------------------------------------------------------------

    def _registered(self) -> list[str]:
        # Every registered workflow's timers, also those an earlier definition armed.
        return list(self._workflows)

    def _start_timers(self) -> None:
        """Run the timer service once the engine is open and runs a timed workflow; a
        workflow registered later makes it look again at once."""
        service = self._timer_service
        if service is None or not self._open:
            return
        if not any(wf.has_timers for wf in self._workflows.values()):
            return
        if service.running:
            service.wake()
        else:
            service.start()

    @property
    def timer_service(self) -> TimerService | None:
        """This engine's timer service (None with `timers=False`)."""
        return self._timer_service

    async def timers(self, instance_id: str) -> list[Timer]:
        """The instance's armed timers, earliest due first: event, due time (the database's
        clock), the stay that armed them. Empty when none is armed."""
        self._check_open()
        check_text(instance_id, "instance_id")
        store = self._store
        if not isinstance(store, TimerStore):
            return []
        return await store.timers(instance_id)

    async def _fire_timer(self, timer: Timer) -> Outcome:
        """Fire a claimed timer as any call is fired, under its firing's request id, refused
        (StaleTimer) once the instance left the stay that armed it."""
        firing = TimerFiring(timer.stay, timer.event, timer.n)
        rid = firing.request_id
        args = (TIMER_ACTOR, rid, None, None, None, None)
        return await self._fire(timer.instance_id, timer.event, *args, firing)

    # -- instances -------------------------------------------------------------------------

    async def create(
        self,
        workflow: str,
        *,
        instance_id: str,
        data: Mapping[str, Any] | None = None,
        connection: Connection | None = None,
        request_id: str | None = None,
        version: int | None = None,
    ) -> Instance:
        """A new instance of `workflow` in its initial state at version 1.
        Raises InstanceExists when the id is taken, InvalidPayload for data its `data=` refuses.

        It runs definition `version` of the workflow (None: the newest registered here);
        DefinitionMismatch, with nothing written, for a version this engine has not registered.

        `request_id` is the create's idempotency key: a retry with the same key, id, workflow
        and data answers the first create (as it was created) and writes nothing; the same key
        with anything else raises [`CreateKeyReused`][flowlock.CreateKeyReused]. A key names one
        create on the whole database. The initial state's timers are armed in the same commit.

        `connection`: an asyncpg connection inside a transaction you opened (PostgreSQL
        only): the instance is inserted in that transaction, so it exists once you commit and
        not at all if you roll back (see [`fire`][flowlock.engine.Engine.fire])."""
        self._check_open()
        check_text(instance_id, "instance_id")
        if request_id is not None:
            check_text(request_id, "request_id")
        wf, pinned = self._creating(workflow, version)
        body = self._create_data(wf, data)
        new = Instance(
            id=instance_id,
            workflow=wf.name,
            state=wf.initial,
            version=1,
            data=body,
            definition_version=pinned,
        )
        arm, claims = wf.timers(wf.initial), self._create_claims(wf, new)
        if connection is None:
            made = await self._created(self._store, new, request_id, arm, claims)
            inst = first_create(new, made, request_id)
            self._remember(inst)
            return inst
        # Not remembered: the caller may roll back, and the id be created again elsewhere.
        async with transactional(self._store).in_transaction(connection) as store:
            made = await self._created(store, new, request_id, arm, claims)
        return first_create(new, made, request_id)

    async def get(self, instance_id: str) -> Instance:
        """The instance as last committed. Raises InstanceNotFound."""
        self._check_open()
        check_text(instance_id, "instance_id")
        inst = await self._store.get(instance_id)
        self._remember(inst)
        return inst

    async def history(
        self, instance_id: str, *, after: int = 0, limit: int | None = None
    ) -> list[HistoryEntry]:
        """The applied transitions of versions above `after`, oldest first; at most `limit`."""
        self._check_open()
        check_text(instance_id, "instance_id")
        return await self._store.history(instance_id, **history_range(after, limit))

    # -- queries ---------------------------------------------------------------------------

    async def list(
        self,
        workflow: str | None = None,
        state: str | Collection[str] | None = None,
        updated_before: datetime | None = None,
        updated_after: datetime | None = None,
        limit: int = DEFAULT_LIMIT,
        after: str | None = None,
    ) -> Page:
        """One page of the instances that match every filter given, in id order.

        `workflow`, `state` (one or a list), `updated_before` / `updated_after` (timezone-aware,
        strict) filter; `limit` is 1 to 1000; `after` is the previous page's `next_cursor`.
        Returns a [`flowlock.Page`][flowlock.Page] (`next_cursor` None on the last page). Pages
        are a keyset over the id, so a walk returns each instance at most once and ends, also
        under concurrent writes; each page is one consistent read (the queries guide says more).
        InvalidInput, before anything is read, for a bad filter, limit or cursor.
        """
        self._check_open()
        query = instance_query(workflow, state, updated_before, updated_after)
        size = check_limit(limit)
        start = decode_cursor(after)
        # One row more than the page: whether it exists says if there is a next page, so the
        # last page says so itself instead of costing the caller an empty read.
        found = await self._store.list_instances(query, after=start, limit=size + 1)
        shown = tuple(found[:size])
        for inst in shown:
            self._remember(inst)
        more = len(found) > size
        return Page(shown, cursor_after(shown[-1].id) if more else None)

    async def count(
        self,
        workflow: str | None = None,
        state: str | Collection[str] | None = None,
        updated_before: datetime | None = None,
        updated_after: datetime | None = None,
    ) -> int:
        """How many instances match the filters; the same filters as
        [`list`][flowlock.engine.Engine.list], checked the same way. One consistent read (under
        concurrent writes it may differ from what a walk over the pages, read later, finds)."""
        self._check_open()
        query = instance_query(workflow, state, updated_before, updated_after)
        return await self._store.count_instances(query)

    async def fire(
        self,
        instance_id: str,
        event: str,
        *,
        actor: str | None = None,
        request_id: str | None = None,
        expected_version: int | None = None,
        payload: Mapping[str, Any] | None = None,
        strategy: str | Strategy | None = None,
        connection: Connection | None = None,
    ) -> Outcome:
        """Fire `event` at the instance; the transition is applied at most once.

        Returns an Outcome (`applied` or `idempotent`). Raises TransitionNotAllowed,
        GuardRejected, CapacityReached / UniqueViolation / RateLimited (a constraint; a capacity
        with `wait=` waits for a slot first), VersionMismatch, ConflictRetriesExhausted,
        LockTimeout / LockBusy, InstanceNotFound, or InvalidInput for bad arguments (before
        anything is read), such as InvalidPayload for a payload its schema refuses.

        `payload` (a JSON object) is passed to the guard and effect and kept in the history
        row (`HistoryEntry.payload`). `request_id` is the call's idempotency key: a retry
        with the same event and payload answers the first outcome (`idempotent=True`); the
        same key with another event or payload raises IdempotencyKeyReused. Only applied calls
        are remembered: a refused one (TransitionNotAllowed, GuardRejected, StepFailed...) wrote
        nothing, so a retry under the same key may apply once the state allows it. A guard or
        effect that raises is reported as StepFailed, data an effect returns that is not JSON
        or too large as InvalidInput; either way nothing is written.

        `connection`: an asyncpg (or psycopg 3 async) connection in a transaction you opened
        (PostgreSQL only), written in a savepoint of it: it commits or rolls back with your
        rows. docs/postgresql.md ("Inside the application's transaction") says the rest.
        """
        rid = caller_request_id(request_id, instance_id)
        args = (actor, rid, expected_version, payload, strategy, connection)
        return await self._waiting(lambda: self._fire(instance_id, event, *args, None))

    async def _fire(
        self,
        instance_id: str,
        event: str,
        actor: str | None,
        request_id: str | None,
        expected_version: int | None,
        payload: Mapping[str, Any] | None,
        strategy: str | Strategy | None,
        connection: Connection | None,
        timer: TimerFiring | None,
        /,
        *,
        repair: bool = False,
        where: Callable[[Instance], bool] | None = None,
    ) -> Outcome:
        # repair: an operator's reserved event (flowlock.admin.repair), run alone, unbatched.
        # where: a bulk run's selection, checked on the read the write is decided on.
        started = time.perf_counter()
        # Without OpenTelemetry this line is the whole cost of tracing (flowlock.tracing).
        span = tracing.start_fire(instance_id, event) if tracing.AVAILABLE else None
        try:
            self._check_open()
            check_fire_args(instance_id, event, actor, request_id, expected_version, repair=repair)
            body, parsed = self._fire_payload(event, payload)
            call = Call(
                instance_id=instance_id,
                event=event,
                payload=body,
                actor=actor,
                request_id=request_id,
                expected_version=expected_version,
                strategy="",
                timer=timer,
                trace=None if span is None else span.traceparent(),
                where=where,
                parsed=parsed,
            )
            if connection is not None:
                joinable = transactional(self._store)
                if strategy is not None:
                    in_transaction(self._requested(strategy))  # refused before anything is read
                async with joinable.in_transaction(connection) as store:
                    chosen = await self._strategy_for(instance_id, event, strategy, store)
                    chosen = in_transaction(chosen)
                    if span is not None:
                        span.chose(chosen.name)
                    call = dataclasses.replace(call, strategy=chosen.name)
                    result = await self._runner.run(chosen, Fire(call, started, span), store)
                # Answered once flowlock's part of the caller's transaction has ended well.
                outcome = self._runner.outcome(call, result, started)
            else:
                chosen = await self._strategy_for(instance_id, event, strategy, self._store)
                if span is not None:
                    span.chose(chosen.name)
                call = dataclasses.replace(call, strategy=chosen.name)
                fire, runner, batcher = Fire(call, started, span), self._runner, self._batcher
                if batcher is None or repair or not batchable(chosen):
                    outcome = await runner.alone(chosen, self._store, fire)
                else:
                    # Keyed by the strategy object too: calls asking for different strategies
                    # on one instance are batched apart (the lane holds the object, so its id
                    # is not reused).
                    outcome = await batcher.submit(
                        (instance_id, id(chosen)),
                        fire,
                        functools.partial(runner.alone, chosen, self._store),
                        functools.partial(runner.together, chosen, self._store),
                    )
        except BaseException as exc:
            if span is not None:
                span.failed(exc, failure_label(exc))
            raise
        else:
            if span is not None:
                span.done(outcome)
        finally:
            if span is not None:
                span.end()
        return outcome

    # -- helpers ---------------------------------------------------------------------------

    def _remember(self, inst: Instance) -> None:
        if not self._per_definition_strategy:
            return
        cache = self._instance_workflow
        cache[inst.id] = (inst.workflow, inst.definition_version)
        cache.move_to_end(inst.id)
        if len(cache) > _WORKFLOW_CACHE_SIZE:
            cache.popitem(last=False)

    async def _strategy_for(
        self, instance_id: str, event: str, requested: str | Strategy | None, store: Store
    ) -> Strategy:
        if requested is not None:
            return self._requested(requested)
        if not self._per_definition_strategy:
            return self._strategies[self._default]
        pin = self._instance_workflow.get(instance_id)
        if pin is None:
            inst = await store.get(instance_id)
            if store is self._store:  # what a caller's transaction reads may yet roll back
                self._remember(inst)
            pin = (inst.workflow, inst.definition_version)
        # The instance's own version as last read (after a migration a stale pick costs speed).
        wf = self._workflows.runs(*pin)
        if wf is None:
            return self._strategies[self._default]
        t = wf.transitions.get(event)
        picked = (t.strategy if t is not None else None) or wf.strategy or self._default
        return self._strategies[picked]

    def _requested(self, requested: str | Strategy) -> Strategy:
        """The strategy a call asked for, by name or as an object (a Distributed without a
        backend is bound to the engine's)."""
        if isinstance(requested, str):
            found = self._strategies.get(requested)
            if found is None:
                raise InvalidInput(unknown_strategy(requested, self._strategies))
            return found
        if isinstance(requested, Distributed):
            return requested.bound(self._locks)
        if isinstance(requested, Strategy):
            return requested
        raise InvalidInput(f"strategy must be a name or a Strategy, not {requested!r}")
