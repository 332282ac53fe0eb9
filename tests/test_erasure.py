"""Erasure reaches the disk: after ``erase_owner`` no file under the data directory (log,
key store, read models, WAL files, Tantivy segments, vector shards, vector cache) holds
the owner's text, and the log keeps only the owner's envelopes (crypto-shredding)."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import struct
import threading
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest

from prme import MemoryEngine, MessageDraft
from prme.producers import free_space
from prme.producers.audit import audit_owner
from prme.producers.partitioner import partition_for_key
from prme.projectors import rebuild_worker
from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider
from prme.schemas.config import Settings

BOB = "bob-1"
"""Lives in alice's partition (of 4): their documents share Tantivy segments and SQLite
pages, so erasing alice must purge around bob's data, not drop whole files."""


def files_holding(root: Path, marker: str) -> list[str]:
    """Every file under ``root`` whose bytes contain ``marker`` or its lower-cased form
    (entity ids and index terms are lower-cased), like ``grep -rli``."""
    needles = {marker.encode(), marker.lower().encode()}
    found = []
    for path in root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            if any(needle in data for needle in needles):
                found.append(str(path.relative_to(root)))
    return sorted(found)


def vector_forms(vector: Sequence[float]) -> tuple[bytes, bytes]:
    """A vector as the files hold it: little-endian float32 (segments, vector cache) and
    CBOR's items (qdrant-edge's WAL): each float in the shortest form that keeps it, half
    (``f9``) or single (``fa``) precision, big-endian."""
    single = struct.pack(f"<{len(vector)}f", *vector)
    items = []
    for (component,) in struct.iter_unpack("<f", single):
        half = struct.pack(">e", component) if abs(component) < 65504 else b""
        if half and struct.unpack(">e", half)[0] == component:
            items.append(b"\xf9" + half)
        else:
            items.append(b"\xfa" + struct.pack(">f", component))
    return single, b"".join(items)


def files_holding_vectors(root: Path, vectors: Sequence[Sequence[float]]) -> list[str]:
    """Every file under ``root`` that holds one of ``vectors`` in either form (a file an
    index build swaps away meanwhile holds nothing)."""
    needles = [form for vector in vectors for form in vector_forms(vector)]
    found = []
    for folder, _, names in os.walk(root):
        for name in names:
            path = Path(folder, name)
            try:
                data = path.read_bytes()
            except (FileNotFoundError, IsADirectoryError):
                continue
            if any(needle in data for needle in needles):
                found.append(str(path.relative_to(root)))
    return sorted(found)


def owner_vectors(engine: MemoryEngine, owner: str, but_not: str) -> list[list[float]]:
    """The vectors of ``owner``'s points that ``but_not`` holds no copy of."""
    stores = [shard.models.get("vector") for shard in engine.runner.shards.values()]
    points = [point for store in stores if store is not None for point in store._points()]  # type: ignore[attr-defined]
    others = {vector_forms(p.vector)[0] for p in points if p.payload.get("owner") == but_not}
    return [
        p.vector
        for p in points
        if p.payload.get("owner") == owner and vector_forms(p.vector)[0] not in others
    ]


def markers() -> tuple[str, str]:
    tag = uuid.uuid4().hex[:10]
    # Capitalised, so the entity extractor makes graph entities of them too.
    return f"Alicemark{tag}", f"Bobmark{tag}"


def drafts(owner: str, marker: str) -> list[MessageDraft]:
    return [
        MessageDraft(
            owner=owner,
            content=f"The vault code is {marker} and nobody else knows it. Ask {marker} Smith.",
            session_id="s1",
            name=f"{owner}-{marker}-speaker",
            metadata={"note": marker},
            fields={"extra": marker},
        ),
        MessageDraft(
            owner=owner,
            # Two words of the marker: with one, the hashed provider's 64 signed slots gave
            # alice's and bob's texts the same vector in ~2 % of runs.
            content=[{"type": "text", "text": f"Remember {marker} for Lisbon ({marker}trip)."}],
            session_id="s1",
            role="assistant",
            tool_calls=[{"id": "c1", "name": "lookup", "args": {"q": marker}}],
        ),
    ]


