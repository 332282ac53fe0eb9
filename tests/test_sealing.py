"""Sealing: a record's private fields encrypted with its owner's data key."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import pytest

from prme.producers.factory import open_key_store
from prme.producers.keys import LocalKeyStore
from prme.schemas.codec import decode_record, encode_record
from prme.schemas.config import Settings
from prme.schemas.errors import RecordDecodeError
from prme.schemas.records import Message, NodeArchived, OwnerErased
from prme.schemas.sealing import (
    ErasedRecord,
    Sealer,
    envelope_of,
    is_sealed,
    new_data_key,
    record_envelope,
)

from . import record_builders as build

SECRET = "zebra-7731-secret"


def message(owner: str = "alice", **fields: object) -> Message:
    values: dict[str, object] = {
        "event_id": "0190a1b2-0000-7000-8000-000000000001",
        "owner": owner,
        "session_id": "s1",
        "scope": "work",
        "recorded_at": datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
        "request_id": "r1",
        "role": "user",
        "content": f"my {SECRET} is here",
        "name": f"name-{SECRET}",
        "metadata": {"note": SECRET},
        "fields": {"extra": SECRET},
        "tool_calls": [{"id": "c1", "name": "lookup", "args": {"q": SECRET}}],
    }
    values.update(fields)
    return msgspec.convert(values, Message)


def test_a_sealed_record_keeps_its_envelope_readable_and_its_private_fields_unreadable() -> None:
    key, sealer = new_data_key(), Sealer()
    plain = encode_record(message())
    sealed = sealer.seal(plain, key)
    assert SECRET.encode() not in sealed
    assert is_sealed(sealed) and not is_sealed(plain)
    envelope = envelope_of(sealed)
    assert (envelope.owner, envelope.kind, envelope.session_id, envelope.scope) == (
        "alice",
        "message",
        "s1",
        "work",
    )
    assert envelope.request_id == "r1" and envelope.kid == key.kid
    record, opened = Sealer().open(sealed, key.key)
    assert record == message() and opened == plain


@pytest.mark.parametrize(
    "record",
    [
        message(),
        message(occurred_at=datetime(2025, 12, 31, 23, 59, 59, 123456, tzinfo=UTC)),
        message(request_id=None, scope="default", session_id="default"),
        build.cleared("0190a1b2-0000-7000-8000-000000000002"),
        build.archived("0190a1b2-0000-7000-8000-000000000003", "node-1"),
        build.erased("0190a1b2-0000-7000-8000-000000000004"),
    ],
)
def test_a_records_envelope_read_from_it_equals_the_one_decoded_from_its_bytes(
    record: Any,
) -> None:
    plain = encode_record(record)
    assert record_envelope(record) == envelope_of(plain)
    key = new_data_key()
    sealed = Sealer().seal(plain, key, record_envelope(record))
    opened, plain_again = Sealer().open(sealed, key.key)
    assert opened == record and plain_again == plain


def test_without_its_key_a_sealed_record_opens_as_an_erased_envelope() -> None:
    sealed = Sealer().seal(encode_record(message()), new_data_key())
    record, data = Sealer().open_with(sealed, {})
    assert isinstance(record, ErasedRecord) and record.erased and data == sealed
    shown = msgspec.json.decode(msgspec.json.encode(record))
    assert shown["event_id"] == message().event_id and shown["kind"] == "message"
    assert "content" not in shown and SECRET not in str(shown)


def test_records_written_before_sealing_open_as_plain_records() -> None:
    plain = encode_record(message())
    record, data = Sealer().open_with(plain, {})
    assert record == message() and data is plain


def test_the_erasure_marker_is_never_sealed_but_other_control_records_are() -> None:
    key, sealer = new_data_key(), Sealer()
    erased = OwnerErased(event_id="e2", owner="alice", recorded_at=datetime.now(UTC))
    assert sealer.seal(encode_record(erased), key) == encode_record(erased)
    archived = NodeArchived(
        event_id="e3", owner="alice", recorded_at=datetime.now(UTC), node_id="n", reason=SECRET
    )
    sealed = sealer.seal(encode_record(archived), key)
    assert SECRET.encode() not in sealed
    assert sealer.open(sealed, key.key)[0] == archived


def test_a_sealed_record_with_another_owners_envelope_does_not_open() -> None:
    key, sealer = new_data_key(), Sealer()
    sealed = sealer.seal(encode_record(message()), key)
    forged = msgspec.msgpack.encode(msgspec.structs.replace(envelope_of(sealed), owner="mallory"))
    with pytest.raises(RecordDecodeError, match="does not open"):
        sealer.open(forged, key.key)
    with pytest.raises(RecordDecodeError, match="does not open"):
        sealer.open(sealed, new_data_key().key)


def test_a_plain_record_still_decodes_with_the_plain_decoder() -> None:
    assert decode_record(encode_record(message())) == message()


async def test_the_local_key_store_keeps_one_key_per_owner_until_it_is_erased(
    tmp_path: Path,
) -> None:
    path = tmp_path / "keys.sqlite3"
    first, second = LocalKeyStore(path), LocalKeyStore(path)
    await first.start()
    await second.start()
    try:
        alice = (await first.writing_keys(["alice"]))["alice"]
        assert (await second.writing_keys(["alice"]))["alice"] == alice  # another process
        assert await second.reading_keys([("alice", alice.kid)]) == {
            ("alice", alice.kid): alice.key
        }
        bob = (await first.writing_keys(["bob"]))["bob"]
        await first.erase("alice")
        second.forget("alice")
        assert await second.reading_keys([("alice", alice.kid)]) == {}
        assert await first.reading_keys([("bob", bob.kid)]) == {("bob", bob.kid): bob.key}
        again = (await first.writing_keys(["alice"]))["alice"]
        assert again.kid != alice.kid  # a new key after erasure: old records stay erased
    finally:
        await first.close()
        await second.close()
    held = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.is_file())
    assert alice.key not in held and bob.key in held


@pytest.fixture
async def key_store(tmp_path: Path) -> AsyncIterator[LocalKeyStore]:
    store = LocalKeyStore(tmp_path / "keys.sqlite3")
    await store.start()
    try:
        yield store
    finally:
        await store.close()


def held_back(
    monkeypatch: pytest.MonkeyPatch, store: LocalKeyStore, method: str
) -> tuple[asyncio.Event, asyncio.Event]:
    """``(entered, release)``: a call of ``store.<method>`` sets ``entered`` and waits for
    ``release`` before it runs."""
    entered, release = asyncio.Event(), asyncio.Event()
    original = getattr(store, method)

    async def waiting(*args: Any) -> Any:
        entered.set()
        await release.wait()
        return await original(*args)

    monkeypatch.setattr(store, method, waiting)
    return entered, release


async def test_a_writer_whose_keys_are_held_does_not_wait_on_another_owners_creation(
    key_store: LocalKeyStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    bob = (await key_store.writing_keys(["bob"]))["bob"]
    _, release = held_back(monkeypatch, key_store, "_create")
    creating = asyncio.create_task(key_store.writing_keys(["carol"]))
    await asyncio.sleep(0.05)
    assert not creating.done()
    held = await asyncio.wait_for(key_store.writing_keys(["bob"]), 1.0)
    assert held == {"bob": bob}
    release.set()
    assert (await creating)["carol"].kid != bob.kid


async def test_a_writer_during_an_erasure_gets_a_new_key_not_the_erased_one(
    key_store: LocalKeyStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = (await key_store.writing_keys(["alice"]))["alice"]
    entered, release = held_back(monkeypatch, key_store, "_delete")
    erasing = asyncio.create_task(key_store.erase("alice"))
    await entered.wait()
    writing = asyncio.create_task(key_store.writing_keys(["alice"]))
    await asyncio.sleep(0.05)
    assert not writing.done()  # queued behind the erasure, not served the old key
    release.set()
    await erasing
    assert (await writing)["alice"].kid != old.kid
    assert await key_store.reading_keys([("alice", old.kid)]) == {}


async def test_an_erasure_during_a_writers_key_creation_does_not_fail_the_writer(
    key_store: LocalKeyStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    alice = (await key_store.writing_keys(["alice"]))["alice"]
    entered, release = held_back(monkeypatch, key_store, "_create")
    writing = asyncio.create_task(key_store.writing_keys(["alice", "carol"]))
    await entered.wait()  # the writer holds alice's key and creates carol's
    erasing = asyncio.create_task(key_store.erase("alice"))
    await asyncio.sleep(0.05)
    release.set()
    keys = await writing  # was: KeyError 'alice', failing carol's records too
    await erasing
    assert keys["alice"] == alice and keys["carol"].kid != alice.kid
    assert (await key_store.writing_keys(["alice"]))["alice"].kid != alice.kid


async def test_a_key_read_while_its_erasure_waits_is_not_kept_for_later_writers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalKeyStore(tmp_path / "keys.sqlite3", write_ttl_s=0.2)
    await store.start()
    try:
        old = (await store.writing_keys(["alice"]))["alice"]
        await asyncio.sleep(0.3)  # stale: the next writer reads the store again
        entered, release = asyncio.Event(), asyncio.Event()
        load = store._load

        seen: list[object] = []

        async def slow_load(owners: list[str]) -> dict[str, dict[str, bytes]]:
            loaded = await load(owners)
            entered.set()
            await release.wait()
            # Runs once this writer is done and before the waiting erasure resumes: what
            # another writer's lock-free lookup would be handed then.
            asyncio.get_running_loop().call_soon(lambda: seen.append(store._fresh(["alice"])))
            return loaded

        monkeypatch.setattr(store, "_load", slow_load)
        first = asyncio.create_task(store.writing_keys(["alice"]))
        await entered.wait()  # it has read the old key and holds the lock
        erasing = asyncio.create_task(store.erase("alice"))
        await asyncio.sleep(0.05)
        monkeypatch.setattr(store, "_load", load)
        release.set()
        assert (await first)["alice"] == old  # asked before the erasure: its key then
        await erasing
        assert seen == [None]  # was: the key the erasure was about to delete
        assert (await store.writing_keys(["alice"]))["alice"].kid != old.kid
        assert await store.reading_keys([("alice", old.kid)]) == {}
    finally:
        await store.close()


@pytest.mark.kafka
async def test_the_kafka_key_store_shares_keys_between_nodes_until_a_tombstone(
    kafka_settings: Settings,
) -> None:
    first, second = open_key_store(kafka_settings), open_key_store(kafka_settings)
    await first.start()
    await second.start()
    try:
        created = await first.writing_keys(["alice", "bob"])
        alice = created["alice"]
        # Another node finds the key by reading the topic to its end on a miss.
        assert await second.reading_keys([("alice", alice.kid)]) == {
            ("alice", alice.kid): alice.key
        }
        assert (await second.writing_keys(["alice"]))["alice"] == alice
        await first.erase("alice")
        second.forget("alice")  # what the projector does at the owner_erased record
        assert await second.reading_keys([("alice", alice.kid)]) == {}
        bob = created["bob"]
        assert await second.reading_keys([("bob", bob.kid)]) == {("bob", bob.kid): bob.key}
    finally:
        await first.close()
        await second.close()
    cold = open_key_store(kafka_settings)
    await cold.start()
    try:
        assert await cold.reading_keys([("alice", alice.kid)]) == {}
    finally:
        await cold.close()


def test_bytes_that_are_no_record_raise_the_codecs_own_errors() -> None:
    from prme.schemas.errors import UnknownRecordKind

    weird = msgspec.msgpack.encode(
        {
            "v": 1,
            "kind": "weird",
            "event_id": "e",
            "owner": "alice",
            "recorded_at": "2026-01-01T00:00:00Z",
        }
    )
    with pytest.raises(UnknownRecordKind):
        Sealer().open_with(weird, {})
    with pytest.raises(RecordDecodeError, match="not msgpack"):
        Sealer().open_with(b"\xc1 not msgpack", {})


async def test_a_key_store_opened_while_another_process_writes_it_waits_its_turn(
    tmp_path: Path,
) -> None:
    """`prme serve --processes N` opens keys.sqlite3 in N processes at once; switching the
    file to WAL needs a lock another holds for a moment (was: "database is locked", and
    that member died)."""
    import sqlite3
    import threading

    path = tmp_path / "keys.sqlite3"
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    other.execute("CREATE TABLE held (x)")
    other.execute("BEGIN EXCLUSIVE")
    # Held past sqlite3's default busy timeout (5 s), as a loaded disk did in a CI run.
    release = threading.Timer(5.5, other.execute, ("COMMIT",))
    release.start()
    store = LocalKeyStore(path)
    try:
        await asyncio.wait_for(store.start(), 30)
        assert (await store.writing_keys(["alice"]))["alice"].kid
    finally:
        release.join()
        await store.close()
        other.close()


async def test_a_lost_key_store_beside_a_sealed_log_is_refused_not_read_as_erased(
    tmp_path: Path,
) -> None:
    """From an operations trial: a pack's log copied without its ``keys.sqlite3`` opened
    with a new, empty key store, and audit, rebuild and retrieve showed every record
    erased while the node answered ready. An empty key file says it is meant."""
    from prme import MemoryEngine
    from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider
    from prme.schemas.errors import ConfigurationError

    settings = Settings(data_dir=str(tmp_path / "pack"))
    provider = HashedBagOfWordsProvider()
    async with await MemoryEngine.create(settings=settings, embedding_provider=provider) as engine:
        await engine.store("the vault code is 4321", "alice")
    keys = tmp_path / "pack" / "keys.sqlite3"
    for leftover in tmp_path.joinpath("pack").glob("keys.sqlite3*"):
        leftover.unlink()
    with pytest.raises(ConfigurationError, match=r"key store .* is missing, but the log"):
        await MemoryEngine.open(settings=settings, embedding_provider=provider)
    assert not keys.exists()
    keys.touch()  # on purpose: read the records as erased
    async with await MemoryEngine.open(settings=settings, embedding_provider=provider):
        pass
    # A log that holds no sealed record needs no key store.
    plain = tmp_path / "plain"
    async with await MemoryEngine.create(
        settings=Settings(data_dir=str(plain)), embedding_provider=provider
    ):
        pass
    for leftover in plain.glob("keys.sqlite3*"):
        leftover.unlink()
    async with await MemoryEngine.open(
        settings=Settings(data_dir=str(plain)), embedding_provider=provider
    ):
        pass


async def test_a_new_pack_at_a_relative_path_opens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From a review: the lost-key check made the log's URI from a relative path, which
    pathlib refuses, so ``MemoryClient("./agent-memory")`` and the default ``./memory``
    failed at their first open, and every open after."""
    from prme import MemoryEngine
    from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider

    monkeypatch.chdir(tmp_path)
    settings = Settings(data_dir="./agent-memory")
    provider = HashedBagOfWordsProvider()
    async with await MemoryEngine.create(settings=settings, embedding_provider=provider) as engine:
        await engine.store("a relative pack", "alice")
    for leftover in Path("agent-memory").glob("keys.sqlite3*"):
        leftover.unlink()
    from prme.schemas.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="is missing, but the log"):
        await MemoryEngine.open(settings=settings, embedding_provider=provider)
