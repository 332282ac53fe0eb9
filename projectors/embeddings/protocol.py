"""The embedding provider contract users code against (structural: inheritance optional)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import msgspec
import numpy as np


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
    """A provider with a cheaper path for a few texts at a time (queries), with the document
    recipe: the vectors ``embed`` gives, or close approximations of them (the default
    model's int8 query copy: cosine above 0.97), never another recipe. Document-recipe queries
    (a provider without ``embed_query``) go through it when it is there; its vectors are
    never stored as documents'."""

    async def embed_interactive(self, texts: Sequence[str]) -> list[list[float]]: ...


@runtime_checkable
class ArrayEmbeddingProvider(EmbeddingProvider, Protocol):
    """A provider that can hand its document vectors over as one ``(len(texts), dimension)``
    float array: the vectors ``embed`` gives, bit for bit, without a list of Python floats
    per vector. The projector's embedding path uses it when it is there."""

    async def embed_array(self, texts: Sequence[str]) -> np.ndarray: ...


def array_encoder(
    provider: EmbeddingProvider,
) -> Callable[[Sequence[str]], Awaitable[np.ndarray]] | None:
    """The provider's ``embed_array``, or ``None`` when it has none or when ``embed`` was
    overridden below the class that defines ``embed_array`` (a subclass's own ``embed``
    is the recipe, and the array path would bypass it)."""
    cls = type(provider)
    owner = next((c for c in cls.__mro__ if "embed_array" in vars(c)), None)
    instance: dict[str, Any] = getattr(provider, "__dict__", {})
    if owner is None or "embed" in instance or "embed_array" in instance:
        return None
    if getattr(cls, "embed", None) is not getattr(owner, "embed", None):
        return None
    encode: Callable[[Sequence[str]], Awaitable[np.ndarray]] = provider.embed_array  # type: ignore[attr-defined]
    return encode


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
