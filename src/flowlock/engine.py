"""The Engine: register workflows, create instances, fire events, read history, query instances.

It validates every input before any I/O, picks the concurrency strategy for the call, binds the pure
step to the call and hands both to the strategy. It keeps no state about instances between calls
(only a bounded cache of which workflow an instance belongs to, which never changes), so any number
of engines in any number of processes can share one database.

What it does not do lives beside it: building stores and lock backends from URLs
(:mod:`flowlock.connect`), recording metrics (:mod:`flowlock.metrics`) and OpenTelemetry spans
(:mod:`flowlock.tracing`), and sharing the adaptive strategy's escalations
(:class:`flowlock.strategies.monitor.EscalationSync`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Self, TypeAlias

from flowlock import tracing
from flowlock._batching import Batcher
from flowlock._fire import Fire, Runner
from flowlock.core.definition import Workflow
from flowlock.core.errors import (
    EngineClosed,
    FlowlockError,
    InvalidInput,
    UnknownWorkflow,
)
from flowlock.core.jsondata import DEFAULT_MAX_PAYLOAD, MAX_PAYLOAD, check_object
from flowlock.core.models import HistoryEntry, Instance, Outcome, Page
from flowlock.core.query import (
    DEFAULT_LIMIT,
    check_limit,
    cursor_after,
    decode_cursor,
    instance_query,
)
from flowlock.core.settings import check_count, check_seconds, check_text
from flowlock.core.step import Call
from flowlock.locks.base import LockBackend
from flowlock.metrics import Metrics, failure_outcome
from flowlock.stores.base import EscalationBoard, Store, TransactionalStore
from flowlock.strategies.adaptive import Adaptive
from flowlock.strategies.base import Strategy
from flowlock.strategies.distributed import Distributed
from flowlock.strategies.monitor import ConflictMonitor, EscalationSync
from flowlock.strategies.optimistic import Optimistic
from flowlock.strategies.pessimistic import Pessimistic
from flowlock.strategies.transaction import in_transaction

if TYPE_CHECKING:  # the types of pool= and connection=; asyncpg is imported by the store only
    import asyncpg

__all__ = [
    "DEFAULT_MAX_BATCH",
    "DEFAULT_MAX_PAYLOAD",
    "DEFAULT_SYNC",
    "Connection",
    "Engine",
    "LockKind",
    "StrategyConfig",
]

log = logging.getLogger("flowlock")

MAX_ID_LENGTH = 200
_EVENT = re.compile(r"[A-Za-z][A-Za-z0-9_.\-]{0,99}")
_WORKFLOW_CACHE_SIZE = 100_000

DEFAULT_SYNC = 0.5
"""Seconds between two escalation-sync rounds, unless ``escalation_sync``."""

DEFAULT_MAX_BATCH = 256
"""The most calls on one instance the engine decides and writes together, unless ``max_batch``."""
MAX_BATCH = 10_000

StrategyConfig: TypeAlias = Sequence[Strategy] | Mapping[str, Strategy]
"""``strategies=``: Strategy objects, each under its ``.name`` (a sequence), or under the names
given (a mapping, to register one under another name too, e.g. two distributed strategies on
two lock backends, fired by name)."""

LockKind: TypeAlias = Literal["redis", "advisory", "memory"]
"""``Engine.connect(..., locks=...)``: which lock backend the "distributed" strategy leases from."""

Connection: TypeAlias = "asyncpg.Connection | asyncpg.pool.PoolConnectionProxy"
"""``fire(..., connection=...)`` / ``create(..., connection=...)``: an asyncpg connection inside a
transaction the caller opened."""


def _check_text(value: object, what: str) -> str:
    return check_text(what, value, most=MAX_ID_LENGTH)


def _check_fire_args(
    instance_id: str,
    event: str,
    actor: str | None,
    request_id: str | None,
    expected_version: int | None,
) -> None:
    """Every argument of ``fire`` but the payload, checked before anything is read."""
    _check_text(instance_id, "instance_id")
    if not isinstance(event, str) or not _EVENT.fullmatch(event):
        raise InvalidInput(
            f"event {event!r} is not a valid event name (a letter, then letters, digits, "
            "'_', '.', '-'; at most 100 characters)"
        )
    if actor is not None:
        _check_text(actor, "actor")
    if request_id is not None:
        _check_text(request_id, "request_id")
    if expected_version is not None and (
        isinstance(expected_version, bool)
        or not isinstance(expected_version, int)
        or expected_version < 1
    ):
        raise InvalidInput(f"expected_version must be a positive integer, not {expected_version!r}")


class Engine:
    """A workflow engine over one store.

    Use ``async with Engine.connect(database_url) as engine`` (PostgreSQL or SQLite; see
    :func:`flowlock.connect.connect`), or ``Engine(store)`` with any
    :class:`flowlock.stores.base.Store`, opened with ``async with`` or ``await engine.open()`` and
    closed with ``await engine.aclose()``.

    Strategies are configured one way, as objects; the built-in ones have presets by name:

    - ``strategies``: Strategy objects, e.g. ``[Optimistic(max_attempts=5),
      Pessimistic(lock_timeout=1.0), Distributed(ttl=30)]``, each available under its ``.name``;
      or a mapping ``{name: strategy}`` to register one under another name as well. Built-in
      names not given get the preset: ``Optimistic()``, ``Pessimistic()``,
      ``Distributed(locks=locks)`` when the engine has a lock backend, and ``Adaptive`` built from
      the engine's optimistic strategy, ``monitor`` and the strategy the monitor escalates to.
    - ``strategy``: the name of the default strategy ("optimistic" unless a workflow or
      transition says otherwise). A call may name another, or pass a Strategy object.
    - ``locks``: the lock backend (:class:`flowlock.locks.LockBackend`: Redis, PostgreSQL
      advisory, memory) of the "distributed" strategy. A ``Distributed`` given without ``locks``
      (in ``strategies`` or to ``fire``) is bound to it; a ``Distributed`` with a backend of its
      own may come instead of ``locks``. The engine opens and closes every backend of the
      Distributed strategies it holds, with the store.
    - ``monitor`` (a :class:`flowlock.strategies.monitor.ConflictMonitor`): the "adaptive"
      strategy's threshold, window, cool-down and what it escalates to ("pessimistic" by
      default, or "distributed"). When the store is an
      :class:`flowlock.stores.base.EscalationBoard` (memory, PostgreSQL), escalations are shared
      with the other engines on it every ``escalation_sync`` seconds.

    ``batching`` (on by default): concurrent ``fire`` calls on one instance in this process,
    under the same strategy, are applied together. A call on an idle instance runs at once;
    calls that arrive while it is busy queue, and the next batch takes them all (at most
    ``max_batch``): one read, each call decided in arrival order on the state the ones before it
    left, and ONE compare-and-swap from version v to v + k writing the k history rows. Each
    caller gets its own Outcome (``batch_size`` says how many shared its write) or its own error,
    exactly as if the calls had run one after the other in that order. ``batching=False`` runs
    every call in a transaction of its own. Calls with ``connection=`` and calls under a
    strategy that is not one of flowlock's own are never batched.

    ``max_payload_bytes`` bounds a payload (and initial data) encoded as JSON. ``metrics`` (a
    :class:`flowlock.metrics.Metrics`) records Prometheus metrics on its registry; without it
    nothing is recorded. A misconfiguration raises InvalidInput saying what to pass instead.
    """

    def __init__(
        self,
        store: Store,
        *,
        strategy: str = "optimistic",
        strategies: StrategyConfig | None = None,
        locks: LockBackend | None = None,
        monitor: ConflictMonitor | None = None,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD,
        metrics: Metrics | None = None,
        escalation_sync: float = DEFAULT_SYNC,
        batching: bool = True,
        max_batch: int = DEFAULT_MAX_BATCH,
    ) -> None:
        if not isinstance(batching, bool):
            raise InvalidInput(f"batching must be True or False, not {batching!r}")
        check_count("max_batch", max_batch, most=MAX_BATCH, unit="calls")
        # At least 2: the empty object '{}'.
        check_count("max_payload_bytes", max_payload_bytes, least=2, most=MAX_PAYLOAD, unit="bytes")
        check_seconds("escalation_sync", escalation_sync)
        self._store = store
        table = _strategy_table(strategies, locks)
        self._locks = locks if locks is not None else _lease_backend(table.get("distributed"))
        self._backends = _backends(table, locks)
        self._monitor = _add_adaptive(table, monitor)
        self._strategies = table
        if strategy not in table:
            raise InvalidInput(f"unknown default strategy {strategy!r}; use one of {sorted(table)}")
        self._default = strategy
        self._sync: EscalationSync | None = None
        if isinstance(store, EscalationBoard) and "adaptive" in table:
            record = metrics.record_escalations if metrics is not None else None
            self._sync = EscalationSync(
                store, self._monitor, interval=escalation_sync, record=record
            )
        self._metrics = metrics
        self._max_payload = max_payload_bytes
        self._workflows: dict[str, Workflow] = {}
        # Which workflow an instance belongs to never changes; caching it lets a per-workflow or
        # per-transition default strategy be picked without an extra read per call.
        self._instance_workflow: OrderedDict[str, str] = OrderedDict()
        self._per_definition_strategy = False
        self._batcher: Batcher[Fire, Outcome] | None = Batcher(max_batch) if batching else None
        self._runner = Runner(self._workflows, max_payload_bytes, metrics)
        self._open = False

    @classmethod
    def connect(
        cls,
        database_url: str | None = None,
        *,
        pool: asyncpg.Pool | None = None,
        redis_url: str | None = None,
        locks: LockKind | None = None,
        auto_migrate: bool = True,
        pool_size: int | None = None,
        max_size: int | None = None,
        min_size: int | None = None,
        acquire_timeout: float | None = None,
        connect_timeout: float | None = None,
        command_timeout: float | None = None,
        lock_timeout: float | None = None,
        lease_wait: float | None = None,
        application_name: str | None = None,
        schema: str | None = None,
        namespace: str = "default",
        strategy: str = "optimistic",
        strategies: StrategyConfig | None = None,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD,
        monitor: ConflictMonitor | None = None,
        metrics: Metrics | None = None,
        escalation_sync: float = DEFAULT_SYNC,
        batching: bool = True,
        max_batch: int = DEFAULT_MAX_BATCH,
    ) -> Engine:
        """An engine over the database at ``database_url``; the same as
        :func:`flowlock.connect.connect`, which documents every argument."""
        # Imported here, not at the top: connect imports this module (it builds Engines).
        from flowlock.connect import connect

        return connect(
            database_url,
            pool=pool,
            redis_url=redis_url,
            locks=locks,
            auto_migrate=auto_migrate,
            pool_size=pool_size,
            max_size=max_size,
            min_size=min_size,
            acquire_timeout=acquire_timeout,
            connect_timeout=connect_timeout,
            command_timeout=command_timeout,
            lock_timeout=lock_timeout,
            lease_wait=lease_wait,
            application_name=application_name,
            schema=schema,
            namespace=namespace,
            strategy=strategy,
            strategies=strategies,
            max_payload_bytes=max_payload_bytes,
            monitor=monitor,
            metrics=metrics,
            escalation_sync=escalation_sync,
            batching=batching,
            max_batch=max_batch,
        )

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
            if self._sync is not None:
                self._sync.start()
        return self

    async def aclose(self) -> None:
        """Close the lock backends and the store, releasing every connection. Idempotent."""
        if self._open:
            self._open = False
            if self._batcher is not None:
                # Batches already taken finish (each call is bounded) before the store closes.
                await self._batcher.drain()
            if self._sync is not None:
                await self._sync.stop()
            await self._close(self._backends)

    async def _close(self, backends: Sequence[LockBackend]) -> None:
        """Close ``backends`` (last opened first), then the store. A failure does not stop the
        others from closing; it is raised once they all have run."""
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

    async def register(self, workflow: Workflow) -> None:
        """Make ``workflow`` available to ``create`` and ``fire``. Re-registering the same name
        replaces the definition (a deploy); instances keep their state and version."""
        if not isinstance(workflow, Workflow):
            raise InvalidInput(
                f"register() takes a flowlock.Workflow, not {type(workflow).__name__}"
            )
        for name in (workflow.strategy, *(t.strategy for t in workflow.transitions.values())):
            if name is not None and name not in self._strategies:
                raise InvalidInput(_unknown_strategy(name, self._strategies))
        for warning in workflow.safety_warnings(self._default):
            log.warning("flowlock: %s", warning)
        self._workflows[workflow.name] = workflow
        self._per_definition_strategy = any(
            wf.strategy is not None or any(t.strategy for t in wf.transitions.values())
            for wf in self._workflows.values()
        )

    @property
    def workflows(self) -> Mapping[str, Workflow]:
        """The registered workflows by name."""
        return dict(self._workflows)

    # -- instances -------------------------------------------------------------------------

    def _check_data(self, data: object, what: str) -> Mapping[str, Any]:
        """``data`` as plain JSON within ``max_payload_bytes``, or InvalidInput (see
        :func:`flowlock.core.jsondata.check_object`, the check the step also runs on what effects
        return)."""
        return check_object(data, what, self._max_payload)

    async def create(
        self,
        workflow: str,
        *,
        instance_id: str,
        data: Mapping[str, Any] | None = None,
        connection: Connection | None = None,
    ) -> Instance:
        """A new instance of ``workflow`` in its initial state at version 1.
        Raises InstanceExists when the id is taken.

        ``connection``: an asyncpg connection inside a transaction you opened (PostgreSQL
        only): the instance is inserted in that transaction, so it exists once you commit and
        not at all if you roll back (see :meth:`fire`)."""
        self._check_open()
        _check_text(instance_id, "instance_id")
        wf = self._workflow(workflow)
        body = self._check_data(data, "data")
        new = Instance(id=instance_id, workflow=wf.name, state=wf.initial, version=1, data=body)
        if connection is None:
            inst = await self._store.create(new)
            self._remember(inst)
            return inst
        # Not remembered: the caller may roll back, and the id be created again elsewhere.
        async with self._transactional().in_transaction(connection) as store:
            return await store.create(new)

    async def get(self, instance_id: str) -> Instance:
        """The instance as last committed. Raises InstanceNotFound."""
        self._check_open()
        _check_text(instance_id, "instance_id")
        inst = await self._store.get(instance_id)
        self._remember(inst)
        return inst

    async def history(self, instance_id: str) -> list[HistoryEntry]:
        """Every applied transition of the instance, oldest first."""
        self._check_open()
        _check_text(instance_id, "instance_id")
        return await self._store.history(instance_id)

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

        - ``workflow``: of this workflow (a name nobody registered is a valid query; it finds
          what the database holds under that name);
        - ``state``: in this state, or in any of a list of states;
        - ``updated_before`` / ``updated_after``: last changed strictly before / after this
          moment (timezone-aware datetimes);
        - ``limit``: at most this many instances (1 to 1000);
        - ``after``: the ``next_cursor`` of the previous page (None: the first page).

        Returns a :class:`flowlock.Page`: a sequence of Instances plus ``next_cursor`` (None on
        the last page). Instances come in id order (code point order, the same on every store).
        Pages are a keyset over the id, which never changes: a walk over them returns each
        instance at most once and ends, also while other callers fire transitions; an instance
        that matches throughout the walk is returned exactly once, one that changes meanwhile
        may be returned (as it was when its page was read) or not. Each page is one consistent
        read; there is no snapshot across pages.

        Raises InvalidInput (before anything is read) for a bad filter, a naive datetime,
        ``updated_after`` not before ``updated_before``, a limit out of range or a string that is
        not a cursor.
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
        """How many instances match the filters; the same filters as :meth:`list`, checked the
        same way. One consistent read (under concurrent writes it may differ from what a walk
        over the pages, read later, finds)."""
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
        """Fire ``event`` at the instance; the transition is applied at most once.

        Returns an Outcome (``applied`` or ``idempotent``). Raises TransitionNotAllowed,
        GuardRejected, VersionMismatch, ConflictRetriesExhausted, LockTimeout / LockBusy,
        InstanceNotFound, or InvalidInput for bad arguments (before anything is read).

        ``payload`` (a JSON object) is passed to the guard and effect and kept in the history
        row (``HistoryEntry.payload``). ``request_id`` is the call's idempotency key: a retry
        with the same event and payload answers the first outcome (``idempotent=True``); the
        same key with another event or payload raises IdempotencyKeyReused. Only applied calls
        are remembered: a refused one (TransitionNotAllowed, GuardRejected, StepFailed...) wrote
        nothing, so a retry under the same key may apply once the state allows it. A guard or
        effect that raises is reported as StepFailed, data an effect returns that is not JSON
        or too large as InvalidInput; either way nothing is written.

        ``connection``: an asyncpg connection inside a transaction you opened (PostgreSQL
        only). The transition is written in that transaction (in a savepoint, with flowlock's
        lock_timeout set for it and your own put back after), so it commits or rolls back with
        your own rows; flowlock never commits it. Inside it, optimistic makes ONE
        compare-and-swap (a lost race raises ConflictRetriesExhausted with ``attempts=1``, unless
        the winner already applied this request: idempotent), pessimistic holds the row lock
        until you commit, adaptive runs its current choice, and distributed is refused
        (InvalidInput). A failure undoes flowlock's part only; your transaction stays usable.
        InvalidInput, before anything is read, when the store is not PostgreSQL or the
        connection is not in an open transaction.
        """
        started = time.perf_counter()
        # Without OpenTelemetry this line is the whole cost of tracing (flowlock.tracing).
        span = tracing.start_fire(instance_id, event) if tracing.AVAILABLE else None
        try:
            self._check_open()
            _check_fire_args(instance_id, event, actor, request_id, expected_version)
            body = self._check_data(payload, "payload")
            call = Call(
                instance_id=instance_id,
                event=event,
                payload=body,
                actor=actor,
                request_id=request_id,
                expected_version=expected_version,
                strategy="",
            )
            if connection is not None:
                joinable = self._transactional()
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
                if batcher is None or not _batchable(chosen):
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
                span.failed(exc, _failure_label(exc))
            raise
        else:
            if span is not None:
                span.done(outcome)
        finally:
            if span is not None:
                span.end()
        return outcome

    # -- helpers ---------------------------------------------------------------------------

    def _workflow(self, name: str) -> Workflow:
        wf = self._workflows.get(name) if isinstance(name, str) else None
        if wf is None:
            raise UnknownWorkflow(str(name), tuple(self._workflows))
        return wf

    def _remember(self, inst: Instance) -> None:
        if not self._per_definition_strategy:
            return
        cache = self._instance_workflow
        cache[inst.id] = inst.workflow
        cache.move_to_end(inst.id)
        if len(cache) > _WORKFLOW_CACHE_SIZE:
            cache.popitem(last=False)

    def _transactional(self) -> TransactionalStore:
        """The store, when it can join a caller's transaction (``connection=``)."""
        store = self._store
        if not isinstance(store, TransactionalStore):
            raise InvalidInput(
                "connection= runs flowlock inside a transaction you opened on PostgreSQL; this "
                f"engine's store ({type(store).__name__}) cannot join one. Use an engine on a "
                "postgresql:// database, or call without connection=. Nothing was read or written"
            )
        return store

    async def _strategy_for(
        self, instance_id: str, event: str, requested: str | Strategy | None, store: Store
    ) -> Strategy:
        if requested is not None:
            return self._requested(requested)
        if not self._per_definition_strategy:
            return self._strategies[self._default]
        name = self._instance_workflow.get(instance_id)
        if name is None:
            inst = await store.get(instance_id)
            if store is self._store:  # what a caller's transaction reads may yet roll back
                self._remember(inst)
            name = inst.workflow
        wf = self._workflows.get(name)
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
                raise InvalidInput(_unknown_strategy(requested, self._strategies))
            return found
        if isinstance(requested, Distributed):
            return requested.bound(self._locks)
        if isinstance(requested, Strategy):
            return requested
        raise InvalidInput(f"strategy must be a name or a Strategy, not {requested!r}")


