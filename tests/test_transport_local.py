"""The transport contract on the embedded SQLite log, plus what only it promises."""

from __future__ import annotations

from pathlib import Path

import pytest

from prme.producers.local_log import LocalLogTransport
from prme.schemas.config import Settings
from prme.schemas.errors import ConfigurationError

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
