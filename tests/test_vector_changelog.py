"""The vector changelog on a real broker: what a node restores, what an erasure removes."""

from __future__ import annotations

import uuid
from pathlib import Path

import msgspec
import numpy as np
import pytest

from prme.producers.kafka_changelog import KafkaChangelog
from prme.producers.keys import LocalKeyStore
from prme.projectors.derive import embedding_text
from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider
from prme.projectors.embeddings.validation import identity_of
from prme.projectors.embeddings.vector_cache import VectorCache
from prme.projectors.model import ProjectedRecord
from prme.projectors.vector_changelog import VectorChangelog
from prme.schemas.codec import encode_record
from prme.schemas.records import OwnerErased
from prme.schemas.sealing import Sealer

from .record_builders import AT, msg, projected

pytestmark = pytest.mark.kafka
PROVIDER = HashedBagOfWordsProvider(dimension=8)


def with_vectors(items: list[ProjectedRecord]) -> list[ProjectedRecord]:
    return [
        msgspec.structs.replace(item, vector=PROVIDER.vector(embedding_text(item.node)))
        if item.node is not None
        else item
        for item in items
    ]


def node_changelog(
    bootstrap: str, topic: str, cache: VectorCache, keys: LocalKeyStore | None = None
) -> VectorChangelog:
    log = KafkaChangelog(bootstrap, topic, 1, request_timeout_s=30)
    return VectorChangelog(log, cache, identity_of(PROVIDER), keys)


async def test_a_node_restores_vectors_and_loses_only_the_erased_owners_texts(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    topic = f"prme-test-{uuid.uuid4().hex[:12]}.vectors"
    cache, writer_cache = VectorCache(tmp_path / "reader.sqlite3"), VectorCache(tmp_path / "w")
    writer = node_changelog(kafka_bootstrap, topic, writer_cache)
    reader = node_changelog(kafka_bootstrap, topic, cache)
    await writer.start()
    await reader.start()
    try:
        batch = with_vectors(
            projected(
                [
                    msg("e1", "shared text"),
                    msg("e2", "shared text", owner="bob"),
                    msg("e3", "only alice"),
                ]
            )
        )
        assert await writer.record(0, batch) == 3
        assert await writer.record(0, batch) == 0  # each key is published once
        stats = await reader.restore(0)
        assert (stats.records, stats.stored) == (3, 2)
        texts = [embedding_text(p.node) for p in batch if p.node is not None]
        assert None not in cache.get_many(PROVIDER, texts)

        erased = OwnerErased(
            event_id="e4", owner="alice", session_id="s1", scope="default", recorded_at=AT
        )
        assert await writer.record(0, [ProjectedRecord(offset=3, record=erased)]) == 2
        reader.forget(0)
        stats = await reader.restore(0)  # loads only what it has not loaded before
        assert stats.tombstones == 2 and stats.stored == 0
        shared, only_alice = cache.get_many(PROVIDER, ["shared text", "only alice"])
        assert shared is not None  # bob still has this text
        assert only_alice is None
    finally:
        await writer.close()
        await reader.close()
        cache.close()
        writer_cache.close()


async def test_vectors_of_sealed_records_are_sealed_with_their_owners_key(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """The broker gets no vector of a sealed record in plain; a node restores it with the
    owner's key, and once the key is erased nothing of it loads (crypto-shredding), while
    a plain vector (an unsealed record, or one published before sealing) still loads."""
    topic = f"prme-test-{uuid.uuid4().hex[:12]}.vectors"
    keys = LocalKeyStore(tmp_path / "keys.sqlite3")
    await keys.start()
    cache, writer_cache = VectorCache(tmp_path / "reader.sqlite3"), VectorCache(tmp_path / "w")
    writer = node_changelog(kafka_bootstrap, topic, writer_cache, keys)
    reader = node_changelog(kafka_bootstrap, topic, cache, keys)
    await writer.start()
    await reader.start()
    try:
        held = await keys.writing_keys(["alice", "bob"])
        sealer = Sealer()
        batch = with_vectors(
            projected([msg("e1", "alice's text"), msg("e2", "bob's", owner="bob")])
        )
        batch = [
            msgspec.structs.replace(
                item, sealed=sealer.seal(encode_record(item.record), held[item.record.owner])
            )
            for item in batch
        ]
        plain = with_vectors(projected([msg("e3", "a plain record's text", owner="carol")], 2))
        assert await writer.record(0, [*batch, *plain]) == 3
        entries, _ = await writer.log.read(0, 0, 3)
        vectors = [np.asarray(item.vector, dtype="<f4").tobytes() for item in [*batch, *plain]]
        values = [entry.value or b"" for entry in entries]
        assert [any(v in value for value in values) for v in vectors] == [False, False, True]

        assert (await reader.restore(0)).stored == 3
        texts = ["alice's text", "bob's", "a plain record's text"]
        assert None not in cache.get_many(PROVIDER, texts)

        await keys.erase("alice")
        cache.close()
        cache = VectorCache(tmp_path / "fresh.sqlite3")
        fresh = node_changelog(kafka_bootstrap, topic, cache, keys)
        await fresh.start()
        try:
            assert (await fresh.restore(0)).stored == 2
        finally:
            await fresh.close()
        assert [v is None for v in cache.get_many(PROVIDER, texts)] == [True, False, False]
    finally:
        await writer.close()
        await reader.close()
        await keys.close()
        cache.close()
        writer_cache.close()


async def test_a_producer_the_broker_lost_the_sequence_of_is_replaced_by_the_next_publish(
    kafka_bootstrap: str,
) -> None:
    """From repeating a Kafka fault trial by hand: after a broker outage the changelog's
    idempotent producer failed every publish with OutOfOrderSequenceNumber (its timed-out
    batches left a gap), which stopped the projector. The failing publish is now a
    ``TransportUnavailable`` the runner waits out, and the next publish starts a new
    producer first, then stops the broken one. (The broker's refusal is injected into the
    real producer: an outage that makes it happens only now and then.)"""
    from aiokafka.errors import OutOfOrderSequenceNumber

    from prme.schemas.errors import TransportUnavailable

    log = KafkaChangelog(kafka_bootstrap, f"renew-{uuid.uuid4().hex[:8]}", 1, request_timeout_s=30)
    await log.start()
    try:
        await log.publish(0, [(b"k1", b"before")])
        broken = log._producer
        assert broken is not None

        async def refused(*args: object, **kwargs: object) -> object:
            raise OutOfOrderSequenceNumber()

        broken.send_batch = refused  # type: ignore[method-assign]
        with pytest.raises(TransportUnavailable, match="started anew, publish again"):
            await log.publish(0, [(b"k2", b"lost")])
        await log.publish(0, [(b"k2", b"after")])  # a new producer
        assert log._producer is not broken and log._producer is not None
        assert broken._closed  # type: ignore[attr-defined]
        end = await log.end_offset(0)
        entries, _ = await log.read(0, 0, end)
        assert [(e.key, e.value) for e in entries] == [(b"k1", b"before"), (b"k2", b"after")]
    finally:
        await log.close()
