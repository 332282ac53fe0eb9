"""Retrieve searches the lexical (and graph) channels in one hop to the shard's thread, and
the vector channel after them there, or beside them on the shard's second thread once the
shard has an HNSW graph: a failing channel is reported and the others still answer; a
vector model swapped mid-search is searched again."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from prme.producers.producer import MessageDraft
from prme.projectors.model import ModelClosed
from prme.query.engine import MemoryEngine
from prme.query.retrieve import _search_all
from prme.query.types import ChannelReport, RetrieveResponse, StoreResult
from prme.schemas.config import Settings
from prme.schemas.errors import ShardUnavailable


@pytest.fixture
async def engine(local_settings: Settings, hashed_provider: Any) -> AsyncIterator[MemoryEngine]:
    engine = await MemoryEngine.create(settings=local_settings, embedding_provider=hashed_provider)
    yield engine
    await engine.close()


@pytest.fixture
async def indexed_engine(
    local_settings: Settings, hashed_provider: Any
) -> AsyncIterator[MemoryEngine]:
    """Alice's shard past a (low) index threshold, with its HNSW graph built: its vector
    searches run beside the shard's thread."""
    settings = local_settings.replace(qdrant={"index_threshold": 300})
    engine = await MemoryEngine.create(settings=settings, embedding_provider=hashed_provider)
    drafts = [MessageDraft(owner="alice", content=f"note {i} about tea") for i in range(400)]
    await engine.store_many(drafts)
    vector = (await engine.runner.shard_for("alice")).models["vector"]
    assert await asyncio.to_thread(vector.wait_index_idle, 60)
    assert vector.search_beside
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


