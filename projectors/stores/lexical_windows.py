"""The lexical model's sidecar: message sequences per (owner, session, scope) in SQLite.

Each message's lexical document is its own text plus the text of its neighbours in the
same (owner, session, scope), in log order. A ``history_cleared`` / ``history_replaced``
record is a boundary that windows never cross; a ``message_deleted`` record takes its
target out of the sequence. A deleted message's own document keeps only its own text (no
context), so its content never depends on later records.

Every write is keyed by node id or offset, so replaying records that the sidecar already
holds changes nothing. A document is a pure function of the sidecar's content, which is
what makes a rebuild (in any batching) produce the same index.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import msgspec

from prme.projectors.model import MemoryNode, NodeState

_MAX_OFFSET = 2**63 - 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS messages (
    node_id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    session_id TEXT NOT NULL,
    scope TEXT NOT NULL,
    log_offset INTEGER NOT NULL,
    text TEXT NOT NULL,
    speaker TEXT NOT NULL,
    state TEXT NOT NULL,
    removed INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS messages_sequence
    ON messages (owner, session_id, scope, log_offset);
CREATE TABLE IF NOT EXISTS boundaries (
    owner TEXT NOT NULL,
    session_id TEXT NOT NULL,
    scope TEXT NOT NULL,
    log_offset INTEGER NOT NULL,
    PRIMARY KEY (owner, session_id, scope, log_offset)
);
"""


class SequencePoint(msgspec.Struct, frozen=True):
    """A place in a sequence where something was inserted or removed."""

    owner: str
    session_id: str
    scope: str
    offset: int


class LexicalDocument(msgspec.Struct, frozen=True, kw_only=True):
    """What the index holds for one node."""

    node_id: str
    owner: str
    scope: str
    session_id: str
    state: str
    text: str
    context: str
    speaker: str


