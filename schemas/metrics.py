"""Prometheus metrics: every series PRME exports, on a registry one process (or engine) owns.

Producers, projectors and the query service all record into a :class:`Metrics` passed
down to them, so the definitions live here, below every layer. Nothing uses
prometheus-client's global registry. Label values are never owner ids or query text:
only route templates, status classes, partitions, read-model and channel names.

Two kinds of series:

- **pushed**: histograms and counters the code observes as things happen;
- **sampled**: counters a component already keeps (cache hits, dedupe hits, dead letters),
  read when Prometheus scrapes, through :meth:`Metrics.sample`.

``Metrics(enabled=False)`` hands out instruments that do nothing (the benchmark's
"metrics off"), and ``render()`` returns an empty exposition.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .tracing import Attributes, Tracing

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds: retrieval and HTTP calls are milliseconds; applies and encodes can take seconds.
LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0
)  # fmt: skip
BATCH_BUCKETS = (1, 2, 5, 10, 25, 50, 100, 256, 500, 1000)
TAKEOVER_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

Sample = Callable[[], Iterable[tuple[tuple[str, ...], float]]]
"""Returns ``(label values, value)`` pairs at scrape time."""


def transport_label(transport: object) -> str:
    """``kafka`` or ``local``: the transport's class name without ``LogTransport``."""
    return type(transport).__name__.removesuffix("LogTransport").lower() or "log"


class _Null:
    """An instrument that records nothing (metrics disabled)."""

    def labels(self, *values: Any, **named: Any) -> _Null:
        return self

    def inc(self, amount: float = 1) -> None: ...

    def dec(self, amount: float = 1) -> None: ...

    def set(self, value: float) -> None: ...

    def observe(self, value: float) -> None: ...

    def clear(self) -> None: ...

    def remove(self, *values: Any) -> None: ...

    def time(self) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()


class _Sampled(Collector):
    """Series read from the components' own counters when the registry is collected."""

    def __init__(self) -> None:
        self._families: list[tuple[str, str, str, tuple[str, ...], Sample]] = []

    def add(self, kind: str, name: str, doc: str, labels: tuple[str, ...], read: Sample) -> None:
        self._families.append((kind, name, doc, labels, read))

    def collect(self) -> Iterator[Metric]:
        for kind, name, doc, labels, read in self._families:
            family: CounterMetricFamily | GaugeMetricFamily
            if kind == "counter":
                family = CounterMetricFamily(name, doc, labels=list(labels))
            else:
                family = GaugeMetricFamily(name, doc, labels=list(labels))
            totals: dict[tuple[str, ...], float] = {}
            for values, value in read():
                totals[values] = totals.get(values, 0.0) + value
            for values, value in totals.items():
                family.add_metric(list(values), value)
            yield family