async def test_on_an_indexed_shard_the_vector_channel_searches_while_the_lexical_one_does(
    indexed_engine: MemoryEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = indexed_engine
    stored = await engine.store("Aurora needs approval before deployment.", "alice")
    shard = await engine.runner.shard_for("alice")
    vector, lexical = shard.models["vector"], shard.models["lexical"]
    vector_searching = threading.Event()
    lexical_search, vector_search = lexical.search, vector.search

    def lexical_waiting_for_vector(*args: Any) -> Any:
        # On one thread the vector search would only start after this one returned.
        assert vector_searching.wait(10), "the vector channel did not search meanwhile"
        return lexical_search(*args)

    def vector_noting(*args: Any) -> Any:
        vector_searching.set()
        return vector_search(*args)

    monkeypatch.setattr(lexical, "search", lexical_waiting_for_vector)
    monkeypatch.setattr(vector, "search", vector_noting)
    response = await engine.retrieve("Aurora deployment approval", "alice")
    reports = {c.name: c for c in response.receipt.channels}
    assert reports["vector"].used and reports["lexical"].used
    assert response.results[0].node_id == stored.node_ids[0]
    assert response.results[0].semantic_relevance is not None


async def test_on_a_small_shard_the_vector_channel_searches_after_the_lexical_one(
    engine: MemoryEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    stored = await engine.store("Aurora needs approval before deployment.", "alice")
    shard = await engine.runner.shard_for("alice")
    vector, lexical = shard.models["vector"], shard.models["lexical"]
    assert not vector.search_beside  # no HNSW graph: a search of ~1 ms
    order: list[tuple[str, str]] = []
    for name, model in (("vector", vector), ("lexical", lexical)):

        def noting(*args: Any, name: str = name, search: Any = model.search) -> Any:
            order.append((name, threading.current_thread().name.rsplit("_", 1)[0]))
            return search(*args)

        monkeypatch.setattr(model, "search", noting)
    response = await engine.retrieve("Aurora deployment approval", "alice")
    thread = f"prme-p{shard.partition}"
    assert order == [("lexical", thread), ("vector", thread)]
    assert [r.node_id for r in response.results] == stored.node_ids


async def test_a_vector_model_closed_under_the_search_is_searched_again_on_the_shard_thread(
    indexed_engine: MemoryEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = indexed_engine
    stored = await engine.store("Aurora needs approval before deployment.", "alice")
    expected = await engine.retrieve("Aurora deployment approval", "alice")
    shard = await engine.runner.shard_for("alice")
    vector = shard.models["vector"]
    search = vector.search
    threads: list[str] = []

    def swapped_once(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        if len(threads) == 1:  # as if a rebuild had closed it between lookup and search
            raise ModelClosed("swapped")
        return search(*args)

    monkeypatch.setattr(vector, "search", swapped_once)
    response = await engine.retrieve("Aurora deployment approval", "alice")
    assert [thread.rsplit("_", 1)[0] for thread in threads] == [
        f"prme-p{shard.partition}-search",
        f"prme-p{shard.partition}",
    ]
    reports = {c.name: c for c in response.receipt.channels}
    assert reports["vector"].used and not reports["vector"].error
    assert [(r.node_id, r.score) for r in response.results] == [
        (r.node_id, r.score) for r in expected.results
    ]
    assert response.results[0].node_id == stored.node_ids[0]


async def test_retrieves_during_a_vector_rebuild_always_search_the_vector_channel(
    indexed_engine: MemoryEngine,
) -> None:
    engine = indexed_engine
    stop = asyncio.Event()
    errors: list[str] = []
    answered = 0

    async def retrieving() -> None:
        nonlocal answered
        while not stop.is_set():
            response = await engine.retrieve("notes about tea", "alice", top_k=3)
            reports = {c.name: c for c in response.receipt.channels}
            if not reports["vector"].used:
                errors.append(str(reports["vector"].error))
            answered += 1

    readers = [asyncio.create_task(retrieving()) for _ in range(4)]
    try:
        await engine.rebuild(["vector"])
    finally:
        stop.set()
        await asyncio.gather(*readers)
    assert answered > 0 and errors == []


async def test_a_retrieve_the_shard_closes_under_answers_unavailable_not_partial(
    engine: MemoryEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    await engine.store("Aurora needs approval before deployment.", "alice")
    shard = await engine.runner.shard_for("alice")
    lexical = shard.models["lexical"]
    searching, release = threading.Event(), threading.Event()
    lexical_search = lexical.search

    def held(*args: Any) -> Any:
        searching.set()
        assert release.wait(10)
        return lexical_search(*args)

    monkeypatch.setattr(lexical, "search", held)
    retrieving = asyncio.create_task(engine.retrieve("Aurora deployment approval", "alice"))
    assert await asyncio.to_thread(searching.wait, 10)
    closing = asyncio.create_task(shard.close())  # a rebalance took the partition away
    await asyncio.sleep(0.05)
    release.set()
    with pytest.raises(ShardUnavailable, match="closing|closed"):
        await retrieving
    await closing
    with pytest.raises(ShardUnavailable):
        await shard.run(lambda: None)


async def test_a_retrieve_whose_search_fails_does_not_wait_for_the_query_embedding(
    engine: MemoryEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    await engine.store("Aurora needs approval before deployment.", "alice")
    shard = await engine.runner.shard_for("alice")
    embedding = asyncio.Event()

    async def slow_query(text: str) -> list[float]:
        embedding.set()
        await asyncio.sleep(60)
        raise AssertionError("the embedding outlived the request")

    run = shard.run

    async def moved(function: Any, *args: Any) -> Any:
        if function is _search_all:
            await embedding.wait()
            raise ShardUnavailable("partition 0 is closing here")
        return await run(function, *args)

    monkeypatch.setattr(engine.runner.provider, "embed_query", slow_query, raising=False)
    monkeypatch.setattr(shard, "run", moved)
    started = time.monotonic()
    with pytest.raises(ShardUnavailable):
        await asyncio.wait_for(engine.retrieve("Aurora deployment approval", "alice"), 10)
    assert time.monotonic() - started < 5


async def test_a_search_queued_beside_a_closing_shard_answers_unavailable(
    engine: MemoryEngine,
) -> None:
    await engine.store("Aurora needs approval before deployment.", "alice")
    shard = await engine.runner.shard_for("alice")
    searching, release = threading.Event(), threading.Event()

    def held(model: Any) -> list[Any]:
        searching.set()
        assert release.wait(10)
        return []

    first = asyncio.create_task(shard.search_beside("vector", held))
    assert await asyncio.to_thread(searching.wait, 10)
    queued = asyncio.create_task(shard.search_beside("vector", lambda model: []))
    await asyncio.sleep(0.05)
    await shard.close()  # a rebalance took the partition away
    release.set()
    assert await first == []
    with pytest.raises(ShardUnavailable):
        await queued
