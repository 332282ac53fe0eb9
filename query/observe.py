"""What the HTTP service tells an operator: ``GET /metrics`` and one log line per request.

The request middleware times each routed request into
``prme_http_request_duration_seconds{route, method, status}`` (the route *template*,
``/v1/events/{event_id:str}``, never the path; the status *class*, ``2xx``) and writes one
line to the ``prme.http`` logger: route, method, status, duration and a hash of the owner
the request acted for. Never the owner id itself, a query or any content.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any

import msgspec
from litestar import Response, get
from litestar.di import NamedDependency
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from prme.projectors.status import (
    NodeStatus,
    node_status,
    partition_statuses,
    read_log_ends,
    record_statuses,
)
from prme.schemas.metrics import CONTENT_TYPE, Metrics

from .cluster_health import cluster_health
from .engine import MemoryEngine

access_log = logging.getLogger("prme.http")
CALLER_STATE = "prme_caller"
"""Where the request's :class:`~prme.query.auth.Caller` is kept in the ASGI scope state."""


def owner_hash(owner: str) -> str:
    """A short, stable pseudonym of an owner id for logs (sha256, 16 hex digits)."""
    return hashlib.sha256(owner.encode()).hexdigest()[:16]


class RequestObserver:
    """ASGI middleware: duration histogram, in-flight gauge and the access log line."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500
        started = time.perf_counter()

        async def observed(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.metrics.http_in_flight.inc()
        route = scope.get("path_template") or "unmatched"
        method = str(scope.get("method", ""))
        try:
            with self.metrics.tracing.span(
                f"{method} {route}",
                {"http.request.method": method, "http.route": route},
                server=True,
            ) as span:
                await self.app(scope, receive, observed)
                if span is not None:
                    span.set_attribute("http.response.status_code", status)
        finally:
            self.metrics.http_in_flight.dec()
            elapsed = time.perf_counter() - started
            self.metrics.http_request_duration.labels(route, method, f"{status // 100}xx").observe(
                elapsed
            )
            if access_log.isEnabledFor(logging.INFO):
                _log_request(scope, route, method, status, elapsed)


def _log_request(scope: Scope, route: str, method: str, status: int, elapsed: float) -> None:
    caller: Any = scope.get("state", {}).get(CALLER_STATE)
    owners = sorted({owner_hash(o) for o in getattr(caller, "acted_for", ())})
    access_log.info(
        "%s %s %d %.1fms%s",
        method,
        route,
        status,
        elapsed * 1000,
        f" owner={','.join(owners)}" if owners else "",
        extra={
            "route": route,
            "method": method,
            "status": status,
            "duration_ms": round(elapsed * 1000, 3),
            "owner_hash": owners[0] if len(owners) == 1 else owners or None,
        },
    )


@get(
    "/metrics",
    summary="Prometheus metrics (text format)",
    tags=["service"],
    media_type=CONTENT_TYPE,  # the OpenAPI document states the text format, not JSON
)
async def metrics_endpoint(engine: NamedDependency[MemoryEngine]) -> Response[bytes]:
    """Every series of this process; the lag gauges are computed now, waiting for the log
    at most ``STATUS_TIMEOUT_S`` (then from the last log ends read: see
    ``prme_projector_log_end_age_seconds``)."""
    metrics = engine.metrics
    runner = engine.runner
    ends = await read_log_ends(runner)
    if ends.unavailable is not None:
        logging.getLogger(__name__).warning("metrics: log end offsets stale: %s", ends.unavailable)
    try:
        record_statuses(metrics, await partition_statuses(runner, ends=ends), ends)
    except Exception as error:  # serve the rest, say so in the log
        logging.getLogger(__name__).warning("metrics: partition status unavailable: %s", error)
    return Response(metrics.render(), media_type=CONTENT_TYPE)


@get(
    "/v1/status",
    summary="This process: partitions, offsets, lag, sizes, group; the cluster's health",
    tags=["service"],
)
async def status_endpoint(engine: NamedDependency[MemoryEngine]) -> NodeStatus:
    """What ``prme status`` prints (no owner data: partitions, offsets and sizes only)."""
    status = await node_status(engine.runner)
    health = await cluster_health(engine, status)
    return msgspec.structs.replace(status, cluster=health)
