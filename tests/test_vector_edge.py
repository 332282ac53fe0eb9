"""The contract on the embedded qdrant-edge shard, plus what is specific to it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from qdrant_edge import EdgeShard

from prme.projectors.embeddings.protocol import EmbeddingIdentity
from prme.projectors.stores.vector_base import VectorModelBase, point_id
from prme.projectors.stores.vector_edge import EdgeVectorModel
from prme.schemas.errors import ShardUnavailable

from .record_builders import AT, archived
from .vector_contract import (
    IDENTITY,
    MakeModel,
    VectorModelContract,
    basis,
    lifecycle,
    message,
    node_of,
)


class TestEdgeVectorModel(VectorModelContract):
    @pytest.fixture
    def make_model(self, tmp_path: Path) -> Iterator[MakeModel]:
        opened: list[VectorModelBase] = []

        def make(identity: EmbeddingIdentity = IDENTITY, store: str = "a") -> VectorModelBase:
            model = EdgeVectorModel(tmp_path / store, identity)
            opened.append(model)
            return model

        yield make
        for model in opened:
            model.close()


def test_a_second_open_of_the_shard_directory_is_refused(tmp_path: Path) -> None:
    with EdgeVectorModel(tmp_path / "p0", IDENTITY) as model:
        model.apply([message(0, basis(1))])
        with pytest.raises(ShardUnavailable):
            EdgeVectorModel(tmp_path / "p0", IDENTITY)
    with EdgeVectorModel(tmp_path / "p0", IDENTITY) as reopened:
        assert reopened.count() == 1


def test_close_is_idempotent(tmp_path: Path) -> None:
    model = EdgeVectorModel(tmp_path / "p0", IDENTITY)
    model.close()
    model.close()


def test_points_carry_the_node_payload(tmp_path: Path) -> None:
    item = message(0, basis(1, 1), owner="alice", scope="work", session_id="s9", occurred_at=AT)
    with EdgeVectorModel(tmp_path / "p0", IDENTITY) as model:
        model.apply([item, lifecycle(1, archived, node_of(item))])
    shard = EdgeShard.load(str(tmp_path / "p0"))
    try:
        [stored] = shard.retrieve([point_id(node_of(item))], with_payload=True, with_vector=True)
    finally:
        shard.close()
    assert stored.payload == {
        "owner": "alice",
        "scope": "work",
        "session_id": "s9",
        "node_type": "fact",  # derived from "message 0"
        "state": "archived",
        "event_id": item.record.event_id,
        "node_id": node_of(item),
        "recorded_at": AT.timestamp(),
        "occurred_at": AT.timestamp(),
    }
    assert stored.vector == pytest.approx([2**-0.5, 2**-0.5] + [0.0] * 6, abs=1e-6)
