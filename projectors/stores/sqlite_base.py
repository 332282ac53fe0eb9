"""What the SQLite read models share: opening a file in WAL mode, one write transaction
per batch with the tracking row (``applied``), and a canonical content digest.

A model writes its rows and ``applied(model, offset)`` in the same transaction, so after
a crash it holds either the whole batch and its offset or neither. Records at or below
the stored offset are skipped on re-apply; the writes are upserts keyed by ids as well.
"""

from __future__ import annotations

import hashlib
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, ClassVar, Self

import msgspec

from prme.producers.sqlite_files import connect_wal

from ..model import ModelName, ProjectedRecord

_TRACKING_SCHEMA = "CREATE TABLE IF NOT EXISTS applied (model TEXT PRIMARY KEY, offset INTEGER)"
_digest_encoder = msgspec.msgpack.Encoder()


def open_database(path: Path) -> sqlite3.Connection:
    """Open (creating) the SQLite file at ``path`` in WAL mode, in autocommit mode so
    transactions are explicit, usable from any thread (callers serialise access)."""
    connection = connect_wal(path, timeout_s=5.0)
    # NORMAL in WAL mode may lose the newest commits on power loss, but data and tracking
    # row are lost together, so replaying the log from the stored offset repairs it.
    connection.execute("PRAGMA synchronous=NORMAL")
    connection.execute("PRAGMA foreign_keys=OFF")
    # Deleted rows are overwritten, so an erased owner's text does not stay in free pages.
    connection.execute("PRAGMA secure_delete=ON")
    connection.execute(_TRACKING_SCHEMA)
    return connection


def checkpoint(connection: sqlite3.Connection) -> None:
    """Copy the WAL into the database file and truncate the WAL to zero bytes."""
    connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")


@contextmanager
def transaction(connection: sqlite3.Connection) -> Iterator[sqlite3.Cursor]:
    """One write transaction: committed when the block ends, rolled back if it raises."""
    cursor = connection.cursor()
    cursor.execute("BEGIN IMMEDIATE")
    try:
        yield cursor
    except BaseException:
        cursor.execute("ROLLBACK")
        raise
    else:
        cursor.execute("COMMIT")
    finally:
        cursor.close()


def read_offset(connection: sqlite3.Connection | sqlite3.Cursor, model: str) -> int:
    """The offset stored for ``model`` (``-1`` when none)."""
    row = connection.execute("SELECT offset FROM applied WHERE model = ?", (model,)).fetchone()
    return -1 if row is None else int(row[0])


def stored_offset_of(path: Path, model: str) -> int:
    """The offset ``model`` stored in the SQLite file at ``path``, read without opening
    the model (``-1`` when the file or its row is missing or unreadable)."""
    if not path.is_file():
        return -1
    try:
        connection = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=5)
        try:
            return read_offset(connection, model)
        finally:
            connection.close()
    except sqlite3.Error:
        return -1


def write_offset(cursor: sqlite3.Cursor, model: str, offset: int) -> None:
    """Store ``offset`` for ``model`` (inside the caller's transaction)."""
    cursor.execute(
        "INSERT INTO applied (model, offset) VALUES (?, ?) "
        "ON CONFLICT(model) DO UPDATE SET offset = excluded.offset",
        (model, offset),
    )


def digest_rows(connection: sqlite3.Connection, queries: Sequence[tuple[str, str]]) -> str:
    """The sha256 of the rows each ``(label, query)`` returns, in the query's order.

    Every query must have an ``ORDER BY`` that makes its row order total.
    """
    digest = hashlib.sha256()
    for label, query in queries:
        digest.update(_digest_encoder.encode(label))
        for row in connection.execute(query):
            digest.update(_digest_encoder.encode(list(row)))
        digest.update(b"\x00end")
    return digest.hexdigest()


class LockedDatabase:
    """A SQLite connection (``_db``) that every use takes ``_lock`` for; closed by
    ``close()`` or at the end of a ``with`` block."""

    _db: sqlite3.Connection
    _lock: AbstractContextManager[Any]

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class SqliteModel(LockedDatabase):
    """Base of a read model in one SQLite file: subclasses give the schema, the digest
    queries and how one record is applied."""

    name: ClassVar[ModelName]
    schema: ClassVar[str]
    digest_queries: ClassVar[tuple[tuple[str, str], ...]]

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.RLock()
        self._db = open_database(self.path)
        self._db.executescript(self.schema)

    def applied_offset(self) -> int:
        with self._lock:
            return read_offset(self._db, self.name)

    def apply(self, batch: list[ProjectedRecord]) -> None:
        """Apply the records after the stored offset and store the newest offset, in one
        transaction."""
        with self._lock, transaction(self._db) as cursor:
            applied = read_offset(cursor, self.name)
            todo: list[ProjectedRecord] = []
            newest = applied
            for item in batch:
                if item.offset > newest:
                    todo.append(item)
                    newest = item.offset
            if todo:
                self._apply_many(cursor, todo)
                write_offset(cursor, self.name, newest)

    def _apply_many(self, cursor: sqlite3.Cursor, items: list[ProjectedRecord]) -> None:
        """Apply ``items`` (in log order, all past the stored offset); models override this
        to write runs of records with ``executemany``."""
        for item in items:
            self._apply_one(cursor, item)

    def _apply_one(self, cursor: sqlite3.Cursor, item: ProjectedRecord) -> None:
        raise NotImplementedError

    def digest(self) -> str:
        with self._lock:
            return digest_rows(self._db, self.digest_queries)

    def purge(self) -> None:
        """After an erasure: checkpoint the WAL into the file and truncate it, so the
        deleted rows' old pages leave the WAL (``secure_delete`` zeroed them in the file)."""
        with self._lock:
            checkpoint(self._db)

    def _query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._db.execute(sql, params).fetchall()


IN_CHUNK = 500
"""Values per ``IN (...)`` list (SQLite limits the parameters of one statement)."""


def rows_in(
    query: Callable[[str, Sequence[Any]], Iterable[tuple[Any, ...]]],
    sql: str,
    values: Sequence[Any],
    *after: Any,
) -> list[tuple[Any, ...]]:
    """Every row of ``sql`` for ``values``, where ``{marks}`` in ``sql`` stands for their
    ``IN`` list (run in chunks of :data:`IN_CHUNK`; ``after``: the parameters that follow
    the list)."""
    rows: list[tuple[Any, ...]] = []
    for start in range(0, len(values), IN_CHUNK):
        chunk = list(values[start : start + IN_CHUNK])
        rows.extend(query(sql.format(marks=",".join("?" * len(chunk))), [*chunk, *after]))
    return rows


def runs(
    items: list[ProjectedRecord], batched: Callable[[ProjectedRecord], bool]
) -> Iterator[tuple[bool, list[ProjectedRecord]]]:
    """``items`` cut into maximal runs of records that ``batched`` accepts (``True``, the
    run) and single other records (``False``, a one-record list), in order."""
    run: list[ProjectedRecord] = []
    for item in items:
        if batched(item):
            run.append(item)
            continue
        if run:
            yield True, run
            run = []
        yield False, [item]
    if run:
        yield True, run
