"""What an ``owner_erased`` record reaches beyond each read model's own deletes.

After a batch is applied, :class:`Forgetting` (one per runner, shared by its shards)

- notes which owner each embedded text belongs to in the vector cache (the cache is keyed
  by content hash and shared by owners: a vector is dropped once no owner holds it);
- at each erased owner: drops what this process holds of the owner's data keys (the next
  record sealed with them reads the key store, where they are gone), drops the owner's
  vector-cache entries, and has every model of the shard ``purge()`` what its deletes left
  in its files: SQLite models checkpoint and truncate their WAL (``secure_delete`` is on,
  so deleted rows are overwritten), the lexical index is rewritten without deleted
  documents; then an embedded vector shard that deleted points is rewritten without them
  (its files kept their vectors), beside the shard's thread so that its searches go on. A
  model without ``purge`` keeps nothing of the text. A vector store of another embedding
  identity, which is applied no batch until ``prme rebuild --model vector``, deletes the
  owner's points here (``forget_owners``).

The erased owners are noted in ``<shard>/erasures.pending`` before the models apply the
batch and the note is removed after the purge, so a crash in between purges when the
shard opens again.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from prme.producers.free_space import allocated_bytes, check_room
from prme.producers.keys import KeyStore
from prme.schemas.errors import InsufficientSpace, ShardUnavailable
from prme.schemas.records import OwnerErased

from .derive import embedding_text
from .embeddings.cached import CachedEmbeddingProvider
from .embeddings.protocol import EmbeddingIdentity
from .embeddings.vector_cache import VectorCache, content_hash
from .model import ERASURES_PENDING, ModelClosed, ProjectedRecord

if TYPE_CHECKING:
    from .shard import Shard

_log = logging.getLogger("prme.projector")


def purge_models(models: Iterable[Any], owners: Sequence[str] = ()) -> None:
    """Call ``purge()`` on each model that has one (on the shard's thread); a vector store
    waiting for its rebuild first deletes the erased ``owners``' points."""
    for model in models:
        forget = getattr(model, "forget_owners", None)
        if owners and callable(forget):
            forget(owners)
        purge = getattr(model, "purge", None)
        if callable(purge):
            purge()


class Forgetting:
    """The key store that opens sealed records, and the purge that follows an erasure."""

    def __init__(
        self,
        keys: KeyStore | None,
        cache: VectorCache | None,
        identity: EmbeddingIdentity,
        queries: CachedEmbeddingProvider | None = None,
        *,
        min_free_bytes: int = 0,
    ) -> None:
        """``queries``: the provider whose query entries an erasure drops;
        ``min_free_bytes``: the room a store's rewrite leaves free (``limits``)."""
        self.keys = keys
        self._min_free_bytes = min_free_bytes
        self._cache = cache
        self._queries = queries
        self._identity = identity
        self.purges = 0
        """Erasure purges run (this process)."""

    def before_apply(self, shard: Shard, projected: list[ProjectedRecord]) -> None:
        """Note the batch's erased owners in the shard's directory before the models apply
        it: a crash between the models' deletes and the purge leaves the note, and the
        shard purges when it opens again (:meth:`resume`)."""
        erased = _erased(projected)
        if erased:
            _write_pending(shard.directory, sorted({*_read_pending(shard.directory), *erased}))

    async def after_apply(self, shard: Shard, projected: list[ProjectedRecord]) -> None:
        """Note which owner holds each cached vector, and purge the batch's erased owners.
        A memory an owner wrote after its erasure in the same batch (a replay) is noted
        after the purge, its vector stored again: noted before, the purge dropped it, and
        every rebuild encoded that text anew."""
        cache = self._cache
        embedded = [
            (index, item)
            for index, item in enumerate(projected)
            if item.node is not None and item.vector is not None
        ]
        last_erasure = {
            item.record.owner: index
            for index, item in enumerate(projected)
            if isinstance(item.record, OwnerErased)
        }
        before = [
            item for index, item in embedded if index < last_erasure.get(item.record.owner, -1)
        ]
        after = [
            item for index, item in embedded if index > last_erasure.get(item.record.owner, -1)
        ]
        if cache is not None and before:
            await asyncio.to_thread(cache.add_owners, self._identity, _refs(before))
        if last_erasure:
            pending = {*_read_pending(shard.directory), *last_erasure}
            await self._purge(shard, sorted(pending))
        if cache is not None and after:
            if last_erasure:
                vectors = np.array([item.vector for item in after], dtype=np.float32)
                hashes = [digest for digest, _ in _refs(after)]
                await asyncio.to_thread(cache.put_checked, self._identity, hashes, vectors)
            await asyncio.to_thread(cache.add_owners, self._identity, _refs(after))

    async def resume(self, shard: Shard) -> None:
        """Finish a purge a crash interrupted, or make a rewrite a store is due (since an
        earlier version, or an erasure that found no room for it); the shard's models are
        open."""
        pending = _read_pending(shard.directory)
        if pending:
            await self._purge(shard, pending)
        else:
            try:
                await self._rewrite(shard)
            except ShardUnavailable:
                raise
            except Exception as error:  # the pack opens; the rewrite stays due
                _log.warning(
                    "p%d: the vector store could not be rewritten (%s): the vectors of owners "
                    "erased before may stay in its files until it is (at its next opening or "
                    "erasure) or `prme rebuild` replaces it",
                    shard.partition,
                    error,
                )

    async def _purge(self, shard: Shard, owners: list[str]) -> None:
        for owner in owners:
            if self.keys is not None:
                self.keys.forget(owner)
            if self._queries is not None:
                self._queries.forget_owner(owner)
        if self._cache is not None:
            await asyncio.to_thread(self._cache.drop_owners, owners)
        await shard.run(purge_models, list(shard.models.values()), owners)
        await self._rewrite(shard)
        (shard.directory / ERASURES_PENDING).unlink(missing_ok=True)
        self.purges += 1

    async def _rewrite(self, shard: Shard) -> None:
        """Each model's rewrite that is due, beside the shard's thread (its searches go on),
        when the disk has room for its copy beyond ``min_free_bytes``; without it, a warning
        and the rewrite stays due (the store keeps no mark, so it is due at the next opening
        too): a copy the disk cannot hold would end the process (SIGBUS)."""
        due = [name for name, m in shard.models.items() if getattr(m, "rewrite_due", False)]
        if not due:
            return
        stores = [shard.directory / name for name in due]
        needed = await asyncio.to_thread(allocated_bytes, stores)
        try:
            check_room(shard.directory, needed, "the store's rewrite", self._min_free_bytes)
        except InsufficientSpace as error:
            _log.warning(
                "p%d: the vector store's rewrite waits for room: %s; until it is rewritten "
                "its files may hold vectors of erased owners",
                shard.partition,
                error,
            )
            return
        for name in due:
            model = shard.models.get(name)
            rewrite = getattr(model, "rewrite_if_due", None)
            if callable(rewrite):
                try:
                    await asyncio.to_thread(rewrite)
                except ModelClosed:
                    if not shard.closing:
                        raise
                    raise ShardUnavailable(
                        f"partition {shard.partition} closed during its erasure's purge"
                    ) from None


def _refs(items: Iterable[ProjectedRecord]) -> list[tuple[str, str]]:
    """(content hash, owner) of each embedded memory."""
    return [
        (content_hash(embedding_text(item.node)), item.node.owner)
        for item in items
        if item.node is not None
    ]


def _erased(projected: list[ProjectedRecord]) -> list[str]:
    return sorted({p.record.owner for p in projected if isinstance(p.record, OwnerErased)})


def _read_pending(directory: Path) -> list[str]:
    try:
        return list(
            msgspec.json.decode((directory / ERASURES_PENDING).read_bytes(), type=list[str])
        )
    except FileNotFoundError:
        return []
    except msgspec.DecodeError:  # a torn write: purge every model, no owner known
        return [""]


def _write_pending(directory: Path, owners: list[str]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    staged = directory / (ERASURES_PENDING + ".tmp")
    with open(staged, "wb") as handle:
        handle.write(msgspec.json.encode(owners))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(staged, directory / ERASURES_PENDING)
