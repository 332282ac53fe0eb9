"""The engine on a real Kafka broker: read-your-writes, and owners of partitions this
process does not project."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import msgspec
import pytest

from prme import MemoryEngine, MessageDraft
from prme.schemas.config import Settings
from prme.schemas.errors import RequestIdConflict, ShardUnavailable

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


async def test_a_request_id_outlives_the_process_map_through_the_events_model(
    kafka_settings: Settings, hashed_provider: Any
) -> None:
    """Kafka cannot look a key up and a new process's map is empty: the node asks the
    events model of the partition it holds, so a retry after a restart writes nothing and
    answers with the first write, and other content under the same request id is refused
    (both used to be written, the second silently dropped by the projectors)."""
    sent = datetime(2026, 5, 1, 10, 0, tzinfo=timezone(timedelta(hours=2)))
    draft = MessageDraft(
        owner="alice",
        session_id="s1",
        content="Aurora ships on Friday",
        metadata={"b": 1, "a": [2, 3]},
        occurred_at=sent,
        request_id="r-1",
    )
    async with await MemoryEngine.create(
        settings=kafka_settings, embedding_provider=hashed_provider
    ) as engine:
        [first] = await engine.store_many([draft])
    async with await MemoryEngine.open(
        settings=kafka_settings, embedding_provider=hashed_provider
    ) as engine:
        ends = await engine.runner.transport.end_offsets()
        same_instant = msgspec.structs.replace(
            draft, metadata={"a": [2, 3], "b": 1}, occurred_at=sent.astimezone(UTC)
        )
        [again] = await engine.store_many([same_instant])
        assert (again.event_id, again.token) == (first.event_id, first.token)
        with pytest.raises(RequestIdConflict, match="'r-1' of owner 'alice' was already used"):
            await engine.store_many([msgspec.structs.replace(draft, content="Aurora slips")])
        assert await engine.runner.transport.end_offsets() == ends
        history = await engine.history("alice", "s1")
        assert [m.content for m in history] == ["Aurora ships on Friday"]


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


async def test_a_runner_closed_while_its_first_assignment_opens_a_shard_stops_cleanly(
    kafka_settings: Settings, hashed_provider: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """close() during the group's first assignment: the assignment must not seek on the
    closed consumer (it logged "kafka consumer is not started"), and every shard it opened
    is closed."""
    from prme.producers.factory import open_transport
    from prme.projectors.runner import ProjectorRunner

    transport = open_transport(kafka_settings)
    await transport.start()
    runner = ProjectorRunner(kafka_settings, transport, hashed_provider)
    opening = asyncio.Event()
    release = asyncio.Event()
    opened: list[Any] = []
    new_shard = runner._new_shard

    async def slow_new_shard(partition: int, *, lazily: bool) -> Any:
        opening.set()
        await release.wait()
        shard = await new_shard(partition, lazily=lazily)
        opened.append(shard)
        return shard

    runner._new_shard = slow_new_shard  # type: ignore[method-assign]
    try:
        starting = asyncio.create_task(runner.start())
        await asyncio.wait_for(opening.wait(), 60)
        closing = asyncio.create_task(runner.close())
        await asyncio.sleep(0.5)
        release.set()
        await asyncio.wait_for(closing, 60)
        await asyncio.wait_for(starting, 60)
    finally:
        release.set()
        await transport.close()
    assert "consumer is not started" not in caplog.text
    assert all(shard._closed is not None and shard._closed.done() for shard in opened)
    assert runner.shards == {}


async def test_a_retry_through_another_process_is_the_same_event_applied_once(
    kafka_settings: Settings, hashed_provider: Any
) -> None:
    """A second process's producer does not know the first one's request ids, so the
    retry reaches the log again; it carries the same event id, and every read model
    applies it once."""
    from prme.producers.factory import open_transport
    from prme.producers.producer import Producer

    async with await MemoryEngine.create(
        settings=kafka_settings, embedding_provider=hashed_provider
    ) as engine:
        draft = MessageDraft(
            owner="alice", session_id="s1", content="Renew the passport.", request_id="renew-1"
        )
        first = await engine.add_messages("alice", "s1", [draft])
        other = open_transport(kafka_settings)
        await other.start()
        try:
            again = await Producer(other).append_message(draft)
        finally:
            await other.close()
        assert again.position != first[0].token  # written twice: another process's dedupe
        assert again.event_id == first[0].event_id
        await engine.wait_for([again.position])
        history = await engine.history("alice", "s1")
        assert [m.content for m in history] == ["Renew the passport."]
        found = await engine.retrieve("passport", "alice")
        assert [r.text for r in found.results] == ["Renew the passport."]

        # A replacement retried elsewhere: its clear marker is the same event too, so the
        # repeated messages are not hidden behind a second clear.
        drafts = [
            MessageDraft(owner="alice", session_id="s1", content=f"new {i}", request_id=f"n{i}")
            for i in range(2)
        ]
        await engine.replace_history("alice", "s1", drafts)
        other = open_transport(kafka_settings)
        await other.start()
        try:
            producer = Producer(other)
            records = producer.build_replacement("alice", "s1", "default", drafts)
            receipts = await producer.append_records(records)
        finally:
            await other.close()
        await engine.wait_for([receipt.position for receipt in receipts])
        assert [m.content for m in await engine.history("alice", "s1")] == ["new 0", "new 1"]


async def test_a_second_delete_of_a_message_writes_nothing_on_kafka(
    kafka_settings: Settings, hashed_provider: Any
) -> None:
    """Each delete of the same message appended a ``message_deleted`` again; now the
    second is the first deletion's write, also after a restart (the events model knows
    it)."""
    async with await MemoryEngine.create(
        settings=kafka_settings, embedding_provider=hashed_provider
    ) as engine:
        stored = await engine.store("gone", "alice", session_id="s1")
        first = await engine.delete_message("alice", stored.event_id)
        assert await engine.delete_message("alice", stored.event_id) == first
        ends = await engine.runner.transport.end_offsets()
    async with await MemoryEngine.open(
        settings=kafka_settings, embedding_provider=hashed_provider
    ) as engine:
        assert await engine.delete_message("alice", stored.event_id) == first
        assert await engine.runner.transport.end_offsets() == ends
        assert await engine.history("alice", "s1") == []


async def test_a_request_id_another_process_used_first_for_other_content_is_a_conflict(
    kafka_settings: Settings, hashed_provider: Any
) -> None:
    """From a new-user trial: while an owner's node was down, two nodes each appended a
    write with one request id and different content; both answered 201 with the same
    event id, and only the first on the log was applied. The check before an append sees
    this process's writes and the applied ones, not another process's unapplied write; now
    the applied event is compared with the write once it is applied (409)."""
    from prme.producers.factory import open_transport
    from prme.producers.producer import Producer
    from prme.schemas.errors import RequestIdConflict

    async with await MemoryEngine.create(
        settings=kafka_settings, embedding_provider=hashed_provider
    ) as engine:
        other = open_transport(kafka_settings)
        await other.start()
        try:
            for i in range(5):
                owner = f"dup-{i}"
                first = MessageDraft(owner=owner, session_id="s", content="first", request_id="r")
                await Producer(other).append_message(first)
                with pytest.raises(RequestIdConflict, match="reached the log first|already used"):
                    await engine.store("second", owner, session_id="s", request_id="r")
                assert [m.content for m in await engine.history(owner, "s")] == ["first"]
                # The retry of the write that won is answered with the applied copy.
                same = await engine.store("first", owner, session_id="s", request_id="r")
                applied = await engine.get_event(same.event_id, owner)
                assert (same.token.partition, same.token.offset) == (
                    applied.partition,
                    applied.offset,
                )
                assert [m.content for m in await engine.history(owner, "s")] == ["first"]
        finally:
            await other.close()
