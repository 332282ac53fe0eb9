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

import bisect
from pathlib import Path
from typing import Any

import msgspec

from prme.producers.sqlite_files import connect_wal
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
        self._db = connect_wal(path, timeout_s=5.0)
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA secure_delete=ON")
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

    def checkpoint(self) -> None:
        """Copy the WAL into the file and truncate it (after an erasure)."""
        self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

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
            key = (point.owner, point.session_id, point.scope)
            found.update(self._live_near(key, point.offset, "<", self._after, "node_id"))
            found.update(self._live_near(key, point.offset, ">", self._before, "node_id"))
        return found

    def _live_near(
        self, key: tuple[str, str, str], offset: int, comparison: str, limit: int, column: str
    ) -> list[Any]:
        """``column`` of the ``limit`` live messages nearest ``offset`` on the
        ``comparison`` side of it (``"<"``: before it, ``">"``: after it), nearest first."""
        if limit == 0:
            return []
        order = "DESC" if comparison == "<" else "ASC"
        rows = self._db.execute(
            f"SELECT {column} FROM messages WHERE owner = ? AND session_id = ? AND scope = ?"
            f" AND removed = 0 AND log_offset {comparison} ? ORDER BY log_offset {order}"
            " LIMIT ?",
            (*key, offset, limit),
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
        return _document(node_id, (owner, session_id, scope), text, speaker, state, context)

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
        before = self._live_texts(key, low, offset, "DESC", self._before)
        after = self._live_texts(key, offset, high, "ASC", self._after)
        return "\n".join([*reversed(before), *after])

    def _live_texts(
        self, key: tuple[str, str, str], low: int, high: int, order: str, limit: int
    ) -> list[str]:
        """Texts of at most ``limit`` live messages strictly between ``low`` and ``high``,
        taken from the ``ASC`` (low) or ``DESC`` (high) end."""
        if limit == 0:
            return []
        rows = self._db.execute(
            "SELECT text FROM messages WHERE owner = ? AND session_id = ? AND scope = ?"
            f" AND removed = 0 AND log_offset > ? AND log_offset < ? ORDER BY log_offset {order}"
            " LIMIT ?",
            (*key, low, high, limit),
        ).fetchall()
        return [row[0] for row in rows]

    def documents_for(
        self, changed: set[str], points: list[SequencePoint]
    ) -> dict[str, LexicalDocument | None]:
        """The documents of ``changed`` and of ``affected(points)``: what
        :meth:`document` gives for each, read with a few queries per sequence instead of
        several per node.

        Per sequence the anchors (points and changed rows) are cut into clusters; each
        cluster loads the live messages and boundaries from ``before + after`` live
        messages below its lowest anchor to as many above its highest. Every window that
        touches an anchor lies inside that slice, and a boundary outside it cannot cut a
        window inside it."""
        rows = self._rows(changed)
        found: dict[str, LexicalDocument | None] = dict.fromkeys(changed)
        anchors: dict[tuple[str, str, str], set[int]] = {}
        wanted: dict[tuple[str, str, str], set[int]] = {}
        for point in points:
            key = (point.owner, point.session_id, point.scope)
            anchors.setdefault(key, set()).add(point.offset)
            wanted.setdefault(key, set()).add(point.offset)
        for node_id, (
            owner,
            session_id,
            scope,
            offset,
            text,
            speaker,
            state,
            removed,
        ) in rows.items():
            key = (owner, session_id, scope)
            anchors.setdefault(key, set()).add(offset)
            if removed:
                found[node_id] = _document(node_id, key, text, speaker, state, "")
        for key, offsets in anchors.items():
            for cluster in _clusters(sorted(offsets)):
                self._documents_in(key, cluster, wanted.get(key, set()), rows, found)
        return found

    def _rows(self, node_ids: set[str]) -> dict[str, tuple[Any, ...]]:
        rows: dict[str, tuple[Any, ...]] = {}
        ids = sorted(node_ids)
        for start in range(0, len(ids), 500):
            chunk = ids[start : start + 500]
            marks = ",".join("?" * len(chunk))
            for row in self._db.execute(
                "SELECT node_id, owner, session_id, scope, log_offset, text, speaker, state, "
                f"removed FROM messages WHERE node_id IN ({marks})",
                chunk,
            ):
                rows[row[0]] = row[1:]
        return rows

    def _documents_in(
        self,
        key: tuple[str, str, str],
        cluster: list[int],
        points: set[int],
        rows: dict[str, tuple[Any, ...]],
        found: dict[str, LexicalDocument | None],
    ) -> None:
        reach = self._before + self._after
        low = min([cluster[0], *self._live_near(key, cluster[0], "<", reach, "log_offset")])
        high = max([cluster[-1], *self._live_near(key, cluster[-1], ">", reach, "log_offset")])
        live = self._db.execute(
            "SELECT node_id, log_offset, text, speaker, state FROM messages WHERE owner = ?"
            " AND session_id = ? AND scope = ? AND removed = 0 AND log_offset BETWEEN ? AND ?"
            " ORDER BY log_offset",
            (*key, low, high),
        ).fetchall()
        bounds = [
            row[0]
            for row in self._db.execute(
                "SELECT log_offset FROM boundaries WHERE owner = ? AND session_id = ?"
                " AND scope = ? AND log_offset BETWEEN ? AND ? ORDER BY log_offset",
                (*key, low, high),
            )
        ]
        offsets = [row[1] for row in live]
        position = {row[0]: index for index, row in enumerate(live)}
        first, last = cluster[0], cluster[-1]
        # Only this cluster's own anchors: a changed node near the slice's edge belongs to
        # another cluster, whose slice reaches far enough around it.
        dirty = {row[0] for row in live if row[0] in rows and first <= row[1] <= last}
        for point in points:
            if not first <= point <= last:
                continue
            at = bisect.bisect_left(offsets, point)
            after_point = at + 1 if at < len(offsets) and offsets[at] == point else at
            dirty.update(row[0] for row in live[max(at - self._after, 0) : at])
            dirty.update(row[0] for row in live[after_point : after_point + self._before])
        for node_id in dirty:
            index = position[node_id]
            offset = offsets[index]
            cut = bisect.bisect_left(bounds, offset)
            floor = bounds[cut - 1] if cut > 0 else -1
            ceiling = bounds[cut] if cut < len(bounds) else _MAX_OFFSET
            texts = (
                [row[2] for row in live[max(index - self._before, 0) : index] if row[1] > floor]
                if self._before
                else []
            )
            if self._after:
                texts.extend(
                    row[2] for row in live[index + 1 : index + 1 + self._after] if row[1] < ceiling
                )
            _, _, text, speaker, state = live[index]
            found[node_id] = _document(node_id, key, text, speaker, state, "\n".join(texts))

    def close(self) -> None:
        self.rollback()
        self._db.close()


CLUSTER_GAP = 4096
"""Anchors of one sequence further apart than this many log offsets load separate slices
(a delete deep in a long session does not load everything up to the newest message)."""


def _clusters(offsets: list[int]) -> list[list[int]]:
    clusters: list[list[int]] = []
    for offset in offsets:
        if clusters and offset - clusters[-1][-1] <= CLUSTER_GAP:
            clusters[-1].append(offset)
        else:
            clusters.append([offset])
    return clusters


def _document(
    node_id: str, key: tuple[str, str, str], text: str, speaker: str, state: str, context: str
) -> LexicalDocument:
    owner, session_id, scope = key
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
