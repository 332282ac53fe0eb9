"""VectorCache: durable vectors keyed by (embedding identity, content hash)."""

from __future__ import annotations

import hashlib
import math
import sqlite3
from array import array
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider
from prme.projectors.embeddings.protocol import EmbeddingIdentity
from prme.projectors.embeddings.vector_cache import (
    VectorCache,
    as_float32,
    content_hash,
    embed_with_cache,
)


class Counting(HashedBagOfWordsProvider):
    def __init__(self, dimension: int = 16, version: str = "v1") -> None:
        super().__init__(dimension=dimension)
        self.calls: list[list[str]] = []
        self.version = version
        self.poison: object = None

    @property
    def model_version(self) -> str:
        return self.version

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        self.calls.append(list(texts))
        vectors = await super().embed(texts)
        if self.poison is not None:
            vectors[0] = self.poison  # type: ignore[call-overload]
        return vectors


def test_content_hash_is_the_sha256_of_the_utf8_text() -> None:
    assert content_hash("héllo") == hashlib.sha256("héllo".encode()).hexdigest()
    assert content_hash("a") != content_hash("a ")


def test_put_then_get_round_trips_as_float32(tmp_path: Path) -> None:
    identity = EmbeddingIdentity("m", "v", 3)
    with VectorCache(tmp_path / "vectors.sqlite") as cache:
        cache.put_many(identity, ["a", "b"], [[0.1, 0.2, 0.3], [1.0, -1.0, 0.5]])
        got = cache.get_many(identity, ["b", "missing", "a", "a"])
    assert got[0] == [1.0, -1.0, 0.5]
    assert got[1] is None
    assert got[2] == as_float32([0.1, 0.2, 0.3]) == got[3]
    assert got[2] is not got[3]
    assert np.allclose(got[2], [0.1, 0.2, 0.3], atol=1e-7)


def test_the_file_is_created_at_the_first_use_only(tmp_path: Path) -> None:
    path = tmp_path / "vectors.sqlite"
    with VectorCache(path) as cache:
        assert cache.hits == cache.misses == 0
    assert not path.exists()
    cache = VectorCache(path)
    assert cache.get_many(EmbeddingIdentity("m", "v", 2), ["a"]) == [None]
    assert path.exists()
    cache.close()
    with pytest.raises(sqlite3.ProgrammingError):
        cache.count()


def test_vectors_survive_reopening(tmp_path: Path) -> None:
    identity = EmbeddingIdentity("m", "v", 2)
    with VectorCache(tmp_path / "vectors.sqlite") as cache:
        cache.put_many(identity, ["kept"], [[0.5, 0.25]])
    with VectorCache(tmp_path / "vectors.sqlite") as cache:
        assert cache.get_many(identity, ["kept"]) == [[0.5, 0.25]]
        assert cache.count() == 1


def test_a_different_identity_misses(tmp_path: Path) -> None:
    with VectorCache(tmp_path / "vectors.sqlite") as cache:
        cache.put_many(EmbeddingIdentity("m", "v1", 2), ["t"], [[0.5, 0.25]])
        assert cache.get_many(EmbeddingIdentity("m", "v2", 2), ["t"]) == [None]
        assert cache.get_many(EmbeddingIdentity("other", "v1", 2), ["t"]) == [None]
        assert cache.get_many(EmbeddingIdentity("m", "v1", 3), ["t"]) == [None]


def test_a_malformed_batch_stores_nothing(tmp_path: Path) -> None:
    identity = EmbeddingIdentity("m", "v", 2)
    with VectorCache(tmp_path / "vectors.sqlite") as cache:
        with pytest.raises(ValueError, match="vector 1"):
            cache.put_many(identity, ["a", "b"], [[0.5, 0.25], [math.nan, 0.0]])
        with pytest.raises(ValueError, match="returned 1 vectors for 2 inputs"):
            cache.put_many(identity, ["a", "b"], [[0.5, 0.25]])
        assert cache.count() == 0


async def test_a_second_embed_with_cache_makes_zero_provider_calls(tmp_path: Path) -> None:
    provider = Counting()
    texts = ["alpha beta", "gamma", "alpha beta", "delta"]
    with VectorCache(tmp_path / "vectors.sqlite") as cache:
        first = await embed_with_cache(provider, cache, texts)
        assert provider.calls == [["alpha beta", "gamma", "delta"]]
        second = await embed_with_cache(provider, cache, texts)
    assert provider.calls == [["alpha beta", "gamma", "delta"]]
    assert first == second
    assert first[0] == first[2] and first[0] is not first[2]
    assert first[1].tolist() == as_float32(provider.vector("gamma"))


async def test_vectors_come_back_as_float32_arrays_equal_to_the_stored_ones(
    tmp_path: Path,
) -> None:
    provider = Counting()
    with VectorCache(tmp_path / "vectors.sqlite") as cache:
        computed = await embed_with_cache(provider, cache, ["a", "b"])
        cached = await embed_with_cache(provider, cache, ["a", "b"])
        listed = cache.get_many(provider, ["a", "b"])
    for vectors in (computed, cached):
        assert all(isinstance(v, array) and v.typecode == "f" for v in vectors)
        assert [v.tolist() for v in vectors] == listed
    assert listed == [as_float32(provider.vector("a")), as_float32(provider.vector("b"))]