async def write_and_erase(engine: MemoryEngine, data_dir: Path) -> tuple[str, str, Any]:
    """Both owners write their marker (and one text they share); alice is erased: neither
    her text nor her texts' vectors stay in a file."""
    assert partition_for_key(b"alice", 4) == partition_for_key(BOB.encode(), 4)
    alice, bob = markers()
    await engine.store_many([*drafts("alice", alice), *drafts(BOB, bob)])
    shared = "Both of us like the shared sentence about the harbour."
    await engine.store(shared, "alice")
    stored = await engine.store(shared, BOB)
    await engine.archive(stored.node_ids[0], BOB, reason="kept")
    assert files_holding(data_dir, alice), "the marker must reach the read models first"
    vectors = owner_vectors(engine, "alice", but_not=BOB)
    assert len(vectors) == 2 and files_holding_vectors(data_dir, vectors)
    before = engine.runner.vector_cache.count()
    result = await engine.erase_owner("alice")
    # alice's two texts leave the cache; the text bob shares stays.
    assert engine.runner.vector_cache.count() == before - 2
    assert files_holding_vectors(data_dir, vectors) == []
    return alice, bob, result


async def check_bob_intact(engine: MemoryEngine, bob: str) -> None:
    found = await engine.retrieve(f"vault code {bob}", BOB)
    assert any(bob in result.text for result in found.results)
    history = await engine.history(BOB, "s1")
    assert [message.name for message in history][0] == f"{BOB}-{bob}-speaker"
    assert history[0].metadata == {"note": bob}
    assert (await engine.retrieve("vault code", "alice")).results == []
    assert await engine.history("alice", "s1") == []


async def audit(engine: MemoryEngine, owner: str) -> list[dict[str, Any]]:
    rows = [row async for row in audit_owner(engine._transport, owner, keys=engine.runner.keys)]
    return [msgspec.to_builtins(row) for row in rows]


async def test_erasing_an_owner_leaves_no_file_with_its_text_on_the_local_log(
    local_settings: Settings, hashed_provider: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rebuild_worker, "MIN_RECORDS_PER_WORKER", 1)  # rebuild in workers
    data_dir = local_settings.data_path
    engine = await MemoryEngine.create(settings=local_settings, embedding_provider=hashed_provider)
    try:
        alice, bob, _ = await write_and_erase(engine, data_dir)
        assert files_holding(data_dir, alice) == []
        assert files_holding(data_dir, bob) != []
        await check_bob_intact(engine, bob)
        alice_rows = await audit(engine, "alice")
        assert [row["record"]["kind"] for row in alice_rows] == [
            "message",
            "message",
            "message",
            "owner_erased",
        ]
        for row in alice_rows[:3]:
            assert row["record"]["erased"] is True and "content" not in row["record"]
        bob_rows = await audit(engine, BOB)
        assert bob in bob_rows[0]["record"]["content"] and "erased" not in bob_rows[0]["record"]
        # A rebuild replays alice's sealed records: with the key gone they become nothing.
        await engine.rebuild(processes=2)
        assert files_holding(data_dir, alice) == []
        await check_bob_intact(engine, bob)
    finally:
        await engine.close()
    reopened = await MemoryEngine.open(settings=local_settings, embedding_provider=hashed_provider)
    try:
        await check_bob_intact(reopened, bob)
    finally:
        await reopened.close()
    assert files_holding(data_dir, alice) == []


@pytest.fixture
async def engine(local_settings: Settings, hashed_provider: Any) -> AsyncIterator[MemoryEngine]:
    async with await MemoryEngine.create(
        settings=local_settings, embedding_provider=hashed_provider
    ) as opened:
        yield opened


async def test_the_log_never_holds_the_text_in_plain(
    engine: MemoryEngine, local_settings: Settings
) -> None:
    alice, _ = markers()
    await engine.store_many(drafts("alice", alice))
    assert (await audit(engine, "alice"))[0]["record"]["metadata"] == {"note": alice}
    await engine.close()
    log_files = [p for p in local_settings.data_path.iterdir() if p.name.startswith("log.")]
    assert log_files and all(alice.encode() not in p.read_bytes() for p in log_files)


async def test_an_owner_erased_writes_again_under_a_new_key(engine: MemoryEngine) -> None:
    old, new = markers()
    await engine.store(f"old secret {old}", "alice")
    await engine.erase_owner("alice")
    await engine.store(f"new secret {new}", "alice")
    assert [r.text for r in (await engine.retrieve("secret", "alice")).results] == [
        f"new secret {new}"
    ]
    kinds = [
        (row["record"]["kind"], "erased" in row["record"]) for row in await audit(engine, "alice")
    ]
    assert kinds == [("message", True), ("owner_erased", False), ("message", False)]


