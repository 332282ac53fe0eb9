"""The vector read model contract: every implementation's test class subclasses
``VectorModelContract`` and provides the ``make_model`` fixture.

``make_model(identity=IDENTITY, store="a")`` opens the store named ``store`` (creating it
the first time); calling it again with the same name after ``close()`` reopens that store.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Protocol

import pytest

from prme.projectors.derive import derive_node
from prme.projectors.embeddings.protocol import EmbeddingIdentity
from prme.projectors.model import ProjectedRecord
from prme.projectors.stores.vector_base import VectorHit, VectorModelBase
from prme.schemas.errors import EmbeddingMismatch
from prme.schemas.records import AnyRecord, memory_node_id

from . import record_builders
from .record_builders import AT, archived, erased, msg, projected, restored, superseded

DIM = 8
IDENTITY = EmbeddingIdentity("test-model", "1", DIM)
OTHER_VERSION = EmbeddingIdentity("test-model", "2", DIM)
OTHER_DIMENSION = EmbeddingIdentity("test-model", "1", DIM * 2)


class MakeModel(Protocol):
    def __call__(
        self, identity: EmbeddingIdentity = IDENTITY, store: str = "a"
    ) -> VectorModelBase: ...


def basis(*weights: float) -> list[float]:
    """A dimension-8 vector from its first components."""
    return [float(w) for w in weights] + [0.0] * (DIM - len(weights))


def message(
    offset: int,
    vector: list[float] | None,
    owner: str = "alice",
    scope: str = "default",
    session_id: str = "s1",
    occurred_at: datetime | None = None,
) -> ProjectedRecord:
    record = msg(
        f"e{offset:04d}-{owner}",
        f"message {offset}",
        owner,
        session_id,
        scope,
        occurred_at=occurred_at,
    )
    return ProjectedRecord(offset=offset, record=record, node=derive_node(record), vector=vector)


def node_of(item: ProjectedRecord) -> str:
    assert item.node is not None
    return item.node.node_id


def lifecycle(
    offset: int, kind: Callable[..., AnyRecord], node_id: str, owner: str = "alice", **extra: str
) -> ProjectedRecord:
    """``kind`` (a builder of ``record_builders``: ``archived``, ``restored``, ``superseded``)
    of ``node_id`` at ``offset``."""
    return ProjectedRecord(
        offset=offset, record=kind(f"l{offset:04d}", node_id, owner=owner, **extra)
    )


def ids(hits: list[VectorHit]) -> list[str]:
    return [hit.node_id for hit in hits]


class VectorModelContract:
    """Behaviour every vector read model implementation must have."""

    @pytest.fixture
    def make_model(self) -> MakeModel:
        raise NotImplementedError("subclasses provide make_model")

    def test_is_the_vector_read_model(self, make_model: MakeModel) -> None:
        model = make_model()
        assert model.name == "vector"
        assert model.applied_offset() == -1
        assert model.count() == 0
        assert model.search(basis(1), "alice", None, 5) == []
        assert model.stored_identity() == IDENTITY
        assert not model.identity_mismatch

    def test_search_ranks_by_cosine_similarity(self, make_model: MakeModel) -> None:
        model = make_model()
        far, exact, near = message(0, basis(0, 1)), message(1, basis(3)), message(2, basis(1, 1))
        model.apply([far, exact, near])
        hits = model.search(basis(2), "alice", None, 10)
        assert ids(hits) == [node_of(exact), node_of(near), node_of(far)]
        assert [hit.score for hit in hits] == pytest.approx([1.0, 2**-0.5, 0.0], abs=1e-5)
        assert ids(model.search(basis(2), "alice", None, 2)) == [node_of(exact), node_of(near)]

    def test_owner_filter_never_returns_another_owners_points(self, make_model: MakeModel) -> None:
        model = make_model()
        mine = message(0, basis(0, 1), owner="alice")
        theirs = [message(i, basis(1), owner="bob") for i in range(1, 6)]
        model.apply([mine, *theirs])
        assert ids(model.search(basis(1), "alice", None, 3)) == [node_of(mine)]
        assert set(ids(model.search(basis(1), "bob", None, 10))) == set(map(node_of, theirs))
        assert model.search(basis(1), "carol", None, 10) == []

    def test_scores_for_gives_the_cosine_of_named_nodes_of_the_owner_only(
        self, make_model: MakeModel
    ) -> None:
        model = make_model()
        exact, near = message(0, basis(3)), message(1, basis(1, 1))
        theirs = message(2, basis(1), owner="bob")
        model.apply([exact, near, theirs, lifecycle(3, archived, node_of(near))])
        scores = model.scores_for(basis(2), "alice", [node_of(near), node_of(theirs)])
        assert scores == {node_of(near): pytest.approx(2**-0.5, abs=1e-5)}

    def test_scope_filter(self, make_model: MakeModel) -> None:
        model = make_model()
        work = message(0, basis(1), scope="work")
        home = message(1, basis(1, 0.1), scope="home")
        model.apply([work, home])
        assert ids(model.search(basis(1), "alice", "work", 10)) == [node_of(work)]
        assert ids(model.search(basis(1), "alice", "home", 10)) == [node_of(home)]
        assert ids(model.search(basis(1), "alice", None, 10)) == [node_of(work), node_of(home)]
        assert model.search(basis(1), "alice", "other", 10) == []

    def test_archived_and_superseded_leave_search_until_restored(
        self, make_model: MakeModel
    ) -> None:
        model = make_model()
        a, b, c = message(0, basis(1)), message(1, basis(1, 0.2)), message(2, basis(1, 0.4))
        model.apply([a, b, c])
        model.apply(
            [
                lifecycle(3, archived, node_of(a)),
                lifecycle(4, superseded, node_of(b), by_node_id=node_of(c)),
            ]
        )
        assert ids(model.search(basis(1), "alice", None, 10)) == [node_of(c)]
        every = model.search(basis(1), "alice", None, 10, include_inactive=True)
        assert ids(every) == [node_of(a), node_of(b), node_of(c)]
        model.apply([lifecycle(5, restored, node_of(a)), lifecycle(6, restored, node_of(b))])
        assert ids(model.search(basis(1), "alice", None, 10)) == [
            node_of(a),
            node_of(b),
            node_of(c),
        ]
        assert model.count("alice") == 3

    def test_lifecycle_of_unknown_or_foreign_node_changes_nothing(
        self, make_model: MakeModel
    ) -> None:
        model = make_model()
        a = message(0, basis(1))
        model.apply([a])
        model.apply(
            [
                lifecycle(1, archived, memory_node_id("missing")),
                lifecycle(2, archived, node_of(a), owner="mallory"),
                lifecycle(3, restored, memory_node_id("missing")),
            ]
        )
        assert ids(model.search(basis(1), "alice", None, 10)) == [node_of(a)]
        assert model.count() == 1
        assert model.applied_offset() == 3

    def test_owner_erased_removes_that_owner_only(self, make_model: MakeModel) -> None:
        model = make_model()
        model.apply([message(i, basis(1, i), owner="alice") for i in range(3)])
        bobs = [message(i, basis(1, i), owner="bob") for i in range(3, 5)]
        model.apply(bobs)
        model.apply([ProjectedRecord(offset=5, record=erased("x5"))])
        assert model.count("alice") == 0
        assert model.search(basis(1), "alice", None, 10, include_inactive=True) == []
        assert model.count("bob") == 2
        assert set(ids(model.search(basis(1), "bob", None, 10))) == set(map(node_of, bobs))
        assert model.count() == 2

    def test_control_records_only_advance_the_offset(self, make_model: MakeModel) -> None:
        model = make_model()
        model.apply([message(0, basis(1))])
        before = (model.count(), model.search(basis(1), "alice", None, 10))
        controls = [
            record_builders.cleared("c1"),
            record_builders.deleted("c2", "e0000-alice"),
            record_builders.replaced("c3", message_count=0),
        ]
        model.apply([*projected(controls, start=1), message(4, None)])
        assert (model.count(), model.search(basis(1), "alice", None, 10)) == before
        assert model.applied_offset() == 4

    def test_state_persists_across_close_and_reopen(self, make_model: MakeModel) -> None:
        model = make_model()
        a = message(0, basis(1), occurred_at=AT)
        model.apply([a, message(1, basis(0, 1), owner="bob")])
        model.apply([lifecycle(7, archived, node_of(a))])
        digest = model.digest()
        model.close()
        reopened = make_model()
        assert reopened.applied_offset() == 7
        assert reopened.stored_identity() == IDENTITY
        assert reopened.digest() == digest
        assert reopened.count() == 2
        assert reopened.search(basis(1), "alice", None, 10) == []
        assert ids(reopened.search(basis(1), "alice", None, 10, include_inactive=True)) == [
            node_of(a)
        ]

    def test_reapplying_a_batch_changes_nothing(self, make_model: MakeModel) -> None:
        model = make_model()
        a = message(0, basis(1))
        batch = [
            a,
            message(1, basis(1, 1), owner="bob"),
            lifecycle(2, archived, node_of(a)),
            message(3, basis(0, 1), scope="work"),
        ]
        model.apply(batch)
        digest = model.digest()
        model.apply(batch)
        assert model.digest() == digest
        assert model.count() == 3
        assert model.applied_offset() == 3

    def test_digest_ignores_write_order_and_batching(self, make_model: MakeModel) -> None:
        records = [message(i, basis(1, i / 3, -i), owner=("alice", "bob")[i % 2]) for i in range(6)]
        first, second = make_model(store="a"), make_model(store="b")
        assert first.digest() == second.digest()
        first.apply(records)
        second.apply([records[3], records[1], records[4]])
        assert first.digest() != second.digest()
        second.apply([records[0], records[2], records[5]])
        assert first.digest() == second.digest()
        second.apply([lifecycle(6, archived, node_of(records[0]))])
        assert first.digest() != second.digest()

    def test_other_identity_on_reopen_is_a_mismatch(self, make_model: MakeModel) -> None:
        model = make_model()
        model.apply([message(0, basis(1))])
        model.close()
        for identity in (OTHER_VERSION, OTHER_DIMENSION):
            other = make_model(identity=identity)
            assert other.identity_mismatch
            assert other.stored_identity() == IDENTITY
            query = [1.0] * identity.dimension
            with pytest.raises(EmbeddingMismatch):
                other.search(query, "alice", None, 5)
            with pytest.raises(EmbeddingMismatch):
                other.apply([message(1, query)])
            other.close()
        same = make_model()
        assert not same.identity_mismatch
        assert same.count() == 1
        assert same.applied_offset() == 0

    @pytest.mark.parametrize(
        "bad",
        [basis(1, float("nan")), basis(float("inf")), [1.0] * (DIM - 1), [1.0] * (DIM + 1)],
        ids=["nan", "inf", "short", "long"],
    )
    def test_invalid_vectors_raise_and_write_nothing(
        self, make_model: MakeModel, bad: list[float]
    ) -> None:
        model = make_model()
        with pytest.raises(ValueError):
            model.apply([message(0, basis(1)), message(1, bad)])
        assert model.count() == 0
        assert model.applied_offset() == -1
        with pytest.raises(ValueError):
            model.search(bad, "alice", None, 5)
