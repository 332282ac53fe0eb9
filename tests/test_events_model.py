"""The events read model: every record by event id, with offsets and derived node ids."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from prme.projectors.stores.events import EventsModel
from prme.schemas.records import AnyRecord, Message

from . import record_builders
from .record_builders import archived, cleared, deleted, erased, projected


def msg(event_id: str, owner: str = "alice") -> Message:
    return record_builders.msg(event_id, "hi Caroline", owner, scope="work")


@pytest.fixture
def events(tmp_path: Path) -> Iterator[EventsModel]:
    model = EventsModel(tmp_path / "events.sqlite", partition=3)
    yield model
    model.close()


def test_every_kind_is_recorded_with_its_position(events: EventsModel) -> None:
    records: list[AnyRecord] = [
        msg("e1"),
        cleared("c1"),
        deleted("d1", "e1"),
        archived("a1", "mem:e1"),
    ]
    events.apply(projected(records, start=5))
    row = events.get("e1")
    assert row is not None
    assert (row.event_id, row.partition, row.offset, row.kind) == ("e1", 3, 5, "message")
    assert (row.owner, row.session_id, row.scope) == ("alice", "s1", "work")
    assert row.node_ids == ["mem:e1"]
    assert row.record == records[0]
    assert [r.kind for r in events.by_owner("alice")] == [
        "message",
        "history_cleared",
        "message_deleted",
        "node_archived",
    ]
    assert [r.record for r in events.by_owner("alice")] == records
    assert events.applied_offset() == 8


def test_node_ids_are_derived_nodes_only(events: EventsModel) -> None:
    events.apply(projected([msg("e1"), cleared("c1")]))
    assert events.node_ids("e1") == ["mem:e1"]
    assert events.node_ids("c1") == []
    assert events.node_ids("unknown") == []
    assert events.get("unknown") is None


def test_owner_erased_deletes_only_that_owners_rows(events: EventsModel) -> None:
    events.apply(projected([msg("e1"), msg("e2", owner="bob"), msg("e3")]))
    events.apply(projected([erased("x1")], start=3))
    assert events.by_owner("alice") == []
    assert events.get("e1") is None
    assert events.get("x1") is None
    assert [r.event_id for r in events.by_owner("bob")] == ["e2"]
    assert events.applied_offset() == 3


def test_reapplying_is_harmless(events: EventsModel) -> None:
    batch = projected([msg("e1"), msg("e2")])
    events.apply(batch)
    digest = events.digest()
    events.apply(batch)
    assert events.digest() == digest
    assert len(events.by_owner("alice")) == 2


def test_reopen_keeps_offset_and_data(tmp_path: Path) -> None:
    path = tmp_path / "events.sqlite"
    with EventsModel(path, partition=0) as model:
        model.apply(projected([msg("e1")], start=41))
        digest = model.digest()
    with EventsModel(path, partition=0) as reopened:
        assert reopened.applied_offset() == 41
        assert reopened.digest() == digest
        row = reopened.get("e1")
        assert row is not None and row.offset == 41
