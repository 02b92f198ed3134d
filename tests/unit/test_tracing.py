"""OpenTelemetry spans on the memory store: a ``flowlock.fire`` span per call with the strategy
that ran, the attempts and the outcome; ``flowlock.lock_wait`` and ``flowlock.commit`` beneath
it; a ``flowlock.batch`` span for a batch; an error span for a refused call; and ``fire``
unchanged, with no span, when OpenTelemetry is not installed or no provider is configured."""

from __future__ import annotations

import asyncio
import importlib
import re
import sys
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import StatusCode

import flowlock
from flowlock import examples, tracing
from flowlock.core.install import pip_install
from flowlock.core.models import HistoryEntry, Instance
from flowlock.locks import MemoryLocks
from flowlock.stores import MemoryStore
from span_probes import Spans, attrs, end_of, recording, span_id, start_of, within

BOUND = 10.0  # seconds any wait here may take before the test calls it a hang (generous)


def ticket() -> flowlock.Workflow:
    """A workflow that can apply one event many times (touch) and then refuse it (close)."""
    return flowlock.Workflow(
        "ticket",
        strategy="optimistic",
        states=["open", "closed"],
        initial="open",
        transitions=[
            flowlock.Transition("touch", source="open", target="open"),
            flowlock.Transition("close", source="open", target="closed"),
        ],
    )


