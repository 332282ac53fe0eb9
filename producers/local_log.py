"""The embedded log: one SQLite file (WAL) with Kafka's partitions, offsets and partitioner.

Safe for one writer process and many readers: every append runs in one ``BEGIN IMMEDIATE``
transaction that also computes the next offsets, so a batch is all-or-nothing even when
the writer is killed mid-way, and two writers cannot hand out the same offset.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from prme.schemas.cluster import static_map
from prme.schemas.errors import ConfigurationError, TransportError

from .partitioner import Partitioner
from .sqlite_files import connect_wal
from .sqlite_thread import SqliteThread, failed_write
from .transport import (
    LogEntry,
    LogItem,
    Membership,
    PartitionsCallback,
    Position,
    check_same_write,
)

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS log (
    partition INTEGER NOT NULL,
    offset INTEGER NOT NULL,
    key BLOB NOT NULL,
    value BLOB NOT NULL,
    timestamp_ms INTEGER NOT NULL,
    PRIMARY KEY (partition, offset)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS dedupe (
    dedupe_key TEXT PRIMARY KEY,
    partition INTEGER NOT NULL,
    offset INTEGER NOT NULL,
    fingerprint BLOB
) WITHOUT ROWID;
"""
_ADD_FINGERPRINTS = "ALTER TABLE dedupe ADD COLUMN fingerprint BLOB"
"""A log written before fingerprints: its keys keep a NULL one, which conflicts with none."""

_KEYS_PER_QUERY = 500
ChangeMark = tuple[int, int, int]
"""Where the log file stands (``LocalLogTransport.read_changed``): equal marks, no write
between them."""
_POLL_INTERVAL_S = 0.05
"""How often a local consumer re-reads the file for appends made by another process."""