def _failure_label(exc: BaseException) -> str:
    """The ``flowlock.outcome`` of a call that raised ``exc``: the metrics' label for a flowlock
    error, "cancelled" for a cancelled call, "error" for anything else (a bug)."""
    if isinstance(exc, FlowlockError):
        return failure_outcome(exc)
    return "cancelled" if isinstance(exc, asyncio.CancelledError) else "error"


def _batchable(strategy: Strategy) -> bool:
    """Whether the engine may run ``strategy`` over a batch: flowlock's own strategies hand what
    they plan to the store as it is (a strategy of an application's may not)."""
    if isinstance(strategy, Adaptive):
        return _batchable(strategy.escalated)
    return isinstance(strategy, Optimistic | Pessimistic | Distributed)


# -- composing the strategy table -----------------------------------------------------------


def _given(strategies: StrategyConfig | None) -> dict[str, Strategy]:
    """``strategies=`` as a table by name, every entry checked to be a Strategy object."""
    if strategies is None:
        return {}
    if isinstance(strategies, str) or not isinstance(strategies, Sequence | Mapping):
        raise InvalidInput(
            "strategies takes Strategy objects, e.g. strategies=[flowlock.Optimistic("
            f"max_attempts=5)], not {strategies!r}; choose the default by name with strategy=..."
        )
    pairs = (
        list(strategies.items())
        if isinstance(strategies, Mapping)
        else [(getattr(s, "name", None), s) for s in strategies]
    )
    table: dict[str, Strategy] = {}
    for name, given in pairs:
        if not isinstance(given, Strategy) or not isinstance(name, str):
            raise InvalidInput(
                f"strategies takes Strategy objects such as flowlock.Optimistic(max_attempts=5) "
                f"or flowlock.Pessimistic(lock_timeout=1.0), not {given!r}; name the default "
                "with strategy='pessimistic'"
            )
        if name in table:
            raise InvalidInput(f"two strategies named {name!r} in strategies=; give one")
        table[name] = given
    return table


