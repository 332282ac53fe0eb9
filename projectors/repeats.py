"""Records that repeat an event: each read model applies an event once, the first copy.

A write sent with a ``request_id`` has an event id derived from it
(``producer.request_event_id``). A retry the log cannot deduplicate (sent through another
process, or after a restart, on Kafka) reaches the log again as the same event at a later
offset. Left to the models, such a copy would re-activate a memory archived since, add
graph edges and lexical boundaries, or (a request id reused for other content) mix two
texts. So the shard drops it before any model sees it.

"Already applied" is what the shard's events model holds (event id, offset, owner). A
staged shard without an events model (a rebuild of other models) replays its partition
from offset 0 and notes the request-carrying events it applies in ``first_copies.sqlite3``
in its own directory: the staging directory, which every staged shard of that rebuild
(a worker's, then the parent's that applies the rest) opens, and which goes with it. A
copy at the offset its first copy was applied at is a replay after a crash, and is kept.
An erasure forgets the owner's events, so a write after it is new again.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from pathlib import Path

from prme.producers.sqlite_files import connect_wal
from prme.schemas.records import OwnerErased

from .model import ProjectedRecord
from .stores.sqlite_base import rows_in

FirstCopy = tuple[int, str]
"""``(offset, owner)`` of an event's first copy."""
Lookup = Callable[[Sequence[str]], dict[str, FirstCopy]]
"""The first copy of each given event id already applied (``EventsModel.first_copies``)."""
FILE_NAME = "first_copies.sqlite3"


class FirstCopies:
    """Drops the later copies of an event from a shard's batches (use on the shard's
    thread)."""

    def __init__(self, directory: Path) -> None:
        """``directory``: the shard's, where a shard without an events model keeps what it
        applied."""
        self._path = directory / FILE_NAME
        self._db: sqlite3.Connection | None = None

    def keep(
        self, projected: list[ProjectedRecord], lookup: Lookup | None
    ) -> list[ProjectedRecord]:
        """``projected`` without the records whose event was applied at an earlier offset
        (by ``lookup``, by this shard's own notes without one, or earlier in the batch)."""
        erased = [p.record.owner for p in projected if isinstance(p.record, OwnerErased)]
        ids = [p.record.event_id for p in projected if p.record.request_id]
        if not ids:
            if erased and lookup is None:
                self._forget(erased)
            return projected
        known = lookup(ids) if lookup is not None else self._lookup(ids)
        kept: list[ProjectedRecord] = []
        firsts: list[tuple[str, int, str]] = []
        for item in projected:
            record = item.record
            if isinstance(record, OwnerErased):
                known = {i: first for i, first in known.items() if first[1] != record.owner}
                firsts = [first for first in firsts if first[2] != record.owner]
                if lookup is None:
                    self._forget([record.owner])
            elif record.request_id:
                first = known.get(record.event_id)
                if first is not None and first[0] < item.offset:
                    continue
                known[record.event_id] = (item.offset, record.owner)
                firsts.append((record.event_id, item.offset, record.owner))
            kept.append(item)
        if lookup is None and firsts:
            self._note(firsts)
        return kept

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            db = connect_wal(self._path, timeout_s=5.0)
            db.execute("PRAGMA synchronous=OFF")  # a rebuild's scratch: it starts over anyway
            db.executescript(
                "CREATE TABLE IF NOT EXISTS first_copies (event_id TEXT PRIMARY KEY, "
                "offset INTEGER NOT NULL, owner TEXT NOT NULL);"
                "CREATE INDEX IF NOT EXISTS first_copies_owner ON first_copies (owner);"
            )
            self._db = db
        return self._db

    def _lookup(self, ids: Sequence[str]) -> dict[str, FirstCopy]:
        if self._db is None and not self._path.exists():
            return {}
        rows = rows_in(
            self._connection().execute,
            "SELECT event_id, offset, owner FROM first_copies WHERE event_id IN ({marks})",
            list(dict.fromkeys(ids)),
        )
        return {event_id: (offset, owner) for event_id, offset, owner in rows}

    def _note(self, firsts: list[tuple[str, int, str]]) -> None:
        db = self._connection()
        db.execute("BEGIN")
        db.executemany("INSERT OR IGNORE INTO first_copies VALUES (?, ?, ?)", firsts)
        db.execute("COMMIT")

    def _forget(self, owners: list[str]) -> None:
        if self._db is None and not self._path.exists():
            return
        db = self._connection()
        db.execute("BEGIN")
        db.executemany("DELETE FROM first_copies WHERE owner = ?", [(o,) for o in owners])
        db.execute("COMMIT")
