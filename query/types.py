"""The typed results of retrieval: results, bundle, receipt, and the write/read views."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import msgspec

from prme.producers.transport import Position
from prme.schemas.records import AnyRecord


class MemoryResult(msgspec.Struct, frozen=True, kw_only=True):
    """One retrieved memory node."""

    node_id: str
    event_id: str
    text: str
    node_type: str
    owner: str
    session_id: str
    scope: str
    speaker: str | None
    role: str
    state: str
    recorded_at: datetime
    occurred_at: datetime | None
    score: float
    """The fused score (rrf, weighted composite or zscore, per the fusion used)."""
    semantic_relevance: float | None
    """Cosine similarity to the query, when the vector channel produced one."""
    metadata: dict[str, Any] = {}
    """About the retrieval (``min_score_skipped``), not the memory: the metadata it was
    stored with is in its event (``get_event(event_id)``)."""


class Bundle(msgspec.Struct, frozen=True, kw_only=True):
    """The memories that fit the token budget, ready for a prompt."""

    items: list[MemoryResult]
    token_budget: int
    tokens_used: int
    omitted: list[str] = []
    """Node ids of results left out because they did not fit the budget."""

    def render(self) -> str:
        """One line per memory: ``- [time] (source) text``."""
        return "\n".join(render_line(item) for item in self.items)


def render_line(item: MemoryResult) -> str:
    moment = item.occurred_at or item.recorded_at
    source = item.speaker or item.role
    text = " ".join(item.text.split())
    return f"- [{moment:%Y-%m-%d %H:%M}] ({source}, {item.session_id}) {text}"


class ChannelReport(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    used: bool
    ms: float
    candidates: int = 0
    error: str | None = None


class ResultEvidence(msgspec.Struct, frozen=True, kw_only=True):
    """How one result was found."""

    node_id: str
    event_id: str
    ranks: dict[str, int]
    scores: dict[str, float]
    fused_score: float
    semantic_relevance: float | None
    tokens: int
    in_bundle: bool


class EmbeddingInfo(msgspec.Struct, frozen=True, kw_only=True):
    model_name: str
    model_version: str
    dimension: int
    embed_query_used: bool
    mismatch: bool = False
    query_precision: str | None = None
    """How queries are encoded: ``int8`` (the default model's int8 copy), ``float`` (the
    exact model); ``None`` when the provider does not say (a custom one)."""


class Receipt(msgspec.Struct, frozen=True, kw_only=True):
    """The audit of one retrieval."""

    request_id: str
    owner: str
    query: str
    scope: str | None
    fusion: str
    top_k: int
    min_score: float | None
    min_score_skipped: bool
    channels: list[ChannelReport]
    results: list[ResultEvidence]
    embedding: EmbeddingInfo
    analysis: dict[str, Any]
    elapsed_ms: float
    served_by: str | None = None
    """The node that ran the retrieval (its advertised URL), in a served cluster."""


class RetrieveResponse(msgspec.Struct, frozen=True, kw_only=True):
    results: list[MemoryResult]
    bundle: Bundle
    receipt: Receipt


class StoreResult(msgspec.Struct, frozen=True, kw_only=True):
    """What a write returns: ids and the consistency token."""

    event_id: str
    node_ids: list[str]
    token: Position


class EventView(msgspec.Struct, frozen=True, kw_only=True):
    event_id: str
    kind: str
    owner: str
    session_id: str
    scope: str
    partition: int
    offset: int
    node_ids: list[str]
    record: Any


def with_record(view: EventView) -> EventView:
    """``view`` decoded from JSON (``GET /v1/events/{id}``), its record as a record type."""
    record = msgspec.convert(view.record, AnyRecord)  # type: ignore[arg-type]
    return msgspec.structs.replace(view, record=record)