class WindowStore:
    """Sequence state in one SQLite file; writes are grouped until :meth:`commit`."""

    def __init__(self, path: Path, *, window_before: int, window_after: int) -> None:
        self._before = max(window_before, 0)
        self._after = max(window_after, 0)
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        self._in_transaction = False

    def _begin(self) -> None:
        if not self._in_transaction:
            self._db.execute("BEGIN IMMEDIATE")
            self._in_transaction = True

    def commit(self) -> None:
        if self._in_transaction:
            self._db.execute("COMMIT")
            self._in_transaction = False

    def rollback(self) -> None:
        if self._in_transaction:
            self._db.execute("ROLLBACK")
            self._in_transaction = False

    def add_message(self, offset: int, node: MemoryNode) -> tuple[SequencePoint, bool]:
        """Insert the message; ``True`` when its row is new (a replay keeps the stored row,
        state included)."""
        self._begin()
        cursor = self._db.execute(
            "INSERT INTO messages (node_id, owner, session_id, scope, log_offset, text, speaker,"
            " state) VALUES (?, ?, ?, ?, ?, ?, ?, 'active') ON CONFLICT (node_id) DO NOTHING",
            (
                node.node_id,
                node.owner,
                node.session_id,
                node.scope,
                offset,
                node.text,
                node.speaker if node.speaker is not None else node.role,
            ),
        )
        point = SequencePoint(node.owner, node.session_id, node.scope, offset)
        return point, cursor.rowcount > 0

    def add_boundary(self, owner: str, session_id: str, scope: str, offset: int) -> SequencePoint:
        self._begin()
        self._db.execute(
            "INSERT OR IGNORE INTO boundaries (owner, session_id, scope, log_offset)"
            " VALUES (?, ?, ?, ?)",
            (owner, session_id, scope, offset),
        )
        return SequencePoint(owner, session_id, scope, offset)

    def remove_message(self, owner: str, node_id: str) -> SequencePoint | None:
        """Take the owner's message out of its sequence; ``None`` when it is unknown."""
        self._begin()
        row = self._db.execute(
            "UPDATE messages SET removed = 1 WHERE node_id = ? AND owner = ?"
            " RETURNING session_id, scope, log_offset",
            (node_id, owner),
        ).fetchone()
        return None if row is None else SequencePoint(owner, row[0], row[1], row[2])

    def set_state(self, owner: str, node_id: str, state: NodeState) -> bool:
        """Change the lifecycle state of the owner's node; ``False`` when it is unknown."""
        self._begin()
        cursor = self._db.execute(
            "UPDATE messages SET state = ? WHERE node_id = ? AND owner = ?",
            (state, node_id, owner),
        )
        return cursor.rowcount > 0

    def erase_owner(self, owner: str) -> None:
        self._begin()
        self._db.execute("DELETE FROM messages WHERE owner = ?", (owner,))
        self._db.execute("DELETE FROM boundaries WHERE owner = ?", (owner,))

    def speakers(self, owner: str) -> list[str]:
        """The distinct speakers (or roles) of the owner's messages that are not deleted."""
        rows = self._db.execute(
            "SELECT DISTINCT speaker FROM messages WHERE owner = ? AND removed = 0"
            " AND speaker != '' ORDER BY speaker",
            (owner,),
        ).fetchall()
        return [row[0] for row in rows]

    def affected(self, points: list[SequencePoint]) -> set[str]:
        """Live messages whose window may include a change at one of ``points``.

        A change at p is in the before-window of the ``window_before`` live messages after
        p and in the after-window of the ``window_after`` live messages before it.
        """
        found: set[str] = set()
        for point in set(points):
            key = (point.owner, point.session_id, point.scope, point.offset)
            found.update(self._live_ids(key, "<", "DESC", self._after))
            found.update(self._live_ids(key, ">", "ASC", self._before))
        return found

    def _live_ids(
        self, key: tuple[str, str, str, int], comparison: str, order: str, limit: int
    ) -> list[str]:
        if limit == 0:
            return []
        rows = self._db.execute(
            "SELECT node_id FROM messages WHERE owner = ? AND session_id = ? AND scope = ?"
            f" AND removed = 0 AND log_offset {comparison} ? ORDER BY log_offset {order}"
            " LIMIT ?",
            (*key, limit),
        ).fetchall()
        return [row[0] for row in rows]

    def document(self, node_id: str) -> LexicalDocument | None:
        """The node's document from the current sequence state; ``None`` when unknown."""
        row = self._db.execute(
            "SELECT owner, session_id, scope, log_offset, text, speaker, state, removed"
            " FROM messages WHERE node_id = ?",
            (node_id,),
        ).fetchone()
        if row is None:
            return None
        owner, session_id, scope, offset, text, speaker, state, removed = row
        context = "" if removed else self._context(owner, session_id, scope, offset)
        return LexicalDocument(
            node_id=node_id,
            owner=owner,
            scope=scope,
            session_id=session_id,
            state=state,
            text=text,
            context=context,
            speaker=speaker,
        )

    def _context(self, owner: str, session_id: str, scope: str, offset: int) -> str:
        key = (owner, session_id, scope)
        low, high = self._db.execute(
            "SELECT"
            " (SELECT MAX(log_offset) FROM boundaries WHERE owner = ? AND session_id = ?"
            "  AND scope = ? AND log_offset < ?),"
            " (SELECT MIN(log_offset) FROM boundaries WHERE owner = ? AND session_id = ?"
            "  AND scope = ? AND log_offset > ?)",
            (*key, offset, *key, offset),
        ).fetchone()
        low = -1 if low is None else low
        high = _MAX_OFFSET if high is None else high
        texts: list[str] = []
        if self._before:
            before = self._db.execute(
                "SELECT text FROM messages WHERE owner = ? AND session_id = ? AND scope = ?"
                " AND removed = 0 AND log_offset > ? AND log_offset < ?"
                " ORDER BY log_offset DESC LIMIT ?",
                (*key, low, offset, self._before),
            ).fetchall()
            texts.extend(row[0] for row in reversed(before))
        if self._after:
            after = self._db.execute(
                "SELECT text FROM messages WHERE owner = ? AND session_id = ? AND scope = ?"
                " AND removed = 0 AND log_offset > ? AND log_offset < ?"
                " ORDER BY log_offset ASC LIMIT ?",
                (*key, offset, high, self._after),
            ).fetchall()
            texts.extend(row[0] for row in after)
        return "\n".join(texts)

    def close(self) -> None:
        self.rollback()
        self._db.close()
