"""Lexical hits read their node ids from fast fields; ids that do not fit still come back."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import tantivy
import uuid_utils
from hypothesis import given, settings
from hypothesis import strategies as st

from prme.projectors.model import ProjectedRecord
from prme.projectors.stores import lexical
from prme.projectors.stores.graph import GraphModel
from prme.projectors.stores.lexical import LexicalModel

from .record_builders import msg, projected


def message(offset: int, event_id: str, text: str, owner: str = "alice") -> ProjectedRecord:
    return projected([msg(event_id, text, owner)], start=offset)[0]


def batch() -> list[ProjectedRecord]:
    ids = [str(uuid_utils.uuid7()) for _ in range(3)]
    return [
        message(0, ids[0], "the garden tomatoes are ripe"),
        message(1, ids[1], "tomatoes again for dinner"),
        message(2, "not-a-uuid", "tomatoes in the soup"),
        message(3, ids[2].upper(), "tomatoes and basil"),
        message(4, str(uuid_utils.uuid7()), "tomatoes for bob", owner="bob"),
    ]


def expected_ids(records: list[ProjectedRecord], owner: str) -> set[str]:
    return {r.node.node_id for r in records if r.node is not None and r.node.owner == owner}


def test_search_returns_the_exact_node_ids_whatever_their_form(tmp_path: Path) -> None:
    records = batch()
    with LexicalModel(tmp_path / "lexical") as model:
        model.apply(records)
        hits = model.search("tomatoes", "alice", None, 10)
    assert {hit.node_id for hit in hits} == expected_ids(records, "alice")
    assert len(hits) == 4


def test_ranking_is_the_same_with_and_without_the_id_fast_fields(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    records = batch()
    with LexicalModel(tmp_path / "fast") as model:
        model.apply(records)
        fast = model.search("garden tomatoes dinner", "alice", None, 10)
        fast_digest = model.digest()
    monkeypatch.setattr(lexical, "_schema", _schema_without_id_columns)
    with LexicalModel(tmp_path / "stored") as model:
        model.apply(records)
        stored = model.search("garden tomatoes dinner", "alice", None, 10)
        stored_digest = model.digest()
    assert fast == stored
    assert fast_digest == stored_digest


def test_an_index_built_before_the_id_fast_fields_still_opens_and_searches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    records = batch()
    with monkeypatch.context() as patch:
        patch.setattr(lexical, "_schema", _schema_without_id_columns)
        with LexicalModel(tmp_path / "lexical") as model:
            model.apply(records[:2])
    with LexicalModel(tmp_path / "lexical") as model:
        assert model.applied_offset() == 1
        model.apply(records)
        hits = model.search("tomatoes", "alice", None, 10)
    assert {hit.node_id for hit in hits} == expected_ids(records, "alice")


def test_get_nodes_looks_nodes_up_by_id_and_keeps_owner_and_kind_filters(tmp_path: Path) -> None:
    records = batch()
    graph = GraphModel(tmp_path / "graph.sqlite3")
    statements: list[str] = []
    try:
        graph.apply(records)
        wanted = [r.node.node_id for r in records if r.node is not None]
        graph._db.set_trace_callback(statements.append)
        found = graph.get_nodes("alice", [*wanted, "ses:alice:default:s1", "mem:missing"])
        graph._db.set_trace_callback(None)
        assert set(found) == expected_ids(records, "alice")
        assert all(node.owner == "alice" for node in found.values())
        lookups = [sql for sql in statements if sql.lstrip().upper().startswith("SELECT")]
        plan = " ".join(
            str(row[-1])
            for sql in lookups
            for row in graph._db.execute("EXPLAIN QUERY PLAN " + sql).fetchall()
        )
    finally:
        graph.close()
    # By primary key, not by the owner index (which scans every node of the owner).
    assert lookups
    assert "nodes_owner" not in plan
    assert "sqlite_autoindex_nodes_1" in plan


def _schema_without_id_columns() -> tantivy.Schema:
    """The lexical schema as it was before the id fast fields."""
    return lexical._document_fields().build()


@settings(max_examples=300, deadline=None)
@given(st.uuids())
def test_an_id_read_back_from_its_fast_fields_is_the_canonical_uuid(value: uuid.UUID) -> None:
    node_id = f"mem:{value}"
    columns = lexical._id_columns(node_id)
    assert lexical._node_id_of(columns["node_id_high"], columns["node_id_low"]) == node_id


@pytest.mark.parametrize(
    "value", ["00000000-0000-0000-0000-000000000000", "ffffffff-ffff-ffff-ffff-ffffffffffff"]
)
def test_the_extreme_ids_survive_the_signed_halves(value: str) -> None:
    columns = lexical._id_columns(f"mem:{value}")
    assert lexical._node_id_of(columns["node_id_high"], columns["node_id_low"]) == f"mem:{value}"
    assert lexical._node_id_of(None, 1) is None
