"""A vector shard that holds one owner's points only is searched without the payload
filter (``vector_tenancy``): the same hits as the filtered search, and never another
owner's point."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from qdrant_edge import FieldCondition, Filter, MatchAny, MatchValue, Query, QueryRequest

from prme.projectors.model import ProjectedRecord
from prme.projectors.stores import vector_edge, vector_tenancy
from prme.projectors.stores.vector_base import VectorHit, point_id
from prme.projectors.stores.vector_edge import EdgeVectorModel
from prme.projectors.stores.vector_tenancy import Holding, Tenancy

from .record_builders import archived, erased, restored, superseded
from .vector_contract import IDENTITY, basis, ids, lifecycle, message, node_of

OWNERS = ("alice", "bob", "carol")


def key(node_id: str) -> int:
    return uuid.UUID(point_id(node_id)).int


def filtered(
    model: EdgeVectorModel, vector: list[float], owner: str, include_inactive: bool, limit: int
) -> list[VectorHit]:
    """The search as it is made with the payload conditions (the oracle)."""
    must: list[Any] = [FieldCondition("owner", match=MatchValue(owner))]
    if not include_inactive:
        must.append(FieldCondition("state", match=MatchAny(["active"])))
    request = QueryRequest(
        limit=limit, query=Query.Nearest(vector), filter=Filter(must=must), with_payload=True
    )
    with model._live.lock:
        found = model._live.shard.query(request)
    return [
        VectorHit(node_id=str((point.payload or {})["node_id"]), score=float(point.score))
        for point in found
    ]


class _Recorder:
    """The live EdgeShard, keeping the filter of each query made through it."""

    def __init__(self, shard: object) -> None:
        self.shard = shard
        self.filters: list[Filter | None] = []

    def query(self, request: QueryRequest) -> object:
        self.filters.append(request.filter)
        return self.shard.query(request)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.shard, name)


def recorded(model: EdgeVectorModel) -> _Recorder:
    recorder = _Recorder(model._live.shard)
    model._live.shard = recorder  # type: ignore[assignment]
    return recorder


def payload_conditions(where: Filter | None) -> bool:
    return where is not None and bool(where.must)


# -- the state, from writes alone ---------------------------------------------------------


def test_an_empty_shard_becomes_its_first_owners_and_shared_with_a_second() -> None:
    tenancy = Tenancy()
    tenancy.surveyed(0)
    tenancy.upserted("alice", "active", 1)
    assert tenancy.sole_owner() == "alice"
    tenancy.upserted("alice", "active", 2)
    assert tenancy.sole_owner() == "alice"
    tenancy.upserted("bob", "active", 3)
    assert tenancy.holding is Holding.SHARED
    tenancy.erased("alice")  # bob alone now, but only a survey can say so
    assert tenancy.holding is Holding.UNKNOWN


def test_a_point_without_an_owner_makes_the_shard_shared() -> None:
    tenancy = Tenancy()
    tenancy.surveyed(0)
    tenancy.upserted(None, "active", 1)
    tenancy.upserted("alice", "active", 2)
    assert tenancy.holding is Holding.SHARED
    tenancy.surveyed(1, "alice")
    tenancy.upserted(None, "active", 3)
    assert tenancy.holding is Holding.SHARED


def test_writes_say_nothing_until_a_survey() -> None:
    tenancy = Tenancy()
    tenancy.upserted("alice", "active", 1)
    tenancy.state_set("alice", 1, "archived")
    assert tenancy.holding is Holding.UNKNOWN
    assert tenancy.sole_owner() is None


def test_a_sole_owners_inactive_points_follow_its_state_changes() -> None:
    tenancy = Tenancy()
    tenancy.surveyed(1, "alice", [7])
    tenancy.state_set("alice", 1, "archived")
    tenancy.state_set("bob", 2, "archived")  # not alice's: the write matches no point
    tenancy.upserted("alice", "active", 7)  # written again, active
    assert tenancy.inactive == {1}
    version = tenancy.version
    tenancy.state_set("alice", 1, "active")
    assert tenancy.inactive == set()
    assert tenancy.version > version
    tenancy.erased("bob")
    assert tenancy.sole_owner() == "alice"
    tenancy.erased("alice")
    assert tenancy.holding is Holding.EMPTY


def test_too_many_inactive_points_make_searches_filter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vector_tenancy, "EXCLUDED_AT_MOST", 2)
    tenancy = Tenancy()
    tenancy.surveyed(1, "alice", [1, 2, 3])
    assert tenancy.holding is Holding.SHARED
    tenancy.surveyed(1, "alice", [1, 2])
    tenancy.state_set("alice", 3, "superseded")
    assert tenancy.holding is Holding.SHARED


# -- searches -----------------------------------------------------------------------------


def test_a_sole_owners_search_has_no_payload_condition_and_leaves_out_the_rest(
    tmp_path: Path,
) -> None:
    items = [message(n, basis(1, n / 10)) for n in range(6)]
    with EdgeVectorModel(tmp_path / "p0", IDENTITY) as model:
        model.apply([*items, lifecycle(6, archived, node_of(items[0]))])
        recorder = recorded(model)
        # basis(1) is the tracking point's own vector: it would rank first if not excluded
        active = model.search(basis(1), "alice", None, 10)
        everything = model.search(basis(1), "alice", None, 10, include_inactive=True)
        nobody = model.search(basis(1), "bob", None, 10)
        assert [payload_conditions(f) for f in recorder.filters] == [False, False, True]
        assert active == filtered(model, basis(1), "alice", False, 10)
        assert everything == filtered(model, basis(1), "alice", True, 10)
    assert set(ids(active)) == {node_of(item) for item in items[1:]}
    assert set(ids(everything)) == {node_of(item) for item in items}
    assert nobody == []


def test_a_restored_point_is_found_again(tmp_path: Path) -> None:
    items = [message(n, basis(1, n)) for n in range(3)]
    with EdgeVectorModel(tmp_path / "p0", IDENTITY) as model:
        model.apply([*items, lifecycle(3, archived, node_of(items[0]))])
        assert node_of(items[0]) not in ids(model.search(basis(1), "alice", None, 10))
        model.apply([lifecycle(4, restored, node_of(items[0]))])
        found = model.search(basis(1), "alice", None, 10)
        assert model._tenancy.sole_owner() == "alice"
    assert set(ids(found)) == {node_of(item) for item in items}


def test_a_second_owners_write_makes_the_next_search_filter(tmp_path: Path) -> None:
    with EdgeVectorModel(tmp_path / "p0", IDENTITY) as model:
        model.apply([message(0, basis(1))])
        assert model._tenancy.sole_owner() == "alice"
        theirs = message(1, basis(1), owner="bob")
        model.apply([theirs])
        recorder = recorded(model)
        assert ids(model.search(basis(1), "alice", None, 10)) == [node_of(message(0, None))]
        assert ids(model.search(basis(1), "bob", None, 10)) == [node_of(theirs)]
        assert all(payload_conditions(f) for f in recorder.filters)


def test_an_opened_shard_is_surveyed_once(tmp_path: Path) -> None:
    items = [message(n, basis(1, n), owner="alice") for n in range(4)]
    with EdgeVectorModel(tmp_path / "p0", IDENTITY) as model:
        model.apply([*items, lifecycle(4, superseded, node_of(items[1]), by_node_id="x")])
    with EdgeVectorModel(tmp_path / "p0", IDENTITY) as model:
        assert model._tenancy.holding is Holding.UNKNOWN
        first = model.search(basis(0, 1), "alice", None, 10)
        assert model._tenancy.sole_owner() == "alice"
        assert model._tenancy.inactive == {key(node_of(items[1]))}
        version = model._tenancy.version
        assert model.search(basis(0, 1), "alice", None, 10) == first
        assert model._tenancy.version == version
    assert set(ids(first)) == {node_of(items[n]) for n in (0, 2, 3)}


def test_a_shard_of_several_owners_is_surveyed_as_shared_until_an_erasure(
    tmp_path: Path,
) -> None:
    mine, theirs = message(0, basis(1)), message(1, basis(1), owner="bob")
    with EdgeVectorModel(tmp_path / "p0", IDENTITY) as model:
        model.apply([mine, theirs])
    with EdgeVectorModel(tmp_path / "p0", IDENTITY) as model:
        assert ids(model.search(basis(1), "alice", None, 10)) == [node_of(mine)]
        assert model._tenancy.holding is Holding.SHARED
        model.apply([ProjectedRecord(offset=2, record=erased("x2", owner="alice"))])
        assert ids(model.search(basis(1), "bob", None, 10)) == [node_of(theirs)]
        assert model._tenancy.sole_owner() == "bob"
        assert model.search(basis(1), "alice", None, 10) == []


def test_a_replaced_live_shard_is_surveyed_again(tmp_path: Path) -> None:
    with EdgeVectorModel(tmp_path / "p0", IDENTITY) as model:
        model.apply([message(0, basis(1))])
        model.search(basis(1), "alice", None, 10)
        recorder = recorded(model)  # another object, as a build's or a rewrite's swap gives
        model._tenancy.surveyed(2)  # would keep the filter if the new shard were not surveyed
        model.search(basis(1), "alice", None, 10)
        assert model._tenancy.sole_owner() == "alice"
        assert not payload_conditions(recorder.filters[-1])


def test_too_many_inactive_points_for_an_id_list_are_filtered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vector_tenancy, "EXCLUDED_AT_MOST", 2)
    monkeypatch.setattr(vector_edge, "EXCLUDED_AT_MOST", 2)
    items = [message(n, basis(1, n)) for n in range(5)]
    gone = [lifecycle(5 + n, archived, node_of(items[n])) for n in range(3)]
    with EdgeVectorModel(tmp_path / "p0", IDENTITY) as model:
        model.apply([*items, *gone])
        found = model.search(basis(1), "alice", None, 10)
        assert model._tenancy.holding is Holding.SHARED
    with EdgeVectorModel(tmp_path / "p0", IDENTITY) as model:
        assert model.search(basis(1), "alice", None, 10) == found
        assert model._tenancy.holding is Holding.SHARED
    assert set(ids(found)) == {node_of(items[3]), node_of(items[4])}


class _FailingWrites:
    """The live EdgeShard, whose writes fail (a full disk)."""

    def __init__(self, shard: object) -> None:
        self.shard = shard

    def update(self, operation: object) -> None:
        raise OSError("No space left on device")

    def __getattr__(self, name: str) -> object:
        return getattr(self.shard, name)


def test_a_write_that_fails_leaves_the_shard_to_be_surveyed_again(tmp_path: Path) -> None:
    """A review found the tenancy taking in an upsert the shard never got: the archived
    point written again (a re-sent message) was then searched as active."""
    archived_item, kept = message(0, basis(1, 0.1)), message(1, basis(1, 0.2))
    with EdgeVectorModel(tmp_path / "p0", IDENTITY) as model:
        model.apply([archived_item, kept, lifecycle(2, archived, node_of(archived_item))])
        live = model._live.shard
        model._live.shard = _FailingWrites(live)  # type: ignore[assignment]
        resent = ProjectedRecord(
            offset=3, record=archived_item.record, node=archived_item.node, vector=basis(1, 0.1)
        )
        with pytest.raises(OSError, match="No space"):
            model.apply([resent])
        model._live.shard = live  # the same live shard, as after a failed write
        assert model.search(basis(1), "alice", None, 10) == filtered(
            model, basis(1), "alice", False, 10
        )


def test_a_search_without_an_owner_is_never_unfiltered(tmp_path: Path) -> None:
    """A review found that ``None`` matched the tenancy's "no sole owner" and searched every
    owner's points (unreachable through the engine, which encodes the owner first)."""
    with EdgeVectorModel(tmp_path / "p0", IDENTITY) as model:
        model.apply([message(0, basis(1)), message(1, basis(1), owner="bob")])
        with pytest.raises(TypeError):
            model.search(basis(1), None, None, 10)  # type: ignore[arg-type]


