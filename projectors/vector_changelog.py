"""The vector changelog: every vector a node computes, on a compacted Kafka topic
co-partitioned with the events topic (``<events topic>.vectors``).

A record's key is ``<provider identity key> US <content hash> US <owner>`` (US = the
ASCII unit separator, ``\\x1f``). Its value is the vector as little-endian float32 bytes
(the vector cache's format) sealed with the owner's data key, the key that sealed the
record the vector was computed for: :class:`SealedVector`, AES-GCM bound to the record's
key. So the broker holds no vector in plain, and erasing the owner's keys shreds them at
once, as it does the owner's records; a restore loads the vectors whose key it has. A
vector of an unsealed record (``log.seal_records`` off) is published in plain, the bare
float32 bytes, as every vector was before sealing (such values a topic already holds stay
plain, as the latest value of their keys, until their owner's erasure tombstones them: a
node does not publish a key the changelog has). The owner is in the key so an erasure
can tombstone exactly that owner's entries; the content hash is the vector cache's (sha256
of the text the vector channel embeds), so a loaded entry is a cache hit on replay.

A node handed partition N first :meth:`VectorChangelog.restore`\\ s changelog partition N
into its vector cache, then replays the events: with the same provider identity it
encodes nothing. Before a batch is applied, :meth:`VectorChangelog.record` publishes the
batch's vectors that are not on the changelog yet and, at each ``owner_erased`` record,
tombstones every key of that owner (every identity) — in log order, before the read
models apply the batch, so a crash in between repeats harmless work.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import msgspec
import numpy as np

from prme.producers.kafka_changelog import ChangelogEntry, KafkaChangelog
from prme.producers.keys import KeyStore
from prme.schemas.errors import RecordDecodeError
from prme.schemas.records import OwnerErased
from prme.schemas.sealing import DataKey, KeyRef, Sealer, key_ref

from .derive import embedding_text
from .embeddings.protocol import EmbeddingIdentity
from .embeddings.vector_cache import VectorCache, content_hash
from .model import ProjectedRecord

SEPARATOR = "\x1f"
_FLOAT32 = np.dtype("<f4")
_log = logging.getLogger("prme.projector")


class ChangelogKey(msgspec.Struct, frozen=True):
    identity: str
    content_hash: str
    owner: str

    def encode(self) -> bytes:
        return SEPARATOR.join((self.identity, self.content_hash, self.owner)).encode()

    @classmethod
    def decode(cls, raw: bytes) -> ChangelogKey | None:
        parts = raw.decode("utf-8", "replace").split(SEPARATOR, 2)
        return cls(*parts) if len(parts) == 3 else None


class SealedVector(msgspec.Struct, frozen=True, array_like=True):
    """A sealed changelog value: which of the owner's keys, and the sealed float32 bytes."""

    kid: str
    sealed: bytes


_sealed_decoder = msgspec.msgpack.Decoder(SealedVector)
_sealed_encoder = msgspec.msgpack.Encoder()


class RestoreStats(msgspec.Struct):
    """What one restore read: records, vectors stored in the cache, tombstones seen."""

    partition: int
    records: int = 0
    stored: int = 0
    tombstones: int = 0
    seconds: float = 0.0


