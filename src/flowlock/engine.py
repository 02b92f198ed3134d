"""The Engine: register workflows, create instances, fire events, read history.

It validates every input before any I/O, picks the concurrency strategy for the call, binds the pure
step to the call and hands both to the strategy. It keeps no state about instances between calls
(only a bounded cache of which workflow an instance belongs to, which never changes), so any number
of engines in any number of processes can share one database.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Mapping
from types import TracebackType
from typing import Any, Self

from flowlock.definition import Workflow
from flowlock.errors import (
    ConflictRetriesExhausted,
    EngineClosed,
    FlowlockError,
    InstanceNotFound,
    InvalidInput,
    LockError,
    LockLost,
    PayloadTooLarge,
    TransitionRefused,
    UnknownWorkflow,
)
from flowlock.locks.base import LockBackend
from flowlock.metrics import Metrics
from flowlock.models import HistoryEntry, Instance, Outcome, Snapshot
from flowlock.step import Call, Idempotent, decide
from flowlock.stores.base import EscalationBoard, Store
from flowlock.strategies.adaptive import Adaptive
from flowlock.strategies.base import Strategy, StrategyResult
from flowlock.strategies.distributed import Distributed
from flowlock.strategies.monitor import ConflictMonitor
from flowlock.strategies.optimistic import Optimistic
from flowlock.strategies.pessimistic import Pessimistic

__all__ = ["Engine"]

log = logging.getLogger("flowlock")

MAX_ID_LENGTH = 200
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_EVENT = re.compile(r"[A-Za-z][A-Za-z0-9_.\-]{0,99}")
_WORKFLOW_CACHE_SIZE = 100_000


def _check_text(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise InvalidInput(f"{what} must be a string, not {type(value).__name__}")
    if not value:
        raise InvalidInput(f"{what} must not be empty")
    if len(value) > MAX_ID_LENGTH:
        raise InvalidInput(f"{what} is {len(value)} characters long; the limit is {MAX_ID_LENGTH}")
    if _CONTROL.search(value):
        raise InvalidInput(f"{what} {value!r} contains a NUL or control character")
    return value


class Engine:
    """A workflow engine over one store.

    Use ``async with Engine.connect(database_url) as engine`` (PostgreSQL or SQLite), or
    ``Engine(store)`` with any :class:`flowlock.stores.base.Store`, opened with ``async with`` or
    ``await engine.open()`` and closed with ``await engine.aclose()``.

    Options (keyword-only): ``strategy`` is the default strategy ("optimistic" unless a workflow or
    transition says otherwise); ``max_attempts``, ``backoff_base`` and ``backoff_cap`` (seconds)
    configure optimistic retries; ``lock_timeout`` (seconds) bounds pessimistic row-lock waits;
    ``max_payload_bytes`` bounds a payload (and initial data) encoded as JSON. ``locks`` (a
    :class:`flowlock.locks.LockBackend`: Redis, PostgreSQL advisory, memory) enables the
    "distributed" strategy, with leases of ``lease_ttl`` seconds waited for at most ``lease_wait``;
    the engine opens and closes it with the store. ``monitor`` (a
    :class:`flowlock.strategies.monitor.ConflictMonitor`) configures the "adaptive" strategy: its
    threshold, window, cool-down and what it escalates to ("pessimistic" by default, or
    "distributed"); escalations are shared with other engines through the store (PostgreSQL) every
    ``escalation_sync`` seconds. ``metrics`` (a :class:`flowlock.metrics.Metrics`) records
    Prometheus metrics on its registry; without it nothing is recorded.
    """

    def __init__(
        self,
        store: Store,
        *,
        strategy: str = "optimistic",
        max_attempts: int = 3,
        backoff_base: float = 0.005,
        backoff_cap: float = 0.2,
        lock_timeout: float = 5.0,
        max_payload_bytes: int = 64 * 1024,
        locks: LockBackend | None = None,
        lease_ttl: float = 10.0,
        lease_wait: float = 5.0,
        monitor: ConflictMonitor | None = None,
        escalation_sync: float = 0.5,
        metrics: Metrics | None = None,
        strategies: Mapping[str, Strategy] | None = None,
    ) -> None:
        if max_payload_bytes < 2:
            raise InvalidInput("max_payload_bytes must be at least 2 (the empty object '{}')")
        self._store = store
        self._strategies: dict[str, Strategy] = {
            "optimistic": Optimistic(
                max_attempts=max_attempts, backoff_base=backoff_base, backoff_cap=backoff_cap
            ),
            "pessimistic": Pessimistic(lock_timeout=lock_timeout),
        }
        self._locks = locks
        if locks is not None:
            self._strategies["distributed"] = Distributed(
                locks=locks, ttl=lease_ttl, wait=lease_wait, max_attempts=max_attempts
            )
        if strategies:
            self._strategies.update(strategies)
        self._monitor = monitor if monitor is not None else ConflictMonitor()
        escalated = self._strategies.get(self._monitor.escalate_to)
        if escalated is None or self._monitor.escalate_to in ("optimistic", "adaptive"):
            raise InvalidInput(
                f"the adaptive strategy escalates to {self._monitor.escalate_to!r}, which this "
                f"engine does not have as a locking strategy; use 'pessimistic' or configure "
                "locks=... for 'distributed'"
            )
        optimistic = self._strategies["optimistic"]
        if isinstance(optimistic, Optimistic):
            self._strategies.setdefault(
                "adaptive",
                Adaptive(optimistic=optimistic, escalated=escalated, monitor=self._monitor),
            )
        self._escalation_sync = escalation_sync
        self._board: EscalationBoard | None = store if isinstance(store, EscalationBoard) else None
        self._sync_task: asyncio.Task[None] | None = None
        self._metrics = metrics
        if strategy not in self._strategies:
            raise InvalidInput(
                f"unknown default strategy {strategy!r}; use one of {sorted(self._strategies)}"
            )
        self._default = strategy
        self._max_payload = max_payload_bytes
        self._workflows: dict[str, Workflow] = {}
        # Which workflow an instance belongs to never changes; caching it lets a per-workflow or
        # per-transition default strategy be picked without an extra read per call.
        self._instance_workflow: OrderedDict[str, str] = OrderedDict()
        self._per_definition_strategy = False
        self._open = False

    @classmethod
    def connect(
        cls,
        database_url: str,
        *,
        redis_url: str | None = None,
        locks: str | None = None,
        auto_migrate: bool = True,
        pool_size: int = 20,
        schema: str | None = None,
        namespace: str = "default",
        **options: Any,
    ) -> Engine:
        """An engine over the database at ``database_url``: ``postgresql://...`` (asyncpg pool of
        ``pool_size``, tables in ``schema`` if given) or ``sqlite:///path``. Open it with
        ``async with``. Migrations run on open unless ``auto_migrate=False``.

        The "distributed" strategy leases from Redis when ``redis_url`` (``redis://`` or
        ``unix://``) is given, or from PostgreSQL advisory locks with ``locks="advisory"`` (no
        Redis needed); without either it is not available. ``namespace`` separates lock keys of
        unrelated deployments sharing one Redis or database."""
        from flowlock.stores import store_from_url

        store = store_from_url(
            database_url, auto_migrate=auto_migrate, pool_size=pool_size, schema=schema
        )
        backend = _lock_backend(store, database_url, redis_url, locks, schema, namespace)
        return cls(store, locks=backend, **options)

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def store(self) -> Store:
        """The store this engine writes to."""
        return self._store

    @property
    def closed(self) -> bool:
        return not self._open

    async def open(self) -> Self:
        """Open the store (connect, migrate) and the lock backend. Idempotent."""
        if not self._open:
            await self._store.open()
            if self._locks is not None:
                try:
                    await self._locks.open()
                except BaseException:
                    await self._store.aclose()
                    raise
            self._open = True
            if self._board is not None and "adaptive" in self._strategies:
                self._sync_task = asyncio.create_task(
                    self._sync_escalations(), name="flowlock-sync"
                )
        return self

    async def aclose(self) -> None:
        """Close the lock backend and the store, releasing every connection. Idempotent."""
        if self._open:
            self._open = False
            if self._sync_task is not None:
                self._sync_task.cancel()
                await asyncio.gather(self._sync_task, return_exceptions=True)
                self._sync_task = None
            try:
                if self._locks is not None:
                    await self._locks.aclose()
            finally:
                await self._store.aclose()

    @property
    def monitor(self) -> ConflictMonitor:
        """The adaptive strategy's conflict monitor (escalated keys, counts)."""
        return self._monitor

    @property
    def metrics(self) -> Metrics | None:
        return self._metrics

    async def _sync_escalations(self) -> None:
        """Share escalations with the other engines on this database, about every
        ``escalation_sync`` seconds: publish ours, adopt theirs. Bounded; failures are logged and
        retried on the next tick (the local monitor keeps working without the board)."""
        board, monitor = self._board, self._monitor
        assert board is not None
        seen_up, seen_down = 0, 0
        while True:
            await asyncio.sleep(self._escalation_sync)
            try:
                async with asyncio.timeout(max(1.0, 4 * self._escalation_sync)):
                    for escalation in monitor.take_pending():
                        await board.publish(escalation)
                    shared = await board.active(time.time())
                monitor.adopt({e.key: e for e in shared})
            except (FlowlockError, TimeoutError) as exc:
                log.warning("flowlock: sharing escalations failed, retrying: %s", exc)
            if self._metrics is not None:
                self._metrics.escalated_keys.set(monitor.active_count)
                self._metrics.escalations.labels(monitor.escalate_to).inc(
                    monitor.escalations - seen_up
                )
                self._metrics.deescalations.inc(monitor.deescalations - seen_down)
            seen_up, seen_down = monitor.escalations, monitor.deescalations

    @property
    def locks(self) -> LockBackend | None:
        """The lock backend of the "distributed" strategy, if one is configured."""
        return self._locks

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
        if data is None:
            return {}
        if not isinstance(data, Mapping):
            raise InvalidInput(
                f"{what} must be a JSON object (a mapping), not {type(data).__name__}"
            )
        if not data:
            return data
        try:
            size = len(json.dumps(data, separators=(",", ":")).encode())
        except (TypeError, ValueError) as exc:
            raise InvalidInput(f"{what} is not JSON-serialisable: {exc}") from exc
        if size > self._max_payload:
            raise PayloadTooLarge(size, self._max_payload)
        return data

    async def create(
        self, workflow: str, *, instance_id: str, data: Mapping[str, Any] | None = None
    ) -> Instance:
        """A new instance of ``workflow`` in its initial state at version 1.
        Raises InstanceExists when the id is taken."""
        self._check_open()
        _check_text(instance_id, "instance_id")
        wf = self._workflow(workflow)
        body = self._check_data(data, "data")
        inst = await self._store.create(
            Instance(id=instance_id, workflow=wf.name, state=wf.initial, version=1, data=body)
        )
        self._remember(inst)
        return inst

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
    ) -> Outcome:
        """Fire ``event`` at the instance; the transition is applied at most once.

        Returns an Outcome (``applied`` or ``idempotent``). Raises TransitionNotAllowed,
        GuardRejected, VersionMismatch, ConflictRetriesExhausted, LockTimeout / LockBusy,
        InstanceNotFound, or InvalidInput for bad arguments (before anything is read).
        """
        started = time.perf_counter()
        self._check_open()
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
            raise InvalidInput(
                f"expected_version must be a positive integer, not {expected_version!r}"
            )
        body = self._check_data(payload, "payload")
        chosen = await self._strategy_for(instance_id, event, strategy)

        call = Call(
            instance_id=instance_id,
            event=event,
            payload=body,
            actor=actor,
            request_id=request_id,
            expected_version=expected_version,
            strategy=chosen.name,
        )
        workflows = self._workflows
        seen: list[str] = []

        def bound(snap: Snapshot) -> HistoryEntry | Idempotent:
            if not seen:
                seen.append(snap.instance.workflow)
            return decide(workflows, snap, call)

        metrics = self._metrics
        if metrics is None:
            result = await chosen.run(self._store, call, bound)
        else:
            try:
                result = await chosen.run(self._store, call, bound)
            except FlowlockError as exc:
                _record_failure(metrics, seen, event, chosen.name, exc, started)
                raise
        outcome = Outcome(
            applied=result.applied,
            idempotent=not result.applied,
            instance=result.instance,
            attempts=result.attempts,
            strategy=result.strategy or chosen.name,
            elapsed=time.perf_counter() - started,
            event=event,
            request_id=request_id,
            reason=result.reason,
        )
        if metrics is not None:
            _record(metrics, outcome, result)
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

    async def _strategy_for(
        self, instance_id: str, event: str, requested: str | Strategy | None
    ) -> Strategy:
        if requested is not None:
            if isinstance(requested, str):
                found = self._strategies.get(requested)
                if found is None:
                    raise InvalidInput(_unknown_strategy(requested, self._strategies))
                return found
            if isinstance(requested, Strategy):
                return requested
            raise InvalidInput(f"strategy must be a name or a Strategy, not {requested!r}")
        if not self._per_definition_strategy:
            return self._strategies[self._default]
        name = self._instance_workflow.get(instance_id)
        if name is None:
            name = (await self.get(instance_id)).workflow
        wf = self._workflows.get(name)
        if wf is None:
            return self._strategies[self._default]
        t = wf.transitions.get(event)
        picked = (t.strategy if t is not None else None) or wf.strategy or self._default
        return self._strategies[picked]


