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
