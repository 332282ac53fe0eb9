"""The vector changelog on a real broker: what a node restores, what an erasure removes."""

from __future__ import annotations

import uuid
from pathlib import Path

import msgspec
import pytest

from prme.producers.kafka_changelog import KafkaChangelog
from prme.projectors.derive import embedding_text
from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider
from prme.projectors.embeddings.validation import identity_of
from prme.projectors.embeddings.vector_cache import VectorCache
from prme.projectors.model import ProjectedRecord
from prme.projectors.vector_changelog import VectorChangelog
from prme.schemas.records import OwnerErased

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


def node_changelog(bootstrap: str, topic: str, cache: VectorCache) -> VectorChangelog:
    log = KafkaChangelog(bootstrap, topic, 1, request_timeout_s=30)
    return VectorChangelog(log, cache, identity_of(PROVIDER))


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