def _unknown_strategy(name: str, known: Mapping[str, Strategy]) -> str:
    hint = ""
    if name == "distributed":
        hint = (
            "; the distributed strategy needs a lock backend: Engine.connect(..., redis_url=...) "
            'or Engine.connect(..., locks="advisory") on PostgreSQL, or Engine(store, locks=...)'
        )
    return f"unknown strategy {name!r}; this engine has {sorted(known)}{hint}"


def _lock_backend(
    store: Store,
    database_url: str,
    redis_url: str | None,
    kind: str | None,
    schema: str | None,
    namespace: str,
) -> LockBackend | None:
    """The lock backend Engine.connect composes (only engine, CLI and service compose backends)."""
    if kind is None:
        if redis_url is None:
            return None
        kind = "redis"
    if kind == "redis":
        if redis_url is None:
            raise InvalidInput('locks="redis" needs redis_url="redis://host:6379/0"')
        from flowlock.locks.redis import RedisLocks

        return RedisLocks(redis_url, namespace=namespace, fence_floor=store.fencing_floor)
    if kind == "advisory":
        if database_url.partition("://")[0].lower() not in ("postgresql", "postgres"):
            raise InvalidInput('locks="advisory" needs a postgresql:// database_url')
        from flowlock.locks.advisory import AdvisoryLocks

        return AdvisoryLocks(database_url, namespace=namespace, schema=schema)
    if kind == "memory":
        from flowlock.locks.memory import MemoryLocks

        return MemoryLocks()
    raise InvalidInput(f'locks must be "redis", "advisory" or "memory", not {kind!r}')


