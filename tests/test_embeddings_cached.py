"""CachedEmbeddingProvider: the LRU wrapper described in CUSTOM-EMBEDDINGS."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence

import pytest

from prme.projectors.embeddings.cached import CachedEmbeddingProvider
from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider
from prme.projectors.embeddings.protocol import EmbeddingProvider, QueryEmbeddingProvider


class Recorder(HashedBagOfWordsProvider):
    """A document-only provider that records its calls and can be told to misbehave."""

    def __init__(self) -> None:
        super().__init__(dimension=8)
        self.document_calls: list[list[str]] = []
        self.query_calls: list[str] = []
        self.version = "v1"
        self.break_with: object = None
        self.closed = False

    @property
    def model_version(self) -> str:
        return self.version

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        self.document_calls.append(list(texts))
        if isinstance(self.break_with, Exception):
            raise self.break_with
        vectors = await super().embed(texts)
        if self.break_with is not None:
            vectors[-1] = self.break_with  # type: ignore[call-overload]
        return vectors

    def close(self) -> None:
        self.closed = True


class QueryRecorder(Recorder):
    """The same, with a distinct query recipe."""

    def __init__(self) -> None:
        super().__init__()
        self.query_error: Exception | None = None
        self.query_result: object = None

    async def embed_query(self, text: str) -> list[float]:
        self.query_calls.append(text)
        if self.query_error is not None:
            raise self.query_error
        if self.query_result is not None:
            return self.query_result  # type: ignore[return-value]
        return self.vector("query: " + text)


async def test_exposes_the_wrapped_identity_and_satisfies_both_protocols() -> None:
    inner = Recorder()
    cached = CachedEmbeddingProvider(inner)
    assert (cached.model_name, cached.model_version, cached.dimension) == (
        inner.model_name,
        "v1",
        8,
    )
    assert isinstance(cached, EmbeddingProvider)
    assert isinstance(cached, QueryEmbeddingProvider)


async def test_repeated_documents_hit_the_cache_and_misses_go_in_one_deduplicated_call() -> None:
    inner = Recorder()
    cached = CachedEmbeddingProvider(inner)
    first = await cached.embed(["alpha", "beta", "alpha"])
    assert inner.document_calls == [["alpha", "beta"]]
    second = await cached.embed(["beta", "gamma", "alpha", "gamma"])
    assert inner.document_calls == [["alpha", "beta"], ["gamma"]]
    assert first == [inner.vector("alpha"), inner.vector("beta"), inner.vector("alpha")]
    assert second[0] == first[1] and second[2] == first[0]
    assert second[1] == second[3] == inner.vector("gamma")
    assert await cached.embed([]) == []
    assert len(inner.document_calls) == 2


async def test_returned_lists_are_independently_owned() -> None:
    cached = CachedEmbeddingProvider(Recorder())
    first, duplicate = await cached.embed(["alpha", "alpha"])
    assert first is not duplicate
    pristine = list(first)
    first[0] = 123.0
    duplicate.append(1.0)
    again = await cached.embed(["alpha"])
    assert again == [pristine]
    query = await cached.embed_query("alpha")
    query[0] = -5.0
    assert await cached.embed_query("alpha") == pristine


async def test_query_and_document_entries_are_separate_when_the_provider_has_embed_query() -> None:
    inner = QueryRecorder()
    cached = CachedEmbeddingProvider(inner)
    assert cached.has_query_encoder
    document = (await cached.embed(["aurora"]))[0]
    query = await cached.embed_query("aurora")
    assert query == inner.vector("query: aurora") != document
    assert inner.query_calls == ["aurora"]
    assert await cached.embed_query("aurora") == query
    assert await cached.embed(["aurora"]) == [document]
    assert inner.query_calls == ["aurora"] and inner.document_calls == [["aurora"]]


async def test_a_query_reads_neither_documents_nor_another_owners_queries() -> None:
    """From a review: a query found the vector of a text another owner stored (or an
    erased owner asked) at once, and counted a hit on the open /metrics: an oracle for
    exactly what others wrote. Queries are encoded as documents (the same vectors) but
    cached per owner, apart from documents; an erasure drops the owner's entries."""
    inner = Recorder()
    cached = CachedEmbeddingProvider(inner)
    assert not cached.has_query_encoder
    assert await cached.embed(["bob's diagnosis"]) == [inner.vector("bob's diagnosis")]
    hits = cached.cache_info().hits
    query = await cached.embed_query("bob's diagnosis", owner="alice")
    assert query == inner.vector("bob's diagnosis")
    assert cached.cache_info().hits == hits  # encoded again, not read from bob's entry
    assert inner.document_calls == [["bob's diagnosis"], ["bob's diagnosis"]]
    assert await cached.embed_query("bob's diagnosis", owner="alice") == query
    assert cached.cache_info().hits == hits + 1  # alice's own entry
    await cached.embed_query("bob's diagnosis", owner="carol")
    assert len(inner.document_calls) == 3  # carol's is her own
    cached.forget_owner("alice")
    await cached.embed_query("bob's diagnosis", owner="alice")
    assert len(inner.document_calls) == 4
    assert await cached.embed(["bob's diagnosis"]) == [inner.vector("bob's diagnosis")]
    assert len(inner.document_calls) == 4  # the document entry is bob's projection's


