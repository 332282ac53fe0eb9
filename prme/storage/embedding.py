"""Seed-compatible import path: ``from prme.storage.embedding import FastEmbedProvider``."""

from prme.projectors.embeddings.cached import CachedEmbeddingProvider
from prme.projectors.embeddings.fastembed_provider import DEFAULT_MODEL_NAME, FastEmbedProvider
from prme.projectors.embeddings.protocol import (
    EmbeddingIdentity,
    EmbeddingProvider,
    InteractiveEmbeddingProvider,
    QueryEmbeddingProvider,
)

__all__ = [
    "DEFAULT_MODEL_NAME",
    "CachedEmbeddingProvider",
    "EmbeddingIdentity",
    "EmbeddingProvider",
    "FastEmbedProvider",
    "InteractiveEmbeddingProvider",
    "QueryEmbeddingProvider",
]
