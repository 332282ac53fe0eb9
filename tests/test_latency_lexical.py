"""Lexical hits read their node ids from fast fields; ids that do not fit still come back.
An owner alone in its partition is searched without filter clauses, with the same hits."""

from __future__ import annotations

import itertools
import tempfile
import uuid
from pathlib import Path
from unittest import mock

import pytest
import tantivy
import uuid_utils
from hypothesis import event, given, settings
from hypothesis import strategies as st

from prme.projectors.model import ProjectedRecord
from prme.projectors.stores import lexical
from prme.projectors.stores.graph import GraphModel
from prme.projectors.stores.lexical import LexicalModel

from .lexical_contract import legacy_schema
from .record_builders import RecordLog, msg, projected


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
    return legacy_schema(fast_ids=False)


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


_WORDS = ["trip", "paris", "dog", "dogs", "pottery", "camping", "guitar", "running", "runs"]


@st.composite
def _owner_logs(draw: st.DrawFn) -> tuple[RecordLog, list[int]]:
    """A partition where alice holds most documents: some of bob's, some archived or
    superseded, some replaced by later versions (deleted documents), in 1-3 commits."""
    log = RecordLog()
    nodes: list[str] = []
    for _ in range(draw(st.integers(1, 40))):
        owner = draw(st.sampled_from(["alice"] * 6 + ["bob"]))
        text = " ".join(draw(st.lists(st.sampled_from(_WORDS), min_size=1, max_size=6)))
        speaker = draw(st.sampled_from(["Ann", "Dog", None]))
        nodes.append(
            log.message(owner, text, session=draw(st.sampled_from(["a", "b"])), speaker=speaker)
        )
        change = draw(st.sampled_from(["none"] * 4 + ["archive", "supersede", "restore"]))
        target = draw(st.sampled_from(nodes))
        if change == "archive":
            log.archive("alice", target)
        elif change == "supersede":
            log.supersede("alice", target, by_node_id=nodes[-1])
        elif change == "restore":
            log.restore("alice", target)
    cuts = sorted(draw(st.lists(st.integers(0, len(log.records)), max_size=2)))
    return log, cuts


@settings(max_examples=60, deadline=None)
@given(
    _owner_logs(),
    st.lists(st.sampled_from([*_WORDS, "ann", "zebra"]), min_size=1, max_size=5),
    st.sampled_from([1, 3, 10, 100]),
    st.booleans(),
)
def test_an_unfiltered_pruned_search_returns_exactly_the_filtered_hits(
    logged: tuple[RecordLog, list[int]], words: list[str], limit: int, include_inactive: bool
) -> None:
    log, cuts = logged
    fast_paths: list[int] = []
    excluded = lexical._excluded

    def recording(*args: object, **kwargs: object) -> set[tuple[int, int]] | None:
        found = excluded(*args, **kwargs)  # type: ignore[arg-type]
        if found is not None:
            fast_paths.append(len(found))
        return found

    query = " ".join(words)
    with tempfile.TemporaryDirectory() as directory, LexicalModel(Path(directory)) as model:
        for start, end in itertools.pairwise([0, *cuts, len(log.records)]):
            model.apply(log.records[start:end])
        with mock.patch.object(lexical, "_excluded", recording):
            pruned = model.search(query, "alice", None, limit, include_inactive)
        with mock.patch.object(lexical, "_excluded", lambda *args, **kwargs: None):
            filtered = model.search(query, "alice", None, limit, include_inactive)
        parsed = _parsed_search(model, query, include_inactive)
    assert pruned == filtered
    event("unfiltered, pruned" if fast_paths else "filtered")
    # The flat query scores as the parser's nested one does.
    assert {hit.node_id for hit in pruned} <= set(parsed)
    for hit in pruned:
        assert hit.score == pytest.approx(parsed[hit.node_id], rel=1e-5)
    if len(pruned) < limit:
        assert {hit.node_id for hit in pruned} == set(parsed)


def test_the_unfiltered_search_serves_an_owner_alone_and_not_a_shared_partition(
    tmp_path: Path,
) -> None:
    log = RecordLog()
    alone = [log.message("alice", f"dog walk {n}") for n in range(30)]
    log.archive("alice", alone[0])
    taken: list[set[tuple[int, int]] | None] = []
    excluded = lexical._excluded

    def recording(*args: object, **kwargs: object) -> set[tuple[int, int]] | None:
        taken.append(excluded(*args, **kwargs))  # type: ignore[arg-type]
        return taken[-1]

    with (
        LexicalModel(tmp_path / "lexical") as model,
        mock.patch.object(lexical, "_excluded", recording),
    ):
        model.apply(log.records)
        hits = model.search("dog", "alice", None, 10)
        assert alone[0] not in {hit.node_id for hit in hits}
        assert taken[-1] is not None and len(taken[-1]) == 1  # the archived document
        shared = RecordLog()
        for n in range(40):
            shared.message("bob", f"dog park {n}")
        model.apply(projected([r.record for r in shared.records], start=len(log.records)))
        assert model.search("dog", "alice", None, 10)
        assert taken[-1] is None  # bob holds more than half: the filters stay in the query
        assert model.search("dog", "alice", "default", 10)
        assert len(taken) == 2  # a scope filter always stays in the query


def _parsed_search(model: LexicalModel, query: str, include_inactive: bool) -> dict[str, float]:
    """Every hit of the query parser's form of ``query``, filtered: node id -> score."""
    index = model._index
    terms = lexical._TERM.findall(query.lower())
    text, _errors = index.parse_query_lenient(
        " ".join(terms), default_field_names=lexical._SEARCH_FIELDS, field_boosts=model._boosts
    )
    filters = [("owner", "alice")] + ([] if include_inactive else [("state", "active")])
    clauses = [(tantivy.Occur.Must, text)] + [
        (tantivy.Occur.Must, lexical._filter_clause(index.schema, f, v)) for f, v in filters
    ]
    searcher = index.searcher()
    hits = searcher.search(tantivy.Query.boolean_query(clauses), 10_000, count=False).hits
    return {searcher.doc(address)["node_id"][0]: score for score, address in hits}
