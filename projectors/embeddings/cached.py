"""``CachedEmbeddingProvider``: an in-memory LRU around any embedding provider.

Query and document entries are kept apart, and a query's entry is its owner's alone: a
query that found the vector of a text another owner stored (or of one an erased owner
asked) answered in microseconds instead of milliseconds, and counted a cache hit on the
open ``/metrics``, which told the caller that someone had written exactly that text.
Queries are encoded as documents when the wrapped provider has no ``embed_query`` (the
same vectors), but never read or fill the document entries. Nothing is admitted until the whole response passed validation, failed calls store
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
Key = tuple[Task, str, str]
"""(task, owner, text); documents are shared by every owner (owner "")."""


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
        self._entries: OrderedDict[Key, tuple[float, ...]] = OrderedDict()
        self._hits = 0
        self._misses = 0
        self._queries = Coalescer(self._embed_queries)
        """Concurrent queries missing from the cache, encoded as documents together."""
        self._query_keys: dict[str, set[Key]] = {}
        """The query entries of each owner (forgotten when the owner is erased)."""
        self._forgotten: dict[str, int] = {}
        """How often each owner was forgotten: a query encoded meanwhile is not kept."""

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without its entries (another process fills its own)."""
        state = {
            **self.__dict__,
            "_entries": OrderedDict(),
            "_query_keys": {},
            "_forgotten": {},
            "_hits": 0,
            "_misses": 0,
        }
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

    def prepare(self) -> None:
        """The wrapped provider's ``prepare`` (fetch its model's files), if it has one."""
        prepare = getattr(self._provider, "prepare", None)
        if callable(prepare):
            prepare()

    @property
    def query_precision(self) -> str | None:
        """The wrapped provider's ``query_precision``, if it says."""
        precision = getattr(self._provider, "query_precision", None)
        return precision if isinstance(precision, str) else None

    def prepare_queries(self) -> None:
        """The wrapped provider's ``prepare_queries`` (make its query encoder's files), if
        it has one."""
        prepare = getattr(self._provider, "prepare_queries", None)
        if callable(prepare):
            prepare()

    def clear(self) -> None:
        self._entries.clear()
        self._query_keys.clear()

    def forget_owner(self, owner: str) -> None:
        """Drop ``owner``'s query entries (an erasure: they hold the owner's questions)."""
        self._forgotten[owner] = self._forgotten.get(owner, 0) + 1
        for key in self._query_keys.pop(owner, ()):
            self._entries.pop(key, None)

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """Document vectors, one per text in order; only misses reach the provider, in one
        call with duplicates removed."""
        return await self._embed_documents(check_texts(texts))

    async def embed_query(self, text: str, *, owner: str = "") -> list[float]:
        """The query vector of ``owner`` (cached for that owner only): the wrapped
        ``embed_query`` when it has one, else the document encoding of ``text``."""
        if not isinstance(text, str):
            raise TypeError(f"query text is {type(text).__name__}, not str")
        check_identity_unchanged(self._identity, self._provider)
        key: Key = ("query", owner, text)
        cached = self._lookup(key)
        if cached is not None:
            return cached
        forgotten = self._forgotten.get(owner, 0)
        if self._query_encoder:
            self._misses += 1
            vector = validate_vector(self._identity, await self._provider.embed_query(text))
            check_identity_unchanged(self._identity, self._provider)
        else:
            vector = await self._queries.encode(text)
        if self._forgotten.get(owner, 0) == forgotten:  # not erased while it was encoded
            self._admit(key, vector)
            self._query_keys.setdefault(owner, set()).add(key)
        return list(vector)

    async def _embed_queries(self, texts: list[str]) -> list[list[float]]:
        """Queries encoded as documents together, on the wrapped provider's
        ``embed_interactive`` when it has one (the document entries are not read)."""
        self._misses += len(texts)
        fresh = await document_query_encoder(self._provider)(texts)
        vectors = validate_vectors(self._identity, len(texts), fresh)
        check_identity_unchanged(self._identity, self._provider)
        return vectors

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
            cached = self._lookup(("document", "", text))
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
                self._admit(("document", "", text), vector)
                found[text] = vector
        return [list(found[text]) for text in texts]

    def _lookup(self, key: Key) -> list[float] | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        self._hits += 1
        return list(entry)

    def _admit(self, key: Key, vector: list[float]) -> None:
        self._entries[key] = tuple(vector)
        self._entries.move_to_end(key)
        while len(self._entries) > self._max_entries:
            evicted, _ = self._entries.popitem(last=False)
            owned = self._query_keys.get(evicted[1]) if evicted[0] == "query" else None
            if owned is not None:
                owned.discard(evicted)
                if not owned:
                    del self._query_keys[evicted[1]]