async def test_a_stored_vector_that_is_not_finite_counts_as_missing(tmp_path: Path) -> None:
    provider = Counting(dimension=4)
    poisoned = np.array([0.5, np.nan, 0.5, 0.5], dtype="<f4").tobytes()
    with VectorCache(tmp_path / "vectors.sqlite") as cache:
        await embed_with_cache(provider, cache, ["kept"])
        cache.load_changelog(
            provider_key(provider), {content_hash("bad"): poisoned}, [], "prme.vectors", 1
        )
        assert cache.get_many(provider, ["bad", "kept"])[0] is None
        vectors = await embed_with_cache(provider, cache, ["bad", "kept"])
    assert provider.calls[-1] == ["bad"]
    assert vectors[0].tolist() == as_float32(provider.vector("bad"))


def provider_key(provider: Counting) -> str:
    return EmbeddingIdentity(provider.model_name, provider.model_version, provider.dimension).key


async def test_only_misses_are_encoded_in_one_call(tmp_path: Path) -> None:
    provider = Counting()
    with VectorCache(tmp_path / "vectors.sqlite") as cache:
        await embed_with_cache(provider, cache, ["a", "b"])
        result = await embed_with_cache(provider, cache, ["c", "a", "d", "c"])
    assert provider.calls[-1] == ["c", "d"]
    assert len(provider.calls) == 2
    assert result[0] == result[3]
    assert result[0].tolist() == as_float32(provider.vector("c"))


async def test_changing_the_model_misses_by_construction(tmp_path: Path) -> None:
    with VectorCache(tmp_path / "vectors.sqlite") as cache:
        await embed_with_cache(Counting(version="v1"), cache, ["a"])
        other = Counting(version="v2")
        await embed_with_cache(other, cache, ["a"])
        assert other.calls == [["a"]]
        wider = Counting(dimension=32)
        assert len((await embed_with_cache(wider, cache, ["a"]))[0]) == 32
        assert wider.calls == [["a"]]


async def test_embed_with_cache_validates_before_storing(tmp_path: Path) -> None:
    provider = Counting()
    with VectorCache(tmp_path / "vectors.sqlite") as cache:
        await embed_with_cache(provider, cache, ["earlier"])
        provider.poison = ["0.5"] * 16
        with pytest.raises(ValueError, match="vector 0: component 0 is str"):
            await embed_with_cache(provider, cache, ["a", "b"])
        assert cache.count() == 1
        provider.poison = None
        await embed_with_cache(provider, cache, ["a", "b", "earlier"])
        assert provider.calls[-1] == ["a", "b"]


async def test_a_large_batch_is_looked_up_in_chunks(tmp_path: Path) -> None:
    provider = Counting(dimension=4)
    texts = [f"text {index}" for index in range(1200)]
    with VectorCache(tmp_path / "vectors.sqlite") as cache:
        first = await embed_with_cache(provider, cache, texts)
        second = await embed_with_cache(provider, cache, texts)
    assert len(provider.calls) == 1
    assert first == second


def test_a_cache_file_in_the_earlier_layout_is_read_and_written(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "old.sqlite3"
    with sqlite3.connect(path) as db:
        db.execute(
            "CREATE TABLE vectors (identity TEXT NOT NULL, content_hash TEXT NOT NULL, "
            "vector BLOB NOT NULL, PRIMARY KEY (identity, content_hash)) WITHOUT ROWID"
        )
    provider = HashedBagOfWordsProvider(dimension=8)
    with VectorCache(path) as cache:
        cache.put_many(provider, ["a", "b"], [provider.vector("a"), provider.vector("b")])
        cache.put_many(provider, ["a"], [provider.vector("a")])
        assert cache.get_many(provider, ["b", "a", "c"]) == [
            as_float32(provider.vector("b")),
            as_float32(provider.vector("a")),
            None,
        ]
        assert cache.count(provider) == 2
    with sqlite3.connect(path) as db:
        indexes = db.execute(
            "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'vectors'"
        ).fetchall()
    assert [name for (name,) in indexes if not name.startswith("sqlite_autoindex")] == []


class ArrayOnly(HashedBagOfWordsProvider):
    """Answers on its array path only: ``embed`` must not be called."""

    def __init__(self, dimension: int = 16) -> None:
        super().__init__(dimension=dimension)
        self.calls: list[list[str]] = []
        self.poison: float | None = None

    async def embed_array(self, texts: Sequence[str]) -> np.ndarray:
        self.calls.append(list(texts))
        matrix = await super().embed_array(texts)
        if self.poison is not None:
            matrix[-1, 0] = self.poison
        return matrix


async def test_a_provider_array_path_gives_the_vectors_its_lists_give(tmp_path: Path) -> None:
    provider = ArrayOnly()
    listed = Counting()
    texts = ["alpha beta", "gamma", "alpha beta", "delta"]
    with (
        VectorCache(tmp_path / "a.sqlite") as by_array,
        VectorCache(tmp_path / "l.sqlite") as by_list,
    ):
        through_array = await embed_with_cache(provider, by_array, texts)
        through_lists = await embed_with_cache(listed, by_list, texts)
        assert provider.calls == [["alpha beta", "gamma", "delta"]]
        assert through_array == through_lists
        assert through_array[0] is not through_array[2]
        assert by_array.get_many(provider, texts) == by_list.get_many(listed, texts)


async def test_a_bad_array_response_stores_nothing(tmp_path: Path) -> None:
    provider = ArrayOnly()
    with VectorCache(tmp_path / "vectors.sqlite") as cache:
        provider.poison = math.inf
        with pytest.raises(ValueError, match="vector 1: component 0 is inf"):
            await embed_with_cache(provider, cache, ["a", "b"])
        assert cache.count() == 0
