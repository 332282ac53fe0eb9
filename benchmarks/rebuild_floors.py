"""The floors of ``benchmarks.rebuild``: a pack's content written straight into fresh
engines, in a child process of its own.

The content (every point with its vector as Python floats, every document, every SQLite
row) is read back once and kept for the whole run; held in the benchmark's process it
made the rebuilds timed there 3-5 s slower at 100k (the workers spent ~15 % more CPU), so
the child holds it and writes one round of floors per ``run`` line on its stdin, printing
their seconds as one JSON line.

    python -m benchmarks.rebuild_floors PACK_DIR WORK_DIR
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sqlite3
import sys
import time
import uuid
from pathlib import Path
from types import TracebackType
from typing import Any

import tantivy
from qdrant_edge import Distance, EdgeConfig, EdgeShard, EdgeVectorParams, Point, UpdateOperation

from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider
from prme.projectors.stores.lexical import LexicalModel, create_index, document_fields
from prme.projectors.stores.vector_base import point_id
from prme.projectors.stores.vector_edge import EdgeVectorModel

DIMENSION = 384
VECTOR_CHUNK = 4096
SQLITE_FILES = {
    "graph": "graph/graph.sqlite3",
    "history": "history/history.sqlite3",
    "events": "events/events.sqlite3",
    "lexical_sidecar": "lexical/windows.sqlite3",
}


class Content:
    """What the pack's read models hold, read back once, to write straight into engines."""

    def __init__(self, data: Path) -> None:
        self.points: list[list[tuple[uuid.UUID, list[float], dict[str, Any]]]] = []
        self.documents: list[list[dict[str, Any]]] = []
        self.tables: dict[str, list[tuple[str, list[str], list[tuple[Any, ...]]]]] = {}
        shards = sorted(p for p in (data / "shards").iterdir() if p.is_dir())
        identity = HashedBagOfWordsProvider(dimension=DIMENSION)
        for shard in shards:
            vector = EdgeVectorModel(shard / "vector", _identity(identity))
            try:
                self.points.append(
                    [
                        (
                            uuid.UUID(point_id(str(p.payload["node_id"]))),
                            p.vector,
                            dict(p.payload),
                        )
                        for p in vector._points()
                    ]
                )
            finally:
                vector.close()
            lexical = LexicalModel(shard / "lexical")
            try:
                self.documents.append(
                    [document_fields(document) for document in lexical.documents()]
                )
            finally:
                lexical.close()
            for name, relative in SQLITE_FILES.items():
                self.tables.setdefault(name, []).extend(_tables(shard / relative))
        self.records = sum(len(points) for points in self.points)


def _identity(provider: HashedBagOfWordsProvider) -> Any:
    from prme.projectors.embeddings.validation import identity_of

    return identity_of(provider)


def _tables(path: Path) -> list[tuple[str, list[str], list[tuple[Any, ...]]]]:
    """(schema SQL, index SQLs, rows) of every table of the file."""
    db = sqlite3.connect(path)
    try:
        found = []
        for name, sql in db.execute(
            "SELECT name, sql FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite%'"
        ).fetchall():
            indexes = [
                row[0]
                for row in db.execute(
                    "SELECT sql FROM sqlite_master WHERE type = 'index' AND tbl_name = ? "
                    "AND sql IS NOT NULL",
                    (name,),
                )
            ]
            found.append((sql, indexes, db.execute(f"SELECT * FROM {name}").fetchall()))
        return found
    finally:
        db.close()


def floor_vector(content: Content, work: Path) -> float:
    started = time.perf_counter()
    for index, points in enumerate(content.points):
        path = work / f"vector-{index}"
        path.mkdir(parents=True)
        params = EdgeVectorParams(size=DIMENSION, distance=Distance.Cosine)
        shard = EdgeShard.create(str(path), EdgeConfig(vectors=params))
        try:
            for start in range(0, len(points), VECTOR_CHUNK):
                chunk = [Point(i, v, p) for i, v, p in points[start : start + VECTOR_CHUNK]]
                shard.update(UpdateOperation.upsert_points(chunk))
        finally:
            shard.close()
    return time.perf_counter() - started


def floor_lexical(content: Content, work: Path) -> float:
    started = time.perf_counter()
    for index, documents in enumerate(content.documents):
        path = work / f"lexical-{index}"
        path.mkdir(parents=True)
        index_ = create_index(path)
        writer = index_.writer(heap_size=48_000_000, num_threads=1)
        for fields in documents:
            writer.add_document(tantivy.Document(**fields))
        writer.commit()
        writer.wait_merging_threads()
    return time.perf_counter() - started


def floor_sqlite(content: Content, work: Path) -> dict[str, float]:
    seconds: dict[str, float] = {}
    for name, tables in content.tables.items():
        started = time.perf_counter()
        for index, (schema, indexes, rows) in enumerate(tables):
            db = sqlite3.connect(work / f"{name}-{index}.sqlite3", isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute(schema)
            for sql in indexes:
                db.execute(sql)
            if rows:
                marks = ",".join("?" * len(rows[0]))
                table = schema.split("(")[0].split()[-1]
                db.execute("BEGIN IMMEDIATE")
                db.executemany(f"INSERT INTO {table} VALUES ({marks})", rows)
                db.execute("COMMIT")
            db.close()
        seconds[name] = time.perf_counter() - started
    return seconds


def floors_once(content: Content, work: Path) -> dict[str, float]:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    seconds = {"vector": floor_vector(content, work), "lexical": floor_lexical(content, work)}
    seconds.update(floor_sqlite(content, work))
    seconds["sum"] = sum(seconds.values())
    shutil.rmtree(work, ignore_errors=True)
    return seconds


class FloorWriter:
    """The child process holding a pack's content: ``await writer.once()`` writes one
    round of floors and returns their seconds; ``records`` is the pack's point count."""

    def __init__(self, data: Path, work: Path) -> None:
        self._arguments = [sys.executable, "-m", "benchmarks.rebuild_floors", str(data), str(work)]
        self._child: asyncio.subprocess.Process | None = None
        self.records = 0

    async def __aenter__(self) -> FloorWriter:
        self._child = await asyncio.create_subprocess_exec(
            *self._arguments,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            cwd=Path(__file__).resolve().parents[1],  # where `benchmarks` imports from
        )
        self.records = int((await self._line())["records"])
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        child, self._child = self._child, None
        if child is None:
            return
        assert child.stdin is not None
        child.stdin.close()
        try:
            await asyncio.wait_for(child.wait(), 60)
        except TimeoutError:
            child.kill()
            await child.wait()

    async def once(self) -> dict[str, float]:
        assert self._child is not None and self._child.stdin is not None
        self._child.stdin.write(b"run\n")
        await self._child.stdin.drain()
        return {key: float(value) for key, value in (await self._line()).items()}

    async def _line(self) -> dict[str, Any]:
        assert self._child is not None and self._child.stdout is not None
        line = await self._child.stdout.readline()
        if not line:
            code = await self._child.wait()
            raise RuntimeError(f"the floors process exited with {code}")
        found: dict[str, Any] = json.loads(line)
        return found


def serve(data: Path, work: Path) -> None:
    content = Content(data)
    print(json.dumps({"records": content.records}), flush=True)
    for line in sys.stdin:
        if line.strip() == "run":
            print(json.dumps(floors_once(content, work)), flush=True)


if __name__ == "__main__":
    serve(Path(sys.argv[1]), Path(sys.argv[2]))
