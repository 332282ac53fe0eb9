"""The contract on the embedded qdrant-edge shard, plus what is specific to it."""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from qdrant_edge import EdgeShard

from prme.projectors.embeddings.protocol import EmbeddingIdentity
from prme.projectors.model import ModelClosed, ProjectedRecord
from prme.projectors.stores import vector_edge
from prme.projectors.stores.vector_base import VectorModelBase, point_id
from prme.projectors.stores.vector_edge import EdgeVectorModel
from prme.schemas.errors import ShardUnavailable

from .record_builders import AT, archived, erased
from .vector_contract import (
    IDENTITY,
    OTHER_VERSION,
    MakeModel,
    VectorModelContract,
    basis,
    ids,
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


class _CountingShard:
    """The live EdgeShard, counting the payload reads (``retrieve`` calls) made through it."""

    def __init__(self, shard: EdgeShard) -> None:
        self.shard = shard
        self.retrieved: list[int] = []

    def retrieve(self, ids: list[object], **kwargs: object) -> object:
        self.retrieved.append(len(ids))
        return self.shard.retrieve(ids, **kwargs)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> object:
        return getattr(self.shard, name)


@contextlib.contextmanager
def counted_reads(model: EdgeVectorModel) -> Iterator[list[int]]:
    """The sizes of the payload reads made on ``model`` inside the block."""
    counting = _CountingShard(model._live.shard)
    model._live.shard = counting  # type: ignore[assignment]
    try:
        yield counting.retrieved
    finally:
        model._live.shard = counting.shard


def alices(count: int) -> list[ProjectedRecord]:
    return [message(n, basis(1, n / 10), owner="alice") for n in range(count)]


def stored(path: Path, items: list[ProjectedRecord]) -> Path:
    """A closed store at ``path`` holding ``items``."""
    with EdgeVectorModel(path, IDENTITY) as model:
        model.apply(items)
    return path


def test_the_node_ids_of_written_points_are_never_read_back(tmp_path: Path) -> None:
    items = alices(6)
    with EdgeVectorModel(tmp_path / "p0", IDENTITY) as model:
        model.apply(items)
        with counted_reads(model) as reads:
            found = model.search(basis(1), "alice", None, 6)
        assert reads == []
    assert set(ids(found)) == {node_of(item) for item in items}


def test_a_search_reads_a_points_node_id_only_the_first_time_it_returns_it(
    tmp_path: Path,
) -> None:
    items = alices(6)
    with EdgeVectorModel(stored(tmp_path / "p0", items), IDENTITY) as model:
        assert model._primer is None  # fewer than PRIMED_FROM
        with counted_reads(model) as reads:
            first = model.search(basis(1), "alice", None, 3)
            assert reads == [3]
            again = model.search(basis(1), "alice", None, 6)
            assert reads == [3, 3]  # only the three it had not returned yet
            assert model.search(basis(1), "alice", None, 6) == again
            assert reads == [3, 3]
    assert set(ids(first)) < set(ids(again)) == {node_of(item) for item in items}


def test_an_opened_shard_reads_its_node_ids_in_the_background(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vector_edge, "PRIMED_FROM", 4)
    items = alices(6)
    path = stored(tmp_path / "p0", [*items, message(6, None)])  # no vector: no point
    with EdgeVectorModel(path, IDENTITY) as model:
        assert model._primer is not None
        model._primer.join(timeout=30)
        assert model._node_ids == {
            uuid.UUID(point_id(node_of(item))).int: node_of(item) for item in items
        }
        with counted_reads(model) as reads:
            found = model.search(basis(1), "alice", None, 6)
        assert reads == []
    assert set(ids(found)) == {node_of(item) for item in items}


def test_a_priming_overtaken_by_an_erasure_keeps_nothing(tmp_path: Path) -> None:
    path = stored(tmp_path / "p0", [*alices(3), message(3, basis(1), owner="bob")])
    with EdgeVectorModel(path, IDENTITY) as model:
        started_before = model._erasures
        model.apply([ProjectedRecord(offset=4, record=erased("x4"))])
        model._prime(started_before)  # as a primer thread that read before the erasure
        assert model._node_ids == {}


def test_node_ids_stay_right_when_the_remembered_ids_are_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vector_edge, "NODE_ID_CACHE_POINTS", 4)
    items = alices(8)
    with EdgeVectorModel(tmp_path / "p0", IDENTITY) as model:
        model.apply(items)
        small = model.search(basis(1), "alice", None, 3)
        everything = model.search(basis(1), "alice", None, 8)  # passes the bound: emptied
        assert len(model._node_ids) <= 5
        assert model.search(basis(1), "alice", None, 3) == small
    assert ids(everything)[:3] == ids(small)
    assert set(ids(everything)) == {node_of(item) for item in items}


