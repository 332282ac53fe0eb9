"""The projector runner: resume, dead letters, rebuild, embedding identity."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from prme import MemoryEngine
from prme.producers.factory import open_transport
from prme.producers.producer import MessageDraft, Producer
from prme.producers.transport import LogItem
from prme.projectors.dead_letters import dead_letters_of
from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider
from prme.schemas.config import Settings
from prme.schemas.errors import ConfigurationError


class CountingProvider(HashedBagOfWordsProvider):
    """Counts how many texts it was asked to encode."""

    def __init__(self, version: str = "1") -> None:
        super().__init__()
        self.encoded = 0
        self._version = version

    @property
    def model_version(self) -> str:
        return super().model_version + ":" + self._version

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        self.encoded += len(texts)
        return await super().embed(texts)


async def _append_messages(settings: Settings, owner: str, contents: list[str]) -> None:
    transport = open_transport(settings)
    await transport.start()
    try:
        producer = Producer(transport)
        for content in contents:
            await producer.append_message(
                MessageDraft(owner=owner, session_id="s", content=content)
            )
    finally:
        await transport.close()


async def test_a_restarted_engine_resumes_from_stored_offsets(local_settings: Settings) -> None:
    provider = CountingProvider()
    async with await MemoryEngine.create(
        settings=local_settings, embedding_provider=provider
    ) as engine:
        await engine.store("first", "alice", session_id="s")
    await _append_messages(local_settings, "alice", ["second", "third"])
    async with await MemoryEngine.open(
        settings=local_settings, embedding_provider=provider
    ) as engine:
        history = await engine.history("alice", "s")
        assert [m.content for m in history] == ["first", "second", "third"]
    assert provider.encoded == 3


async def check_dead_letter_path(settings: Settings, provider: Any) -> None:
    """An undecodable record lands in the dead letters and projection goes on (shared by
    the local test here and the Kafka one in test_engine_kafka.py)."""
    transport = open_transport(settings)
    await transport.start()
    await transport.append(LogItem(b"alice", b"\xc1 not msgpack"))
    await transport.close()
    async with await MemoryEngine.create(settings=settings, embedding_provider=provider) as engine:
        await engine.store("after the bad record", "alice")
        assert [r.text for r in (await engine.retrieve("bad record", "alice")).results] == [
            "after the bad record"
        ]
    letters = await dead_letters_of(settings)
    assert [(letter.value, "msgpack" in letter.error) for letter in letters] == [
        (b"\xc1 not msgpack", True)
    ]


async def test_an_undecodable_record_goes_to_the_dead_letters_and_projection_goes_on(
    local_settings: Settings, hashed_provider: Any
) -> None:
    await check_dead_letter_path(local_settings, hashed_provider)


async def test_rebuild_swaps_in_equal_models_without_reencoding(local_settings: Settings) -> None:
    provider = CountingProvider()
    async with await MemoryEngine.create(
        settings=local_settings, embedding_provider=provider
    ) as engine:
        for i in range(30):
            await engine.store(f"memory number {i} about topic {i % 3}", f"user{i % 5}", wait=False)
        await engine.runner.catch_up()
        before = {p: s.digests() for p, s in engine.runner.shards.items() if s.models}
        encoded = provider.encoded
        replayed = await engine.rebuild()
        assert sum(replayed.values()) >= 30
        after = {p: s.digests() for p, s in engine.runner.shards.items() if s.models}
        assert after == before
        assert provider.encoded == encoded
        response = await engine.retrieve("memory topic", "user1")
        assert response.results


async def test_a_pack_built_with_a_custom_provider_needs_it_to_reopen(
    local_settings: Settings,
) -> None:
    async with await MemoryEngine.create(
        settings=local_settings, embedding_provider=CountingProvider()
    ):
        pass
    with pytest.raises(ConfigurationError, match="custom embedding provider"):
        await MemoryEngine.open(settings=local_settings)


async def test_another_provider_identity_reports_a_mismatch_until_rebuild(
    local_settings: Settings,
) -> None:
    async with await MemoryEngine.create(
        settings=local_settings, embedding_provider=CountingProvider("1")
    ) as engine:
        await engine.store("green tea in the morning", "alice")
    async with await MemoryEngine.open(
        settings=local_settings, embedding_provider=CountingProvider("2")
    ) as engine:
        response = await engine.retrieve("green tea", "alice", min_score=0.9)
        vector = next(c for c in response.receipt.channels if c.name == "vector")
        assert not vector.used and "mismatch" in (vector.error or "")
        assert response.receipt.embedding.mismatch
        assert [r.text for r in response.results] == ["green tea in the morning"]
        assert all(r.metadata.get("min_score_skipped") is True for r in response.results)
        assert response.receipt.min_score_skipped
        await engine.rebuild(["vector"])
        rebuilt = await engine.retrieve("green tea", "alice", min_score=0.1)
        assert next(c for c in rebuilt.receipt.channels if c.name == "vector").used
        assert not rebuilt.receipt.min_score_skipped


async def test_queries_keep_answering_while_a_rebuild_runs(local_settings: Settings) -> None:
    import asyncio

    from prme.producers.producer import MessageDraft

    async with await MemoryEngine.create(
        settings=local_settings, embedding_provider=CountingProvider()
    ) as engine:
        drafts = [
            MessageDraft(owner="alice", content=f"filler note {i} about gardening")
            for i in range(1500)
        ]
        for start in range(0, len(drafts), 500):
            await engine.store_many(drafts[start : start + 500])
        await engine.store("The Aurora launch is on Friday.", "alice")
        rebuild = asyncio.create_task(engine.rebuild(["vector", "lexical", "graph"]))
        answers: list[str] = []
        while not rebuild.done():
            response = await engine.retrieve("Aurora launch Friday", "alice", top_k=1)
            answers.append(response.results[0].text)
        await rebuild
        assert len(answers) >= 3
        assert set(answers) == {"The Aurora launch is on Friday."}
        after = await engine.retrieve("Aurora launch Friday", "alice", top_k=1)
        assert after.results[0].text == "The Aurora launch is on Friday."


async def test_an_apply_fault_that_is_not_the_records_stops_the_projector_without_dead_letters(
    local_settings: Settings, hashed_provider: Any
) -> None:
    from prme.schemas.errors import ShardUnavailable

    engine = await MemoryEngine.create(settings=local_settings, embedding_provider=hashed_provider)
    try:
        first = await engine.store("before the fault", "alice")
        shard = await engine.runner.shard_for("alice")
        # A real fault in one read model: its SQLite connection goes away under it.
        await shard.run(lambda: shard.models["graph"]._db.close())  # type: ignore[attr-defined]
        with pytest.raises(ShardUnavailable, match="projector stopped"):
            await engine.store("after the fault", "alice")
        assert engine.runner.failure is not None
        assert engine.runner.dead_letter_count == 0
        assert first.token.offset == shard.models["history"].applied_offset()
    finally:
        await engine.close()


async def test_a_transient_log_error_is_waited_out_and_the_batch_applied_once(
    local_settings: Settings, hashed_provider: Any
) -> None:
    """From a Kafka fault trial: a changelog publish that timed out while brokers were down
    (``TransportUnavailable``) stopped the projector for good; two stalled brokers stopped
    every node of a cluster. Now the projector says it is retrying, waits, reads the
    partition again from what its shard applied, and applies every record once."""
    from prme.query.service import readiness
    from prme.schemas.errors import TransportUnavailable

    engine = await MemoryEngine.create(settings=local_settings, embedding_provider=hashed_provider)
    try:
        await engine.store("before the outage", "alice")
        shard = await engine.runner.shard_for("alice")
        apply = shard.apply
        faults = 2
        seen_retrying: list[str] = []

        async def flaky(entries: Any, encode: Any) -> Any:
            nonlocal faults
            if faults:
                faults -= 1
                if engine.runner.retrying is not None:
                    seen_retrying.append((await readiness(engine)).detail)
                raise TransportUnavailable("kafka: changelog publish timed out after 30s")
            return await apply(entries, encode)

        shard.apply = flaky  # type: ignore[method-assign]
        written = await engine.store_many(
            [MessageDraft(owner="alice", content=f"during the outage {i}") for i in range(3)]
        )
        assert faults == 0 and engine.runner.failure is None and engine.runner.retrying is None
        assert seen_retrying and "waits out a log error and tries again" in seen_retrying[0]
        assert (await readiness(engine)).ready
        history = await engine.history("alice", "default")
        assert [m.content for m in history] == [
            "before the outage",
            *(f"during the outage {i}" for i in range(3)),
        ]
        assert shard.applied_offset() == written[-1].token.offset
        assert engine.runner.dead_letter_count == 0
    finally:
        await engine.close()


async def test_a_retry_does_not_read_a_dead_letter_again(
    local_settings: Settings, hashed_provider: Any
) -> None:
    """From a review: the retry sought each partition back to what its models applied,
    which never passes a dead letter, so a partition ending in one sent it again at every
    retry, even when another partition had failed."""
    from prme.schemas.errors import TransportUnavailable

    engine = await MemoryEngine.create(settings=local_settings, embedding_provider=hashed_provider)
    try:
        await engine.store("before", "alice")
        await engine.runner.transport.append(LogItem(b"alice", b"\xc1 not msgpack"))
        await engine.store("first", "bob")  # waits: alice's dead letter was applied first
        assert engine.runner.dead_letter_count == 1
        bob = await engine.runner.shard_for("bob")
        assert bob is not await engine.runner.shard_for("alice")
        apply, faults = bob.apply, 1

        async def flaky(entries: Any, encode: Any) -> Any:
            nonlocal faults
            if faults:
                faults -= 1
                raise TransportUnavailable("kafka: changelog publish timed out after 30s")
            return await apply(entries, encode)

        bob.apply = flaky  # type: ignore[method-assign]
        await engine.store("second", "bob")
        assert faults == 0
        assert [m.content for m in await engine.history("bob", "default")] == ["first", "second"]
        assert engine.runner.dead_letter_count == 1
        assert len(await dead_letters_of(local_settings)) == 1
    finally:
        await engine.close()
