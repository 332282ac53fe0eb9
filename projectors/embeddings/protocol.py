"""The embedding provider contract users code against (structural: inheritance optional)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, runtime_checkable

import msgspec


@runtime_checkable
class EmbeddingProvider(Protocol):
    """Stable ``model_name``, ``model_version``, positive int ``dimension`` and async
    ``embed(texts)`` returning one vector per input, in order."""

    @property
    def model_name(self) -> str: ...

    @property
    def model_version(self) -> str: ...

    @property
    def dimension(self) -> int: ...

    async def embed(self, texts: Sequence[str]) -> list[list[float]]: ...


@runtime_checkable
class QueryEmbeddingProvider(EmbeddingProvider, Protocol):
    """A provider with a separate query recipe."""

    async def embed_query(self, text: str) -> list[float]: ...


@runtime_checkable
class InteractiveEmbeddingProvider(EmbeddingProvider, Protocol):
    """A provider with a cheaper path for a few texts at a time (queries) that gives the
    vectors ``embed`` gives, bit for bit (so the two share cache entries). Document-recipe
    queries (a provider without ``embed_query``) go through it when it is there."""

    async def embed_interactive(self, texts: Sequence[str]) -> list[list[float]]: ...


def document_query_encoder(
    provider: EmbeddingProvider,
) -> Callable[[Sequence[str]], Awaitable[list[list[float]]]]:
    """What encodes queries with the document recipe (a provider without ``embed_query``):
    its ``embed_interactive`` when it has one, else ``embed``."""
    interactive = getattr(provider, "embed_interactive", None)
    return interactive if callable(interactive) else provider.embed


class EmbeddingIdentity(msgspec.Struct, frozen=True):
    """What a vector space is: vectors of different identities are never compared."""

    model_name: str
    model_version: str
    dimension: int

    @property
    def key(self) -> str:
        return f"{self.model_name}|{self.model_version}|{self.dimension}"
