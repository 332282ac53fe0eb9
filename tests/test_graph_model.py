"""The graph read model: nodes, edges, lifecycle, search and tracking."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from prme.projectors.model import ProjectedRecord
from prme.projectors.stores.graph import Edge, GraphModel, entity_node_id, session_node_id
from prme.schemas.records import AnyRecord

from .record_builders import (
    AT,
    archived,
    cleared,
    deleted,
    erased,
    msg,
    projected,
    replaced,
    restored,
    superseded,
)


@pytest.fixture
def graph(tmp_path: Path) -> Iterator[GraphModel]:
    with GraphModel(tmp_path / "graph.sqlite") as model:
        yield model


def test_message_creates_memory_node_and_its_edges(graph: GraphModel) -> None:
    graph.apply(projected([msg("e1", "Caroline moved to Berlin"), msg("e2", "Nice weather")]))
    nodes = graph.get_nodes("alice", ["mem:e1", "mem:e2"])
    assert set(nodes) == {"mem:e1", "mem:e2"}
    assert nodes["mem:e1"].state == "active"
    assert nodes["mem:e1"].entities == ["caroline", "berlin"]
    assert nodes["mem:e1"].text == "Caroline moved to Berlin"
    assert nodes["mem:e1"].recorded_at == AT
    session = session_node_id("alice", "default", "s1")
    assert graph.edges_of("alice", "mem:e1") == [
        Edge("mem:e1", "e1", "derived_from"),
        Edge("mem:e1", entity_node_id("alice", "Berlin"), "mentions"),
        Edge("mem:e1", entity_node_id("alice", "caroline"), "mentions"),
        Edge("mem:e1", "mem:e2", "next"),
        Edge("mem:e1", session, "part_of"),
    ]
    assert graph.applied_offset() == 1


def test_next_edges_stay_within_a_session(graph: GraphModel) -> None:
    graph.apply(projected([msg("e1", "one"), msg("e2", "two", session="s2"), msg("e3", "three")]))
    next_edges = [e for e in graph.edges_of("alice", "mem:e3") if e.kind == "next"]
    assert next_edges == [Edge("mem:e1", "mem:e3", "next")]
    assert [e for e in graph.edges_of("alice", "mem:e2") if e.kind == "next"] == []


def test_control_records_never_create_nodes_or_edges(graph: GraphModel) -> None:
    graph.apply(projected([msg("e1", "Caroline moved to Berlin")]))
    before = graph.digest()
    graph.apply(
        projected(
            [
                cleared("c1"),
                deleted("d1", "e1"),
                replaced("r1", 0),
            ],
            start=1,
        )
    )
    assert graph.digest() == before
    assert graph.node_state("alice", "mem:e1") == "active"
    assert graph.get_nodes("alice", ["c1", "d1", "r1", "mem:c1", "mem:d1", "mem:r1"]) == {}
    assert graph.applied_offset() == 3


def test_archive_restore_and_supersede_change_state(graph: GraphModel) -> None:
    graph.apply(
        projected([msg("e1", "Caroline lives in Berlin"), msg("e2", "Caroline lives in Rome")])
    )
    graph.apply(projected([archived("a1", "mem:e1")], start=2))
    assert graph.node_state("alice", "mem:e1") == "archived"
    assert [h.node_id for h in graph.search("alice", None, ["caroline"], 10)] == ["mem:e2"]
    assert {
        h.node_id for h in graph.search("alice", None, ["caroline"], 10, include_inactive=True)
    } == {
        "mem:e1",
        "mem:e2",
    }
    graph.apply(projected([restored("r1", "mem:e1")], start=3))
    assert graph.node_state("alice", "mem:e1") == "active"
    graph.apply(
        projected(
            [superseded("x1", "mem:e1", "mem:e2")],
            start=4,
        )
    )
    assert graph.node_state("alice", "mem:e1") == "superseded"
    assert graph.node_state("alice", "mem:e2") == "active"
    assert Edge("mem:e2", "mem:e1", "supersedes") in graph.edges_of("alice", "mem:e1")
    assert [h.node_id for h in graph.search("alice", None, ["caroline"], 10)] == ["mem:e2"]


def test_lifecycle_records_of_another_owner_change_nothing(graph: GraphModel) -> None:
    graph.apply(projected([msg("e1", "Caroline"), msg("e2", "Rome", owner="bob")]))
    graph.apply(
        projected(
            [
                archived("a1", "mem:e1", owner="bob"),
                superseded("x1", "mem:e1", "mem:e2", owner="bob"),
            ],
            start=2,
        )
    )
    assert graph.node_state("alice", "mem:e1") == "active"
    assert all(edge.kind != "supersedes" for edge in graph.edges_of("alice", "mem:e1"))


def test_nodes_of_other_owners_are_never_returned(graph: GraphModel) -> None:
    graph.apply(
        projected([msg("e1", "Caroline", owner="alice"), msg("e2", "Caroline", owner="bob")])
    )
    assert set(graph.get_nodes("alice", ["mem:e1", "mem:e2"])) == {"mem:e1"}
    assert graph.node_state("alice", "mem:e2") is None
    assert graph.edges_of("alice", "mem:e2") == []
    assert [h.node_id for h in graph.search("alice", None, ["caroline"], 10)] == ["mem:e1"]
    assert [h.node_id for h in graph.search("bob", None, ["Caroline"], 10)] == ["mem:e2"]


def test_search_filters_by_exact_scope(graph: GraphModel) -> None:
    graph.apply(
        projected([msg("e1", "Caroline", scope="work"), msg("e2", "Caroline", scope="work/x")])
    )
    assert [h.node_id for h in graph.search("alice", "work", ["caroline"], 10)] == ["mem:e1"]
    assert {h.node_id for h in graph.search("alice", None, ["caroline"], 10)} == {
        "mem:e1",
        "mem:e2",
    }


def test_search_ranks_direct_hits_by_matched_entities_and_idf(graph: GraphModel) -> None:
    graph.apply(
        projected(
            [
                msg("e1", "Caroline met Melanie", session="a"),
                msg("e2", "Caroline again", session="b"),
                msg("e3", "Caroline once more", session="c"),
                msg("e4", "Melanie alone", session="d"),
                msg("e5", "Nothing here", session="e"),
            ]
        )
    )
    hits = graph.search("alice", None, ["caroline", "melanie"], 10)
    assert [h.node_id for h in hits][:2] == ["mem:e1", "mem:e4"]
    assert {h.node_id for h in hits} == {"mem:e1", "mem:e2", "mem:e3", "mem:e4"}
    assert hits[0].score > hits[1].score > hits[2].score > 0


def test_search_reaches_two_hops_at_lower_score(graph: GraphModel) -> None:
    said = {
        "e1": ("Caroline joined the Pride Parade", "a"),
        "e2": ("The Pride Parade was in June 2023", "b"),
        "e3": ("what a day", "a"),
        "e4": ("Unrelated Tokyo trip", "c"),
    }
    graph.apply(projected([msg(e, text, session=s) for e, (text, s) in said.items()]))
    hits = {h.node_id: h.score for h in graph.search("alice", None, ["Caroline"], 10)}
    assert set(hits) == {"mem:e1", "mem:e2", "mem:e3"}
    assert hits["mem:e1"] > hits["mem:e2"] > 0
    assert hits["mem:e1"] > hits["mem:e3"] > 0
    assert graph.search("alice", None, ["caroline"], 1)[0].node_id == "mem:e1"


def test_search_with_unknown_or_no_entities_is_empty(graph: GraphModel) -> None:
    graph.apply(projected([msg("e1", "Caroline")]))
    assert graph.search("alice", None, [], 10) == []
    assert graph.search("alice", None, ["nobody"], 10) == []
    assert graph.search("carol", None, ["caroline"], 10) == []


def test_owner_erased_removes_only_that_owner(graph: GraphModel) -> None:
    graph.apply(
        projected([msg("e1", "Caroline", owner="alice"), msg("e2", "Caroline", owner="bob")])
    )
    graph.apply(projected([erased("x")], start=2))
    assert graph.get_nodes("alice", ["mem:e1"]) == {}
    assert graph.edges_of("alice", "mem:e1") == []
    assert graph.search("alice", None, ["caroline"], 10) == []
    assert set(graph.get_nodes("bob", ["mem:e2"])) == {"mem:e2"}
    assert len(graph.edges_of("bob", "mem:e2")) == 3


def test_reapplying_a_batch_is_harmless(graph: GraphModel) -> None:
    batch = projected(
        [
            msg("e1", "Caroline moved to Berlin"),
            msg("e2", "Caroline likes Rome"),
            archived("a1", "mem:e1"),
        ]
    )
    graph.apply(batch)
    digest = graph.digest()
    graph.apply(batch)
    graph.apply(batch[:2])
    assert graph.digest() == digest
    assert graph.node_state("alice", "mem:e1") == "archived"
    assert graph.applied_offset() == 2


def test_replaying_into_a_fresh_model_gives_the_same_digest(tmp_path: Path) -> None:
    batch = projected([msg("e1", "Caroline moved to Berlin"), msg("e2", "Melanie in Berlin")])
    with GraphModel(tmp_path / "a.sqlite") as first, GraphModel(tmp_path / "b.sqlite") as second:
        first.apply(batch)
        second.apply(batch[:1])
        second.apply(batch[1:])
        assert first.digest() == second.digest()


def test_reopen_keeps_offset_and_data(tmp_path: Path) -> None:
    path = tmp_path / "graph.sqlite"
    with GraphModel(path) as model:
        assert model.applied_offset() == -1
        model.apply(projected([msg("e1", "Caroline")], start=7))
        digest = model.digest()
    with GraphModel(path) as reopened:
        assert reopened.applied_offset() == 7
        assert reopened.digest() == digest
        assert reopened.node_state("alice", "mem:e1") == "active"


def test_messages_without_a_derived_node_add_nothing(graph: GraphModel) -> None:
    graph.apply([ProjectedRecord(offset=0, record=msg("e1", "Caroline"), node=None)])
    assert graph.get_nodes("alice", ["mem:e1"]) == {}
    assert graph.applied_offset() == 0


def test_hub_entities_are_not_two_hop_bridges(graph: GraphModel) -> None:
    records: list[AnyRecord] = [
        msg(f"h{i}", f"Busy on Monday {i}", session=f"h{i}") for i in range(30)
    ]
    records.append(msg("c1", "Caroline called on Monday", session="c"))
    graph.apply(projected(records))
    assert [h.node_id for h in graph.search("alice", None, ["caroline"], 50)] == ["mem:c1"]
    assert len(graph.search("alice", None, ["monday"], 50)) == 31


def test_match_entities_finds_known_names_in_lower_case_text(graph: GraphModel) -> None:
    graph.apply(
        projected(
            [msg("e1", "Caroline moved to New York for 3 weeks"), msg("b1", "Rome", owner="bob")]
        )
    )
    assert graph.match_entities("alice", "what did caroline do in new york, for 3 weeks?") == [
        "caroline",
        "new york",
        "3 weeks",
    ]
    assert graph.match_entities("alice", "rome") == []
    assert graph.match_entities("alice", "") == []


def test_ids_of_parts_without_a_colon_or_backslash_are_unchanged() -> None:
    """Packs written before ids escaped their parts keep their ids (and digests)."""
    assert entity_node_id("alice", "New  York") == "ent:alice:new york"
    assert session_node_id("alice", "default", "s1") == "ses:alice:default:s1"


def test_a_colon_in_an_owner_or_name_never_joins_another_owners_entity(
    graph: GraphModel,
) -> None:
    """Entity ids were ``ent:<owner>:<name>``: owner ``acme`` naming "alice:report" and
    owner ``acme:alice`` naming "report" (one partition) shared one node. The one who wrote
    second lost the entity from its own searches, the other's writes changed the first's
    graph scores (which a retrieve's receipt shows), and erasing one deleted the other's
    entity."""
    graph.apply(projected([msg("e1", 'Filed "alice:report"', owner="acme"), msg("e2", "x")]))
    before = graph.search("acme", None, ["alice:report"], 10)
    assert [h.node_id for h in before] == ["mem:e1"]
    graph.apply(projected([msg("e3", 'Filed the "report"', owner="acme:alice")], start=2))
    assert graph.search("acme", None, ["alice:report"], 10) == before
    assert [h.node_id for h in graph.search("acme:alice", None, ["report"], 10)] == ["mem:e3"]
    assert graph.match_entities("acme:alice", "where is the report") == ["report"]
    assert entity_node_id("acme", "alice:report") != entity_node_id("acme:alice", "report")
    graph.apply(projected([erased("x1", owner="acme")], start=3))
    assert [h.node_id for h in graph.search("acme:alice", None, ["report"], 10)] == ["mem:e3"]
    assert graph.match_entities("acme:alice", "the report") == ["report"]


def test_a_colon_in_an_owner_scope_or_session_never_joins_another_session(
    graph: GraphModel,
) -> None:
    graph.apply(
        projected(
            [
                msg("e1", "one", owner="acme:alice", scope="default", session="s1"),
                msg("e2", "two", owner="acme", scope="alice", session="default:s1"),
                msg("e3", "three", owner="acme", scope="alice:default", session="s1"),
            ]
        )
    )
    sessions = {
        node_id: edge.dst
        for node_id, owner in (("mem:e1", "acme:alice"), ("mem:e2", "acme"), ("mem:e3", "acme"))
        for edge in graph.edges_of(owner, node_id)
        if edge.kind == "part_of"
    }
    assert len(set(sessions.values())) == 3, sessions
    assert sessions["mem:e1"] == session_node_id("acme:alice", "default", "s1")
    assert sessions["mem:e2"] == session_node_id("acme", "alice", "default:s1")


def _old_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ids a graph wrote before ``GRAPH_FORMAT``: parts joined by ':' as they were."""
    from prme.projectors.entities import normalise_entity
    from prme.projectors.stores import graph as module

    monkeypatch.setattr(
        module, "entity_node_id", lambda owner, name: f"ent:{owner}:{normalise_entity(name)}"
    )
    monkeypatch.setattr(
        module, "session_node_id", lambda owner, scope, session: f"ses:{owner}:{scope}:{session}"
    )


def _written_before_the_format(path: Path, batches: list[list[AnyRecord]]) -> str:
    """A graph file as the code before ``GRAPH_FORMAT`` left it; its digest."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        _old_ids(monkeypatch)
        with GraphModel(path) as old:
            start = 0
            for batch in batches:
                old.apply(projected(batch, start=start))
                start += len(batch)
            digest = old.digest()
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA user_version = 0")
    db.close()
    return digest


def test_a_graph_written_before_ids_were_escaped_is_rekeyed_as_a_replay_would_build_it(
    tmp_path: Path,
) -> None:
    batches: list[list[AnyRecord]] = [
        [
            msg("e1", 'Filed "alice:report" with Caroline', owner="acme"),
            msg("e2", 'Filed the "report" with Caroline', owner="acme:alice"),
            msg("e3", "Rome trip", owner="acme", scope="alice", session="default:s1"),
            msg("e4", "Rome again", owner="acme:alice", scope="default", session="s1"),
            msg("e5", 'A "back\\slash" in Oslo', owner="b\\ob", session="x\\:y"),
            msg("e6", "Caroline lives in Berlin"),
        ],
        [erased("x1", owner="acme")],  # left acme:alice's edges to acme's nodes dangling
        [msg("e7", 'The "report" is due', owner="acme:alice")],
    ]
    old_path = tmp_path / "old.sqlite"
    _written_before_the_format(old_path, batches)
    fresh_path = tmp_path / "fresh.sqlite"
    with GraphModel(fresh_path) as fresh:
        fresh.apply(projected([r for batch in batches for r in batch]))
        expected = fresh.digest()
    with GraphModel(old_path) as reopened:
        assert reopened.digest() == expected
        assert reopened.applied_offset() == 7
        hits = reopened.search("acme:alice", None, ["report"], 10)
        assert {"mem:e2", "mem:e7"} <= {h.node_id for h in hits}
    with GraphModel(old_path) as again:  # once: the file now says its format
        assert again.digest() == expected


def test_a_graph_whose_ids_need_no_escaping_is_left_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / "graph.sqlite"
    before = _written_before_the_format(
        path, [[msg("e1", "Caroline moved to Berlin"), msg("e2", "Rome", owner="bob")]]
    )
    with GraphModel(path) as reopened:
        assert reopened.digest() == before
