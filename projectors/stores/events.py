"""The events read model: every record of one partition by event id, with where it sits
on the log and the node ids it derived (provenance and audit), one SQLite file per shard.

``owner_erased`` deletes the owner's rows, the erasure record's own row included; the
log keeps the audit trail.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from prme.schemas.codec import decode_record, encode_record
from prme.schemas.records import AnyRecord, OwnerErased, kind_of

from ..model import ProjectedRecord
from .sqlite_base import SqliteModel, rows_in, runs

_SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    event_id TEXT PRIMARY KEY,
    partition INTEGER NOT NULL,
    offset INTEGER NOT NULL,
    kind TEXT NOT NULL,
    owner TEXT NOT NULL,
    session_id TEXT NOT NULL,
    scope TEXT NOT NULL,
    recorded_at TEXT NOT NULL,
    node_ids TEXT NOT NULL,
    record BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS events_owner ON events (owner, offset);
"""
_INSERT = (
    "INSERT INTO events (event_id, partition, offset, kind, owner, session_id, scope, "
    "recorded_at, node_ids, record) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
    "ON CONFLICT(event_id) DO NOTHING"
)


class EventRow(msgspec.Struct, frozen=True, kw_only=True):
    event_id: str
    partition: int
    offset: int
    kind: str
    owner: str
    session_id: str
    scope: str
    node_ids: list[str]
    record: AnyRecord


class EventsModel(SqliteModel):
    """Every record of one partition (read model ``events``)."""

    name = "events"
    schema = _SCHEMA
    digest_queries = (
        (
            "events",
            "SELECT event_id, partition, offset, kind, owner, session_id, scope, recorded_at, "
            "node_ids, record FROM events ORDER BY offset, event_id",
        ),
    )

    def __init__(self, path: Path, partition: int) -> None:
        self.partition = partition
        super().__init__(path)

    def _apply_many(self, cursor: sqlite3.Cursor, items: list[ProjectedRecord]) -> None:
        for batched, run in runs(items, lambda item: not isinstance(item.record, OwnerErased)):
            if batched:
                cursor.executemany(_INSERT, [self._row(item) for item in run])
            else:
                self._apply_one(cursor, run[0])

    def _apply_one(self, cursor: sqlite3.Cursor, item: ProjectedRecord) -> None:
        if isinstance(item.record, OwnerErased):
            cursor.execute("DELETE FROM events WHERE owner = ?", (item.record.owner,))
        else:
            cursor.execute(_INSERT, self._row(item))

    def _row(self, item: ProjectedRecord) -> tuple[Any, ...]:
        record = item.record
        node_ids = [item.node.node_id] if item.node is not None else []
        return (
            record.event_id,
            self.partition,
            item.offset,
            kind_of(record),
            record.owner,
            record.session_id,
            record.scope,
            record.recorded_at.isoformat(),
            json.dumps(node_ids),
            item.data if item.data is not None else encode_record(record),
        )

    def first_copies(self, event_ids: Sequence[str]) -> dict[str, tuple[int, str]]:
        """``(offset, owner)`` of each of ``event_ids`` this model holds."""
        rows = rows_in(
            self._query,
            "SELECT event_id, offset, owner FROM events WHERE event_id IN ({marks})",
            list(dict.fromkeys(event_ids)),
        )
        return {event_id: (offset, owner) for event_id, offset, owner in rows}

    def first_records(self, event_ids: Sequence[str]) -> dict[str, tuple[int, AnyRecord]]:
        """``(offset, record)`` of each of ``event_ids`` this model holds (its first copy)."""
        rows = rows_in(
            self._query,
            "SELECT event_id, offset, record FROM events WHERE event_id IN ({marks})",
            list(dict.fromkeys(event_ids)),
        )
        return {event_id: (offset, decode_record(data)) for event_id, offset, data in rows}

    def get(self, event_id: str) -> EventRow | None:
        rows = self._query(f"SELECT {_COLUMNS} FROM events WHERE event_id = ?", (event_id,))
        return _row(rows[0]) if rows else None

    def node_ids(self, event_id: str) -> list[str]:
        rows = self._query("SELECT node_ids FROM events WHERE event_id = ?", (event_id,))
        return list(json.loads(rows[0][0])) if rows else []

    def by_owner(self, owner: str) -> list[EventRow]:
        """The owner's events in log order."""
        rows = self._query(
            f"SELECT {_COLUMNS} FROM events WHERE owner = ? ORDER BY offset", (owner,)
        )
        return [_row(row) for row in rows]


_COLUMNS = ", ".join(EventRow.__struct_fields__)
"""The ``events`` columns an :class:`EventRow` is read from, in its field order."""


def _row(row: tuple[Any, ...]) -> EventRow:
    fields = dict(zip(EventRow.__struct_fields__, row, strict=True))
    fields["node_ids"] = json.loads(fields["node_ids"])
    fields["record"] = decode_record(fields["record"])
    return EventRow(**fields)