# -- any sequence of writes ---------------------------------------------------------------

_WRITERS = st.sampled_from(("alice",) * 8 + ("bob", "carol"))
"""Mostly one owner, so that shards are often one owner's."""
_STEP = st.one_of(
    st.tuples(st.just("write"), _WRITERS, st.integers(0, 7)),
    st.tuples(st.just("resend"), st.integers(0, 7)),  # a message written again, as it was
    st.tuples(
        st.sampled_from(("archive", "restore", "supersede")),
        st.integers(0, 2),
        st.sampled_from(("its owner",) * 3 + ("another owner", "a node never written")),
    ),
    st.tuples(st.just("erase"), _WRITERS),
    st.tuples(st.just("reopen")),
    st.tuples(st.just("search")),
)


def _lifecycle_step(
    offset: int, step: tuple[object, ...], written: list[ProjectedRecord]
) -> ProjectedRecord | None:
    kind, pick, whose = str(step[0]), int(str(step[1])), str(step[2])
    if whose == "a node never written":
        node_id, owner = f"mem:never-{pick}", OWNERS[pick % len(OWNERS)]
    elif not written:
        return None
    else:
        target = written[-1 - pick % len(written)]  # the latest first
        node_id, owner = node_of(target), target.record.owner
        if whose == "another owner":
            owner = OWNERS[(OWNERS.index(owner) + 1) % len(OWNERS)]
    builder = {"archive": archived, "restore": restored}.get(kind)
    if builder is None:
        return lifecycle(offset, superseded, node_id, owner=owner, by_node_id="other")
    return lifecycle(offset, builder, node_id, owner=owner)


