"""A durable vector cache keyed by (embedding identity, content hash).

A rebuild that keeps the model finds every vector here instead of recomputing it; a
different model (name, version or dimension) has a different identity key, so it misses
by construction. Vectors are stored as little-endian float32, the precision the vector
stores keep.
"""

from __future__ import annotations

import asyncio
import hashlib
import sqlite3
import threading
import time
from array import array
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from prme.producers.sqlite_files import connect_wal
from prme.schemas.metrics import Metrics

from ..stores.sqlite_base import LockedDatabase, transaction
from .protocol import EmbeddingIdentity, array_encoder
from .validation import (
    Float32Vector,
    check_identity_unchanged,
    check_texts,
    float32_vector,
    float32_vectors,
    identity_of,
    validate_array,
    validate_matrix,
)

_FLOAT32 = np.dtype("<f4")
_CHUNK = 500
_SCHEMA = """
CREATE TABLE IF NOT EXISTS vectors (
    identity TEXT NOT NULL,
    content_hash TEXT NOT NULL,
    vector BLOB NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS vectors_key ON vectors (identity, content_hash);
"""
"""A rowid table with a unique key index: new rows go to the end of the table and only the
small index takes random inserts. (A file made before this layout keeps its ``WITHOUT
ROWID`` table, which has the same columns and key, so the same statements work on it; it
is only slower: ~2.5x per insert, its 1.5 KB rows split pages at random keys.)"""
_CHANGELOG_SCHEMA = """
CREATE TABLE IF NOT EXISTS changelog_offsets (
    name TEXT PRIMARY KEY,
    next_offset INTEGER NOT NULL
) WITHOUT ROWID;
"""
_OWNERS_SCHEMA = """
CREATE TABLE IF NOT EXISTS vector_owners (
    owner TEXT NOT NULL,
    identity TEXT NOT NULL,
    content_hash TEXT NOT NULL,
    PRIMARY KEY (owner, identity, content_hash)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS vector_owners_key ON vector_owners (identity, content_hash);
"""
"""Which owners' texts a cached vector is the vector of: an erased owner's vectors are
dropped once no other owner holds them (vectors cached before this table existed have no
owners noted and stay)."""
_CACHE_KIB = 32 * 1024
_PUT_VECTOR = "INSERT OR REPLACE INTO vectors (identity, content_hash, vector) VALUES (?, ?, ?)"


