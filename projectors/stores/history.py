"""The history read model: chat histories per (owner, session, scope) with clear, replace
and delete applied, one SQLite file per shard.

Each ``message`` is stored with its log offset (``seq``) and its exact encoded record;
``history_cleared`` and ``history_replaced`` are stored as clear markers (the
replacement's messages are ordinary ``message`` records after the marker);
``message_deleted`` flags its target. A read pages backwards from the newest entry and
stops at the newest clear marker.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any, cast

from prme.schemas.codec import decode_record, encode_record
from prme.schemas.records import (
    HistoryCleared,
    HistoryReplaced,
    Message,
    MessageDeleted,
    OwnerErased,
)

from ..model import ProjectedRecord
from .sqlite_base import SqliteModel, runs

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    event_id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    session_id TEXT NOT NULL,
    scope TEXT NOT NULL,
    seq INTEGER NOT NULL,
    kind TEXT NOT NULL,
    deleted INTEGER NOT NULL DEFAULT 0,
    record BLOB
);
CREATE INDEX IF NOT EXISTS entries_history ON entries (owner, session_id, scope, seq);
"""


class HistoryModel(SqliteModel):
    """Chat histories of one shard (read model ``history``)."""

    name = "history"
    schema = _SCHEMA
    digest_queries = (
        (
            "entries",
            "SELECT event_id, owner, session_id, scope, seq, kind, deleted, record "
            "FROM entries ORDER BY seq, event_id",
        ),
    )

    def __init__(self, path: Path) -> None:
        super().__init__(path)

    def _apply_many(self, cursor: sqlite3.Cursor, items: list[ProjectedRecord]) -> None:
        for batched, run in runs(items, _inserts):
            if batched:
                cursor.executemany(_INSERT, [_row(item) for item in run])
            else:
                self._apply_one(cursor, run[0])

    def _apply_one(self, cursor: sqlite3.Cursor, item: ProjectedRecord) -> None:
        record = item.record
        if _inserts(item):
            cursor.execute(_INSERT, _row(item))
        elif isinstance(record, MessageDeleted):
            cursor.execute(
                "UPDATE entries SET deleted = 1 WHERE event_id = ? AND owner = ? "
                "AND kind = 'message'",
                (record.target_event_id, record.owner),
            )
        elif isinstance(record, OwnerErased):
            cursor.execute("DELETE FROM entries WHERE owner = ?", (record.owner,))

    def messages(
        self, owner: str, session_id: str, scope: str, *, limit: int | None = None
    ) -> list[Message]:
        """The logical history, oldest first: after the newest clear marker, without
        deleted messages; with ``limit``, its last ``limit`` messages."""
        if limit is not None and limit <= 0:
            return []
        newest_first: list[Message] = []
        with self._lock:
            cursor = self._db.execute(
                "SELECT kind, deleted, record FROM entries "
                "WHERE owner = ? AND session_id = ? AND scope = ? ORDER BY seq DESC",
                (owner, session_id, scope),
            )
            try:
                for kind, deleted, data in cursor:
                    if kind == "clear":
                        break
                    if deleted:
                        continue
                    newest_first.append(cast(Message, decode_record(data)))
                    if limit is not None and len(newest_first) >= limit:
                        break
            finally:
                cursor.close()
        newest_first.reverse()
        return newest_first

    def sessions(self, owner: str) -> list[tuple[str, str]]:
        """The owner's ``(session_id, scope)`` pairs that have any history entry."""
        rows = self._query(
            "SELECT DISTINCT session_id, scope FROM entries WHERE owner = ? "
            "ORDER BY session_id, scope",
            (owner,),
        )
        return [(session_id, scope) for session_id, scope in rows]


_INSERT = (
    "INSERT OR IGNORE INTO entries (event_id, owner, session_id, scope, seq, kind, record) "
    "VALUES (?, ?, ?, ?, ?, ?, ?)"
)


def _inserts(item: ProjectedRecord) -> bool:
    """Whether the record adds an entry (a message or a clear marker)."""
    return isinstance(item.record, Message | HistoryCleared | HistoryReplaced)


def _row(item: ProjectedRecord) -> tuple[Any, ...]:
    record = item.record
    if isinstance(record, Message):
        kind, data = "message", item.data if item.data is not None else encode_record(record)
    else:
        kind, data = "clear", None
    return (record.event_id, record.owner, record.session_id, record.scope, item.offset, kind, data)
