"""The engine on a real Kafka broker: read-your-writes, and owners of partitions this
process does not project."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from prme import MemoryEngine, MessageDraft
from prme.schemas.config import Settings
from prme.schemas.errors import ShardUnavailable

from .test_projector import check_dead_letter_path

pytestmark = pytest.mark.kafka


async def test_store_then_retrieve_and_history_agree_on_kafka(
    kafka_settings: Settings, hashed_provider: Any
) -> None:
    async with await MemoryEngine.create(
        settings=kafka_settings, embedding_provider=hashed_provider
    ) as engine:
        await engine.store("Aurora needs approval before deployment.", "alice", session_id="s1")
        response = await engine.retrieve("Aurora approval", "alice")
        assert [r.text for r in response.results] == ["Aurora needs approval before deployment."]

        results = await engine.add_messages(
            "alice",
            "s1",
            [MessageDraft(owner="alice", session_id="s1", content=f"m{i}") for i in range(3)],
            wait=False,
        )
        history = await engine.history("alice", "s1", after=results[-1].token)
        assert [m.content for m in history][-3:] == ["m0", "m1", "m2"]
        await engine.clear_history("alice", "s1")
        assert await engine.history("alice", "s1") == []


async def test_owners_of_partitions_another_member_holds_are_refused(
    kafka_settings: Settings, hashed_provider: Any, tmp_path: Any
) -> None:
    other = kafka_settings.replace(data_dir=str(tmp_path / "other"))
    first = await MemoryEngine.create(settings=kafka_settings, embedding_provider=hashed_provider)
    second = await MemoryEngine.create(settings=other, embedding_provider=hashed_provider)
    try:
        deadline = asyncio.get_running_loop().time() + 60
        while asyncio.get_running_loop().time() < deadline:
            held = [set(first.runner.shards), set(second.runner.shards)]
            if all(held) and held[0] | held[1] == set(range(4)) and not held[0] & held[1]:
                break
            await asyncio.sleep(0.2)
        else:
            pytest.fail(f"the group did not split the partitions: {held}")
        owner = next(
            f"user{i}"
            for i in range(100)
            if first.runner.transport.partition_for(f"user{i}".encode()) in second.runner.shards
        )
        with pytest.raises(ShardUnavailable, match="does not project"):
            await first.retrieve("anything", owner)
        stored = await second.store("held by the second member", owner)
        assert stored.token.partition in second.runner.shards
        assert [r.text for r in (await second.retrieve("second member", owner)).results] == [
            "held by the second member"
        ]
    finally:
        await second.close()
        await first.close()


async def test_an_undecodable_record_on_kafka_goes_to_the_dead_letter_topic(
    kafka_settings: Settings, hashed_provider: Any
) -> None:
    await check_dead_letter_path(kafka_settings, hashed_provider)
