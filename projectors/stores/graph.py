"""The graph read model: memory, entity and session nodes and their edges, one SQLite file
per shard.

A ``message`` record with a derived node adds the memory node, a ``derived_from`` edge to
its event, ``mentions`` edges to entity nodes (``ent:<owner>:<name>``), a ``part_of``
edge to its session node (``ses:<owner>:<scope>:<session>``) and a ``next`` edge from the
session's previous memory node. Each part of those ids has its ``\\`` and ``:`` escaped
(``\\\\``, ``\\:``), so no two (owner, name) or (owner, scope, session) share an id: an
owner ``acme`` naming "alice:report" and an owner ``acme:alice`` naming "report" shared one
node before (``GRAPH_FORMAT``). Lifecycle records change a memory node's state;
``owner_erased`` deletes the owner's nodes and edges; control records change nothing.

``search`` scores memory nodes within two hops of the query's entities:

* 1 hop: a node mentioning query entities scores the sum of their idf weights,
  ``ln(1 + (N - df + 0.5) / (df + 0.5))`` (``N`` memory nodes of the owner, ``df`` of
  them mentioning the entity, kept as the entity node's ``degree``);
* 2 hops, each at half weight: entities co-mentioned with a query entity (the
  ``CO_ENTITIES`` most frequent) add their idf to the nodes mentioning them, and a
  ``next`` neighbour of one of the ``NEXT_EXPANSION`` best 1-hop nodes adds that node's
  1-hop score. Hub entities (mentioned by more than ``HUB_MIN_DEGREE`` nodes and
  ``HUB_FRACTION`` of the owner's nodes) are never bridges: they would pull in everything.

Every statement filters by owner, scope and state in SQL.
"""

from __future__ import annotations

import json
import math
import sqlite3
from collections import defaultdict
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import msgspec

from prme.schemas.records import (
    Message,
    NodeArchived,
    NodeRestored,
    NodeSuperseded,
    OwnerErased,
)

from ..entities import normalise_entity
from ..model import MemoryNode, NodeState, ProjectedRecord
from .sqlite_base import SqliteModel, rows_in, runs, transaction

EdgeKind = Literal["derived_from", "mentions", "part_of", "supersedes", "next"]
HOP_DECAY = 0.5
CO_ENTITIES = 32
HUB_MIN_DEGREE = 20
HUB_FRACTION = 0.05
NEXT_EXPANSION = 50
MAX_ENTITY_WORDS = 6


class StoredNode(MemoryNode, frozen=True, kw_only=True):
    """A memory node as the graph holds it, with its lifecycle state."""

    state: NodeState = "active"


class Edge(msgspec.Struct, frozen=True):
    src: str
    dst: str
    kind: EdgeKind


class GraphHit(msgspec.Struct, frozen=True):
    node_id: str
    score: float


GRAPH_FORMAT = 1
"""``PRAGMA user_version`` of a graph file whose entity and session ids escape their parts
(``id_part``). A file written before (0) is re-keyed when it is opened (``_rekey``)."""


def id_part(text: str) -> str:
    """One part of a composite node id, ``\\`` and ``:`` escaped (``\\\\``, ``\\:``): the
    parts of an id can be told apart whatever they hold, and a part with neither is
    unchanged (so are the ids, and the digests, of packs whose ids have neither)."""
    if ":" not in text and "\\" not in text:
        return text
    return text.replace("\\", "\\\\").replace(":", "\\:")


def entity_node_id(owner: str, name: str) -> str:
    return f"ent:{id_part(owner)}:{id_part(normalise_entity(name))}"


def session_node_id(owner: str, scope: str, session_id: str) -> str:
    return f"ses:{id_part(owner)}:{id_part(scope)}:{id_part(session_id)}"


_SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (
    node_id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    kind TEXT NOT NULL,
    scope TEXT,
    session_id TEXT,
    node_type TEXT,
    state TEXT NOT NULL DEFAULT 'active',
    text TEXT NOT NULL DEFAULT '',
    speaker TEXT,
    role TEXT,
    event_id TEXT,
    recorded_at TEXT,
    occurred_at TEXT,
    content_hash TEXT,
    entities TEXT,
    seq INTEGER,
    degree INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS nodes_owner ON nodes (owner, kind, scope, state);
CREATE INDEX IF NOT EXISTS nodes_session ON nodes (owner, scope, session_id, kind, seq);
CREATE TABLE IF NOT EXISTS edges (
    src TEXT NOT NULL,
    dst TEXT NOT NULL,
    kind TEXT NOT NULL,
    owner TEXT NOT NULL,
    PRIMARY KEY (src, dst, kind)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS edges_dst ON edges (dst, kind, src);
CREATE INDEX IF NOT EXISTS edges_owner ON edges (owner);
"""

_NODE_COLUMNS = (
    "node_id, owner, session_id, scope, node_type, state, text, speaker, role, event_id, "
    "recorded_at, occurred_at, content_hash, entities"
)


class GraphModel(SqliteModel):
    """Nodes and edges of one shard (read model ``graph``)."""

    name = "graph"
    schema = _SCHEMA
    digest_queries = (
        (
            "nodes",
            "SELECT node_id, owner, kind, scope, session_id, node_type, state, text, speaker, "
            "role, event_id, recorded_at, occurred_at, content_hash, entities, seq, degree "
            "FROM nodes ORDER BY node_id",
        ),
        ("edges", "SELECT src, dst, kind, owner FROM edges ORDER BY src, dst, kind"),
    )

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        with self._lock:
            if self._db.execute("PRAGMA user_version").fetchone()[0] < GRAPH_FORMAT:
                with transaction(self._db) as cursor:
                    _rekey(cursor)
                    cursor.execute(f"PRAGMA user_version = {GRAPH_FORMAT}")

    def _apply_many(self, cursor: sqlite3.Cursor, items: list[ProjectedRecord]) -> None:
        for batched, run in runs(items, _adds_node):
            if batched:
                _add_memory_nodes(cursor, run)
            else:
                self._apply_one(cursor, run[0])

    def _apply_one(self, cursor: sqlite3.Cursor, item: ProjectedRecord) -> None:
        record = item.record
        if isinstance(record, Message):
            if item.node is not None:
                _add_memory_node(cursor, item.node, item.offset)
        elif isinstance(record, NodeArchived):
            _set_state(cursor, record.owner, record.node_id, "archived")
        elif isinstance(record, NodeRestored):
            _set_state(cursor, record.owner, record.node_id, "active")
        elif isinstance(record, NodeSuperseded):
            _supersede(cursor, record)
        elif isinstance(record, OwnerErased):
            cursor.execute("DELETE FROM edges WHERE owner = ?", (record.owner,))
            cursor.execute("DELETE FROM nodes WHERE owner = ?", (record.owner,))

    def get_nodes(self, owner: str, node_ids: list[str]) -> dict[str, StoredNode]:
        """The owner's memory nodes among ``node_ids`` (others' nodes are never returned).

        Looked up by primary key: the unary ``+`` keeps SQLite from choosing the owner
        index, which would scan every node of the owner (10 ms at 40k nodes)."""
        rows = rows_in(
            self._query,
            f"SELECT {_NODE_COLUMNS} FROM nodes WHERE node_id IN ({{marks}}) "
            "AND +owner = ? AND +kind = 'memory'",
            node_ids,
            owner,
        )
        return {row[0]: _stored_node(row) for row in rows}

    def node_state(self, owner: str, node_id: str) -> str | None:
        rows = self._query(
            "SELECT state FROM nodes WHERE node_id = ? AND owner = ? AND kind = 'memory'",
            (node_id, owner),
        )
        return rows[0][0] if rows else None

    def edges_of(self, owner: str, node_id: str) -> list[Edge]:
        """Every edge of the owner that starts or ends at ``node_id``."""
        rows = self._query(
            "SELECT src, dst, kind FROM edges WHERE owner = ? AND src = ? "
            "UNION SELECT src, dst, kind FROM edges WHERE owner = ? AND dst = ? "
            "ORDER BY kind, src, dst",
            (owner, node_id, owner, node_id),
        )
        return [Edge(src, dst, kind) for src, dst, kind in rows]

    def match_entities(self, owner: str, text: str) -> list[str]:
        """The owner's known entity names that occur in ``text`` as whole words, whatever
        their case (``what did caroline do`` finds ``caroline``), in first-seen order."""
        words = [word.strip(".,!?;:()\"'“”‘’") for word in text.casefold().split()]
        words = [word for word in words if word]
        phrases = list(
            dict.fromkeys(
                " ".join(words[start : start + size])
                for start in range(len(words))
                for size in range(1, MAX_ENTITY_WORDS + 1)
                if start + size <= len(words)
            )
        )
        rows = rows_in(
            self._query,
            "SELECT text FROM nodes WHERE node_id IN ({marks}) AND owner = ? "
            "AND kind = 'entity' AND degree > 0",
            [entity_node_id(owner, phrase) for phrase in phrases],
            owner,
        )
        found = {row[0] for row in rows}
        return [phrase for phrase in phrases if phrase in found]

    def search(
        self,
        owner: str,
        scope: str | None,
        entities: list[str],
        limit: int,
        include_inactive: bool = False,
    ) -> list[GraphHit]:
        """Memory nodes within two hops of ``entities`` (names, normalised here), best first."""
        query_ids = list(dict.fromkeys(entity_node_id(owner, name) for name in entities))
        if not query_ids or limit <= 0:
            return []
        with self._lock:
            search = _Search(self._db, owner, scope, include_inactive)
            return search.run(query_ids, limit)


class _Search:
    """One graph search: every SQL statement filters by owner, scope and state.

    ``CROSS JOIN`` pins the join order (edges first, by their indexes): without table
    statistics SQLite would otherwise scan all the owner's nodes first.
    """

    def __init__(
        self, db: sqlite3.Connection, owner: str, scope: str | None, include_inactive: bool
    ) -> None:
        self._db = db
        self._owner = owner
        self._filter = "n.owner = ? AND n.kind = 'memory'"
        self._params: list[Any] = [owner]
        if scope is not None:
            self._filter += " AND n.scope = ?"
            self._params.append(scope)
        if not include_inactive:
            self._filter += " AND n.state = 'active'"

    def run(self, query_ids: list[str], limit: int) -> list[GraphHit]:
        total = self._db.execute(
            "SELECT COUNT(*) FROM nodes WHERE owner = ? AND kind = 'memory'", [self._owner]
        ).fetchone()[0]
        degrees = self._degrees(query_ids)
        if not degrees:
            return []
        hub = max(HUB_MIN_DEGREE, HUB_FRACTION * total)
        direct = self._mentioning({e: _idf(df, total) for e, df in degrees.items()})
        scores: dict[str, float] = defaultdict(float, direct)
        sources = [entity for entity, df in degrees.items() if df <= hub]
        co_degrees = self._co_mentioned(sources, query_ids, hub)
        co_weights = {e: _idf(df, total) for e, df in co_degrees.items()}
        for node_id, score in self._mentioning(co_weights).items():
            scores[node_id] += HOP_DECAY * score
        best_direct = dict(sorted(direct.items(), key=lambda item: -item[1])[:NEXT_EXPANSION])
        for node_id, score in self._next_neighbours(best_direct).items():
            scores[node_id] += HOP_DECAY * score
        ranked = sorted(scores.items(), key=lambda item: (-item[1], item[0]))
        return [GraphHit(node_id, score) for node_id, score in ranked[:limit]]

    def _degrees(self, entity_ids: list[str]) -> dict[str, int]:
        """How many memory nodes of the owner mention each entity (all scopes and states)."""
        marks = ",".join("?" * len(entity_ids))
        rows = self._db.execute(
            f"SELECT node_id, degree FROM nodes WHERE node_id IN ({marks}) "
            "AND owner = ? AND kind = 'entity' AND degree > 0",
            [*entity_ids, self._owner],
        ).fetchall()
        return dict(rows)

    def _mentioning(self, weights: dict[str, float]) -> dict[str, float]:
        if not weights:
            return {}
        scores: dict[str, float] = defaultdict(float)
        for entity, node_id in self._edges_from(list(weights), "mentions", "dst", "src"):
            scores[node_id] += weights[entity]
        return scores

    def _edges_from(
        self, ids: list[str], kind: EdgeKind, end: str, other: str
    ) -> list[tuple[str, str]]:
        """``(id, node)`` for each ``kind`` edge whose ``end`` column is one of ``ids`` and
        whose ``other`` column is a node the filter admits."""
        marks = ",".join("?" * len(ids))
        return self._db.execute(
            f"SELECT e.{end}, e.{other} FROM edges e CROSS JOIN nodes n ON n.node_id = e.{other} "
            f"WHERE e.kind = '{kind}' AND e.{end} IN ({marks}) AND {self._filter}",
            [*ids, *self._params],
        ).fetchall()

    def _co_mentioned(self, sources: list[str], query_ids: list[str], hub: float) -> dict[str, int]:
        """The entities most often mentioned together with ``sources`` (hubs left out)."""
        if not sources:
            return {}
        source_marks = ",".join("?" * len(sources))
        query_marks = ",".join("?" * len(query_ids))
        rows = self._db.execute(
            "SELECT e2.dst, ent.degree, COUNT(*) AS together FROM edges e1 "
            "CROSS JOIN nodes n ON n.node_id = e1.src "
            "CROSS JOIN edges e2 ON e2.src = e1.src AND e2.kind = 'mentions' "
            "CROSS JOIN nodes ent ON ent.node_id = e2.dst "
            f"WHERE e1.kind = 'mentions' AND e1.dst IN ({source_marks}) "
            f"AND e2.dst NOT IN ({query_marks}) AND ent.degree <= ? AND {self._filter} "
            "GROUP BY e2.dst ORDER BY together DESC, e2.dst LIMIT ?",
            [*sources, *query_ids, hub, *self._params, CO_ENTITIES],
        ).fetchall()
        return {entity: degree for entity, degree, _ in rows}

    def _next_neighbours(self, direct: dict[str, float]) -> dict[str, float]:
        if not direct:
            return {}
        best: dict[str, float] = defaultdict(float)
        ids = list(direct)
        for start in range(0, len(ids), 500):
            chunk = ids[start : start + 500]
            rows = self._edges_from(chunk, "next", "src", "dst")
            rows += self._edges_from(chunk, "next", "dst", "src")
            for hit, other in rows:
                best[other] = max(best[other], direct[hit])
        return best


def _idf(df: int, total: int) -> float:
    return math.log(1.0 + max(total - df + 0.5, 0.5) / (df + 0.5))


_UPSERT_NODE = (
    "INSERT INTO nodes (node_id, owner, kind, scope, session_id, node_type, state, text, "
    "speaker, role, event_id, recorded_at, occurred_at, content_hash, entities, seq) "
    "VALUES (?, ?, 'memory', ?, ?, ?, 'active', ?, ?, ?, ?, ?, ?, ?, ?, ?) "
    "ON CONFLICT(node_id) DO UPDATE SET node_type = excluded.node_type, "
    "text = excluded.text, speaker = excluded.speaker, role = excluded.role, "
    "content_hash = excluded.content_hash, entities = excluded.entities"
)


def _node_row(node: MemoryNode, seq: int) -> tuple[Any, ...]:
    """The ``nodes`` row of a memory node, in the column order of its INSERT."""
    return (
        node.node_id,
        node.owner,
        node.scope,
        node.session_id,
        node.node_type,
        node.text,
        node.speaker,
        node.role,
        node.event_id,
        node.recorded_at.isoformat(),
        node.occurred_at.isoformat() if node.occurred_at else None,
        node.content_hash,
        json.dumps(node.entities),
        seq,
    )


def _add_memory_node(cursor: sqlite3.Cursor, node: MemoryNode, seq: int) -> None:
    owner = node.owner
    cursor.execute(_UPSERT_NODE, _node_row(node, seq))
    _add_edge(cursor, node.node_id, node.event_id, "derived_from", owner)
    session_id = session_node_id(owner, node.scope, node.session_id)
    cursor.execute(
        "INSERT OR IGNORE INTO nodes (node_id, owner, kind, scope, session_id, text) "
        "VALUES (?, ?, 'session', ?, ?, ?)",
        (session_id, owner, node.scope, node.session_id, node.session_id),
    )
    _add_edge(cursor, node.node_id, session_id, "part_of", owner)
    for name in node.entities:
        entity_id = entity_node_id(owner, name)
        cursor.execute(
            "INSERT OR IGNORE INTO nodes (node_id, owner, kind, text) VALUES (?, ?, 'entity', ?)",
            (entity_id, owner, normalise_entity(name)),
        )
        if _add_edge(cursor, node.node_id, entity_id, "mentions", owner):
            cursor.execute("UPDATE nodes SET degree = degree + 1 WHERE node_id = ?", (entity_id,))
    previous = cursor.execute(
        "SELECT node_id FROM nodes WHERE owner = ? AND scope = ? AND session_id = ? "
        "AND kind = 'memory' AND seq < ? ORDER BY seq DESC LIMIT 1",
        (owner, node.scope, node.session_id, seq),
    ).fetchone()
    if previous is not None:
        _add_edge(cursor, previous[0], node.node_id, "next", owner)


def _adds_node(item: ProjectedRecord) -> bool:
    return isinstance(item.record, Message) and item.node is not None


_INSERT_EDGE = "INSERT OR IGNORE INTO edges (src, dst, kind, owner) VALUES (?, ?, ?, ?)"


def _add_memory_nodes(cursor: sqlite3.Cursor, run: list[ProjectedRecord]) -> None:
    """``_add_memory_node`` for a run of message records, with one ``executemany`` per
    statement: the same rows, edges and degrees as adding them one by one.

    A node's ``next`` edge comes from the newest memory node of its session with a lower
    ``seq``. Every stored node has a lower ``seq`` than this run's offsets (the model
    applies only records past its stored offset), so that is the previous node of the
    session added in this run or, before the first, the session's newest stored one. A
    node id stored already keeps its ``seq`` (the upsert leaves it), so it never becomes
    the newest."""
    nodes = [(item.node, item.offset) for item in run if item.node is not None]
    ids = list(dict.fromkeys(node.node_id for node, _ in nodes))
    stored: set[str] = set()
    mentioned: set[tuple[str, str]] = set()
    for start in range(0, len(ids), 500):
        chunk = ids[start : start + 500]
        marks = ",".join("?" * len(chunk))
        stored.update(
            row[0]
            for row in cursor.execute(
                f"SELECT node_id FROM nodes WHERE node_id IN ({marks})", chunk
            )
        )
        mentioned.update(
            cursor.execute(
                f"SELECT src, dst FROM edges WHERE kind = 'mentions' AND src IN ({marks})", chunk
            ).fetchall()
        )
    node_rows: list[tuple[Any, ...]] = []
    edges: list[tuple[str, str, str, str]] = []
    sessions: dict[str, tuple[str, str, str, str]] = {}
    entities: dict[str, tuple[str, str]] = {}
    degrees: dict[str, int] = defaultdict(int)
    newest: dict[tuple[str, str, str], str | None] = {}
    nexts: list[tuple[str, str, str, str]] = []
    for node, seq in nodes:
        owner = node.owner
        node_rows.append(_node_row(node, seq))
        edges.append((node.node_id, node.event_id, "derived_from", owner))
        session_id = session_node_id(owner, node.scope, node.session_id)
        sessions.setdefault(session_id, (session_id, owner, node.scope, node.session_id))
        edges.append((node.node_id, session_id, "part_of", owner))
        for name in node.entities:
            entity_id = entity_node_id(owner, name)
            entities.setdefault(entity_id, (owner, normalise_entity(name)))
            if (node.node_id, entity_id) not in mentioned:
                mentioned.add((node.node_id, entity_id))
                degrees[entity_id] += 1
                edges.append((node.node_id, entity_id, "mentions", owner))
        key = (owner, node.scope, node.session_id)
        if key not in newest:
            row = cursor.execute(
                "SELECT node_id FROM nodes WHERE owner = ? AND scope = ? AND session_id = ? "
                "AND kind = 'memory' AND seq < ? ORDER BY seq DESC LIMIT 1",
                (*key, seq),
            ).fetchone()
            newest[key] = None if row is None else row[0]
        previous = newest[key]
        if previous is not None:
            nexts.append((previous, node.node_id, "next", owner))
        if node.node_id not in stored:
            stored.add(node.node_id)
            newest[key] = node.node_id
    cursor.executemany(_UPSERT_NODE, node_rows)
    cursor.executemany(
        "INSERT OR IGNORE INTO nodes (node_id, owner, kind, scope, session_id, text) "
        "VALUES (?, ?, 'session', ?, ?, ?)",
        [(sid, owner, scope, session, session) for sid, owner, scope, session in sessions.values()],
    )
    cursor.executemany(
        "INSERT OR IGNORE INTO nodes (node_id, owner, kind, text) VALUES (?, ?, 'entity', ?)",
        [(entity_id, owner, text) for entity_id, (owner, text) in entities.items()],
    )
    cursor.executemany(_INSERT_EDGE, edges)
    cursor.executemany(_INSERT_EDGE, nexts)
    cursor.executemany(
        "UPDATE nodes SET degree = degree + ? WHERE node_id = ?",
        [(count, entity_id) for entity_id, count in degrees.items()],
    )


def _add_edge(cursor: sqlite3.Cursor, src: str, dst: str, kind: EdgeKind, owner: str) -> bool:
    """Add the edge unless it exists; whether it was added."""
    cursor.execute(
        "INSERT OR IGNORE INTO edges (src, dst, kind, owner) VALUES (?, ?, ?, ?)",
        (src, dst, kind, owner),
    )
    return cursor.rowcount == 1


def _set_state(cursor: sqlite3.Cursor, owner: str, node_id: str, state: NodeState) -> int:
    cursor.execute(
        "UPDATE nodes SET state = ? WHERE node_id = ? AND owner = ? AND kind = 'memory'",
        (state, node_id, owner),
    )
    return cursor.rowcount


def _supersede(cursor: sqlite3.Cursor, record: NodeSuperseded) -> None:
    """The node leaves retrieval, as the vector and lexical models mark it, whatever
    ``by_node_id`` names (the producer refuses a node superseding itself, but the log may
    hold one); the ``supersedes`` edge only joins two distinct nodes of the owner."""
    _set_state(cursor, record.owner, record.node_id, "superseded")
    found = cursor.execute(
        "SELECT COUNT(*) FROM nodes WHERE owner = ? AND kind = 'memory' AND node_id IN (?, ?)",
        (record.owner, record.node_id, record.by_node_id),
    ).fetchone()[0]
    if found == 2 and record.node_id != record.by_node_id:
        _add_edge(cursor, record.by_node_id, record.node_id, "supersedes", record.owner)


_OLD_FORMAT = "(instr({id}, '\\') > 0 OR length({id}) - length(replace({id}, ':', '')) != {colons})"
"""An id an older graph wrote that is not what ``entity_node_id`` (2 colons) or
``session_node_id`` (3) now make: a part held a ``:`` or a ``\\``."""


def _rekey(cursor: sqlite3.Cursor) -> None:
    """Give the entity and session nodes of a graph written before ``GRAPH_FORMAT`` their
    escaped ids, as a replay of the log would: each edge to one is re-pointed from its own
    owner and name (the rest of the old id after ``ent:<owner>:``) or its memory node's
    scope and session, and the nodes are made again from the edges, with their degrees
    counted anew (a node two owners shared becomes one per owner). Nodes whose parts hold
    neither character, almost always all of them, are not touched."""
    mentions = cursor.execute(
        "SELECT src, dst, owner FROM edges WHERE kind = 'mentions' AND "
        + _OLD_FORMAT.format(id="dst", colons=2)
    ).fetchall()
    sessions = cursor.execute(
        "SELECT e.src, e.dst, e.owner, n.scope, n.session_id FROM edges e "
        "JOIN nodes n ON n.node_id = e.src WHERE e.kind = 'part_of' AND "
        + _OLD_FORMAT.format(id="e.dst", colons=3)
    ).fetchall()
    if not mentions and not sessions:
        return
    stale: list[tuple[str, str, str]] = []
    edges: list[tuple[str, str, str, str]] = []
    entities: dict[str, tuple[str, str]] = {}
    for src, dst, owner in mentions:
        name = dst.removeprefix(f"ent:{owner}:")  # the id was made from the edge's owner
        entity_id = entity_node_id(owner, name)
        entities[entity_id] = (owner, normalise_entity(name))
        stale.append((src, dst, "mentions"))
        edges.append((src, entity_id, "mentions", owner))
    session_nodes: dict[str, tuple[str, str, str, str]] = {}
    for src, dst, owner, scope, session in sessions:
        session_id = session_node_id(owner, scope, session)
        session_nodes[session_id] = (session_id, owner, scope, session)
        stale.append((src, dst, "part_of"))
        edges.append((src, session_id, "part_of", owner))
    cursor.executemany("DELETE FROM edges WHERE src = ? AND dst = ? AND kind = ?", stale)
    cursor.execute(
        "DELETE FROM nodes WHERE (kind = 'entity' AND "
        + _OLD_FORMAT.format(id="node_id", colons=2)
        + ") OR (kind = 'session' AND "
        + _OLD_FORMAT.format(id="node_id", colons=3)
        + ")"
    )
    cursor.executemany(_INSERT_EDGE, edges)
    cursor.executemany(
        "INSERT OR REPLACE INTO nodes (node_id, owner, kind, text, degree) "
        "VALUES (?, ?, 'entity', ?, "
        "(SELECT COUNT(*) FROM edges WHERE dst = ? AND kind = 'mentions'))",
        [(entity_id, owner, text, entity_id) for entity_id, (owner, text) in entities.items()],
    )
    cursor.executemany(
        "INSERT OR REPLACE INTO nodes (node_id, owner, kind, scope, session_id, text) "
        "VALUES (?, ?, 'session', ?, ?, ?)",
        [
            (sid, owner, scope, session, session)
            for sid, owner, scope, session in session_nodes.values()
        ],
    )


def _stored_node(row: tuple[Any, ...]) -> StoredNode:
    fields = dict(zip(_NODE_COLUMNS.split(", "), row, strict=True))
    recorded_at, occurred_at = fields.pop("recorded_at"), fields.pop("occurred_at")
    entities = fields.pop("entities")
    return StoredNode(
        **fields,
        recorded_at=datetime.fromisoformat(recorded_at),
        occurred_at=datetime.fromisoformat(occurred_at) if occurred_at else None,
        entities=json.loads(entities) if entities else [],
    )
