"""Coalescer: concurrent one-text encodings go together, one batch at a time; and the
cached provider coalesces the queries that miss its cache."""

from __future__ import annotations

import asyncio
import pickle
import threading
from collections.abc import Sequence

import pytest

from prme.projectors.embeddings.cached import CachedEmbeddingProvider
from prme.projectors.embeddings.coalescing import Coalescer
from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider


class GatedEncoder:
    """Records each batch; a batch waits for ``gate`` while it is closed."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail_with: Exception | None = None

    async def __call__(self, texts: list[str]) -> list[list[float]]:
        self.batches.append(list(texts))
        await self.gate.wait()
        if self.fail_with is not None:
            error, self.fail_with = self.fail_with, None
            raise error
        return [[float(len(text)), 1.0] for text in texts]


async def _started(
    coalescer: Coalescer, encoder: GatedEncoder, text: str
) -> asyncio.Task[list[float]]:
    task = asyncio.ensure_future(coalescer.encode(text))
    while not encoder.batches or text not in sum(encoder.batches, []):
        await asyncio.sleep(0)
    return task


async def test_a_lone_call_is_encoded_at_once_and_alone() -> None:
    encoder = GatedEncoder()
    coalescer = Coalescer(encoder)
    assert await coalescer.encode("abc") == [3.0, 1.0]
    assert encoder.batches == [["abc"]]


async def test_calls_made_while_a_batch_runs_go_together_next() -> None:
    encoder = GatedEncoder()
    encoder.gate.clear()
    coalescer = Coalescer(encoder)
    first = await _started(coalescer, encoder, "a")
    rest = [asyncio.ensure_future(coalescer.encode(t)) for t in ("bb", "ccc", "bb")]
    await asyncio.sleep(0)
    assert encoder.batches == [["a"]]  # the others wait for the running batch
    encoder.gate.set()
    results = await asyncio.gather(first, *rest)
    assert encoder.batches == [["a"], ["bb", "ccc"]]  # the repeat is encoded once
    assert results == [[1.0, 1.0], [2.0, 1.0], [3.0, 1.0], [2.0, 1.0]]
    results[1].append(9.0)
    assert results[3] == [2.0, 1.0]  # each caller has its own copy


async def test_a_batch_holds_at_most_max_batch_texts() -> None:
    encoder = GatedEncoder()
    encoder.gate.clear()
    coalescer = Coalescer(encoder, max_batch=2)
    first = await _started(coalescer, encoder, "x")
    rest = [asyncio.ensure_future(coalescer.encode(f"t{i}")) for i in range(5)]
    await asyncio.sleep(0)
    encoder.gate.set()
    await asyncio.gather(first, *rest)
    assert [len(batch) for batch in encoder.batches] == [1, 2, 2, 1]


async def test_an_error_reaches_the_callers_of_its_batch_only() -> None:
    encoder = GatedEncoder()
    encoder.gate.clear()
    coalescer = Coalescer(encoder)
    first = await _started(coalescer, encoder, "a")
    encoder.fail_with = RuntimeError("model gone")
    later = asyncio.ensure_future(coalescer.encode("bb"))
    await asyncio.sleep(0)
    encoder.gate.set()
    with pytest.raises(RuntimeError, match="model gone"):
        await first
    assert await later == [2.0, 1.0]


async def test_a_caller_that_gives_up_leaves_the_others_their_results() -> None:
    encoder = GatedEncoder()
    encoder.gate.clear()
    coalescer = Coalescer(encoder)
    first = await _started(coalescer, encoder, "a")
    quitter = asyncio.ensure_future(coalescer.encode("quit"))
    stayer = asyncio.ensure_future(coalescer.encode("stay"))
    alone = asyncio.ensure_future(coalescer.encode("gone"))
    await asyncio.sleep(0)
    quitter.cancel()
    encoder.gate.set()
    assert await first == [1.0, 1.0]
    assert await stayer == [4.0, 1.0]
    assert await alone == [4.0, 1.0]
    assert quitter.cancelled()
    assert encoder.batches == [["a"], ["stay", "gone"]]
    assert await coalescer.encode("again") == [5.0, 1.0]  # and it keeps working


class CountingProvider(HashedBagOfWordsProvider):
    """Document-only (queries use the document recipe); counts its calls."""

    def __init__(self) -> None:
        super().__init__(dimension=8)
        self.calls: list[list[str]] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        self.calls.append(list(texts))
        await self.gate.wait()
        return await super().embed(texts)


async def test_queries_missing_the_cache_are_encoded_in_one_call_and_hits_do_not_wait() -> None:
    inner = CountingProvider()
    cached = CachedEmbeddingProvider(inner)
    known = await cached.embed_query("known question")
    inner.gate.clear()
    first = asyncio.ensure_future(cached.embed_query("q0"))
    while len(inner.calls) < 2:
        await asyncio.sleep(0)
    queries = [asyncio.ensure_future(cached.embed_query(f"q{i}")) for i in range(1, 6)]
    # A cached query answers while the batch before it is still running.
    assert await asyncio.wait_for(cached.embed_query("known question"), 1.0) == known
    inner.gate.set()
    vectors = await asyncio.gather(first, *queries)
    assert inner.calls == [["known question"], ["q0"], [f"q{i}" for i in range(1, 6)]]
    alone = HashedBagOfWordsProvider(dimension=8)
    assert vectors == [(await alone.embed([f"q{i}"]))[0] for i in range(6)]
    assert cached.cache_info().entries == 7


async def test_a_pickled_provider_coalesces_in_its_own_process() -> None:
    cached = CachedEmbeddingProvider(CountingProvider())
    await cached.embed_query("before")
    copy = pickle.loads(pickle.dumps(cached))
    assert copy.cache_info().entries == 0
    assert await copy.embed_query("after") == await cached.embed_query("after")


class InteractiveProvider(CountingProvider):
    """Has the cheaper path for a few texts (same vectors); records which path ran."""

    def __init__(self) -> None:
        super().__init__()
        self.interactive: list[list[str]] = []

    async def embed_interactive(self, texts: Sequence[str]) -> list[list[float]]:
        self.interactive.append(list(texts))
        return await HashedBagOfWordsProvider.embed(self, texts)


async def test_queries_take_the_interactive_path_apart_from_documents() -> None:
    inner = InteractiveProvider()
    cached = CachedEmbeddingProvider(inner)
    reference = HashedBagOfWordsProvider(dimension=8)
    questions = await asyncio.gather(*(cached.embed_query(f"q{i}") for i in range(3)))
    assert inner.interactive == [["q0", "q1", "q2"]] and inner.calls == []
    assert questions == await reference.embed(["q0", "q1", "q2"])
    # Documents take embed and never read a query's entry, nor a query a document's.
    assert await cached.embed(["q1", "a document"]) == await reference.embed(["q1", "a document"])
    assert inner.calls == [["q1", "a document"]]
    assert await cached.embed_query("a document") == (await reference.embed(["a document"]))[0]
    assert inner.interactive == [["q0", "q1", "q2"], ["a document"]]
    assert await cached.embed_query("q1") == questions[1]  # the query's own entry
    assert len(inner.interactive) == 2


def test_callers_on_two_event_loops_are_batched_apart_and_answered_on_their_own() -> None:
    """Sync clients run their own loops in threads: a future is only resolved by its loop."""
    batches: list[list[str]] = []

    async def encode_slowly(texts: list[str]) -> list[list[float]]:
        batches.append(texts)
        await asyncio.sleep(0.05)
        return [[float(len(text)), float(threading.get_ident() % 1000)] for text in texts]

    coalescer = Coalescer(encode_slowly)
    results: dict[str, list[list[float]]] = {}
    both_started = threading.Barrier(2)

    def client(name: str) -> None:
        async def ask() -> list[list[float]]:
            both_started.wait()
            return await asyncio.gather(*(coalescer.encode(name * n) for n in (1, 2, 3)))

        results[name] = asyncio.run(asyncio.wait_for(ask(), 10))

    threads = [threading.Thread(target=client, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(15)
    assert sorted(results) == ["a", "b"]
    for vectors in results.values():
        assert [v[0] for v in vectors] == [1.0, 2.0, 3.0]
        assert len({v[1] for v in vectors}) == 1  # one batch, in that client's thread
    assert sorted(batches) == [["a", "aa", "aaa"], ["b", "bb", "bbb"]]
