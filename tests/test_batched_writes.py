"""The SQLite read models write a batch with ``executemany`` runs; the content must be what
applying the same records one at a time gives (the rule the batched code replaced),
whatever the mix: repeated event ids, deletes, clears, lifecycle changes, erasures."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from prme.projectors.model import ProjectedRecord
from prme.projectors.stores.events import EventsModel
from prme.projectors.stores.graph import GraphModel
from prme.projectors.stores.history import HistoryModel
from prme.projectors.stores.sqlite_base import SqliteModel, transaction, write_offset
from prme.schemas.codec import encode_record
from prme.schemas.records import (
    AnyRecord,
    HistoryCleared,
    HistoryReplaced,
    MessageDeleted,
    NodeArchived,
    NodeRestored,
    NodeSuperseded,
    OwnerErased,
)
from tests.record_builders import AT, msg, projected

NAMES = ("Caroline", "Melanie", "Berlin", "Oscar", "May 7, 2023", "$20", "New York")


def _log(seed: int, count: int) -> list[AnyRecord]:
    rng = random.Random(seed)
    records: list[AnyRecord] = []
    messages: list[tuple[str, str]] = []
    for index in range(count):
        owner = rng.choice(("alice", "bob", "carol"))
        session = rng.choice(("s1", "s2"))
        roll = rng.random()
        base = {"owner": owner, "session_id": session, "scope": "default", "recorded_at": AT}
        if roll < 0.70 or not messages:
            if messages and rng.random() < 0.08:  # the same event appended twice
                event_id, text = rng.choice(messages)
            else:
                event_id = f"01900000-0000-7000-8000-{index:012d}"
                words = rng.sample(NAMES, rng.randint(0, 3))
                text = f"{' and '.join(words)} met at the river {rng.randint(1, 9)} km away"
                messages.append((event_id, text))
            records.append(msg(event_id, text, owner=owner, session=session))
            continue
        event_id = f"01900000-0000-7000-9000-{index:012d}"
        target, _ = rng.choice(messages)
        node = f"mem:{target}"
        other = f"mem:{rng.choice(messages)[0]}"
        choices: list[AnyRecord] = [
            MessageDeleted(event_id=event_id, target_event_id=target, **base),
            HistoryCleared(event_id=event_id, **base),
            HistoryReplaced(event_id=event_id, message_count=0, **base),
            NodeArchived(event_id=event_id, node_id=node, **base),
            NodeRestored(event_id=event_id, node_id=node, **base),
            NodeSuperseded(event_id=event_id, node_id=node, by_node_id=other, **base),
        ]
        if roll > 0.98:
            choices = [OwnerErased(event_id=event_id, **base)]
        records.append(rng.choice(choices))
    return records


def _one_by_one(model: SqliteModel, batch: list[ProjectedRecord]) -> None:
    with transaction(model._db) as cursor:
        for item in batch:
            model._apply_one(cursor, item)
        write_offset(cursor, model.name, batch[-1].offset)


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("model_type", [GraphModel, HistoryModel, EventsModel])
def test_batched_apply_writes_what_one_record_at_a_time_writes(
    tmp_path: Path, seed: int, model_type: type[SqliteModel]
) -> None:
    def open_model(name: str) -> SqliteModel:
        path = tmp_path / f"{name}.sqlite3"
        return EventsModel(path, 3) if model_type is EventsModel else model_type(path)  # type: ignore[call-arg]

    batch = [
        ProjectedRecord(
            offset=item.offset, record=item.record, node=item.node, data=encode_record(item.record)
        )
        for item in projected(_log(seed, 400))
    ]
    reference, batched = open_model("reference"), open_model("batched")
    try:
        for start in range(0, len(batch), 97):
            chunk = batch[start : start + 97]
            _one_by_one(reference, chunk)
            batched.apply(chunk)
        assert batched.applied_offset() == reference.applied_offset() == len(batch) - 1
        assert batched.digest() == reference.digest()
    finally:
        reference.close()
        batched.close()