def _same_as_filtered(model: EdgeVectorModel, offset: int) -> None:
    query = basis(1, offset % 4)
    for owner in OWNERS:
        for include_inactive in (False, True):
            assert model.search(query, owner, None, 30, include_inactive) == filtered(
                model, query, owner, include_inactive, 30
            )


@settings(
    max_examples=80,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(steps=st.lists(_STEP, min_size=1, max_size=24))
def test_every_search_equals_the_filtered_search_after_any_writes(
    tmp_path_factory: pytest.TempPathFactory, steps: list[tuple[object, ...]]
) -> None:
    """Writes, state changes (of a node's owner, another owner's, or a node never
    written), messages written again, erasures and reopenings, searched now and then (so
    writes also land while nothing is known); then searched once more."""
    path = tmp_path_factory.mktemp("tenancy") / "p0"
    written: list[ProjectedRecord] = []
    model = EdgeVectorModel(path, IDENTITY)
    try:
        for offset, step in enumerate(steps):
            kind = step[0]
            item: ProjectedRecord | None = None
            if kind == "reopen":
                model.close()
                model = EdgeVectorModel(path, IDENTITY)
            elif kind == "search":
                _same_as_filtered(model, offset)
            elif kind == "write":
                number = int(str(step[2]))
                item = message(offset, basis(1, number, number % 3), owner=str(step[1]))
                written.append(item)
            elif kind == "resend":
                if written:
                    earlier = written[int(str(step[1])) % len(written)]
                    item = ProjectedRecord(
                        offset=offset,
                        record=earlier.record,
                        node=earlier.node,
                        vector=earlier.vector,
                    )
            elif kind == "erase":
                item = ProjectedRecord(offset=offset, record=erased(f"x{offset}", str(step[1])))
            else:
                item = _lifecycle_step(offset, step, written)
            if item is not None:
                model.apply([item])
        _same_as_filtered(model, len(steps))
    finally:
        model.close()


def test_state_changes_of_nodes_without_a_point_leave_nothing_to_exclude(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node without a vector (never embedded here) archived on a one-owner shard used to
    add an id no point has to the list of points left out, and enough of them made the
    owner's searches filter again."""
    monkeypatch.setattr(vector_tenancy, "EXCLUDED_AT_MOST", 3)
    items = [message(n, basis(1, n)) for n in range(3)]
    with EdgeVectorModel(tmp_path / "p0", IDENTITY) as model:
        model.apply(items)
        model.apply(
            [lifecycle(10 + n, archived, f"mem:{uuid.uuid4()}") for n in range(5)]
            + [lifecycle(20, archived, node_of(items[0]))]
        )
        assert model._tenancy.sole_owner() == "alice"
        assert model._tenancy.inactive == {key(node_of(items[0]))}
        recorder = recorded(model)
        found = model.search(basis(1), "alice", None, 10)
        assert not any(payload_conditions(f) for f in recorder.filters)
    assert set(ids(found)) == {node_of(item) for item in items[1:]}
