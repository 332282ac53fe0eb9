"""Retrieve searches every channel in one hop to the shard's thread: a failing channel is
reported and the others still answer."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from prme.query.engine import MemoryEngine
from prme.query.types import ChannelReport, RetrieveResponse, StoreResult
from prme.schemas.config import Settings


@pytest.fixture
async def engine(local_settings: Settings, hashed_provider: Any) -> AsyncIterator[MemoryEngine]:
    engine = await MemoryEngine.create(settings=local_settings, embedding_provider=hashed_provider)
    yield engine
    await engine.close()


async def test_every_channel_reports_its_own_time_and_candidates(engine: MemoryEngine) -> None:
    await engine.store("Aurora needs approval before deployment.", "alice")
    await engine.store("Lunch is at noon on Fridays.", "alice", session_id="other")
    response = await engine.retrieve("Aurora deployment approval", "alice")
    reports = {c.name: c for c in response.receipt.channels}
    assert [c.name for c in response.receipt.channels][:2] == ["vector", "lexical"]
    assert reports["vector"].used and reports["vector"].candidates == 2
    assert reports["lexical"].used and reports["lexical"].candidates == 1
    assert all(c.ms >= 0 for c in reports.values())
    assert response.results[0].text == "Aurora needs approval before deployment."


async def retrieve_with_channel_closed(
    engine: MemoryEngine, channel: str, min_score: float
) -> tuple[StoreResult, RetrieveResponse, dict[str, ChannelReport]]:
    """Store one memory, close ``channel``'s real store under the shard, then retrieve it."""
    stored = await engine.store("Aurora needs approval before deployment.", "alice")
    shard = await engine.runner.shard_for("alice")
    await shard.call(channel, lambda model: model.close())  # a real store gone away
    response = await engine.retrieve("Aurora deployment approval", "alice", min_score=min_score)
    reports = {c.name: c for c in response.receipt.channels}
    assert not reports[channel].used
    assert reports[channel].error
    return stored, response, reports


async def test_a_failing_lexical_channel_leaves_the_vector_channel_answering(
    engine: MemoryEngine,
) -> None:
    stored, response, reports = await retrieve_with_channel_closed(engine, "lexical", 0.0)
    assert reports["vector"].used
    assert [r.node_id for r in response.results] == stored.node_ids
    assert response.results[0].semantic_relevance is not None


async def test_a_failing_vector_channel_skips_the_floor_and_keeps_lexical_results(
    engine: MemoryEngine,
) -> None:
    stored, response, _ = await retrieve_with_channel_closed(engine, "vector", 0.99)
    assert response.receipt.min_score_skipped
    assert [r.node_id for r in response.results] == stored.node_ids
    assert response.results[0].metadata == {"min_score_skipped": True}
