"""Key stores: where each owner's data keys live (the keys that seal its records).

One interface, :class:`KeyStore`, two implementations chosen once by
``producers.factory.open_key_store``: :class:`LocalKeyStore`, a SQLite file beside the
embedded log, and ``kafka_keys.KafkaKeyStore``, a compacted topic ``<topic>.keys``.
Erasing an owner deletes its keys; its sealed records then read as envelopes only.

Each process keeps the keys it used in memory. A key for writing is re-read from the
store once ``write_ttl_s`` has passed, so a process writing for an owner that another
process erased stops using the erased key within that time; the projector drops an
owner's keys when it applies the owner's ``owner_erased`` record (:meth:`forget`).

Keys are stored as they are (no master key wraps them): at rest they are as protected as
the key store's file or topic.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import sqlite3
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol, runtime_checkable

from prme.schemas.errors import ConfigurationError
from prme.schemas.sealing import DataKey, KeyRef, is_sealed, new_data_key

from .sqlite_files import connect_wal
from .sqlite_thread import SqliteThread, failed_write

WRITE_TTL_S = 60.0
"""How long a process seals with a key before reading the store again."""


@runtime_checkable
class KeyStore(Protocol):
    """Per-owner data keys: created on first write, deleted on erasure."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def writing_keys(self, owners: Iterable[str]) -> dict[str, DataKey]:
        """A key to seal with for each owner, created (durably) where it has none."""
        ...

    def held_writing_keys(self, owners: Iterable[str]) -> dict[str, DataKey]:
        """The writing keys of ``owners`` this process holds fresh now (no store read, none
        created; an owner without one is left out)."""
        ...

    async def reading_keys(self, refs: Iterable[KeyRef]) -> dict[KeyRef, bytes]:
        """The keys of ``(owner, kid)`` pairs; an erased (or unknown) one is missing."""
        ...

    async def erase(self, owner: str) -> None:
        """Delete every key of ``owner`` (durably, before returning)."""
        ...

    def forget(self, owner: str) -> None:
        """Drop what this process holds of ``owner``'s keys (the next use reads the store)."""
        ...


class CachingKeyStore:
    """The in-memory part both stores share; subclasses read, create and delete keys."""

    def __init__(self, *, write_ttl_s: float = WRITE_TTL_S) -> None:
        self._held: dict[str, dict[str, bytes]] = {}
        self._writing: dict[str, tuple[float, DataKey]] = {}
        """Per owner, the key it seals with and when it was read from the store."""
        self._erasing: collections.Counter[str] = collections.Counter()
        """Owners an erasure is deleting now: nothing of theirs is held meanwhile."""
        self._write_ttl_s = write_ttl_s
        self._lock = asyncio.Lock()

    async def _load(self, owners: list[str]) -> dict[str, dict[str, bytes]]:
        """The stored keys ``{kid: key}`` of each owner (authoritative, not cached)."""
        raise NotImplementedError

    async def _create(self, owners: list[str]) -> dict[str, DataKey]:
        """Store a new key for each owner (in one write), or return the one another writer
        stored first."""
        raise NotImplementedError

    async def _delete(self, owner: str) -> None:
        raise NotImplementedError

    def _hold(self, owner: str, keys: dict[str, bytes], now: float) -> None:
        if self._erasing[owner]:
            return  # read before the erasure deleted them: used once, never kept
        self._held[owner] = keys
        if keys:
            kid = next(iter(keys))
            self._writing[owner] = (now, DataKey(kid, keys[kid]))
        else:
            self._writing.pop(owner, None)

    async def _refresh(self, owners: list[str]) -> dict[str, dict[str, bytes]]:
        """Read ``owners``' keys from the store, hold them, and return them."""
        if not owners:
            return {}
        loaded = await self._load(owners)
        now = time.monotonic()
        for owner in owners:
            self._hold(owner, loaded.get(owner, {}), now)
        return loaded

    async def writing_keys(self, owners: Iterable[str]) -> dict[str, DataKey]:
        wanted = list(dict.fromkeys(owners))
        held = self._fresh(wanted)
        if held is not None:  # every key held and fresh: no need to queue behind a creation
            return held
        async with self._lock:
            chosen = self.held_writing_keys(wanted)
            loaded = await self._refresh([owner for owner in wanted if owner not in chosen])
            for owner, keys in loaded.items():
                if keys:
                    kid = next(iter(keys))
                    chosen[owner] = DataKey(kid, keys[kid])
            keyless = [owner for owner in wanted if owner not in chosen]
            if keyless:
                created = await self._create(keyless)
                now = time.monotonic()
                for owner, key in created.items():
                    self._hold(owner, {key.kid: key.key}, now)
                chosen.update(created)
            return {owner: chosen[owner] for owner in wanted}

    def held_writing_keys(self, owners: Iterable[str]) -> dict[str, DataKey]:
        """The keys of ``owners`` this process holds and read within ``write_ttl_s`` (no
        store read; an owner without one, or being erased, is left out)."""
        limit = time.monotonic() - self._write_ttl_s
        chosen: dict[str, DataKey] = {}
        for owner in owners:
            held = self._writing.get(owner)
            if held is not None and held[0] >= limit and not self._erasing[owner]:
                chosen[owner] = held[1]
        return chosen

    def _fresh(self, owners: list[str]) -> dict[str, DataKey] | None:
        """``held_writing_keys`` if it has every one of ``owners``; else ``None``."""
        chosen = self.held_writing_keys(owners)
        return chosen if len(chosen) == len(owners) else None

    async def reading_keys(self, refs: Iterable[KeyRef]) -> dict[KeyRef, bytes]:
        wanted = set(refs)
        async with self._lock:
            missing = sorted(
                {owner for owner, kid in wanted if kid not in self._held.get(owner, {})}
            )
            loaded = await self._refresh(missing)
            found: dict[KeyRef, bytes] = {}
            for owner, kid in wanted:
                key = loaded.get(owner, self._held.get(owner, {})).get(kid)
                if key is not None:
                    found[(owner, kid)] = key
            return found

    async def erase(self, owner: str) -> None:
        # Marked before the delete: a writer meanwhile finds nothing held for the owner and
        # queues behind this erasure (then gets a new key) instead of sealing with this one.
        self._erasing[owner] += 1
        try:
            self.forget(owner)
            async with self._lock:
                self.forget(owner)
                await self._delete(owner)
        finally:
            self._erasing[owner] -= 1
            if not self._erasing[owner]:
                del self._erasing[owner]

    def forget(self, owner: str) -> None:
        self._held.pop(owner, None)
        self._writing.pop(owner, None)


