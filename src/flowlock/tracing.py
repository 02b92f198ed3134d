"""Optional OpenTelemetry spans: `flowlock.fire` per call, and its children.

Install flowlock's `otel` extra. Without it, or without a tracer provider, a
call costs a flag check. docs/tracing.md lists the spans, attributes and costs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar, Token
from typing import TYPE_CHECKING, Any

from flowlock.core.errors import ConflictRetriesExhausted, InvalidInput
from flowlock.core.install import pip_install
from flowlock.core.models import HistoryEntry, Timer
from flowlock.core.outbox import Message

try:  # the otel extra: without it every helper here is a no-op
    from opentelemetry import context as _otel_context
    from opentelemetry import trace as _trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    _PROPAGATOR = TraceContextTextMapPropagator()
except ImportError:
    AVAILABLE = False
else:
    AVAILABLE = True

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer, TracerProvider

    from flowlock.core.models import Outcome

__all__ = [
    "AVAILABLE",
    "BATCH",
    "COMMIT",
    "DELIVER",
    "FIRE",
    "LOCK_WAIT",
    "NO_SPAN",
    "TRACER_NAME",
    "FireSpan",
    "batch_span",
    "commit_done",
    "commit_span",
    "current",
    "deliver_span",
    "lock_failed",
    "lock_wait",
    "locked",
    "start_fire",
    "tracer",
    "use_tracer_provider",
]

TRACER_NAME = "flowlock"

FIRE = "flowlock.fire"
LOCK_WAIT = "flowlock.lock_wait"
COMMIT = "flowlock.commit"
BATCH = "flowlock.batch"
DELIVER = "flowlock.outbox.deliver"

# Attribute names (docs/tracing.md has the table).
WORKFLOW = "flowlock.workflow"
INSTANCE_ID = "flowlock.instance_id"
EVENT = "flowlock.event"
STRATEGY = "flowlock.strategy"
ATTEMPTS = "flowlock.attempts"
OUTCOME = "flowlock.outcome"
BATCH_SIZE = "flowlock.batch_size"
ATTEMPT = "flowlock.attempt"
ENTRIES = "flowlock.entries"
CONFLICT = "flowlock.conflict"
LOCK = "flowlock.lock"
ACQUIRED = "flowlock.lock.acquired"

_provider: TracerProvider | None = None  # use_tracer_provider's, over the global one
_cached: tuple[object, Tracer] | None = None  # (the provider it came from, flowlock's tracer)

# The tracer of the traced fire (or batch) this code runs under; None: make no spans.
_CURRENT: ContextVar[Tracer | None] = ContextVar("flowlock_tracer", default=None)

NO_SPAN: AbstractContextManager[None] = nullcontext()
"""What [`commit_span`][flowlock.tracing.commit_span] hands out when nothing is traced: one object,
reused by every call (a nullcontext keeps no state)."""


def use_tracer_provider(provider: TracerProvider | None) -> None:
    """Send flowlock's spans to `provider` instead of the global one; None goes back.

    For tests, and for applications with a provider of their own. OpenTelemetry lets the
    global provider be set only once per process.
    """
    global _provider, _cached
    if provider is not None:
        if not AVAILABLE:
            raise InvalidInput(
                "use_tracer_provider() needs OpenTelemetry, which is not installed; install it "
                f"with {pip_install('otel')} (or pip install opentelemetry-api)"
            )
        if not isinstance(provider, _trace.TracerProvider):
            raise InvalidInput(
                "use_tracer_provider() takes an opentelemetry.trace.TracerProvider (e.g. the "
                f"SDK's opentelemetry.sdk.trace.TracerProvider()) or None, not {provider!r}"
            )
    _provider, _cached = provider, None


def tracer() -> Tracer | None:
    """flowlock's tracer, or None when OpenTelemetry or a tracer provider is missing.

    None means no span at all, rather than non-recording ones.
    """
    global _cached
    if not AVAILABLE:
        return None
    provider = _provider if _provider is not None else _trace.get_tracer_provider()
    cached = _cached
    if cached is not None and cached[0] is provider:
        return cached[1]
    # The API's stand-ins until (unless) an SDK provider is set: every span would be dropped.
    if isinstance(provider, _trace.ProxyTracerProvider | _trace.NoOpTracerProvider):
        return None
    found = provider.get_tracer(TRACER_NAME)
    _cached = (provider, found)
    return found


def current() -> Tracer | None:
    """The tracer of the traced `fire` (or batch) the caller runs under, or None."""
    return _CURRENT.get()


class FireSpan:
    """The `flowlock.fire` span of one call.

    It is current in the caller's context from [`start_fire`][flowlock.tracing.start_fire] until
    `end`. `end` must run in that same context (`fire`'s `finally`).
    """

    __slots__ = ("_otel_token", "_token", "span", "tracer")

    def __init__(self, tracer: Tracer, instance_id: str, event: str) -> None:
        self.tracer = tracer
        self.span: Span = tracer.start_span(
            FIRE, attributes={INSTANCE_ID: instance_id, EVENT: event}
        )
        self._otel_token = _otel_context.attach(_trace.set_span_in_context(self.span))
        self._token: Token[Tracer | None] = _CURRENT.set(tracer)

    def traceparent(self) -> str:
        """This span's W3C traceparent: kept on the messages the call emits, so that each
        delivery's span links back to it."""
        ctx = self.span.get_span_context()
        return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"

    def chose(self, strategy: str) -> None:
        """The strategy picked for the call (replaced by the one that ran, on success)."""
        self.span.set_attribute(STRATEGY, strategy)

    def read(self, workflow: str) -> None:
        """The instance's workflow, once a failed call had read it."""
        self.span.set_attribute(WORKFLOW, workflow)

    def batched(self, size: int) -> None:
        """The call failed in a batch of `size` calls."""
        self.span.set_attribute(BATCH_SIZE, size)

    def done(self, outcome: Outcome) -> None:
        """The call returned `outcome`."""
        self.span.set_attributes(
            {
                WORKFLOW: outcome.instance.workflow,
                STRATEGY: outcome.strategy,
                ATTEMPTS: outcome.attempts,
                OUTCOME: "applied" if outcome.applied else "idempotent",
                BATCH_SIZE: outcome.batch_size,
            }
        )

    def failed(self, exc: BaseException, label: str) -> None:
        """The call raised `exc`; `label` is its outcome.

        A cancelled call gets its label but no error status: it is no error of its own.
        """
        span = self.span
        span.set_attribute(OUTCOME, label)
        if isinstance(exc, ConflictRetriesExhausted):
            span.set_attribute(ATTEMPTS, exc.attempts)
        if isinstance(exc, Exception):
            span.record_exception(exc)
            span.set_status(_trace.Status(_trace.StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))

    def end(self) -> None:
        _CURRENT.reset(self._token)
        _otel_context.detach(self._otel_token)
        self.span.end()


def timer_span(timer: Timer) -> AbstractContextManager[Span] | None:
    """A `flowlock.timer` span around one firing (its fire span is a child); None when nothing
    is traced."""
    found = tracer()
    if found is None:
        return None
    return found.start_as_current_span(
        "flowlock.timer",
        attributes={
            "flowlock.instance_id": timer.instance_id,
            "flowlock.workflow": timer.workflow,
            "flowlock.event": timer.event,
            "flowlock.timer.stay": timer.stay,
            "flowlock.timer.firing": timer.n,
            "flowlock.timer.lag": timer.lag,
        },
    )


def deliver_span(message: Message) -> AbstractContextManager[Span] | None:
    """A `flowlock.outbox.deliver` span around one delivery of `message`, linked to the span
    of the call that emitted it (its `trace`); None when nothing is traced. A `Then` the
    handler returns is fired under it."""
    found = tracer()
    if found is None:
        return None
    links = []
    if message.trace:
        carrier = {"traceparent": message.trace}
        emitted = _trace.get_current_span(_PROPAGATOR.extract(carrier)).get_span_context()
        if emitted.is_valid:
            links.append(_trace.Link(emitted))
    return found.start_as_current_span(
        DELIVER,
        context=_otel_context.Context(),  # a root of its own: the emitting call ended long ago
        links=links,
        attributes={
            INSTANCE_ID: message.instance_id,
            WORKFLOW: message.workflow,
            "flowlock.outbox.kind": message.kind,
            "flowlock.outbox.key": message.key,
            "flowlock.outbox.attempt": message.attempt,
        },
    )


def start_fire(instance_id: str, event: str) -> FireSpan | None:
    """A `flowlock.fire` span for a call, made current; None when nothing is traced."""
    found = tracer()
    return None if found is None else FireSpan(found, instance_id, event)


@contextmanager
def batch_span(
    first: FireSpan, spans: Sequence[FireSpan | None], instance_id: str, strategy: str
) -> Iterator[object]:
    """A `flowlock.batch` span around one batch's strategy run, in the driver task.

    It is a child of the first call's fire span and links to the others'. The batch's lock
    wait and commit spans are its children, shared by its calls. The engine passes
    [`NO_SPAN`][flowlock.tracing.NO_SPAN] when the batch is not traced.
    """
    links = [
        _trace.Link(s.span.get_span_context()) for s in spans if s is not None and s is not first
    ]
    with first.tracer.start_as_current_span(
        BATCH,
        context=_trace.set_span_in_context(first.span),
        links=links,
        attributes={INSTANCE_ID: instance_id, STRATEGY: strategy, BATCH_SIZE: len(spans)},
    ) as span:
        token = _CURRENT.set(first.tracer)
        try:
            yield span
        finally:
            _CURRENT.reset(token)


def commit_span(
    planned: Sequence[HistoryEntry], attempt: int
) -> AbstractContextManager[Span | None]:
    """A `flowlock.commit` span around a compare-and-swap of `planned`.

    `attempt` is the attempt number. A child of the current span; the shared no-op when
    nothing is traced. Report the result with [`commit_done`][flowlock.tracing.commit_done].
    """
    found = _CURRENT.get()
    if found is None:
        return NO_SPAN
    return found.start_as_current_span(COMMIT, attributes={ATTEMPT: attempt, ENTRIES: len(planned)})


def commit_done(span: Span | None, won: bool) -> None:
    """Whether the compare-and-swap of `span` won.

    False: another writer got there first, and nothing was written.
    """
    if span is not None:
        span.set_attribute(CONFLICT, not won)


def lock_wait(start: float, end: float, *, lock: str, acquired: bool = True) -> None:
    """A `flowlock.lock_wait` span from `start` to `end`, in monotonic seconds.

    `lock` is "row" or "lease". `acquired` is False when the call was answered after the
    release, without taking the lock.
    """
    found = _CURRENT.get()
    if found is not None:
        _Clock().span(found, LOCK_WAIT, start, end, {LOCK: lock, ACQUIRED: acquired})


def lock_failed(start: float, exc: BaseException, *, lock: str) -> None:
    """A `flowlock.lock_wait` span from `start` until now that ended in `exc`.

    `exc` is a timeout, a busy lock or a lock backend that is down.
    """
    found = _CURRENT.get()
    if found is not None:
        clock = _Clock()
        clock.span(found, LOCK_WAIT, start, clock.now, {LOCK: lock, ACQUIRED: False}, exc)


def locked(start: float, waited: float | None, held: float | None, entries: int) -> None:
    """The spans of a store's locked step that began at `start` (monotonic).

    A lock-wait span for `waited` seconds, then a commit span for the time the lock was
    held, when `entries` > 0. A store that does not measure the wait (None) gets one commit
    span for the whole call.
    """
    found = _CURRENT.get()
    if found is None:
        return
    clock = _Clock()
    got = start
    if waited is not None:
        got = start + waited
        clock.span(found, LOCK_WAIT, start, got, {LOCK: "row", ACQUIRED: True})
    if entries > 0:
        released = got + held if waited is not None and held is not None else clock.now
        clock.span(found, COMMIT, got, released, {ATTEMPT: 1, ENTRIES: entries, CONFLICT: False})


class _Clock:
    """Now on both clocks, read once.

    Turns the monotonic times strategies measure into the wall-clock nanoseconds spans take.
    Spans made with one clock meet exactly where their times meet.
    """

    __slots__ = ("now", "now_ns")

    def __init__(self) -> None:
        self.now, self.now_ns = time.monotonic(), time.time_ns()

    def wall(self, t: float) -> int:
        return self.now_ns - round((self.now - t) * 1e9)

    def span(
        self,
        found: Tracer,
        name: str,
        start: float,
        end: float,
        attributes: dict[str, Any],
        exc: BaseException | None = None,
    ) -> None:
        """A span from `start` to `end` (monotonic seconds) under the current span."""
        span = found.start_span(name, attributes=attributes, start_time=self.wall(start))
        if exc is not None:
            span.record_exception(exc)
            span.set_status(_trace.Status(_trace.StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        span.end(end_time=self.wall(max(start, end)))
