"""The contract on qdrant-client (local mode here; one collection shared by partitions)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from qdrant_client import QdrantClient

from prme.projectors.embeddings.protocol import EmbeddingIdentity
from prme.projectors.stores.vector_base import VectorModelBase
from prme.projectors.stores.vector_edge import EdgeVectorModel
from prme.projectors.stores.vector_qdrant import QdrantVectorModel

from .vector_contract import IDENTITY, MakeModel, VectorModelContract, basis, message

pytestmark = pytest.mark.filterwarnings("ignore:Payload indexes have no effect")


class TestQdrantVectorModel(VectorModelContract):
    @pytest.fixture
    def make_model(self, tmp_path: Path) -> Iterator[MakeModel]:
        clients: dict[str, QdrantClient] = {}

        def make(identity: EmbeddingIdentity = IDENTITY, store: str = "a") -> VectorModelBase:
            # A reopen starts a new client on the same files, as a restarted process would.
            if store in clients:
                clients.pop(store).close()
            clients[store] = QdrantClient(path=str(tmp_path / store))
            return QdrantVectorModel(clients[store], "memories", 3, identity)

        yield make
        for client in clients.values():
            client.close()


def test_partitions_share_the_collection_but_not_their_tracking() -> None:
    client = QdrantClient(":memory:")
    try:
        first = QdrantVectorModel(client, "memories", 0, IDENTITY)
        second = QdrantVectorModel(client, "memories", 1, IDENTITY)
        first.apply([message(0, basis(1), owner="alice"), message(1, basis(1), owner="alice")])
        second.apply([message(0, basis(0, 1), owner="bob")])
        assert (first.applied_offset(), second.applied_offset()) == (1, 0)
        assert (first.count(), second.count()) == (2, 1)
        assert first.digest() != second.digest()
        assert len(second.search(basis(1), "bob", None, 10)) == 1
        reopened = QdrantVectorModel(client, "memories", 1, IDENTITY)
        assert reopened.applied_offset() == 0
        assert reopened.digest() == second.digest()
    finally:
        client.close()


def test_a_new_partition_in_a_collection_of_another_model_is_a_mismatch() -> None:
    client = QdrantClient(":memory:")
    try:
        QdrantVectorModel(client, "memories", 0, IDENTITY)
        other = EmbeddingIdentity("other-model", "1", IDENTITY.dimension)
        late = QdrantVectorModel(client, "memories", 1, other)
        assert late.identity_mismatch
        assert late.stored_identity() == IDENTITY
    finally:
        client.close()


def test_both_engines_give_the_same_digest_for_the_same_content(tmp_path: Path) -> None:
    records = [message(i, basis(1, i / 7, -i), owner=("alice", "bob")[i % 2]) for i in range(5)]
    client = QdrantClient(":memory:")
    try:
        qdrant = QdrantVectorModel(client, "memories", 0, IDENTITY)
        with EdgeVectorModel(tmp_path / "p0", IDENTITY) as edge:
            assert edge.digest() == qdrant.digest()
            edge.apply(records)
            qdrant.apply(records)
            assert edge.digest() == qdrant.digest()
    finally:
        client.close()