async def test_a_failed_query_encoder_fails_and_stores_nothing() -> None:
    inner = QueryRecorder()
    cached = CachedEmbeddingProvider(inner)
    inner.query_error = RuntimeError("query service down")
    with pytest.raises(RuntimeError, match="query service down"):
        await cached.embed_query("aurora")
    assert inner.document_calls == []  # no silent fallback to the document encoding
    inner.query_error = None
    assert await cached.embed_query("aurora") == inner.vector("query: aurora")
    assert inner.query_calls == ["aurora", "aurora"]


async def test_a_malformed_query_vector_raises_and_is_not_cached() -> None:
    inner = QueryRecorder()
    cached = CachedEmbeddingProvider(inner)
    inner.query_result = [math.nan] * 8
    with pytest.raises(ValueError, match="component 0 is nan"):
        await cached.embed_query("aurora")
    inner.query_result = None
    assert await cached.embed_query("aurora") == inner.vector("query: aurora")
    assert cached.cache_info().entries == 1


async def test_a_failed_document_call_stores_nothing() -> None:
    inner = Recorder()
    cached = CachedEmbeddingProvider(inner)
    inner.break_with = ConnectionError("down")
    with pytest.raises(ConnectionError):
        await cached.embed(["alpha", "beta"])
    assert cached.cache_info().entries == 0


@pytest.mark.parametrize(
    "bad",
    [
        ["0.1"] * 8,
        [math.nan] * 8,
        [math.inf] * 8,
        [0.1] * 7,
        [[0.1]] * 8,
        [1e39] * 8,
    ],
    ids=["numeric-strings", "nan", "inf", "short", "nested", "over-float32"],
)
async def test_a_malformed_batch_admits_nothing_and_earlier_entries_stay(bad: object) -> None:
    inner = Recorder()
    cached = CachedEmbeddingProvider(inner)
    earlier = await cached.embed(["earlier"])
    inner.break_with = bad
    with pytest.raises(ValueError, match="vector 2"):
        await cached.embed(["alpha", "earlier", "beta", "gamma"])
    assert inner.document_calls[-1] == ["alpha", "beta", "gamma"]
    assert cached.cache_info().entries == 1
    inner.break_with = None
    repaired = await cached.embed(["alpha", "earlier", "beta", "gamma"])
    assert inner.document_calls[-1] == ["alpha", "beta", "gamma"]  # every failed input retried
    assert repaired[1] == earlier[0]
    assert repaired[0] == inner.vector("alpha")


