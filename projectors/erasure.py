"""What an ``owner_erased`` record reaches beyond each read model's own deletes.

After a batch is applied, :class:`Forgetting` (one per runner, shared by its shards)

- notes which owner each embedded text belongs to in the vector cache (the cache is keyed
  by content hash and shared by owners: a vector is dropped once no owner holds it);
- at each erased owner: drops what this process holds of the owner's data keys (the next
  record sealed with them reads the key store, where they are gone), drops the owner's
  vector-cache entries, and has every model of the shard ``purge()`` what its deletes left
  in its files: SQLite models checkpoint and truncate their WAL (``secure_delete`` is on,
  so deleted rows are overwritten), the lexical index is rewritten without deleted
  documents. A model without ``purge`` keeps nothing of the text (the vector payloads
  hold ids and timestamps only).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from prme.producers.keys import KeyStore
from prme.schemas.records import OwnerErased

from .derive import embedding_text
from .embeddings.protocol import EmbeddingIdentity
from .embeddings.vector_cache import VectorCache, content_hash
from .model import ProjectedRecord

if TYPE_CHECKING:
    from .shard import Shard


def purge_models(models: Iterable[Any]) -> None:
    """Call ``purge()`` on each model that has one (on the shard's thread)."""
    for model in models:
        purge = getattr(model, "purge", None)
        if callable(purge):
            purge()


class Forgetting:
    """The key store that opens sealed records, and the purge that follows an erasure."""

    def __init__(
        self, keys: KeyStore | None, cache: VectorCache | None, identity: EmbeddingIdentity
    ) -> None:
        self.keys = keys
        self._cache = cache
        self._identity = identity
        self.purges = 0
        """Erasure purges run (this process)."""

    async def after_apply(self, shard: Shard, projected: list[ProjectedRecord]) -> None:
        cache = self._cache
        if cache is not None:
            refs = [
                (content_hash(embedding_text(item.node)), item.node.owner)
                for item in projected
                if item.node is not None and item.vector is not None
            ]
            if refs:
                await asyncio.to_thread(cache.add_owners, self._identity, refs)
        erased = sorted({p.record.owner for p in projected if isinstance(p.record, OwnerErased)})
        if not erased:
            return
        if self.keys is not None:
            for owner in erased:
                self.keys.forget(owner)
        if cache is not None:
            await asyncio.to_thread(cache.drop_owners, erased)
        await shard.run(purge_models, list(shard.models.values()))
        self.purges += 1
