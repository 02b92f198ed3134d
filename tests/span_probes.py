"""What the tracing tests use to see flowlock's spans: an SDK tracer provider recording into an
in-memory exporter, handed to flowlock with ``flowlock.tracing.use_tracer_provider`` (never set
as the process's global provider, which OpenTelemetry allows only once), and ways to walk the
recorded spans by name, parent and link.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from flowlock import tracing


class Spans:
    """The spans flowlock finished while recording, in the order they ended."""

    def __init__(self, provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
        self.provider = provider
        self._exporter = exporter

    @property
    def all(self) -> list[ReadableSpan]:
        return list(self._exporter.get_finished_spans())

    def named(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.all if s.name == name]

    def one(self, name: str) -> ReadableSpan:
        found = self.named(name)
        assert len(found) == 1, [s.name for s in self.all]
        return found[0]

    def children(self, parent: ReadableSpan, name: str | None = None) -> list[ReadableSpan]:
        """The spans whose parent is ``parent`` (and named ``name``), by start time."""
        found = [
            s
            for s in self.all
            if s.parent is not None
            and s.parent.span_id == span_id(parent)
            and (name is None or s.name == name)
        ]
        return sorted(found, key=lambda s: start_of(s))

    def clear(self) -> None:
        self._exporter.clear()


def span_id(span: ReadableSpan) -> int:
    context = span.context
    assert context is not None
    return int(context.span_id)


def start_of(span: ReadableSpan) -> int:
    assert span.start_time is not None
    return span.start_time


def end_of(span: ReadableSpan) -> int:
    assert span.end_time is not None
    return span.end_time


def attrs(span: ReadableSpan) -> dict[str, Any]:
    found: Mapping[str, Any] = span.attributes or {}
    return dict(found)


def within(inner: ReadableSpan, outer: ReadableSpan) -> bool:
    """``inner`` started and ended inside ``outer``'s time."""
    return start_of(outer) <= start_of(inner) <= end_of(inner) <= end_of(outer)


@contextmanager
def recording() -> Iterator[Spans]:
    """flowlock's spans go to a fresh provider (recorded as they end) until the block ends."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_tracer_provider(provider)
    try:
        yield Spans(provider, exporter)
    finally:
        tracing.use_tracer_provider(None)
        provider.shutdown()