async def test_a_response_with_the_wrong_count_admits_nothing() -> None:
    class Short(Recorder):
        async def embed(self, texts: Sequence[str]) -> list[list[float]]:
            return (await super().embed(texts))[:-1]

    cached = CachedEmbeddingProvider(Short())
    with pytest.raises(ValueError, match="returned 1 vectors for 2 inputs"):
        await cached.embed(["alpha", "beta"])
    assert cached.cache_info().entries == 0


@pytest.mark.parametrize("recorder", [QueryRecorder, Recorder], ids=["query recipe", "documents"])
async def test_a_changed_provider_identity_raises(recorder: type[Recorder]) -> None:
    inner = recorder()
    cached = CachedEmbeddingProvider(inner)
    await cached.embed(["alpha"])
    inner.version = "v2"
    with pytest.raises(ValueError, match="changed"):
        await cached.embed(["alpha"])
    with pytest.raises(ValueError, match="changed"):
        await cached.embed_query("alpha")
    assert cached.model_version == "v1"


async def test_an_identity_change_during_the_call_admits_nothing() -> None:
    class Drifting(Recorder):
        async def embed(self, texts: Sequence[str]) -> list[list[float]]:
            vectors = await super().embed(texts)
            self.version = "v2"
            return vectors

    inner = Drifting()
    cached = CachedEmbeddingProvider(inner)
    with pytest.raises(ValueError, match="changed"):
        await cached.embed(["alpha"])
    assert cached.cache_info().entries == 0


async def test_an_invalid_provider_identity_is_rejected_at_wrap_time() -> None:
    inner = Recorder()
    inner.version = ""
    with pytest.raises(ValueError, match="model_version"):
        CachedEmbeddingProvider(inner)
    with pytest.raises(ValueError, match="max_entries"):
        CachedEmbeddingProvider(Recorder(), max_entries=0)


async def test_least_recently_used_entries_are_evicted_first() -> None:
    inner = Recorder()
    cached = CachedEmbeddingProvider(inner, max_entries=2)
    await cached.embed(["a", "b"])
    await cached.embed(["a"])  # "a" is now the most recently used
    await cached.embed(["c"])  # evicts "b"
    assert cached.cache_info().entries == 2
    await cached.embed(["a", "c"])
    assert inner.document_calls[-1] == ["c"]
    await cached.embed(["b"])
    assert inner.document_calls[-1] == ["b"]


async def test_the_wrapper_never_closes_the_caller_owned_provider() -> None:
    inner = Recorder()
    cached = CachedEmbeddingProvider(inner)
    await cached.embed(["a"])
    cached.clear()
    del cached
    assert not inner.closed
    assert await inner.embed(["a"]) == [inner.vector("a")]


async def test_cache_info_counts_hits_and_misses() -> None:
    cached = CachedEmbeddingProvider(Recorder(), max_entries=5)
    await cached.embed(["a", "b"])
    await cached.embed(["a", "c"])
    info = cached.cache_info()
    assert (info.hits, info.misses, info.entries, info.max_entries) == (1, 3, 3, 5)


async def test_a_query_encoded_while_its_owner_is_erased_is_not_kept() -> None:
    """From a review: a retrieve whose query was being encoded when the owner's erasure
    dropped the owner's entries stored it afterwards."""

    class Slow(Recorder):
        async def embed(self, texts: Sequence[str]) -> list[list[float]]:
            await asyncio.sleep(0.05)
            return await super().embed(texts)

    cached = CachedEmbeddingProvider(Slow())
    asked = asyncio.ensure_future(cached.embed_query("alice's question", owner="alice"))
    await asyncio.sleep(0.01)  # encoding
    cached.forget_owner("alice")
    await asked
    assert cached.cache_info().entries == 0
    await cached.embed_query("alice's question", owner="alice")  # asked again: kept
    assert cached.cache_info().entries == 1
