"""The metadata both retrievers attach to a retrieved memory."""

from __future__ import annotations

from typing import Any

from prme.query.types import RetrieveResponse


def results_with_metadata(response: RetrieveResponse) -> list[tuple[str, str, dict[str, Any]]]:
    """``(node_id, text, metadata)`` per result, best first.

    The metadata holds the ids, the fused ``score``, ``semantic_relevance`` (cosine, or
    None), the per-channel ``scores`` and ``ranks`` from the receipt, where the memory came
    from, and ``min_score_skipped: True`` when the engine skipped the score floor.
    """
    evidence = {item.node_id: item for item in response.receipt.results}
    rows: list[tuple[str, str, dict[str, Any]]] = []
    for result in response.results:
        found = evidence.get(result.node_id)
        metadata: dict[str, Any] = {
            "node_id": result.node_id,
            "event_id": result.event_id,
            "score": result.score,
            "semantic_relevance": result.semantic_relevance,
            "scores": dict(found.scores) if found else {},
            "ranks": dict(found.ranks) if found else {},
            "node_type": result.node_type,
            "owner": result.owner,
            "session_id": result.session_id,
            "scope": result.scope,
            "role": result.role,
            "speaker": result.speaker,
            "recorded_at": result.recorded_at.isoformat(),
            "occurred_at": result.occurred_at.isoformat() if result.occurred_at else None,
            "request_id": response.receipt.request_id,
        }
        if result.metadata.get("min_score_skipped"):
            metadata["min_score_skipped"] = True
        rows.append((result.node_id, result.text, metadata))
    return rows
