"""A write retried where the log could not deduplicate it (on Kafka: through another
process, after a restart) reaches the log again as the same event (its event id derives
from its request id). Every read model applies it once: the first copy wins, live and in
a rebuild (in this process, in worker processes, and of one model alone)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from prme import MemoryEngine, MessageDraft
from prme.producers.partitioner import partition_for_key
from prme.producers.producer import log_item
from prme.projectors import rebuild_worker
from prme.schemas.config import Settings
from prme.schemas.records import Record


async def append_again(engine: MemoryEngine, records: list[Record]) -> None:
    """What a second Kafka process appends: the same records, no dedupe entry to stop them."""
    producer = engine._producer
    items = [msgspec.structs.replace(log_item(r), dedupe_key=None) for r in records]
    positions = await producer.append_items(items, [r.event_id for r in records])
    await engine.wait_for(positions)


def digests(engine: MemoryEngine) -> dict[int, dict[str, str]]:
    return {p: shard.digests() for p, shard in sorted(engine.runner.shards.items())}


def draft(owner: str, content: str, request_id: str, session_id: str = "s") -> MessageDraft:
    return MessageDraft(owner=owner, session_id=session_id, content=content, request_id=request_id)


async def check_state(engine: MemoryEngine, archived: str, session: list[str]) -> None:
    texts = [r.text for r in (await engine.retrieve("vault code zebra", "alice")).results]
    assert "The vault code is zebra." not in texts  # archived, and a copy did not revive it
    assert (await engine.get_event(archived, "alice")).record.content == "The vault code is zebra."
    found = await engine.retrieve("apples", "alice")
    assert [r.text for r in found.results] == ["I like apples."]
    history = [m.content for m in await engine.history("bob", "s")]
    assert history == ["message 0", "message 1", "message 2"]
    shard = engine.runner.shards[engine.runner.transport.partition_for(b"bob")]
    edges = await shard.call(
        "graph",
        lambda graph: sorted(
            {
                (edge.src, edge.dst)
                for node_id in session
                for edge in graph.edges_of("bob", node_id)
                if edge.kind == "next"
            }
        ),
    )
    assert edges == sorted(zip(session, session[1:], strict=False))


async def test_a_repeated_event_is_applied_once_live_and_in_every_rebuild(
    tmp_path: Any, hashed_provider: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rebuild_worker, "MIN_RECORDS_PER_WORKER", 1)  # rebuild in workers
    # Two partitions, so that two worker processes stage them; each ends with a repeat.
    settings = Settings(data_dir=str(tmp_path / "pack")).replace(log={"partitions": 2})
    assert len({partition_for_key(owner, 2) for owner in (b"alice", b"bob")}) == 2
    async with await MemoryEngine.create(
        settings=settings, embedding_provider=hashed_provider
    ) as engine:
        producer = engine._producer
        vault = producer.build_message(draft("alice", "The vault code is zebra.", "v1"))
        await engine.store_many([draft("alice", "The vault code is zebra.", "v1")])
        await engine.archive(f"mem:{vault.event_id}", "alice")
        # A request id reused for other content: the first content stays the event's.
        await engine.store_many([draft("alice", "I like apples.", "k1")])
        session = [draft("bob", f"message {i}", f"b{i}") for i in range(3)]
        stored = await engine.store_many(session)
        ids = [r.node_ids[0] for r in stored]

        await append_again(engine, [vault])  # archived since: stays archived
        await append_again(
            engine, [producer.build_message(draft("alice", "My flight is on Friday.", "k1"))]
        )
        await append_again(engine, [producer.build_message(d) for d in session])
        await check_state(engine, vault.event_id, ids)
        live = digests(engine)
        # Staged without the events model, in worker processes and in this one; then all.
        for models, processes in ((["vector", "graph"], 2), (["vector", "lexical"], 1)):
            await engine.rebuild(models=models, processes=processes)
            assert digests(engine) == live, (models, processes)
            await check_state(engine, vault.event_id, ids)
        for processes in (2, 1):
            await engine.rebuild(processes=processes)
            assert digests(engine) == live, processes
        await check_state(engine, vault.event_id, ids)


async def test_after_an_erasure_the_same_request_id_is_a_new_write(
    tmp_path: Any, hashed_provider: Any
) -> None:
    settings = Settings(data_dir=str(tmp_path / "pack")).replace(log={"partitions": 1})
    async with await MemoryEngine.create(
        settings=settings, embedding_provider=hashed_provider
    ) as engine:
        await engine.store_many([draft("alice", "old note walrus", "n1")])
        await engine.erase_owner("alice")
        again = engine._producer.build_message(draft("alice", "new note penguin", "n1"))
        await append_again(engine, [again])
        assert [m.content for m in await engine.history("alice", "s")] == ["new note penguin"]
        digests = engine.runner.shards[0].digests()
        await engine.rebuild(models=["vector"])
        await engine.rebuild()
        assert engine.runner.shards[0].digests() == digests
        assert [r.text for r in (await engine.retrieve("penguin", "alice")).results] == [
            "new note penguin"
        ]


async def test_an_erased_owner_writing_a_request_id_again_is_written(
    tmp_path: Any, hashed_provider: Any
) -> None:
    """The local log's dedupe table forgets the erased owner's request ids: the same id
    after the erasure was answered with the erased write's position and written nowhere."""
    settings = Settings(data_dir=str(tmp_path / "pack")).replace(log={"partitions": 1})
    async with await MemoryEngine.create(
        settings=settings, embedding_provider=hashed_provider
    ) as engine:
        first = await engine.store("old note walrus", "alice", request_id="n1")
        await engine.erase_owner("alice")
        again = await engine.store("new note penguin", "alice", request_id="n1")
        assert again.token != first.token
        found = await engine.retrieve("penguin", "alice")
        assert [r.text for r in found.results] == ["new note penguin"]