class LocalLogTransport(SqliteThread):
    """A durable partitioned log in ``path`` (a SQLite file)."""

    _what = "the local log"

    def __init__(self, path: Path | str, partitions: int = 12) -> None:
        if partitions <= 0:
            raise ConfigurationError("partitions must be positive")
        super().__init__()
        self._path = Path(path)
        self._partitions = partitions
        self._partitioner = Partitioner(partitions)
        self._appended: asyncio.Condition | None = None
        self._appends = 0
        """How many appends this process made: a poller waits for it to move."""
        self._opens = 0
        """Connections opened: a change mark belongs to one of them."""
        self.dedupe_hits = 0
        """Items this process appended whose dedupe key was already on the log."""
        self.exact_end_offsets = True
        """``end_offsets`` is exactly what has been written (Kafka's read_committed end can
        stop before a committed record, at another writer's open transaction): a read's
        ``after`` token past it was never handed out."""

    @property
    def partitions(self) -> int:
        return self._partitions

    @property
    def path(self) -> Path:
        return self._path

    async def start(self) -> None:
        if self._executor is None:
            self._appended = asyncio.Condition()
        await self._start_thread("prme-local-log")

    def _open(self) -> None:
        connection = connect_wal(self._path)
        connection.execute("PRAGMA synchronous=NORMAL")
        connection.executescript(_SCHEMA)
        connection.execute("BEGIN IMMEDIATE")
        try:
            columns = {row[1] for row in connection.execute("PRAGMA table_info(dedupe)")}
            if "fingerprint" not in columns:
                connection.execute(_ADD_FINGERPRINTS)
            row = connection.execute("SELECT value FROM meta WHERE name='partitions'").fetchone()
            if row is None:
                connection.execute(
                    "INSERT INTO meta VALUES ('partitions', ?)", (str(self._partitions),)
                )
            elif int(row[0]) != self._partitions:
                raise ConfigurationError(
                    f"{self._path} was created with {row[0]} partitions, not "
                    f"{self._partitions}: owners would move to other partitions"
                )
            connection.execute("COMMIT")
        except BaseException:
            if connection.in_transaction:
                connection.execute("ROLLBACK")
            connection.close()
            raise
        self._connection = connection
        self._opens += 1

    def partition_for(self, key: bytes) -> int:
        return self._partitioner(key)

    async def append(self, item: LogItem) -> Position:
        return (await self.append_many([item]))[0]

    async def append_many(self, items: Sequence[LogItem], *, atomic: bool = True) -> list[Position]:
        """Append in one transaction; ``atomic=False`` is accepted for interface parity (a
        local batch is always all-or-nothing)."""
        if not items:
            return []
        positions: list[Position] = await self._run(self._append_many, list(items))
        assert self._appended is not None
        self._appends += 1
        async with self._appended:
            self._appended.notify_all()
        return positions

    def _append_many(self, items: list[LogItem]) -> list[Position]:
        connection = self._require_connection()
        now_ms = int(time.time() * 1000)
        next_offsets: dict[int, int] = {}
        positions: list[Position] = []
        hits = 0
        connection.execute("BEGIN IMMEDIATE")
        try:
            for item in items:
                if item.dedupe_key is not None:
                    row = connection.execute(
                        "SELECT partition, offset, fingerprint FROM dedupe WHERE dedupe_key=?",
                        (item.dedupe_key,),
                    ).fetchone()
                    if row is not None:
                        check_same_write(item, row[2])
                        positions.append(Position(row[0], row[1]))
                        hits += 1
                        continue
                partition = self.partition_for(item.key)
                offset = next_offsets.get(partition)
                if offset is None:
                    offset = connection.execute(
                        "SELECT COALESCE(MAX(offset) + 1, 0) FROM log WHERE partition=?",
                        (partition,),
                    ).fetchone()[0]
                next_offsets[partition] = offset + 1
                connection.execute(
                    "INSERT INTO log VALUES (?, ?, ?, ?, ?)",
                    (partition, offset, item.key, item.value, now_ms),
                )
                if item.dedupe_key is not None:
                    connection.execute(
                        "INSERT INTO dedupe VALUES (?, ?, ?, ?)",
                        (item.dedupe_key, partition, offset, item.fingerprint),
                    )
                positions.append(Position(partition, offset))
            connection.execute("COMMIT")
        except BaseException as error:
            failed_write(
                connection,
                error,
                f"the embedded log {self._path} could not be written",
                "nothing of the append was written",
            )
            raise
        self.dedupe_hits += hits
        return positions

    async def written_fingerprints(self, keys: Sequence[str]) -> dict[str, bytes | None]:
        return await self._run(self._written_fingerprints, list(keys))

    def _written_fingerprints(self, keys: list[str]) -> dict[str, bytes | None]:
        connection = self._require_connection()
        found: dict[str, bytes | None] = {}
        for start in range(0, len(keys), _KEYS_PER_QUERY):
            chunk = keys[start : start + _KEYS_PER_QUERY]
            marks = ",".join("?" * len(chunk))
            query = f"SELECT dedupe_key, fingerprint FROM dedupe WHERE dedupe_key IN ({marks})"
            found.update(connection.execute(query, chunk).fetchall())
        return found

    async def forget_dedupe(self, prefix: str) -> None:
        await self._run(self._forget_dedupe, prefix)

    def _forget_dedupe(self, prefix: str) -> None:
        # A range on the primary key: the keys starting with ``prefix`` sort below the
        # prefix with its last character one higher (SQLite compares text as UTF-8 bytes,
        # which keeps code-point order).
        connection = self._require_connection()
        last = ord(prefix[-1]) if prefix else 0x10FFFF
        if last >= 0x10FFFF or 0xD7FF <= last < 0xE000:  # no next character to bound by
            connection.execute(
                "DELETE FROM dedupe WHERE substr(dedupe_key, 1, ?) = ?", (len(prefix), prefix)
            )
        else:
            connection.execute(
                "DELETE FROM dedupe WHERE dedupe_key >= ? AND dedupe_key < ?",
                (prefix, prefix[:-1] + chr(last + 1)),
            )

    async def read(self, partition: int, offset: int, max_records: int = 500) -> list[LogEntry]:
        self._check_partition(partition)
        rows = await self._run(self._read, partition, offset, max_records)
        return [LogEntry(partition, o, bytes(k), bytes(v), ts) for o, k, v, ts in rows]

    def _read(self, partition: int, offset: int, max_records: int) -> list[tuple[Any, ...]]:
        return (
            self._require_connection()
            .execute(
                "SELECT offset, key, value, timestamp_ms FROM log "
                "WHERE partition=? AND offset>=? ORDER BY offset LIMIT ?",
                (partition, offset, max_records),
            )
            .fetchall()
        )

    async def read_changed(
        self, positions: dict[int, int], max_records: int, since: ChangeMark | None
    ) -> tuple[ChangeMark, dict[int, list[LogEntry]]]:
        """``read`` of every partition in ``positions`` in one call to the log's thread,
        with the file's change mark; when the mark is still ``since``, nothing is read."""
        mark, rows = await self._run(self._read_changed, positions, max_records, since)
        return mark, {
            partition: [LogEntry(partition, o, bytes(k), bytes(v), ts) for o, k, v, ts in found]
            for partition, found in rows.items()
            if found
        }

    def _read_changed(
        self, positions: dict[int, int], max_records: int, since: ChangeMark | None
    ) -> tuple[ChangeMark, dict[int, list[tuple[Any, ...]]]]:
        # ``data_version`` moves when another connection commits, ``total_changes`` with
        # every row this one writes (an append whose caller was cancelled included); both
        # start again with a new connection, whose first mark could equal an old one.
        connection = self._require_connection()
        version = connection.execute("PRAGMA data_version").fetchone()[0]
        mark = (self._opens, version, connection.total_changes)
        if mark == since:
            return mark, {}
        return mark, {
            partition: self._read(partition, offset, max_records)
            for partition, offset in sorted(positions.items())
        }

    async def end_offsets(self) -> dict[int, int]:
        rows = await self._run(self._end_offsets)
        ends = dict.fromkeys(range(self._partitions), 0)
        ends.update({partition: end for partition, end in rows})
        return ends

    def _end_offsets(self) -> list[tuple[int, int]]:
        return (
            self._require_connection()
            .execute("SELECT partition, MAX(offset) + 1 FROM log GROUP BY partition")
            .fetchall()
        )

    @property
    def appends(self) -> int:
        """The count of appends made through this transport (see :meth:`wait_for_append`)."""
        return self._appends

    async def wait_for_append(self, seen: int, timeout_s: float) -> None:
        """Return once this process has appended since the count was ``seen``, or after
        ``timeout_s`` (appends made by other processes are found by the caller re-reading).
        Comparing counts, not waiting on an event, keeps an append made while the caller
        was reading from being missed."""
        condition = self._appended
        assert condition is not None
        async with condition:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(condition.wait_for(lambda: self._appends != seen), timeout_s)

    def consumer(self, group: str, membership: Membership | None = None) -> LocalLogConsumer:
        return LocalLogConsumer(self, membership)

    def _check_partition(self, partition: int) -> None:
        if not 0 <= partition < self._partitions:
            raise TransportError(f"partition {partition} is not in 0..{self._partitions - 1}")