def _strategy_table(
    strategies: StrategyConfig | None, locks: LockBackend | None
) -> dict[str, Strategy]:
    """The strategies given (a Distributed without a backend bound to ``locks``), then the
    built-in presets for the names not given. "adaptive" is added by :func:`_add_adaptive`."""
    table = {
        name: s.bound(locks) if isinstance(s, Distributed) else s
        for name, s in _given(strategies).items()
    }
    own = _lease_backend(table.get("distributed"))
    if locks is not None and own is not None and own is not locks:
        raise InvalidInput(
            "locks=... and the Distributed strategy's own locks=... are two different lock "
            "backends; give the backend once (a Distributed() without locks= uses the engine's)"
        )
    table.setdefault("optimistic", Optimistic())
    table.setdefault("pessimistic", Pessimistic())
    if locks is not None:
        table.setdefault("distributed", Distributed(locks=locks))
    return table


def _lease_backend(strategy: Strategy | None) -> LockBackend | None:
    return strategy.locks if isinstance(strategy, Distributed) else None


def _backends(table: Mapping[str, Strategy], locks: LockBackend | None) -> list[LockBackend]:
    """The lock backends the engine opens and closes: ``locks`` and those of the Distributed
    strategies it holds, each once."""
    found = [locks, *(_lease_backend(s) for s in table.values())]
    unique: list[LockBackend] = []
    for backend in found:
        if backend is not None and all(backend is not u for u in unique):
            unique.append(backend)
    return unique