def test_an_erasure_drops_the_remembered_node_ids(tmp_path: Path) -> None:
    items = alices(3)
    kept = message(3, basis(1), owner="bob")
    with EdgeVectorModel(tmp_path / "p0", IDENTITY) as model:
        model.apply([*items, kept])
        model.search(basis(1), "alice", None, 3)
        assert len(model._node_ids) == 4  # every point written
        model.apply([ProjectedRecord(offset=4, record=erased("x4"))])
        assert model._node_ids == {}
        assert model.search(basis(1), "alice", None, 3) == []
        assert ids(model.search(basis(1), "bob", None, 3)) == [node_of(kept)]


def test_a_mismatched_store_remembers_no_node_ids_and_a_purge_forgets_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vector_edge, "PRIMED_FROM", 2)
    path = stored(tmp_path / "p0", alices(3))
    with EdgeVectorModel(path, OTHER_VERSION) as mismatched:
        assert mismatched.identity_mismatch
        assert mismatched._primer is None
        assert mismatched._node_ids == {}
    with EdgeVectorModel(path, IDENTITY) as model:
        assert model._primer is not None
        model._primer.join(timeout=30)
        assert len(model._node_ids) == 3
        model.purge()  # what an erasure's purge calls on every model of the shard
        assert model._node_ids == {}


def test_a_rewrite_after_an_erasure_lets_searches_go_on_and_keeps_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rewrite that drops an erased owner's vectors from the files reads the shard a
    page at a time: a search meanwhile is answered, not held for the whole copy (it held
    the shard's lock throughout: ~12 s at 100k points)."""
    items = alices(3)
    kept = [message(3 + i, basis(1, i), owner="bob") for i in range(5)]
    copying, resume = threading.Event(), threading.Event()
    point = vector_edge.Point

    def slow_point(*args: object) -> object:
        if threading.current_thread().name == "rewrite":
            copying.set()
            resume.wait(30)
        return point(*args)

    with EdgeVectorModel(tmp_path / "p0", IDENTITY) as model:
        model.apply([*items, *kept])
        model.apply([ProjectedRecord(offset=8, record=erased("x8"))])
        model.purge()
        monkeypatch.setattr(vector_edge, "Point", slow_point)
        monkeypatch.setattr(vector_edge, "_SCROLL_PAGE", 2)
        rewrote: list[bool] = []
        rewrite = threading.Thread(
            target=lambda: rewrote.append(model.rewrite_if_due()), name="rewrite"
        )
        rewrite.start()
        try:
            assert copying.wait(30)
            found = ids(model.search(basis(1), "bob", None, 5))  # mid-copy
            assert sorted(found) == sorted(node_of(m) for m in kept)
        finally:
            resume.set()
            rewrite.join(60)
        assert rewrote == [True]
        assert model.rewrite_if_due() is False  # done: nothing due
        assert sorted(ids(model.search(basis(1), "bob", None, 9))) == sorted(
            node_of(m) for m in kept
        )
        assert model.search(basis(1), "alice", None, 3) == []
        assert model.applied_offset() == 8


def test_a_rewrite_due_on_a_closed_shard_is_refused_not_skipped(tmp_path: Path) -> None:
    """Skipped, the erasure's purge would count as done: its pending note removed, the
    reopened shard would keep the deleted vectors in its files."""
    model = EdgeVectorModel(tmp_path / "p0", IDENTITY)
    model.apply([*alices(2), ProjectedRecord(offset=2, record=erased("x2"))])
    model.close()
    with pytest.raises(ModelClosed):
        model.rewrite_if_due()


def test_a_close_after_the_copy_and_before_the_swap_leaves_the_shard_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shard closed (the node stopping) between the rewrite's last page and its swap was
    swapped and opened again behind the closed model: its WAL lock held, a reopen in the
    process failed (review)."""
    model = EdgeVectorModel(tmp_path / "p0", IDENTITY)
    model.apply([*alices(2), message(2, basis(1), owner="bob")])
    model.apply([ProjectedRecord(offset=3, record=erased("x3"))])
    copy = EdgeVectorModel._copy_points

    def copy_then_close(self: EdgeVectorModel, staged: Path) -> None:
        copy(self, staged)
        self.close()

    monkeypatch.setattr(EdgeVectorModel, "_copy_points", copy_then_close)
    with pytest.raises(ModelClosed):
        model.rewrite_if_due()
    assert not list(tmp_path.glob("p0.index-*"))
    monkeypatch.undo()
    with EdgeVectorModel(tmp_path / "p0", IDENTITY) as reopened:
        assert ids(reopened.search(basis(1), "bob", None, 3)) == [
            node_of(message(2, basis(1), owner="bob"))
        ]