def content_hash(text: str) -> str:
    """The sha256 (hex) of the text's UTF-8 bytes."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def as_float32(vector: Sequence[float]) -> list[float]:
    """The vector rounded to float32, as the cache and the vector stores keep it."""
    return np.asarray(vector, dtype=_FLOAT32).tolist()


class VectorCache(LockedDatabase):
    """SQLite file of vectors; safe to share between threads and processes. The file is
    opened, and created, at its first use: a process that never embeds nor reads a vector
    (a serve-only node) leaves none in its data directory."""

    def __init__(self, path: Path, *, timeout_s: float = 30.0) -> None:
        self._path = Path(path)
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._connection: sqlite3.Connection | None = None
        self._closed = False
        self.hits = 0
        """Texts :meth:`get_many` found a vector for (this process, since opening)."""
        self.misses = 0

    @property
    def _db(self) -> sqlite3.Connection:  # type: ignore[override]
        """The connection (callers hold ``_lock``), opened at the first use."""
        if self._connection is None:
            if self._closed:
                raise sqlite3.ProgrammingError("Cannot operate on a closed database.")
            self._connection = self._open()
        return self._connection

    def _open(self) -> sqlite3.Connection:
        db = connect_wal(self._path, timeout_s=self._timeout_s)
        try:
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute(f"PRAGMA cache_size=-{_CACHE_KIB}")
            db.execute("PRAGMA secure_delete=ON")
            exists = db.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'vectors'"
            ).fetchone()
            if exists is None:  # an older file keeps its layout (no second key index on it)
                db.executescript(_SCHEMA)
            db.executescript(_CHANGELOG_SCHEMA)
            db.executescript(_OWNERS_SCHEMA)
        except BaseException:
            db.close()
            raise
        return db

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._connection is not None:
                self._connection.close()

    @property
    def path(self) -> Path:
        return self._path

    def get_many(
        self, identity: EmbeddingIdentity | Any, texts: Sequence[str]
    ) -> list[list[float] | None]:
        """The cached vector of each text under ``identity`` (a provider works too), or
        ``None`` where there is none."""
        ident = identity_of(identity)
        found = self.get_hashed(ident, [content_hash(text) for text in check_texts(texts)])
        return [None if vector is None else vector.tolist() for vector in found]

    def get_hashed(
        self, identity: EmbeddingIdentity, hashes: Sequence[str]
    ) -> list[Float32Vector | None]:
        """``get_many`` for texts given by their ``content_hash``, as float32 vectors. A
        stored vector of the wrong width or with a non-finite component counts as missing."""
        unique = list(dict.fromkeys(hashes))
        stored: dict[str, bytes] = {}
        with self._lock:
            for start in range(0, len(unique), _CHUNK):
                chunk = unique[start : start + _CHUNK]
                marks = ",".join("?" * len(chunk))
                rows = self._db.execute(
                    f"SELECT content_hash, vector FROM vectors "
                    f"WHERE identity = ? AND content_hash IN ({marks})",
                    (identity.key, *chunk),
                )
                stored.update(rows)
        width = identity.dimension * _FLOAT32.itemsize
        usable = {digest: blob for digest, blob in stored.items() if len(blob) == width}
        if usable:
            joined = np.frombuffer(b"".join(usable.values()), dtype=_FLOAT32)
            matrix = joined.reshape(len(usable), identity.dimension)
            digests = list(usable)
            for index in np.flatnonzero(~np.isfinite(matrix).all(axis=1)).tolist():
                del usable[digests[index]]
        found = [
            float32_vector(blob) if (blob := usable.get(digest)) is not None else None
            for digest in hashes
        ]
        hits = sum(vector is not None for vector in found)
        self.hits += hits
        self.misses += len(found) - hits
        return found

    def put_many(
        self,
        identity: EmbeddingIdentity | Any,
        texts: Sequence[str],
        vectors: Sequence[Sequence[float]],
    ) -> None:
        """Store one vector per text (validated first: a bad batch stores nothing)."""
        ident = identity_of(identity)
        batch = check_texts(texts)
        checked = validate_matrix(ident, len(batch), list(vectors)).astype(_FLOAT32)
        self.put_checked(ident, [content_hash(text) for text in batch], checked)

    def put_checked(
        self, identity: EmbeddingIdentity, hashes: Sequence[str], vectors: np.ndarray
    ) -> None:
        """Store rows of ``vectors`` (already validated, float32) under their content
        hashes."""
        key = identity.key
        rows = [(key, digest, row.tobytes()) for digest, row in zip(hashes, vectors, strict=True)]
        if not rows:
            return
        with self._lock, transaction(self._db) as cursor:
            cursor.executemany(_PUT_VECTOR, rows)

    def add_owners(self, identity: EmbeddingIdentity, refs: Sequence[tuple[str, str]]) -> None:
        """Note that owner holds the text of each ``(content_hash, owner)``."""
        key = identity.key
        rows = [(owner, key, digest) for digest, owner in dict.fromkeys(refs)]
        if not rows:
            return
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.executemany(
                    "INSERT OR IGNORE INTO vector_owners (owner, identity, content_hash) "
                    "VALUES (?, ?, ?)",
                    rows,
                )
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def drop_owners(self, owners: Iterable[str]) -> int:
        """Forget the owners' notes and drop the vectors no other owner holds (overwritten
        on disk: ``secure_delete`` is on and the WAL is truncated); returns how many."""
        dropped = 0
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for owner in owners:
                    held = self._db.execute(
                        "SELECT identity, content_hash FROM vector_owners WHERE owner = ?",
                        (owner,),
                    ).fetchall()
                    self._db.execute("DELETE FROM vector_owners WHERE owner = ?", (owner,))
                    for identity, digest in held:
                        shared = self._db.execute(
                            "SELECT 1 FROM vector_owners WHERE identity = ? AND content_hash = ?",
                            (identity, digest),
                        ).fetchone()
                        if shared is None:
                            dropped += self._db.execute(
                                "DELETE FROM vectors WHERE identity = ? AND content_hash = ?",
                                (identity, digest),
                            ).rowcount
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return dropped

    def owners(self) -> list[str]:
        """The owners noted as holding a cached vector's text."""
        with self._lock:
            rows = self._db.execute("SELECT DISTINCT owner FROM vector_owners").fetchall()
        return [str(row[0]) for row in rows]

    def forget_changelog_marks(self, prefix: str) -> None:
        """Forget how far the changelogs named ``prefix...`` were loaded (read again in
        full next time)."""
        with self._lock, transaction(self._db) as cursor:
            cursor.execute(
                "DELETE FROM changelog_offsets WHERE substr(name, 1, ?) = ?", (len(prefix), prefix)
            )

    def changelog_offset(self, name: str) -> int:
        """Where loading changelog ``name`` stopped last time (0 when never loaded)."""
        with self._lock:
            row = self._db.execute(
                "SELECT next_offset FROM changelog_offsets WHERE name = ?", (name,)
            ).fetchone()
        return int(row[0]) if row else 0

    def load_changelog(
        self,
        identity_key: str,
        puts: Mapping[str, bytes],
        deletes: Iterable[str],
        name: str,
        next_offset: int,
    ) -> None:
        """In one transaction: store ``content hash -> float32 bytes`` rows under
        ``identity_key``, drop the ``deletes`` hashes, and note ``next_offset`` for ``name``."""
        rows = [(identity_key, digest, blob) for digest, blob in puts.items()]
        gone = [(identity_key, digest) for digest in deletes]
        with self._lock, transaction(self._db) as cursor:
            cursor.executemany(_PUT_VECTOR, rows)
            cursor.executemany("DELETE FROM vectors WHERE identity = ? AND content_hash = ?", gone)
            cursor.execute(
                "INSERT OR REPLACE INTO changelog_offsets (name, next_offset) VALUES (?, ?)",
                (name, next_offset),
            )

    def count(self, identity: EmbeddingIdentity | Any | None = None) -> int:
        with self._lock:
            if identity is None:
                row = self._db.execute("SELECT count(*) FROM vectors").fetchone()
            else:
                row = self._db.execute(
                    "SELECT count(*) FROM vectors WHERE identity = ?", (identity_of(identity).key,)
                ).fetchone()
        return int(row[0])