class Metrics:
    """The PRME instruments, registered on ``registry`` (a fresh one by default)."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        enabled: bool = True,
        tracing: Tracing | None = None,
    ) -> None:
        self.enabled = enabled
        self.tracing = tracing if tracing is not None else Tracing()
        """OpenTelemetry spans (off unless given): handed down with the metrics."""
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._sampled = _Sampled()
        if enabled:
            self.registry.register(self._sampled)
        r = self.registry if enabled else None

        def histogram(name: str, doc: str, labels: tuple[str, ...] = (), **kw: Any) -> Histogram:
            if r is None:
                return cast(Histogram, _Null())
            return Histogram(name, doc, labels, registry=r, **kw)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return cast(Counter, _Null()) if r is None else Counter(name, doc, labels, registry=r)

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return cast(Gauge, _Null()) if r is None else Gauge(name, doc, labels, registry=r)

        # -- HTTP --------------------------------------------------------------------
        self.http_request_duration = histogram(
            "prme_http_request_duration_seconds",
            "HTTP request duration by route template, method and status class",
            ("route", "method", "status"),
            buckets=LATENCY_BUCKETS,
        )
        self.http_in_flight = gauge(
            "prme_http_requests_in_flight", "HTTP requests being served now"
        )
        # -- cluster -----------------------------------------------------------------
        self.cluster_forwards = counter(
            "prme_cluster_forwards",
            "Requests (and read-your-writes waits) sent to the node that owns the owner's "
            "partition, by outcome: forwarded, not_owner (retried), unreachable (retried), "
            "refused (a hop, sent or received, refused: the nodes' cluster keys differ), "
            "resent (a pooled connection broke before the answer: sent again on a new one)",
            ("outcome",),
        )
        self.standby_promotions = counter(
            "prme_cluster_standby_promotions",
            "Partitions this node took over from a standby copy it kept (no replay from the "
            "start of the partition)",
        )
        self.takeover_duration = histogram(
            "prme_cluster_takeover_seconds",
            "From a partition's assignment to this node until it is served here, by how its "
            "shard came: held, kept (parked through the rebalance), standby, opened",
            ("how",),
            buckets=TAKEOVER_BUCKETS,
        )
        self.takeover_records = counter(
            "prme_cluster_takeover_records",
            "Records applied between a partition's assignment and its being served, by how "
            "its shard came (a standby's are only what arrived meanwhile)",
            ("how",),
        )
        self.cluster_partitions = gauge(
            "prme_cluster_owned_partitions",
            "Partitions this node owns (serves and projects), those it keeps as standbys, and "
            "those it warms up to take over (role: owner, standby, warmup)",
            ("role",),
        )
        self.warmup_probes = counter(
            "prme_cluster_warmup_probes",
            "Rebalances this node asked for because its warm-up copies caught up",
        )
        # -- retrieval ---------------------------------------------------------------
        self.retrieve_duration = histogram(
            "prme_retrieve_duration_seconds",
            "Retrieval time per channel (vector, lexical, graph) and stage (query_embedding, "
            "fusion, stages, bundle, total)",
            ("stage",),
            buckets=LATENCY_BUCKETS,
        )
        self.retrieve_requests = counter("prme_retrieve_requests", "Retrievals answered")
        self.min_score_skipped = counter(
            "prme_retrieve_min_score_skipped",
            "Retrievals whose min_score floor was skipped (no cosine to compare with)",
        )
        # -- projector ---------------------------------------------------------------
        self.records_applied = counter(
            "prme_projector_records_applied",
            "Log records applied (or dead-lettered) by the projector, per partition",
            ("partition",),
        )
        self.batch_size = histogram(
            "prme_projector_batch_records",
            "Records per batch the projector applies",
            buckets=BATCH_BUCKETS,
        )
        self.apply_duration = histogram(
            "prme_projector_apply_duration_seconds",
            "Time to apply one batch to one read model",
            ("model",),
            buckets=LATENCY_BUCKETS,
        )
        self.dead_letters = counter(
            "prme_projector_dead_letters",
            "Records sent to the dead letters, by partition and read model ('decode': none)",
            ("partition", "model"),
        )
        self.lag_records = gauge(
            "prme_projector_lag_records",
            "Records on the log not yet applied (log end minus the next offset to read; "
            "transaction markers excluded)",
            ("partition",),
        )
        self.lag_seconds = gauge(
            "prme_projector_lag_seconds",
            "Age of the oldest record not yet applied (0 when caught up)",
            ("partition",),
        )
        self.log_end_offset = gauge(
            "prme_projector_log_end_offset", "The log's end offset per partition", ("partition",)
        )
        self.log_end_age = gauge(
            "prme_projector_log_end_age_seconds",
            "Seconds since the log end offsets (and the lag) shown were read: above 0 while the "
            "log does not answer, when the last ones read are shown (-1: never read)",
        )
        self.applied_offset = gauge(
            "prme_projector_applied_offset",
            "The last offset every read model of the partition has applied",
            ("partition",),
        )
        self.rebuild_replayed = gauge(
            "prme_rebuild_replayed_records",
            "Records replayed by the running (or last) rebuild, per partition",
            ("partition",),
        )
        self.rebuild_target = gauge(
            "prme_rebuild_target_records",
            "Records the running (or last) rebuild replays, per partition (the log end "
            "when it started)",
            ("partition",),
        )
        # -- embedding ---------------------------------------------------------------
        self.texts_encoded = counter(
            "prme_embedding_texts_encoded",
            "Texts handed to the embedding provider (document: misses of the durable vector "
            "cache; query: retrieval queries)",
            ("task",),
        )
        for task in ("document", "query"):  # 0, not absent, on a node that encoded none
            self.texts_encoded.labels(task)
        self.embed_duration = histogram(
            "prme_embedding_batch_duration_seconds",
            "Time of one call to the embedding provider",
            ("task",),
            buckets=LATENCY_BUCKETS,
        )
        # -- log ---------------------------------------------------------------------
        self.log_appends = counter(
            "prme_log_appended_records",
            "Records handed to the log (a retry answered by its request_id included)",
            ("transport",),
        )
        self.append_duration = histogram(
            "prme_log_append_duration_seconds",
            "Time of one append call (one record or one atomic batch)",
            ("transport",),
            buckets=LATENCY_BUCKETS,
        )
        self.transport_errors = counter(
            "prme_log_transport_errors",
            "Failed log operations, by transport and operation",
            ("transport", "operation"),
        )

    # -- sampled series --------------------------------------------------------------

    def sample(self, kind: str, name: str, doc: str, labels: tuple[str, ...], read: Sample) -> None:
        """Export ``read()`` as counter (``kind="counter"``) or gauge family ``name``,
        read at scrape time. Several sources of one name are summed per label set."""
        if self.enabled:
            self._sampled.add(kind, name, doc, labels, read)

    # -- helpers ---------------------------------------------------------------------

    def render(self) -> bytes:
        """The Prometheus text exposition of every series."""
        return generate_latest(self.registry) if self.enabled else b""

    def stopwatch(self, attributes: Attributes | None = None) -> Stopwatch:
        """Times one retrieval (and, with tracing, opens its ``prme.retrieve`` span)."""
        return Stopwatch(self.retrieve_duration, self.tracing, attributes)


class Stopwatch:
    """Times one retrieval's stages into ``prme_retrieve_duration_seconds``: ``lap("fusion")``
    observes the time since the previous lap (or the start), ``stage(name, seconds)`` a
    duration measured elsewhere (a channel), ``total()`` the whole. With tracing each is a
    child span of one ``prme.retrieve`` span, which ``total()`` ends."""

    def __init__(
        self, histogram: Histogram, tracing: Tracing, attributes: Attributes | None = None
    ) -> None:
        self._histogram = histogram
        self._tracing = tracing
        self._span = tracing.start("prme.retrieve", attributes)
        self._started = self._last = time.perf_counter()

    def stage(self, name: str, seconds: float) -> None:
        self._histogram.labels(name).observe(seconds)
        if self._span is not None:
            self._tracing.child(self._span, f"prme.retrieve.{name}", seconds)

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.stage(stage, now - self._last)
        self._last = now

    def total(self, attributes: Attributes | None = None) -> None:
        self._histogram.labels("total").observe(time.perf_counter() - self._started)
        if self._span is not None:
            self._span.set_attributes(attributes or {})
            self._span.end()