def _record(metrics: Metrics, outcome: Outcome, result: StrategyResult) -> None:
    workflow, strategy = outcome.instance.workflow, outcome.strategy
    label = "applied" if outcome.applied else "idempotent"
    metrics.transitions.labels(workflow, outcome.event, strategy, label).inc()
    metrics.attempts.labels(strategy).observe(outcome.attempts)
    metrics.duration.labels(workflow, strategy).observe(outcome.elapsed)
    if outcome.attempts > 1 and strategy == "optimistic":
        metrics.conflicts.labels(workflow, strategy).inc(outcome.attempts - 1)
    if result.lock_wait is not None:
        metrics.lock_wait.labels(strategy).observe(result.lock_wait)
    if result.lock_hold is not None:
        metrics.lock_hold.labels(strategy).observe(result.lock_hold)


def _record_failure(
    metrics: Metrics, seen: list[str], event: str, strategy: str, exc: FlowlockError, started: float
) -> None:
    workflow = seen[0] if seen else ""
    if isinstance(exc, TransitionRefused):
        label = "refused"
    elif isinstance(exc, ConflictRetriesExhausted):
        label = "conflict"
        metrics.conflicts.labels(workflow, strategy).inc(exc.attempts)
    elif isinstance(exc, LockError):
        label = "lock_error"
        if isinstance(exc, LockLost):
            metrics.leases_lost.labels(strategy).inc()
    elif isinstance(exc, InvalidInput | InstanceNotFound):
        label = "invalid"
    else:
        label = "error"
    metrics.transitions.labels(workflow, event, strategy, label).inc()
    metrics.duration.labels(workflow, strategy).observe(time.perf_counter() - started)