async def embed_with_cache(
    provider: Any, cache: VectorCache, texts: Sequence[str], metrics: Metrics | None = None
) -> list[Float32Vector]:
    """Vectors for ``texts`` in order, as float32: cached ones from ``cache``, the rest from
    ONE ``provider.embed`` call over the distinct missing texts, validated and stored
    before they are returned (the call counted and timed in ``metrics``)."""
    identity = identity_of(provider)
    batch = check_texts(texts)
    hashes = [content_hash(text) for text in batch]
    # The cache's SQLite work runs off the event loop (it releases the GIL meanwhile).
    cached = await asyncio.to_thread(cache.get_hashed, identity, hashes)
    missing_at = list(
        {
            text: index
            for index, (text, hit) in enumerate(zip(batch, cached, strict=True))
            if hit is None
        }.items()
    )
    if not missing_at:
        return [vector for vector in cached if vector is not None]
    missing = [text for text, _ in missing_at]
    started = time.perf_counter()
    encode_array = array_encoder(provider)
    if encode_array is not None:
        rounded = validate_array(identity, len(missing), await encode_array(missing))
    else:
        matrix = validate_matrix(identity, len(missing), await provider.embed(missing))
        rounded = matrix.astype(_FLOAT32)
    if metrics is not None:
        metrics.embed_duration.labels("document").observe(time.perf_counter() - started)
        metrics.texts_encoded.labels("document").inc(len(missing))
    check_identity_unchanged(identity, provider)
    await asyncio.to_thread(
        cache.put_checked, identity, [hashes[index] for _, index in missing_at], rounded
    )
    computed = dict(zip(missing, float32_vectors(rounded), strict=True))
    return [
        hit if hit is not None else array("f", computed[text])
        for text, hit in zip(batch, cached, strict=True)
    ]
