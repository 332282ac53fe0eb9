"""A pack belongs to the log it was built from: opened on another log it is refused, not
served as it is while that log's writes are skipped (found by a new-user trial: an
embedded pack reopened on Kafka, and a pack reopened after its topic was made anew)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from prme import MemoryEngine
from prme.query.pack_config import PACK_FILE
from prme.schemas.config import Settings
from prme.schemas.errors import ConfigurationError


async def _write(settings: Settings, provider: Any, count: int) -> None:
    engine = await MemoryEngine.open(
        settings=settings, embedding_provider=provider, create_if_missing=True
    )
    try:
        for index in range(count):
            await engine.store(f"alice keeps note {index}", user_id="alice")
    finally:
        await engine.close()


async def test_a_pack_of_the_local_log_is_refused_on_kafka(
    local_settings: Settings, hashed_provider: Any
) -> None:
    await _write(local_settings, hashed_provider, 3)
    saved = json.loads((local_settings.data_path / PACK_FILE).read_text())
    assert saved["log"] == {"transport": "local", "topic": None}
    kafka = local_settings.replace(log={"transport": "kafka", "topic": "prme.other"})
    with pytest.raises(ConfigurationError) as refused:
        await MemoryEngine.open(settings=kafka, embedding_provider=hashed_provider)
    assert "built from the local log in the pack" in str(refused.value)
    assert "Kafka topic 'prme.other'" in str(refused.value)
    # still the local pack it was
    engine = await MemoryEngine.open(settings=local_settings, embedding_provider=hashed_provider)
    try:
        assert len(await engine.history("alice")) == 3
    finally:
        await engine.close()


async def test_a_pack_made_before_the_log_was_saved_takes_the_log_it_is_opened_on(
    local_settings: Settings, hashed_provider: Any
) -> None:
    await _write(local_settings, hashed_provider, 1)
    path = local_settings.data_path / PACK_FILE
    saved = json.loads(path.read_text())
    del saved["log"]
    path.write_text(json.dumps(saved))
    await _write(local_settings, hashed_provider, 1)
    assert json.loads(path.read_text())["log"] == {"transport": "local", "topic": None}


async def test_read_models_ahead_of_the_log_are_refused_and_kept(
    local_settings: Settings, hashed_provider: Any
) -> None:
    """The log is replaced under the pack (as a Kafka topic deleted and made again):
    the shard applied offsets this log has not reached."""
    settings = local_settings.replace(log={"partitions": 1})
    await _write(settings, hashed_provider, 5)
    for name in ("log.sqlite3", "log.sqlite3-wal", "log.sqlite3-shm"):
        (settings.data_path / name).unlink(missing_ok=True)
    with pytest.raises(ConfigurationError) as refused:
        await MemoryEngine.open(settings=settings, embedding_provider=hashed_provider)
    assert "partition 0" in str(refused.value) and "applied offset 4" in str(refused.value)
    assert "built from another log" in str(refused.value)
    assert (settings.data_path / "shards" / "p0" / "events").is_dir()  # nothing deleted


async def test_on_kafka_a_pack_ahead_of_a_topic_made_anew_is_refused(
    kafka_settings: Settings, hashed_provider: Any
) -> None:
    """The trial's case: a node restarted on its data directory against a topic that was
    made anew (here: a fresh topic of the same name in the pack's own record)."""
    settings = kafka_settings.replace(log={"partitions": 1})
    await _write(settings, hashed_provider, 3)
    fresh = settings.log.topic + "-anew"
    path = settings.data_path / PACK_FILE
    saved = json.loads(path.read_text())
    saved["log"]["topic"] = fresh
    path.write_text(json.dumps(saved))
    anew = settings.replace(log={"topic": fresh, "dlq_topic": fresh + ".dlq"})
    with pytest.raises(Exception) as refused:
        await MemoryEngine.open(settings=anew, embedding_provider=hashed_provider)
    assert "beyond the end of this log's partition" in str(refused.value)  # 503: not served
    assert "built from another log" in str(refused.value)