_SCHEMA = """
CREATE TABLE IF NOT EXISTS data_keys (
    owner TEXT NOT NULL,
    kid TEXT NOT NULL,
    key BLOB NOT NULL,
    PRIMARY KEY (owner, kid)
) WITHOUT ROWID;
"""


class LocalKeyStore(SqliteThread, CachingKeyStore):
    """Keys in a SQLite file (WAL, ``secure_delete`` on: a deleted key is overwritten,
    and the WAL is checkpointed and truncated after each erasure)."""

    _what = "the key store"

    def __init__(
        self, path: Path, *, log_path: Path | None = None, write_ttl_s: float = WRITE_TTL_S
    ) -> None:
        """``log_path``: the log whose records these keys seal; a missing key file is
        refused while it holds a sealed record."""
        SqliteThread.__init__(self)
        CachingKeyStore.__init__(self, write_ttl_s=write_ttl_s)
        self._path = Path(path)
        self._log_path = log_path

    @property
    def path(self) -> Path:
        return self._path

    async def start(self) -> None:
        await self._start_thread("prme-keys")

    def _open(self) -> None:
        if not self._path.exists() and self._log_path is not None:
            check_keys_not_lost(self._path, self._log_path)
        db = connect_wal(self._path)
        db.execute("PRAGMA synchronous=FULL")  # a key must outlive the records it sealed
        db.execute("PRAGMA secure_delete=ON")
        db.executescript(_SCHEMA)
        self._connection = db

    async def _load(self, owners: list[str]) -> dict[str, dict[str, bytes]]:
        return await self._run(self._select, owners)  # type: ignore[no-any-return]

    def _select(self, owners: list[str]) -> dict[str, dict[str, bytes]]:
        db = self._require_connection()
        found: dict[str, dict[str, bytes]] = {}
        for start in range(0, len(owners), 500):
            chunk = owners[start : start + 500]
            marks = ",".join("?" * len(chunk))
            rows = db.execute(
                f"SELECT owner, kid, key FROM data_keys WHERE owner IN ({marks})", chunk
            )
            for owner, kid, key in rows:
                found.setdefault(owner, {})[kid] = bytes(key)
        return found

    async def _create(self, owners: list[str]) -> dict[str, DataKey]:
        return await self._run(self._insert, owners)  # type: ignore[no-any-return]

    def _insert(self, owners: list[str]) -> dict[str, DataKey]:
        db = self._require_connection()
        created: dict[str, DataKey] = {}
        db.execute("BEGIN IMMEDIATE")
        try:
            for owner in owners:
                row = db.execute(
                    "SELECT kid, key FROM data_keys WHERE owner = ? LIMIT 1", (owner,)
                ).fetchone()
                if row is not None:  # another process created it first
                    created[owner] = DataKey(row[0], bytes(row[1]))
                    continue
                key = created[owner] = new_data_key()
                db.execute("INSERT INTO data_keys VALUES (?, ?, ?)", (owner, key.kid, key.key))
            db.execute("COMMIT")
        except BaseException as error:
            failed_write(
                db,
                error,
                f"the key store {self._path} could not be written",
                "nothing was appended",
            )
            raise
        return created

    async def _delete(self, owner: str) -> None:
        await self._run(self._delete_rows, owner)

    def _delete_rows(self, owner: str) -> None:
        db = self._require_connection()
        db.execute("BEGIN IMMEDIATE")
        try:
            db.execute("DELETE FROM data_keys WHERE owner = ?", (owner,))
            db.execute("COMMIT")
        except BaseException as error:
            failed_write(
                db,
                error,
                f"the owner's data key could not be deleted from {self._path}",
                "the erasure is on the log, but its records stay readable until the key is "
                "gone: free some space and send the erasure again",
            )
            raise
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def check_keys_not_lost(path: Path, log_path: Path) -> None:
    """ConfigurationError when the key file at ``path`` is missing while the log at
    ``log_path`` holds a sealed record: a key store made anew would read every such record
    as erased, silently (an operations trial copied a pack's log without its keys, and
    audit, rebuild and retrieve showed everything erased, with the pack ready)."""
    if not log_path.exists():
        return
    read_only = f"{log_path.resolve().as_uri()}?mode=ro"  # a URI needs an absolute path
    with contextlib.closing(sqlite3.connect(read_only, uri=True)) as log:
        try:
            values = log.execute("SELECT value FROM log")
        except sqlite3.OperationalError:  # not a log yet
            return
        if not any(is_sealed(bytes(value)) for (value,) in values):
            return  # written before records were sealed
    raise ConfigurationError(
        f"the key store {path} is missing, but the log {log_path} holds sealed records: "
        "without their keys every one reads as erased. Put back the key store that was "
        "backed up with this log (a pack is its log and its key store together); to read "
        f"the records as erased on purpose, create an empty key store: touch {path}"
    )
