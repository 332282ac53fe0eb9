"""OpenTelemetry spans (the otel extra): a request, its retrieval stages and channels, and
a write from append to apply, linked by the record's event id; no owner or query in them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from prme.query.engine import MemoryEngine
from prme.query.service import create_app
from prme.schemas.config import Settings
from prme.schemas.metrics import Metrics
from prme.schemas.tracing import Tracing

OWNER = "owner-51d0-private"
QUERY = "where is the spare key hidden"


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
async def http(
    local_settings: Settings, hashed_provider: Any, exporter: InMemorySpanExporter
) -> AsyncIterator[httpx.AsyncClient]:
    provider = TracerProvider()  # this test's own provider: the global one is left alone
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    metrics = Metrics(tracing=Tracing.create(True, provider))
    engine = await MemoryEngine.create(
        settings=local_settings, embedding_provider=hashed_provider, metrics=metrics
    )
    transport = httpx.ASGITransport(app=create_app(engine))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://prme") as client:
            yield client
    finally:
        await engine.close()


def named(spans: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [span for span in spans if span.name == name]


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


async def test_a_write_is_traced_from_request_to_append_to_apply(
    http: httpx.AsyncClient, exporter: InMemorySpanExporter
) -> None:
    body = {"user_id": OWNER, "content": "The spare key is under the blue pot"}
    stored = await http.post("/v1/memories", json=body)
    assert stored.status_code == 201
    event_id = stored.json()["event_id"]
    spans = list(exporter.get_finished_spans())

    (request,) = named(spans, "POST /v1/memories")
    assert request.kind == SpanKind.SERVER
    assert request.attributes is not None
    assert request.attributes["http.route"] == "/v1/memories"
    assert request.attributes["http.response.status_code"] == 201
    (append,) = named(spans, "prme.append")
    assert parent_of(append) == request.context.span_id
    assert append.attributes is not None
    assert list(append.attributes["prme.event_ids"]) == [event_id]
    assert append.context.trace_id == request.context.trace_id
    applied = [
        span
        for span in named(spans, "prme.apply")
        if event_id in list((span.attributes or {}).get("prme.event_ids", []))
    ]
    assert len(applied) == 1  # the projector's span names the same event id
    check_no_private_values(spans)


async def test_a_retrieve_has_a_span_per_stage_and_channel(
    http: httpx.AsyncClient, exporter: InMemorySpanExporter
) -> None:
    body = {"user_id": OWNER, "content": "The spare key is under the blue pot"}
    assert (await http.post("/v1/memories", json=body)).status_code == 201
    exporter.clear()
    found = await http.post("/v1/retrieve", json={"user_id": OWNER, "query": QUERY})
    assert found.status_code == 200
    spans = list(exporter.get_finished_spans())

    (request,) = named(spans, "POST /v1/retrieve")
    (retrieve,) = named(spans, "prme.retrieve")
    assert parent_of(retrieve) == request.context.span_id
    assert retrieve.attributes is not None and retrieve.attributes["prme.results"] == 1
    stages = {span.name.removeprefix("prme.retrieve.") for span in spans}
    expected = {"vector", "lexical", "query_embedding", "candidates", "fusion", "stages", "bundle"}
    assert expected <= stages
    for span in spans:
        if span.name.startswith("prme.retrieve."):
            assert parent_of(span) == retrieve.context.span_id, span.name
            assert span.end_time is not None and span.start_time is not None
            assert span.start_time <= span.end_time
    check_no_private_values(spans)


def check_no_private_values(spans: list[ReadableSpan]) -> None:
    for span in spans:
        for value in (span.attributes or {}).values():
            text = str(value)
            assert OWNER not in text and QUERY not in text and "spare key" not in text
