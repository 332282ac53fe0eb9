"""The transport contract on the embedded SQLite log, plus what only it promises."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from prme.producers.local_log import LocalLogConsumer, LocalLogTransport
from prme.producers.transport import LogItem
from prme.schemas.config import Settings
from prme.schemas.errors import ConfigurationError, RequestIdConflict

from .transport_contract import TransportContract


class TestLocalTransport(TransportContract):
    @pytest.fixture
    def settings(self, tmp_path: Path) -> Settings:
        return Settings(data_dir=str(tmp_path / "data")).replace(log={"partitions": 4})


async def test_reopening_with_another_partition_count_is_refused(tmp_path: Path) -> None:
    first = LocalLogTransport(tmp_path / "log.sqlite3", partitions=4)
    await first.start()
    await first.close()
    with pytest.raises(ConfigurationError, match="created with 4 partitions"):
        await LocalLogTransport(tmp_path / "log.sqlite3", partitions=12).start()


async def test_an_append_made_while_a_consumer_reads_wakes_it_at_once(tmp_path: Path) -> None:
    import asyncio

    from prme.producers.transport import LogItem

    transport = LocalLogTransport(tmp_path / "log.sqlite3", partitions=4)
    await transport.start()
    try:
        seen = transport.appends  # the consumer notes the count, then reads...
        await transport.append(LogItem(b"alice", b"x"))  # ...and an append lands meanwhile
        # Waiting now must return at once, not after the 30 s timeout: an event set and
        # cleared during the read used to be missed until the next poll tick.
        await asyncio.wait_for(transport.wait_for_append(seen, timeout_s=30), timeout=2)
    finally:
        await transport.close()


async def test_a_log_written_before_fingerprints_keeps_its_request_ids(tmp_path: Path) -> None:
    path = tmp_path / "log.sqlite3"
    first = LocalLogTransport(path, partitions=4)
    await first.start()
    written = await first.append(LogItem(b"alice", b"old", "alice\x1fr1"))
    await first.close()
    with sqlite3.connect(path) as connection:  # the dedupe table as it was
        connection.execute("ALTER TABLE dedupe DROP COLUMN fingerprint")
    again = LocalLogTransport(path, partitions=4)
    await again.start()
    try:
        assert await again.append(LogItem(b"alice", b"old", "alice\x1fr1", b"print")) == written
        await again.append(LogItem(b"alice", b"new", "alice\x1fr2", b"print-2"))
        with pytest.raises(RequestIdConflict):
            await again.append(LogItem(b"alice", b"other", "alice\x1fr2", b"print-3"))
    finally:
        await again.close()


async def test_a_full_disk_refuses_the_append_as_a_transport_error_that_names_it(
    tmp_path: Path,
) -> None:
    """From an operations trial: with the disk full, ``POST /v1/memories`` answered ``500
    internal: OperationalError`` and ``prme ingest`` died on "cannot rollback - no
    transaction is active" (SQLite had rolled back already), which hid the cause. A full
    database is made here with SQLite's own page limit."""
    from prme.schemas.errors import TransportError

    transport = LocalLogTransport(tmp_path / "log.sqlite3", 4)
    await transport.start()
    try:
        await transport.append(LogItem(key=b"alice", value=b"fits"))
        connection = transport._require_connection()
        pages = connection.execute("PRAGMA page_count").fetchone()[0]
        await transport._run(lambda: connection.execute(f"PRAGMA max_page_count={pages}"))
        with pytest.raises(TransportError, match="database or disk is full.*nothing of"):
            await transport.append_many(
                [LogItem(key=f"o{i}".encode(), value=b"x" * 4000) for i in range(50)]
            )
        await transport._run(lambda: connection.execute("PRAGMA max_page_count=1073741823"))
        written = await transport.append(LogItem(key=b"alice", value=b"after"))
        assert written.offset == 1  # the refused append left nothing behind
    finally:
        await transport.close()


async def _consumer_at_end(transport: LocalLogTransport) -> LocalLogConsumer:
    consumer = transport.consumer("idle")

    async def nothing(_partitions: set[int]) -> None:
        return None

    await consumer.start(nothing, nothing)
    return consumer


