"""The hashed, FastEmbed and cached providers all pass one embedding-provider contract."""

from __future__ import annotations

from pathlib import Path

import pytest

from prme.projectors.embeddings.cached import CachedEmbeddingProvider
from prme.projectors.embeddings.fastembed_provider import FastEmbedProvider
from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider
from prme.projectors.embeddings.protocol import EmbeddingProvider

from .embedding_contract import EmbeddingProviderContract


class TestHashedProvider(EmbeddingProviderContract):
    @pytest.fixture
    def provider(self) -> EmbeddingProvider:
        return HashedBagOfWordsProvider()


class TestCachedHashedProvider(EmbeddingProviderContract):
    @pytest.fixture
    def provider(self) -> EmbeddingProvider:
        return CachedEmbeddingProvider(HashedBagOfWordsProvider(), max_entries=2)


@pytest.fixture(scope="module")
def fastembed(default_model_dir: Path) -> EmbeddingProvider:
    return FastEmbedProvider(models_dir=default_model_dir.parent)


@pytest.mark.model
class TestFastEmbedProvider(EmbeddingProviderContract):
    @pytest.fixture
    def provider(self, fastembed: EmbeddingProvider) -> EmbeddingProvider:
        return fastembed


@pytest.mark.model
class TestCachedFastEmbedProvider(EmbeddingProviderContract):
    @pytest.fixture
    def provider(self, fastembed: EmbeddingProvider) -> EmbeddingProvider:
        return CachedEmbeddingProvider(fastembed)