def _add_adaptive(table: dict[str, Strategy], monitor: ConflictMonitor | None) -> ConflictMonitor:
    """Add the "adaptive" preset to ``table`` unless one was given; returns the monitor whose
    escalations the engine shares (the given Adaptive's own, when one was given)."""
    given = table.get("adaptive")
    if isinstance(given, Adaptive):
        if monitor is not None and monitor is not given.monitor:
            raise InvalidInput(
                "monitor=... and the Adaptive strategy's monitor are two different monitors; "
                "give one (the Adaptive you pass carries its own)"
            )
        monitor = given.monitor
    monitor = monitor if monitor is not None else ConflictMonitor()
    to = monitor.escalate_to
    escalated = table.get(to)
    if escalated is None or to in ("optimistic", "adaptive"):
        raise InvalidInput(
            f"the adaptive strategy escalates to {to!r}, which this engine does not have as a "
            "locking strategy; use 'pessimistic' or configure locks=... for 'distributed'"
        )
    optimistic = table["optimistic"]
    if given is None and isinstance(optimistic, Optimistic):
        table["adaptive"] = Adaptive(optimistic=optimistic, escalated=escalated, monitor=monitor)
    return monitor


def _unknown_strategy(name: str, known: Mapping[str, Strategy]) -> str:
    hint = ""
    if name == "distributed":
        hint = (
            "; the distributed strategy needs a lock backend: Engine.connect(..., redis_url=...) "
            'or Engine.connect(..., locks="advisory") on PostgreSQL, or Engine(store, locks=...) '
            "or strategies=[flowlock.Distributed(locks=...)]"
        )
    return f"unknown strategy {name!r}; this engine has {sorted(known)}{hint}"