class VectorChangelog:
    """Publishes and restores one provider identity's vectors through a changelog log.

    Per partition it remembers which keys are on the changelog (read at restore, added
    when published), so a vector is published once per (identity, text, owner) and an
    erasure knows the owner's keys without reading the partition again.
    """

    def __init__(
        self,
        log: KafkaChangelog,
        cache: VectorCache,
        identity: EmbeddingIdentity,
        keys: KeyStore | None = None,
    ):
        """``keys``: the owners' data keys, which seal and open the values (none: the
        vectors of sealed records are not published, and sealed values not loaded)."""
        self._log = log
        self._cache = cache
        self._identity = identity
        self._keys = keys
        self._sealer = Sealer()
        self._width = identity.dimension * _FLOAT32.itemsize
        self._known: dict[int, dict[bytes, str]] = {}
        self._read_to: dict[int, int] = {}
        """Per partition, the changelog offset this node has read up to."""
        """partition -> key on the changelog -> its owner (filled by restore)."""

    @property
    def log(self) -> KafkaChangelog:
        return self._log

    async def start(self) -> None:
        await self._log.start()

    async def close(self) -> None:
        await self._log.close()

    def restored(self, partition: int) -> bool:
        return partition in self._known

    def forget(self, partition: int) -> None:
        """Drop what this node knows of ``partition`` (it was revoked: another node may
        write its changelog until it comes back, and a new restore reads it again)."""
        self._known.pop(partition, None)
        self._read_to.pop(partition, None)

    async def restore(self, partition: int) -> RestoreStats:
        """Read changelog ``partition`` from its start: every key is noted, and entries of
        this identity not loaded before (the cache remembers the offset it reached) are
        stored in the vector cache; tombstoned entries leave it."""
        started = time.perf_counter()
        stats = RestoreStats(partition)
        mark = f"{self._log.topic}/{partition}/{self._identity.key}"
        end = await self._log.end_offset(partition)
        loaded_until = self._cache.changelog_offset(mark)
        if loaded_until > end:  # the topic was recreated: load it all again
            loaded_until = 0
        known: dict[bytes, str] = {}
        offset = 0
        while offset < end:
            entries, offset = await self._log.read(partition, offset, end)
            stats.records += len(entries)
            keys = await self._opening_keys(entries, loaded_until)
            puts, deletes = self._note(entries, known, loaded_until, stats, keys)
            if puts or deletes:
                self._cache.load_changelog(self._identity.key, puts, deletes, mark, offset)
                stats.stored += len(puts)
        if end != loaded_until:
            self._cache.load_changelog(self._identity.key, {}, (), mark, end)
        self._known[partition] = known
        self._read_to[partition] = end
        await self._note_owners(known)
        stats.seconds = time.perf_counter() - started
        return stats

    async def catch_up(self, partition: int) -> int:
        """Load what was published to ``partition``'s changelog since this node last read
        it (a standby follows its owner's vectors this way); returns the records read."""
        if partition not in self._known:
            return (await self.restore(partition)).records
        start, end = self._read_to.get(partition, 0), await self._log.end_offset(partition)
        if start >= end:
            return 0
        mark = f"{self._log.topic}/{partition}/{self._identity.key}"
        loaded_until = min(self._cache.changelog_offset(mark), start)
        known, fresh = self._known[partition], {}
        stats = RestoreStats(partition)
        offset = start
        while offset < end:
            entries, offset = await self._log.read(partition, offset, end)
            stats.records += len(entries)
            before = set(known)
            keys = await self._opening_keys(entries, loaded_until)
            puts, deletes = self._note(entries, known, loaded_until, stats, keys)
            fresh.update({k: known[k] for k in set(known) - before})
            if puts or deletes:
                self._cache.load_changelog(self._identity.key, puts, deletes, mark, offset)
        self._read_to[partition] = end
        await self._note_owners(fresh)
        return stats.records

    async def _note_owners(self, keys: dict[bytes, str]) -> None:
        """Whose texts the loaded vectors are: an erasure this node applies drops them."""
        refs = [
            (decoded.content_hash, decoded.owner)
            for key in keys
            if (decoded := ChangelogKey.decode(key)) is not None
            and decoded.identity == self._identity.key
        ]
        await asyncio.to_thread(self._cache.add_owners, self._identity, refs)

    async def _opening_keys(
        self, entries: Sequence[ChangelogEntry], loaded_until: int
    ) -> dict[KeyRef, bytes]:
        """The keys that open the sealed values ``_note`` loads from ``entries``."""
        refs = set()
        for entry in entries:
            if entry.value is None or entry.offset < loaded_until:
                continue
            key, sealed = ChangelogKey.decode(entry.key), self._sealed(entry.value)
            if key is not None and sealed is not None and key.identity == self._identity.key:
                refs.add((key.owner, sealed.kid))
        if not refs or self._keys is None:
            return {}
        return await self._keys.reading_keys(refs)

    def _sealed(self, value: bytes) -> SealedVector | None:
        if len(value) == self._width:  # a plain vector
            return None
        try:
            return _sealed_decoder.decode(value)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None

    def _vector(
        self, entry: ChangelogEntry, key: ChangelogKey, keys: dict[KeyRef, bytes]
    ) -> bytes | None:
        """The float32 bytes of a loaded value; ``None`` when its key is gone (erased)."""
        assert entry.value is not None
        if len(entry.value) == self._width:
            return entry.value
        sealed = self._sealed(entry.value)
        if sealed is None:
            _log.warning("vector changelog @%d: a value that is no vector", entry.offset)
            return None
        data_key = keys.get((key.owner, sealed.kid))
        if data_key is None:
            return None
        try:
            plain = self._sealer.open_bytes(sealed.sealed, DataKey(sealed.kid, data_key), entry.key)
        except RecordDecodeError as error:
            _log.warning("vector changelog @%d: %s", entry.offset, error)
            return None
        if len(plain) != self._width:
            _log.warning("vector changelog @%d: a vector of the wrong size", entry.offset)
            return None
        return plain

    def _note(
        self,
        entries: Sequence[ChangelogEntry],
        known: dict[bytes, str],
        loaded_until: int,
        stats: RestoreStats,
        keys: dict[KeyRef, bytes],
    ) -> tuple[dict[str, bytes], set[str]]:
        puts: dict[str, bytes] = {}
        deletes: set[str] = set()
        owners: dict[str, str] = {}
        for entry in entries:
            key = ChangelogKey.decode(entry.key)
            if key is None:
                continue
            if entry.value is None:
                stats.tombstones += 1
                known.pop(entry.key, None)
            else:
                known[entry.key] = owners.setdefault(key.owner, key.owner)
            if entry.offset < loaded_until or key.identity != self._identity.key:
                continue
            if entry.value is None:
                puts.pop(key.content_hash, None)
                deletes.add(key.content_hash)
            elif (vector := self._vector(entry, key, keys)) is not None:
                puts[key.content_hash] = vector
                deletes.discard(key.content_hash)
        if deletes:
            # A text another owner of this partition still has keeps its cached vector.
            live = {ChangelogKey.decode(k) for k in known}
            deletes -= {k.content_hash for k in live if k is not None}
        return puts, deletes

    async def record(self, partition: int, projected: Sequence[ProjectedRecord]) -> int:
        """Publish the batch's vectors that are not on the changelog and tombstone the
        keys of owners erased in it, in log order; returns how many records it wrote."""
        if partition not in self._known:  # an erasure needs every key of the partition
            await self.restore(partition)
        known = self._known[partition]
        sealed_with = {
            item.offset: key_ref(item.sealed)
            for item in projected
            if item.vector is not None and item.sealed is not None
        }
        refs = {ref for ref in sealed_with.values() if ref is not None}
        keys = await self._keys.reading_keys(refs) if refs and self._keys is not None else {}
        pending: dict[bytes, bytes] = {}
        written = 0
        for item in projected:
            if isinstance(item.record, OwnerErased):
                written += await self._publish(partition, pending, known)
                pending = {}
                written += await self._erase(partition, item.record.owner, known)
            elif item.node is not None and item.vector is not None:
                digest = content_hash(embedding_text(item.node))
                key = ChangelogKey(self._identity.key, digest, item.node.owner).encode()
                if key not in known:
                    value = self._value(item, key, sealed_with.get(item.offset), keys)
                    if value is not None:
                        pending[key] = value
        written += await self._publish(partition, pending, known)
        return written

    def _value(
        self, item: ProjectedRecord, key: bytes, ref: KeyRef | None, keys: dict[KeyRef, bytes]
    ) -> bytes | None:
        """The changelog value of ``item``'s vector: sealed with the key that sealed its
        record (``ref``); ``None`` when that key is gone (the owner was erased meanwhile:
        nothing of theirs is published); plain for an unsealed record."""
        plain = np.asarray(item.vector, dtype=_FLOAT32).tobytes()
        if item.sealed is None:
            return plain
        data_key = None if ref is None else keys.get(ref)
        if ref is None or data_key is None:
            return None
        sealed = self._sealer.seal_bytes(plain, DataKey(ref[1], data_key), key)
        return _sealed_encoder.encode(SealedVector(ref[1], sealed))

    async def _publish(
        self, partition: int, pending: dict[bytes, bytes], known: dict[bytes, str]
    ) -> int:
        if not pending:
            return 0
        await self._log.publish(partition, list(pending.items()))
        for key in pending:
            decoded = ChangelogKey.decode(key)
            if decoded is not None:
                known[key] = decoded.owner
        return len(pending)

    async def _erase(self, partition: int, owner: str, known: dict[bytes, str]) -> int:
        self._sealer = Sealer()  # holds no context of the erased owner's keys
        keys = [key for key, holder in known.items() if holder == owner]
        if not keys:
            return 0
        await self._log.publish(partition, [(key, None) for key in keys])
        for key in keys:
            known.pop(key, None)
        return len(keys)
