"""The contract every embedding provider passes (hashed, FastEmbed, cached...).

Subclass ``EmbeddingProviderContract`` with a ``provider`` fixture."""

from __future__ import annotations

import numpy as np
import pytest

from prme.projectors.embeddings.protocol import (
    ArrayEmbeddingProvider,
    EmbeddingProvider,
    InteractiveEmbeddingProvider,
    QueryEmbeddingProvider,
)
from prme.projectors.embeddings.validation import identity_of

TEXTS = ["Aurora ships on Friday.", "The blue door is the back entrance.", "Tea at four."]


class EmbeddingProviderContract:
    def test_satisfies_the_protocol_with_a_valid_identity(
        self, provider: EmbeddingProvider
    ) -> None:
        assert isinstance(provider, EmbeddingProvider)
        identity = identity_of(provider)
        assert identity.model_name and identity.model_version and identity.dimension > 0

    async def test_one_vector_per_text_in_order_of_the_declared_dimension(
        self, provider: EmbeddingProvider
    ) -> None:
        vectors = await provider.embed(TEXTS)
        assert len(vectors) == len(TEXTS)
        assert all(len(v) == provider.dimension for v in vectors)
        assert all(isinstance(x, float) for v in vectors for x in v)
        one_by_one = [(await provider.embed([text]))[0] for text in TEXTS]
        for batched, single in zip(vectors, one_by_one, strict=True):
            assert batched == pytest.approx(single, abs=1e-5)
        reversed_ = await provider.embed(TEXTS[::-1])
        assert reversed_[0] == pytest.approx(vectors[-1], abs=1e-5)

    async def test_the_same_text_gives_the_same_vector(self, provider: EmbeddingProvider) -> None:
        first, second = await provider.embed([TEXTS[0], TEXTS[0]])
        assert first == pytest.approx(second, abs=1e-6)
        assert (await provider.embed([TEXTS[1]]))[0] != pytest.approx(first, abs=1e-3)

    async def test_no_texts_give_no_vectors(self, provider: EmbeddingProvider) -> None:
        assert await provider.embed([]) == []

    async def test_a_bare_string_or_a_non_string_is_refused(
        self, provider: EmbeddingProvider
    ) -> None:
        with pytest.raises(TypeError):
            await provider.embed("not a list")  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            await provider.embed(["fine", 42])  # type: ignore[list-item]

    async def test_a_query_vector_has_the_same_dimension(self, provider: EmbeddingProvider) -> None:
        if not isinstance(provider, QueryEmbeddingProvider):
            return
        vector = await provider.embed_query(TEXTS[0])
        assert len(vector) == provider.dimension

    async def test_the_interactive_path_gives_the_document_vectors_or_close_ones(
        self, provider: EmbeddingProvider
    ) -> None:
        """The document recipe, exactly or approximately (an int8 query copy), and each
        text's vector the same whatever it is encoded with."""
        if not isinstance(provider, InteractiveEmbeddingProvider):
            return
        together = await provider.embed_interactive(TEXTS)
        documents = await provider.embed(TEXTS)
        assert len(together) == len(TEXTS)
        for query, document in zip(together, documents, strict=True):
            assert len(query) == provider.dimension
            if query != document:
                x, y = np.asarray(query), np.asarray(document)
                assert x @ y / (np.linalg.norm(x) * np.linalg.norm(y)) > 0.97
        assert await provider.embed_interactive([TEXTS[1]]) == [together[1]]
        assert await provider.embed_interactive([]) == []

    async def test_the_array_path_gives_the_document_vectors_bit_for_bit(
        self, provider: EmbeddingProvider
    ) -> None:
        if not isinstance(provider, ArrayEmbeddingProvider):
            return
        matrix = await provider.embed_array(TEXTS)
        assert isinstance(matrix, np.ndarray) and np.issubdtype(matrix.dtype, np.floating)
        assert matrix.tolist() == await provider.embed(TEXTS)
        assert (await provider.embed_array([TEXTS[1]])).tolist() == await provider.embed([TEXTS[1]])
        assert (await provider.embed_array([])).shape == (0, provider.dimension)
        with pytest.raises(TypeError):
            await provider.embed_array("not a list")  # type: ignore[arg-type]
