"""``CachedEmbeddingProvider``: an in-memory LRU around any embedding provider.

Query and document entries are kept apart when the wrapped provider has its own
``embed_query``; otherwise queries are encoded as documents and share their entries.
Nothing is admitted until the whole response passed validation, failed calls store
nothing, and callers get their own copies of the vectors. Concurrent queries that miss
the cache are encoded as one batch (``coalescing.Coalescer``), on the wrapped provider's
``embed_interactive`` when it has one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal

import msgspec

from prme.schemas.errors import InvalidEmbedding

from .coalescing import Coalescer
from .protocol import EmbeddingIdentity, document_query_encoder
from .validation import (
    check_identity_unchanged,
    check_texts,
    identity_of,
    validate_vector,
    validate_vectors,
)

Task = Literal["document", "query"]


class CacheInfo(msgspec.Struct, frozen=True, kw_only=True):
    hits: int
    misses: int
    entries: int
    max_entries: int


class CachedEmbeddingProvider:
    """An LRU cache of up to ``max_entries`` vectors in front of ``provider``.

    Exposes the wrapped provider's identity, which must stay stable: a change raises
    ``InvalidEmbedding`` (a ``ValueError``). The wrapped provider stays caller-owned.
    """

    def __init__(self, provider: Any, max_entries: int = 10_000) -> None:
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise InvalidEmbedding(f"max_entries must be a positive int, got {max_entries!r}")
        self._provider = provider
        self._identity = identity_of(provider)
        self._query_encoder = callable(getattr(provider, "embed_query", None))
        self._max_entries = max_entries
        self._entries: OrderedDict[tuple[Task, str], tuple[float, ...]] = OrderedDict()
        self._hits = 0
        self._misses = 0
        self._queries = Coalescer(self._embed_queries)
        """Concurrent queries missing from the cache, encoded as documents together."""

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without its entries (another process fills its own)."""
        state = {**self.__dict__, "_entries": OrderedDict(), "_hits": 0, "_misses": 0}
        del state["_queries"]  # made afresh on the other side
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._queries = Coalescer(self._embed_queries)

    @property
    def provider(self) -> Any:
        return self._provider

    @property
    def identity(self) -> EmbeddingIdentity:
        return self._identity

    @property
    def model_name(self) -> str:
        return self._identity.model_name

    @property
    def model_version(self) -> str:
        return self._identity.model_version

    @property
    def dimension(self) -> int:
        return self._identity.dimension

    @property
    def has_query_encoder(self) -> bool:
        """Whether queries go through the wrapped provider's own ``embed_query``."""
        return self._query_encoder

    def cache_info(self) -> CacheInfo:
        return CacheInfo(
            hits=self._hits,
            misses=self._misses,
            entries=len(self._entries),
            max_entries=self._max_entries,
        )

    def clear(self) -> None:
        self._entries.clear()

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """Document vectors, one per text in order; only misses reach the provider, in one
        call with duplicates removed."""
        return await self._embed_documents(check_texts(texts))

    async def embed_query(self, text: str) -> list[float]:
        """The query vector: the wrapped ``embed_query`` when it has one (cached apart
        from documents), else the document encoding of ``text`` (shared entries)."""
        if not isinstance(text, str):
            raise TypeError(f"query text is {type(text).__name__}, not str")
        if not self._query_encoder:
            check_identity_unchanged(self._identity, self._provider)
            cached = self._lookup(("document", text))
            if cached is not None:
                return cached
            return await self._queries.encode(text)
        check_identity_unchanged(self._identity, self._provider)
        cached = self._lookup(("query", text))
        if cached is not None:
            return cached
        self._misses += 1
        vector = validate_vector(self._identity, await self._provider.embed_query(text))
        check_identity_unchanged(self._identity, self._provider)
        self._admit(("query", text), vector)
        return vector

    async def _embed_queries(self, texts: list[str]) -> list[list[float]]:
        """Queries encoded as documents: on the wrapped provider's ``embed_interactive``
        when it has one (the same vectors, so the entries are shared)."""
        return await self._embed_documents(texts, document_query_encoder(self._provider))

    async def _embed_documents(
        self,
        texts: list[str],
        encode: Callable[[Sequence[str]], Awaitable[list[list[float]]]] | None = None,
    ) -> list[list[float]]:
        check_identity_unchanged(self._identity, self._provider)
        found: dict[str, list[float]] = {}
        missing: dict[str, None] = {}
        for text in texts:
            if text in found or text in missing:
                continue
            cached = self._lookup(("document", text))
            if cached is None:
                missing[text] = None
            else:
                found[text] = cached
        if missing:
            self._misses += len(missing)
            fresh = validate_vectors(
                self._identity, len(missing), await (encode or self._provider.embed)(list(missing))
            )
            check_identity_unchanged(self._identity, self._provider)
            for text, vector in zip(missing, fresh, strict=True):
                self._admit(("document", text), vector)
                found[text] = vector
        return [list(found[text]) for text in texts]

    def _lookup(self, key: tuple[Task, str]) -> list[float] | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        self._hits += 1
        return list(entry)

    def _admit(self, key: tuple[Task, str], vector: list[float]) -> None:
        self._entries[key] = tuple(vector)
        self._entries.move_to_end(key)
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)