@contextlib.asynccontextmanager
async def _two_connections(
    path: Path,
) -> AsyncIterator[tuple[LocalLogTransport, LocalLogTransport]]:
    """Two transports on one log file, as two processes have (a connection each); the
    other's opens first, so the first one's marks start where a reopened one's would."""
    transport, other = LocalLogTransport(path, partitions=4), LocalLogTransport(path, partitions=4)
    await other.start()
    await transport.start()
    try:
        yield transport, other
    finally:
        await other.close()
        await transport.close()


async def test_an_idle_consumer_reads_no_record_until_the_file_changes(tmp_path: Path) -> None:
    """Polling a quiet log asks SQLite whether the file changed, one call per poll, instead
    of reading every partition (12 calls to the log's thread every 50 ms, ~1.7 % of a core
    on an idle server)."""
    transport = LocalLogTransport(tmp_path / "log.sqlite3", partitions=4)
    await transport.start()
    try:
        await transport.append(LogItem(b"alice", b"one"))
        consumer = await _consumer_at_end(transport)
        assert [e.value for b in (await consumer.poll(100, 0.2)).values() for e in b] == [b"one"]
        assert await consumer.poll(100, 0.01) == {}  # a read that finds nothing
        statements: list[str] = []
        await transport._run(
            lambda: transport._require_connection().set_trace_callback(statements.append)
        )
        assert await consumer.poll(100, 0.3) == {}
        assert statements and all(s == "PRAGMA data_version" for s in statements), statements
        await transport.append(LogItem(b"alice", b"two"))
        assert [e.value for b in (await consumer.poll(100, 2)).values() for e in b] == [b"two"]
    finally:
        await transport.close()


async def test_a_quiet_consumer_sees_another_connection_s_append(tmp_path: Path) -> None:
    """Another process's append does not wake this one: the file's ``data_version`` tells
    the next poll that it must read."""
    async with _two_connections(tmp_path / "log.sqlite3") as (transport, other):
        consumer = await _consumer_at_end(transport)
        assert await consumer.poll(100, 0.2) == {}
        await other.append(LogItem(b"bob", b"elsewhere"))
        found = await consumer.poll(100, 2)
        assert [e.value for b in found.values() for e in b] == [b"elsewhere"]


async def test_a_quiet_consumer_sees_an_append_whose_caller_was_cancelled(tmp_path: Path) -> None:
    """The append committed on the log's thread, but its caller never counted it (it was
    cancelled while waiting): the connection's own change count still makes the next poll
    read it."""
    transport = LocalLogTransport(tmp_path / "log.sqlite3", partitions=4)
    await transport.start()
    try:
        consumer = await _consumer_at_end(transport)
        assert await consumer.poll(100, 0.2) == {}
        appends = transport.appends
        await transport._run(transport._append_many, [LogItem(b"carol", b"uncounted")])
        assert transport.appends == appends
        found = await consumer.poll(100, 2)
        assert [e.value for b in found.values() for e in b] == [b"uncounted"]
    finally:
        await transport.close()


async def test_a_seek_on_a_quiet_log_reads_from_the_new_position(tmp_path: Path) -> None:
    transport = LocalLogTransport(tmp_path / "log.sqlite3", partitions=1)
    await transport.start()
    try:
        await transport.append_many([LogItem(b"dan", b"a"), LogItem(b"dan", b"b")])
        consumer = await _consumer_at_end(transport)
        assert len((await consumer.poll(100, 0.2))[0]) == 2
        assert await consumer.poll(100, 0.2) == {}
        consumer.seek(0, 1)
        assert [e.value for e in (await consumer.poll(100, 0.5))[0]] == [b"b"]
    finally:
        await transport.close()


async def test_a_quiet_consumer_reads_again_after_its_transport_reopens(tmp_path: Path) -> None:
    """Found by a review: the change mark is a connection's (both counts start again with a
    new one), so after a reopen its first mark could equal the last, and a record appended
    by another process meanwhile was never read."""
    async with _two_connections(tmp_path / "log.sqlite3") as (transport, other):
        consumer = await _consumer_at_end(transport)
        assert await consumer.poll(10, 0.1) == {}
        await transport.close()
        await other.append(LogItem(b"bob", b"while closed"))
        await transport.start()
        found = await consumer.poll(10, 1)
        assert [e.value for b in found.values() for e in b] == [b"while closed"]