def broker_log_dir(bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Path | None:
    """The log directory of the test session's broker started by kafka.sh (its data dir
    holds a ``bootstrap`` file naming it); ``None`` for a broker started elsewhere."""
    for named in tmp_path_factory.getbasetemp().glob("kafka*/bootstrap"):
        if named.read_text().strip() == bootstrap:
            return named.parent / "logs"
    return None


@pytest.mark.kafka
async def test_erasing_an_owner_on_kafka_leaves_no_text_on_the_node_or_the_broker(
    kafka_settings: Settings,
    hashed_provider: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    data_dir = kafka_settings.data_path
    engine = await MemoryEngine.create(settings=kafka_settings, embedding_provider=hashed_provider)
    broker = broker_log_dir(kafka_settings.log.bootstrap, tmp_path_factory)
    alice_vectors: list[list[float]] = []

    async def erase(owner: str, *, wait: bool = True) -> Any:
        alice_vectors.extend(owner_vectors(engine, "alice", but_not=BOB))
        return await erase_owner(owner, wait=wait)

    erase_owner, engine.erase_owner = engine.erase_owner, erase  # type: ignore[method-assign]
    try:
        alice, bob, _ = await write_and_erase(engine, data_dir)
        assert files_holding(data_dir, alice) == []
        await check_bob_intact(engine, bob)
        # This test's topics only: the session's broker holds every test's (reading them
        # all took this test 275 s in CI).
        topic = kafka_settings.log.topic
        topics = [] if broker is None else [d for d in broker.iterdir() if d.name.startswith(topic)]
        if broker is not None:  # the vector changelog holds no vector in plain
            vectors = alice_vectors + owner_vectors(engine, BOB, but_not="alice")
            assert len(alice_vectors) == 2
            assert [f for d in topics for f in files_holding_vectors(d, vectors)] == []
        alice_rows = await audit(engine, "alice")
        assert alice_rows and all(row["record"].get("erased") for row in alice_rows[:-1]), (
            alice_rows
        )
        if broker is not None:
            held = [f for d in topics for f in files_holding(d, alice) + files_holding(d, bob)]
            assert held == [], held  # the events topic only ever had ciphertext
            assert any(d.name.startswith(topic + ".keys-") for d in topics)
            assert any(d.name.startswith(topic + ".vectors-") for d in topics)
    finally:
        await engine.close()
    assert files_holding(data_dir, alice) == []


@pytest.mark.kafka
async def test_compaction_removes_an_erased_owners_key_from_the_broker(
    kafka_settings: Settings,
    hashed_provider: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    broker = broker_log_dir(kafka_settings.log.bootstrap, tmp_path_factory)
    if broker is None:
        pytest.skip("the broker's log directory is not on this machine")
    fast = {
        "segment.ms": "1000",
        "max.compaction.lag.ms": "1000",
        "delete.retention.ms": "1000",
    }
    settings = kafka_settings.replace(log={"keys_topic_configs": fast})
    engine = await MemoryEngine.create(settings=settings, embedding_provider=hashed_provider)
    try:
        await engine.store("a memory to erase", "alice")
        await engine.store("a memory to keep", BOB)
        keys = await engine.runner.keys.writing_keys(["alice", BOB])
        topic_dirs = sorted(broker.glob(settings.log.topic + ".keys-*"))

        def held(key: bytes) -> bool:
            return any(
                key in p.read_bytes() for d in topic_dirs for p in d.iterdir() if p.is_file()
            )

        assert held(keys["alice"].key) and held(keys[BOB].key)
        await engine.erase_owner("alice")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 90
        writes = 0
        while held(keys["alice"].key):
            assert loop.time() < deadline, "the erased key is still on the broker after 90 s"
            # Kafka rolls a segment only when a record arrives past segment.ms.
            await asyncio.sleep(1.5)
            writes += 1
            await engine.store("a later owner", f"later-{writes}")
        assert held(keys[BOB].key)
    finally:
        await engine.close()


async def test_an_indexed_vector_shard_and_a_build_under_way_keep_no_erased_vector(
    local_settings: Settings, hashed_provider: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An erasure during an HNSW build: the build's copy (taken before the erasure) is not
    swapped in, the rewritten shard holds none of the owner's vectors, and the index build
    that is due afterwards indexes the rewritten shard."""
    from prme.projectors.stores.vector_index_build import IndexBuilder

    settings = local_settings.replace(qdrant={"index_threshold": 4})
    data_dir = settings.data_path
    erased = threading.Event()
    build = IndexBuilder._build

    def build_after_the_erasure(self: IndexBuilder, copy: Path) -> None:
        erased.wait(60)
        build(self, copy)

    monkeypatch.setattr(IndexBuilder, "_build", build_after_the_erasure)
    engine = await MemoryEngine.create(settings=settings, embedding_provider=hashed_provider)
    try:
        alice, bob = markers()
        await engine.store_many([*drafts("alice", alice), *drafts(BOB, bob)])
        await engine.store_many([*drafts(BOB, bob + "x"), *drafts(BOB, bob + "y")])
        store = engine.runner.shards[partition_for_key(b"alice", 4)].models["vector"]
        status = store.index_status()  # type: ignore[attr-defined]
        assert status is not None and status.building
        vectors = owner_vectors(engine, "alice", but_not=BOB)
        assert len(vectors) == 2 and files_holding_vectors(data_dir, vectors)
        await engine.erase_owner("alice")
        erased.set()
        assert files_holding_vectors(data_dir, vectors) == []
        assert await asyncio.to_thread(store.wait_index_idle, 60)  # type: ignore[attr-defined]
        status = store.index_status()  # type: ignore[attr-defined]
        assert status is not None and status.points == 6 and status.indexed >= 6  # (+tracking)
        assert files_holding_vectors(data_dir, vectors) == []
        assert not list(data_dir.glob("shards/p*/vector.index-*"))
        await check_bob_intact(engine, bob)
    finally:
        erased.set()
        await engine.close()


async def test_a_purge_a_crash_interrupted_runs_when_the_shard_opens_again(
    local_settings: Settings, hashed_provider: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prme.projectors.erasure import Forgetting
    from prme.projectors.model import ERASURES_PENDING
    from prme.schemas.errors import ShardUnavailable

    data_dir = local_settings.data_path
    engine = await MemoryEngine.create(settings=local_settings, embedding_provider=hashed_provider)
    alice, bob = markers()
    try:
        await engine.store_many([*drafts("alice", alice), *drafts(BOB, bob)])
        vectors = owner_vectors(engine, "alice", but_not=BOB)

        async def crash(self: Forgetting, shard: Any, owners: list[str]) -> None:
            raise RuntimeError("killed between the deletes and the purge")

        with monkeypatch.context() as patched:
            patched.setattr(Forgetting, "_purge", crash)
            with pytest.raises(ShardUnavailable):
                await engine.erase_owner("alice")
    finally:
        await engine.close()
    assert list(data_dir.glob(f"shards/p*/{ERASURES_PENDING}"))
    assert files_holding(data_dir, alice)  # the lexical segments still hold the text
    assert files_holding_vectors(data_dir, vectors)  # and the vector shard the vectors
    reopened = await MemoryEngine.open(settings=local_settings, embedding_provider=hashed_provider)
    try:
        assert files_holding(data_dir, alice) == []
        assert files_holding_vectors(data_dir, vectors) == []
        assert not list(data_dir.glob(f"shards/p*/{ERASURES_PENDING}"))
        await check_bob_intact(reopened, bob)
    finally:
        await reopened.close()


async def erased_by_an_earlier_build(
    settings: Settings, provider: Any, monkeypatch: pytest.MonkeyPatch
) -> tuple[str, list[list[float]]]:
    """A pack whose alice was erased by a build that deleted her points without rewriting
    the vector shard, and made no marks; bob's marker and alice's vectors (still in a file)."""
    from prme.projectors.stores.vector_edge import EdgeVectorModel

    engine = await MemoryEngine.create(settings=settings, embedding_provider=provider)
    alice, bob = markers()
    try:
        await engine.store_many([*drafts("alice", alice), *drafts(BOB, bob)])
        vectors = owner_vectors(engine, "alice", but_not=BOB)
        with monkeypatch.context() as patched:
            patched.setattr(EdgeVectorModel, "rewrite_if_due", lambda self: False)
            await engine.erase_owner("alice")
    finally:
        await engine.close()
    for mark in settings.data_path.glob("shards/p*/vector.rewrites"):
        mark.unlink()
    assert files_holding_vectors(settings.data_path, vectors)
    return bob, vectors


async def test_a_vector_store_made_before_erasures_rewrote_it_is_rewritten_when_it_opens(
    local_settings: Settings, hashed_provider: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by an upgrade trial: an owner erased by a version that deleted the points
    without rewriting the shard kept their vectors in its files after the upgrade, and
    erasing the owner again deleted no point, so it rewrote nothing."""
    data_dir = local_settings.data_path
    bob, vectors = await erased_by_an_earlier_build(local_settings, hashed_provider, monkeypatch)
    reopened = await MemoryEngine.open(settings=local_settings, embedding_provider=hashed_provider)
    try:
        assert files_holding_vectors(data_dir, vectors) == []
        marks = sorted(data_dir.glob("shards/p*/vector.rewrites"))
        assert [m.parent for m in marks] == sorted(
            p.parent for p in data_dir.glob("shards/p*/vector")
        )
        await check_bob_intact(reopened, bob)
        for mark in marks:
            mark.unlink()
        await reopened.rebuild(models=["vector"])  # a rebuilt store is one that rewrites
        assert sorted(data_dir.glob("shards/p*/vector.rewrites")) == marks
        assert not list(data_dir.glob("shards/p*.rebuild"))
    finally:
        await reopened.close()


async def test_a_store_due_its_rewrite_opens_without_room_for_it_and_is_rewritten_later(
    local_settings: Settings,
    hashed_provider: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """From a review: the rewrite at opening has no way out, so a pack whose disk had no
    room for a copy of its store could no longer be opened (it opened before the upgrade),
    and on a nearly full disk the copy would fill it (SIGBUS)."""
    data_dir = local_settings.data_path
    bob, vectors = await erased_by_an_earlier_build(local_settings, hashed_provider, monkeypatch)
    gib = 1024**3  # a reserve of 1 GiB, and 0.9 GiB free: it opens, but has no room
    cramped = local_settings.replace(limits={"min_free_bytes": gib})
    usage = shutil._ntuple_diskusage(10 * gib, 9 * gib, 9 * gib // 10)
    with monkeypatch.context() as patched, caplog.at_level(logging.WARNING, "prme.projector"):
        patched.setattr(free_space.shutil, "disk_usage", lambda path: usage)
        opened = await MemoryEngine.open(settings=cramped, embedding_provider=hashed_provider)
        try:
            await check_bob_intact(opened, bob)
        finally:
            await opened.close()
    assert any("rewrite waits for room" in r.getMessage() for r in caplog.records)
    assert files_holding_vectors(data_dir, vectors)  # (still due)
    reopened = await MemoryEngine.open(settings=local_settings, embedding_provider=hashed_provider)
    try:
        assert files_holding_vectors(data_dir, vectors) == []
    finally:
        await reopened.close()


async def test_an_erasure_on_a_nearly_full_disk_is_taken_and_its_rewrite_waits_for_room(
    local_settings: Settings,
    hashed_provider: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """From a review: an erasure was refused like any write on a nearly full disk, and its
    rewrite copied the store with no room check (a copy the disk cannot hold: SIGBUS)."""
    gib = 1024**3
    settings = local_settings.replace(limits={"min_free_bytes": gib})
    data_dir = settings.data_path
    roomy = shutil._ntuple_diskusage(10 * gib, 5 * gib, 5 * gib)
    cramped = shutil._ntuple_diskusage(10 * gib, 9 * gib, 9 * gib // 10)
    disk = [roomy]
    monkeypatch.setattr(free_space.shutil, "disk_usage", lambda path: disk[0])
    engine = await MemoryEngine.create(settings=settings, embedding_provider=hashed_provider)
    alice, bob = markers()
    try:
        await engine.store_many([*drafts("alice", alice), *drafts(BOB, bob)])
        vectors = owner_vectors(engine, "alice", but_not=BOB)
        disk[0] = cramped
        with caplog.at_level(logging.WARNING, logger="prme.projector"):
            await engine.erase_owner("alice")  # taken: not refused as writes are
        assert any("rewrite waits for room" in r.getMessage() for r in caplog.records)
        assert (await engine.retrieve("vault code", "alice")).results == []
        assert files_holding(data_dir, alice) == []  # the text is gone at once
        assert files_holding_vectors(data_dir, vectors)  # the copy waits for room
    finally:
        await engine.close()
    disk[0] = roomy
    reopened = await MemoryEngine.open(settings=settings, embedding_provider=hashed_provider)
    try:
        assert files_holding_vectors(data_dir, vectors) == []
        await check_bob_intact(reopened, bob)
    finally:
        await reopened.close()


async def test_a_pack_written_before_sealing_stays_readable_and_its_models_still_forget(
    local_settings: Settings, hashed_provider: Any
) -> None:
    from prme.producers.factory import open_transport
    from prme.producers.producer import Producer

    data_dir = local_settings.data_path
    engine = await MemoryEngine.create(settings=local_settings, embedding_provider=hashed_provider)
    await engine.close()
    alice, bob = markers()
    transport = open_transport(local_settings)  # an older PRME: no key store, plain records
    await transport.start()
    try:
        old = Producer(transport)
        await old.append_records([old.build_message(d) for d in drafts("alice", alice)])
        await old.append_records([old.build_message(d) for d in drafts(BOB, bob)])
    finally:
        await transport.close()
    engine = await MemoryEngine.open(settings=local_settings, embedding_provider=hashed_provider)
    try:
        found = await engine.retrieve(f"vault code {alice}", "alice")
        assert any(alice in result.text for result in found.results)
        await engine.erase_owner("alice")
        # The read models forget; the plain records written before sealing keep their text
        # on the log (docs/ARCHITECTURE.md, "Erasure").
        held = files_holding(data_dir, alice)
        assert held and all(Path(p).name.startswith("log.sqlite3") for p in held), held
        await check_bob_intact(engine, bob)
    finally:
        await engine.close()


async def test_a_vector_store_waiting_for_its_rebuild_still_forgets_an_erased_owner(
    local_settings: Settings, hashed_provider: Any
) -> None:
    """Opened with another embedding model, the vector store answers nothing until
    ``prme rebuild --model vector``; an erasure meanwhile must still leave its files."""
    from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider

    data_dir = local_settings.data_path
    alice, bob = markers()
    async with await MemoryEngine.create(
        settings=local_settings, embedding_provider=hashed_provider
    ) as engine:
        await engine.store_many([*drafts("alice", alice), *drafts(BOB, bob)])
    other_model = HashedBagOfWordsProvider(dimension=32)
    async with await MemoryEngine.open(
        settings=local_settings, embedding_provider=other_model
    ) as engine:
        partition = partition_for_key(b"alice", 4)
        shard = engine.runner.shards[partition]
        assert shard.vector_mismatch
        vectors = shard.models["vector"]  # its points hold ids and timestamps, no text
        assert await shard.run(vectors.count, "alice") == 2
        await engine.erase_owner("alice")
        assert files_holding(data_dir, alice) == []
        assert await shard.run(vectors.count, "alice") == 0
        assert await shard.run(vectors.count, BOB) == 2
        assert shard.vector_mismatch  # still waiting for its rebuild
        await engine.rebuild(models=["vector"])
        assert not engine.runner.shards[partition].vector_mismatch
        assert files_holding(data_dir, alice) == []
        found = await engine.retrieve(f"vault code {bob}", BOB)
        assert any(bob in result.text for result in found.results)


def test_a_retrieve_finds_no_other_owners_text_in_the_embedding_cache(tmp_path: Path) -> None:
    """From a review: the query path read the cache's document entries, so a retrieve of
    exactly a text another owner stored (erased or not) was a cache hit, counted on the
    open /metrics and ~5 ms faster. A query's entries are its owner's, and go with the
    owner's erasure."""
    from prme.projectors.embeddings.cached import CachedEmbeddingProvider
    from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider
    from prme.query.sync_client import MemoryClient

    cached = CachedEmbeddingProvider(HashedBagOfWordsProvider())
    secret = "My test came back positive on March 3"
    with MemoryClient(tmp_path / "pack", embedding_provider=cached) as memory:
        memory.store(secret, user_id="bob")
        memory.retrieve(secret, user_id="bob")
        hits = cached.cache_info().hits
        memory.retrieve(secret, user_id="alice")
        assert cached.cache_info().hits == hits
        memory.retrieve(secret, user_id="alice")
        assert cached.cache_info().hits == hits + 1  # alice's own question, asked again
        entries = cached.cache_info().entries
        memory.erase_owner("alice")
        assert cached.cache_info().entries == entries - 1


class CountingProvider(HashedBagOfWordsProvider):
    """The hashed provider, counting the document texts it encodes."""

    def __init__(self) -> None:
        super().__init__()
        self.encoded = 0

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        self.encoded += len(texts)
        return await super().embed(texts)


async def test_a_rebuild_keeps_the_vector_of_a_memory_written_after_its_owners_erasure(
    local_settings: Settings,
) -> None:
    """From a new-user trial: a replay that held an owner's memory, the owner's erasure
    and the same memory written again noted the owner on the cached vector before the
    purge, which then dropped it: every rebuild encoded that text again."""
    provider = CountingProvider()
    async with await MemoryEngine.create(
        settings=local_settings, embedding_provider=provider
    ) as engine:
        await engine.store("Dave likes green tea", user_id="dave")
        await engine.erase_owner("dave")
        await engine.store("Dave likes green tea", user_id="dave")
        await engine.rebuild(models=["vector"])
        encoded = provider.encoded
        await engine.rebuild(models=["vector"])
        assert provider.encoded == encoded  # every vector from the cache
        found = await engine.retrieve("green tea", "dave")
        assert [result.text for result in found.results] == ["Dave likes green tea"]


async def test_a_write_sealed_before_an_erasure_is_appended_before_its_marker(
    local_settings: Settings, hashed_provider: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that took the owner's key before the erasure began used to be appended
    after the marker: acknowledged, then unreadable (its key erased). Now the erasure
    waits for it (it precedes the marker and is erased with the owner), and a write that
    begins during the erasure waits, then is sealed with a new key and stays readable."""
    from prme.producers.sealing import RecordSealer

    sealed, release = asyncio.Event(), asyncio.Event()
    seal = RecordSealer.seal

    async def seal_then_wait(self: RecordSealer, items: Any) -> Any:
        done = await seal(self, items)
        if not release.is_set():
            sealed.set()
            await release.wait()
        return done

    monkeypatch.setattr(RecordSealer, "seal", seal_then_wait)
    engine = await MemoryEngine.create(settings=local_settings, embedding_provider=hashed_provider)
    try:
        first = asyncio.create_task(engine.store("written as the erasure begins", "carol"))
        await asyncio.wait_for(sealed.wait(), 10)
        erasure = asyncio.create_task(engine.erase_owner("carol"))
        await asyncio.sleep(0.2)
        assert not erasure.done()  # it waits for the write under way
        later = asyncio.create_task(engine.store("written during the erasure", "carol"))
        await asyncio.sleep(0.1)
        release.set()
        stored, erased, kept = await asyncio.wait_for(asyncio.gather(first, erasure, later), 30)
        assert stored.token.offset < erased.token.offset < kept.token.offset
        await engine.wait_for([kept.token])
        history = await engine.history("carol")
        assert [message.content for message in history] == ["written during the erasure"]
    finally:
        release.set()
        await engine.close()


async def test_a_vector_shard_is_rewritten_only_when_the_erasure_deleted_points_of_it(
    local_settings: Settings, hashed_provider: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rewrite holds the partition's writes and costs ~100 µs a point: erasing an owner
    without points in the shard, or erasing again, rewrites nothing (even the first
    erasure after an open)."""
    from prme.projectors.stores.vector_edge import EdgeVectorModel

    rewrites: list[str] = []
    rewrite = EdgeVectorModel.rewrite_if_due

    def counted(self: EdgeVectorModel) -> bool:
        rewrote = rewrite(self)
        if rewrote:
            rewrites.append(self._path.parent.name)
        return rewrote

    monkeypatch.setattr(EdgeVectorModel, "rewrite_if_due", counted)
    engine = await MemoryEngine.create(settings=local_settings, embedding_provider=hashed_provider)
    try:
        await engine.store_many(drafts("alice", "one") + drafts(BOB, "two"))
    finally:
        await engine.close()
    engine = await MemoryEngine.open(settings=local_settings, embedding_provider=hashed_provider)
    try:
        await engine.erase_owner("nobody-at-all")
        await engine.erase_owner("alice")
        await engine.erase_owner("alice")
        assert rewrites == [f"p{partition_for_key(b'alice', 4)}"]
    finally:
        await engine.close()