class LocalLogConsumer:
    """Every partition of a local log (or this process's static share of them), read from
    positions the caller seeks to."""

    def __init__(self, transport: LocalLogTransport, membership: Membership | None = None) -> None:
        self._transport = transport
        self._membership = membership
        self._positions: dict[int, int] = {}
        self._on_revoked: PartitionsCallback | None = None
        self._quiet: tuple[ChangeMark, dict[int, int]] | None = None
        """After a read that found nothing: the file's mark and the positions read at."""

    async def start(self, on_assigned: PartitionsCallback, on_revoked: PartitionsCallback) -> None:
        partitions = set(range(self._transport.partitions))
        membership = self._membership
        if membership is not None and membership.static_members:
            cluster_map = static_map(list(membership.static_members), self._transport.partitions)
            mine = cluster_map.member(membership.url)
            if mine is None:
                raise TransportError(
                    f"{membership.url} is not one of the static members "
                    f"{list(membership.static_members)}"
                )
            partitions = set(mine.partitions)
            membership.on_map(cluster_map)
        self._positions = dict.fromkeys(partitions, 0)
        self._on_revoked = on_revoked
        await on_assigned(partitions)

    async def close(self) -> None:
        if self._on_revoked is not None and self._positions:
            await self._on_revoked(set(self._positions))
        self._positions = {}
        self._on_revoked = None

    def seek(self, partition: int, offset: int) -> None:
        self._positions[partition] = offset

    async def position(self, partition: int) -> int:
        return self._positions[partition]

    def request_rebalance(self) -> None:
        return None  # the local log's split is static

    async def poll(self, max_records: int, timeout_s: float) -> dict[int, list[LogEntry]]:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            seen = self._transport.appends
            batches = await self._read_available(max_records)
            remaining = deadline - asyncio.get_running_loop().time()
            if batches or remaining <= 0:
                return batches
            await self._transport.wait_for_append(seen, min(remaining, _POLL_INTERVAL_S))

    async def _read_available(self, max_records: int) -> dict[int, list[LogEntry]]:
        """Every partition's records past its position, in one call to the log's thread;
        nothing is read while nothing can have changed since a read that found nothing
        (no write to the file, no position moved by a seek)."""
        quiet, read_at = self._quiet, dict(self._positions)
        since = quiet[0] if quiet is not None and quiet[1] == read_at else None
        mark, batches = await self._transport.read_changed(read_at, max_records, since)
        for partition, entries in batches.items():
            self._positions[partition] = entries[-1].offset + 1
        # The positions read at, not the current ones: a seek made meanwhile was not read.
        self._quiet = None if batches else (mark, read_at)
        return batches