class GatedStore(MemoryStore):
    """The memory store whose next write waits at a gate the test opens (the writes after it go
    through): a compare-and-swap held in flight while other calls run."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.gate.set()
        self.waiting = asyncio.Event()

    async def commit(self, entries: Sequence[HistoryEntry]) -> Instance | None:
        if not self.gate.is_set() and not self.waiting.is_set():
            self.waiting.set()
            await self.gate.wait()
        return await super().commit(entries)

    async def held(self) -> None:
        async with asyncio.timeout(BOUND):
            await self.waiting.wait()


@pytest.fixture
def spans() -> Iterator[Spans]:
    with recording() as found:
        yield found


async def _engine(store: MemoryStore | None = None, **options: Any) -> flowlock.Engine:
    eng = await flowlock.Engine(store or MemoryStore(), **options).open()
    await eng.register(examples.approval())
    await eng.register(ticket())
    await eng.create("approval", instance_id="r")
    await eng.create("ticket", instance_id="t")
    return eng


@pytest.fixture
async def mem() -> AsyncIterator[flowlock.Engine]:
    eng = await _engine(locks=MemoryLocks())
    yield eng
    await eng.aclose()


def _fire_span(spans: Spans) -> ReadableSpan:
    return spans.one(tracing.FIRE)


async def test_an_applied_fire_is_one_span_with_a_commit_beneath(
    mem: flowlock.Engine, spans: Spans
) -> None:
    outcome = await mem.fire("r", "approve")
    fire = _fire_span(spans)
    assert attrs(fire) == {
        "flowlock.instance_id": "r",
        "flowlock.event": "approve",
        "flowlock.workflow": "approval",
        "flowlock.strategy": "optimistic",
        "flowlock.attempts": 1,
        "flowlock.outcome": "applied",
        "flowlock.batch_size": 1,
    }
    assert fire.status.status_code is StatusCode.UNSET
    assert fire.parent is None  # the caller had no span of its own
    assert fire.instrumentation_scope is not None
    assert fire.instrumentation_scope.name == "flowlock"
    (commit,) = spans.children(fire)
    assert commit.name == tracing.COMMIT
    assert attrs(commit) == {
        "flowlock.attempt": 1,
        "flowlock.entries": 1,
        "flowlock.conflict": False,
    }
    assert commit.context is not None and fire.context is not None
    assert commit.context.trace_id == fire.context.trace_id
    assert within(commit, fire)
    assert outcome.applied


async def test_an_idempotent_fire_writes_nothing_and_has_no_commit_span(
    mem: flowlock.Engine, spans: Spans
) -> None:
    await mem.fire("r", "approve", request_id="once")
    spans.clear()
    again = await mem.fire("r", "approve", request_id="once")
    assert again.idempotent
    fire = _fire_span(spans)
    assert attrs(fire)["flowlock.outcome"] == "idempotent"
    assert spans.children(fire) == []


async def test_a_refused_fire_is_an_error_span_with_the_exception(
    mem: flowlock.Engine, spans: Spans
) -> None:
    await mem.fire("r", "approve")
    spans.clear()
    with pytest.raises(flowlock.TransitionNotAllowed) as raised:
        await mem.fire("r", "reject")
    fire = _fire_span(spans)
    assert attrs(fire) == {
        "flowlock.instance_id": "r",
        "flowlock.event": "reject",
        "flowlock.workflow": "approval",  # the step read the instance before refusing
        "flowlock.strategy": "optimistic",
        "flowlock.outcome": "refused",
    }
    assert fire.status.status_code is StatusCode.ERROR
    assert fire.status.description == f"TransitionNotAllowed: {raised.value}"
    (event,) = fire.events
    assert event.name == "exception"
    assert event.attributes is not None
    assert event.attributes["exception.type"] == "flowlock.core.errors.TransitionNotAllowed"
    assert spans.children(fire) == []  # nothing was written


async def test_invalid_input_is_traced_before_anything_is_read(
    mem: flowlock.Engine, spans: Spans
) -> None:
    with pytest.raises(flowlock.InvalidInput):
        await mem.fire("r", "not an event")
    fire = _fire_span(spans)
    assert attrs(fire)["flowlock.outcome"] == "invalid"
    assert "flowlock.workflow" not in attrs(fire)
    assert fire.status.status_code is StatusCode.ERROR


@pytest.mark.parametrize(
    ("strategy", "ran", "lock"),
    [
        ("optimistic", "optimistic", None),
        ("adaptive", "optimistic", None),
        ("pessimistic", "pessimistic", "row"),
        ("distributed", "distributed", "lease"),
    ],
)
async def test_each_strategy_traces_its_lock_wait_and_commit(
    mem: flowlock.Engine, spans: Spans, strategy: str, ran: str, lock: str | None
) -> None:
    await mem.fire("r", "approve", strategy=strategy)
    fire = _fire_span(spans)
    assert attrs(fire)["flowlock.strategy"] == ran  # adaptive reports the strategy that ran
    children = spans.children(fire)
    if lock is None:
        assert [c.name for c in children] == [tracing.COMMIT]
        return
    wait, commit = children
    assert (wait.name, commit.name) == (tracing.LOCK_WAIT, tracing.COMMIT)
    assert attrs(wait) == {"flowlock.lock": lock, "flowlock.lock.acquired": True}
    assert attrs(commit)["flowlock.entries"] == 1
    assert end_of(wait) <= start_of(commit)
    assert within(wait, fire) and within(commit, fire)


async def test_the_pessimistic_commit_span_is_the_time_the_row_lock_was_held(
    mem: flowlock.Engine, spans: Spans
) -> None:
    """The memory store measures the wait and the hold; the two spans meet where the lock was
    taken."""
    await mem.fire("t", "touch", strategy="pessimistic")
    wait, commit = spans.children(_fire_span(spans))
    assert end_of(wait) == start_of(commit)


async def test_a_lease_that_times_out_is_an_error_lock_wait(spans: Spans) -> None:
    locks = MemoryLocks()
    eng = await _engine(locks=locks)
    try:
        holder = await locks.acquire("r", ttl=30)
        with pytest.raises(flowlock.LockTimeout):
            await eng.fire("r", "approve", strategy=flowlock.Distributed(wait=0.05))
        await locks.release(holder)
    finally:
        await eng.aclose()
    fire = _fire_span(spans)
    assert attrs(fire)["flowlock.outcome"] == "lock_error"
    (wait,) = spans.children(fire)
    assert wait.name == tracing.LOCK_WAIT
    assert attrs(wait) == {"flowlock.lock": "lease", "flowlock.lock.acquired": False}
    assert wait.status.status_code is StatusCode.ERROR
    assert end_of(wait) - start_of(wait) >= 40_000_000  # it waited (most of) its 50 ms


async def test_a_lost_compare_and_swap_shows_as_a_conflicting_commit_then_a_retry(
    spans: Spans,
) -> None:
    """One engine's write is held while another engine writes the same instance: the first
    loses its compare-and-swap and retries on a fresh read."""
    store = GatedStore()
    slow = await _engine(store, batching=False)
    fast = flowlock.Engine(store, batching=False)
    await fast.open()
    await fast.register(ticket())
    try:
        store.gate.clear()
        held = asyncio.create_task(slow.fire("t", "touch"))
        await store.held()
        await fast.fire("t", "touch")
        store.gate.set()
        async with asyncio.timeout(BOUND):
            outcome = await held
    finally:
        await slow.aclose()
        await fast.aclose()
    assert outcome.attempts == 2
    fires = sorted(spans.named(tracing.FIRE), key=start_of)
    first = fires[0]
    assert attrs(first)["flowlock.attempts"] == 2
    commits = spans.children(first, tracing.COMMIT)
    assert [(attrs(c)["flowlock.attempt"], attrs(c)["flowlock.conflict"]) for c in commits] == [
        (1, True),
        (2, False),
    ]


async def test_a_batch_has_one_batch_span_linked_to_every_callers_fire_span(
    spans: Spans,
) -> None:
    """Calls queued behind a held write run as one batch in the driver task: one batch span
    (a child of the first queued call's fire span, linked to the others) holds the batch's one
    commit; each caller's fire span says the batch's size, and a call the batch refused gets
    its own error."""
    store = GatedStore()
    eng = await _engine(store)
    try:
        store.gate.clear()
        alone = asyncio.create_task(eng.fire("t", "touch"))
        await store.held()
        queued = [
            asyncio.create_task(eng.fire("t", event)) for event in ("touch", "close", "touch")
        ]
        await asyncio.sleep(0)
        store.gate.set()
        async with asyncio.timeout(BOUND):
            answers = await asyncio.gather(alone, *queued, return_exceptions=True)
    finally:
        await eng.aclose()
    assert isinstance(answers[3], flowlock.TransitionNotAllowed)
    fires = sorted(spans.named(tracing.FIRE), key=start_of)
    assert [attrs(f)["flowlock.batch_size"] for f in fires] == [1, 3, 3, 3]
    assert [attrs(f)["flowlock.outcome"] for f in fires] == [
        "applied",
        "applied",
        "applied",
        "refused",
    ]
    assert attrs(fires[3])["flowlock.workflow"] == "ticket"
    assert fires[3].status.status_code is StatusCode.ERROR

    batch = spans.one(tracing.BATCH)
    assert attrs(batch) == {
        "flowlock.instance_id": "t",
        "flowlock.strategy": "optimistic",
        "flowlock.batch_size": 3,
    }
    assert batch.parent is not None and batch.parent.span_id == span_id(fires[1])
    assert {link.context.span_id for link in batch.links} == {span_id(fires[2]), span_id(fires[3])}
    (commit,) = spans.children(batch)
    assert attrs(commit) == {
        "flowlock.attempt": 1,
        "flowlock.entries": 2,
        "flowlock.conflict": False,
    }
    # The call that ran alone wrote under its own fire span; the queued ones wrote nothing alone.
    assert [c.name for c in spans.children(fires[0])] == [tracing.COMMIT]
    assert [c.name for c in spans.children(fires[1])] == [tracing.BATCH]
    assert spans.children(fires[2]) == spans.children(fires[3]) == []


async def test_a_cancelled_fire_says_so_without_an_error_status(spans: Spans) -> None:
    store = GatedStore()
    eng = await _engine(store)
    try:
        store.gate.clear()
        call = asyncio.create_task(eng.fire("t", "touch"))
        await store.held()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
    finally:
        store.gate.set()
        await eng.aclose()
    fire = _fire_span(spans)
    assert attrs(fire)["flowlock.outcome"] == "cancelled"
    assert fire.status.status_code is StatusCode.UNSET


async def test_fire_is_a_child_of_the_callers_span(mem: flowlock.Engine, spans: Spans) -> None:
    app = spans.provider.get_tracer("app")
    with app.start_as_current_span("request") as request:
        await mem.fire("r", "approve")
    fire = _fire_span(spans)
    assert fire.parent is not None
    assert fire.parent.span_id == request.get_span_context().span_id


async def test_nothing_is_traced_without_a_configured_provider(mem: flowlock.Engine) -> None:
    """The API is installed but nobody set a tracer provider: flowlock makes no span at all
    (not even non-recording ones)."""
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    assert tracing.tracer() is None
    assert tracing.start_fire("r", "approve") is None
    assert (await mem.fire("r", "approve")).applied


async def test_fire_works_untraced_when_the_flag_says_opentelemetry_is_missing(
    mem: flowlock.Engine, spans: Spans, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tracing, "AVAILABLE", False)
    assert tracing.tracer() is None
    for strategy in ("optimistic", "pessimistic", "distributed"):
        await mem.fire("t", "touch", strategy=strategy)
    await mem.fire("r", "approve")
    with pytest.raises(flowlock.TransitionNotAllowed):
        await mem.fire("r", "reject")
    assert spans.all == []


def test_without_opentelemetry_tracing_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """flowlock.tracing imported with no ``opentelemetry`` package: the flag is off, every
    helper answers nothing, and the engine fires as before."""
    monkeypatch.setitem(sys.modules, "opentelemetry", None)  # what a missing package looks like
    try:
        importlib.reload(tracing)
        assert tracing.AVAILABLE is False
        assert tracing.tracer() is None
        assert tracing.current() is None
        with tracing.commit_span((), 1) as span:
            tracing.commit_done(span, True)
        assert span is None
        tracing.lock_wait(0.0, 1.0, lock="row")
        tracing.locked(0.0, 0.5, 0.5, 1)
        tracing.use_tracer_provider(None)
        with pytest.raises(flowlock.InvalidInput, match=re.escape(pip_install("otel"))):
            tracing.use_tracer_provider(trace.NoOpTracerProvider())

        async def fire() -> flowlock.Outcome:
            eng = await _engine(locks=MemoryLocks())
            try:
                await eng.fire("t", "touch", strategy="pessimistic")
                await eng.fire("t", "touch", strategy="distributed")
                return await eng.fire("r", "approve")
            finally:
                await eng.aclose()

        assert asyncio.run(fire()).applied
    finally:
        monkeypatch.undo()
        importlib.reload(tracing)
    assert tracing.AVAILABLE is True


def test_use_tracer_provider_takes_only_a_tracer_provider() -> None:
    with pytest.raises(flowlock.InvalidInput, match="TracerProvider"):
        tracing.use_tracer_provider(object())  # type: ignore[arg-type]


def test_a_sync_fire_is_a_child_of_the_calling_threads_span(spans: Spans) -> None:
    """flowlock.sync runs the engine on a loop thread of its own; the caller's context goes
    with each call."""
    with flowlock.sync.Engine(MemoryStore()) as eng:
        eng.register(examples.approval())
        eng.create("approval", instance_id="r")
        with spans.provider.get_tracer("app").start_as_current_span("request") as request:
            eng.fire("r", "approve")
    fire = _fire_span(spans)
    assert fire.parent is not None
    assert fire.parent.span_id == request.get_span_context().span_id
    assert attrs(fire)["flowlock.outcome"] == "applied"
