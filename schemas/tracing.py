"""OpenTelemetry spans, optional (the ``otel`` extra): a request, its retrieval stages and
channels, and a write from append to apply, linked by the records' event ids.

Off by default; ``Settings.tracing.enabled`` turns it on, with the tracer provider the
process configured (``opentelemetry-sdk`` and an exporter: the operator's choice) or the
one handed to :meth:`Tracing.create`. Span attributes never carry an owner id, a query or
content: routes, stages, partitions, offsets, counts and event ids (UUIDs).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from .errors import ConfigurationError

Attributes = Mapping[str, str | int | float | bool | Sequence[str] | Sequence[int]]


class Tracing:
    """Makes spans through ``tracer``; with none, every call does nothing."""

    def __init__(self, tracer: Any = None) -> None:
        self._tracer = tracer

    @classmethod
    def create(cls, enabled: bool, tracer_provider: Any = None) -> Tracing:
        """A tracer from ``tracer_provider`` (default: OpenTelemetry's configured one)."""
        if not enabled:
            return cls()
        try:
            from opentelemetry import trace
        except ImportError as error:
            raise ConfigurationError(
                "tracing.enabled needs OpenTelemetry: pip install 'prme-memory[otel]'"
            ) from error
        provider = tracer_provider if tracer_provider is not None else trace.get_tracer_provider()
        return cls(provider.get_tracer("prme"))

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    @contextlib.contextmanager
    def span(
        self, name: str, attributes: Attributes | None = None, *, server: bool = False
    ) -> Iterator[Any]:
        """A span around the block, current inside it (``None`` when tracing is off);
        ``server`` marks a request's span (SpanKind.SERVER)."""
        if self._tracer is None:
            yield None
            return
        from opentelemetry.trace import SpanKind

        kind = SpanKind.SERVER if server else SpanKind.INTERNAL
        with self._tracer.start_as_current_span(name, attributes=attributes, kind=kind) as span:
            yield span

    def start(self, name: str, attributes: Attributes | None = None) -> Any:
        """A span started now, a child of the current one; the caller ends it."""
        return (
            None if self._tracer is None else self._tracer.start_span(name, attributes=attributes)
        )

    def child(
        self, parent: Any, name: str, seconds: float, attributes: Attributes | None = None
    ) -> None:
        """Record a finished child span of ``parent`` that took ``seconds`` and ended now."""
        if self._tracer is None or parent is None:
            return
        from opentelemetry import trace

        end = time.time_ns()
        span = self._tracer.start_span(
            name,
            context=trace.set_span_in_context(parent),
            attributes=attributes,
            start_time=end - int(seconds * 1e9),
        )
        span.end(end_time=end)
