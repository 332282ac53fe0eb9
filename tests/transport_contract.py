"""The log transport contract, written once; each transport's test module subclasses
``TransportContract`` and provides the ``settings`` fixture (eventsourcing-style)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from prme.producers.factory import open_transport
from prme.producers.partitioner import partition_for_key
from prme.producers.transport import LogItem, LogTransport
from prme.schemas.config import Settings
from prme.schemas.errors import RequestIdConflict

CHILD = Path(__file__).with_name("transport_child.py")


def _item(
    owner: str, value: str, dedupe_key: str | None = None, fingerprint: bytes | None = None
) -> LogItem:
    return LogItem(owner.encode(), value.encode(), dedupe_key, fingerprint)


async def _read_all(transport: LogTransport, partition: int) -> list[tuple[int, bytes, bytes]]:
    entries: list[tuple[int, bytes, bytes]] = []
    offset = 0
    while True:
        batch = await transport.read(partition, offset, 200)
        if not batch:
            return entries
        entries.extend((e.offset, e.key, e.value) for e in batch)
        offset = batch[-1].offset + 1


class TransportContract:
    """Behaviour every LogTransport must show."""

    @pytest.fixture
    def settings(self, tmp_path: Path) -> Settings:
        raise NotImplementedError

    @pytest.fixture
    async def transport(self, settings: Settings) -> AsyncIterator[LogTransport]:
        transport = open_transport(settings)
        await transport.start()
        yield transport
        await transport.close()

    async def test_owner_maps_to_kafkas_default_partition(
        self, transport: LogTransport, settings: Settings
    ) -> None:
        for owner in ("alice", "bob", "carol-42", "ünïcode"):
            expected = partition_for_key(owner.encode(), settings.log.partitions)
            assert transport.partition_for(owner.encode()) == expected
            position = await transport.append(_item(owner, "x"))
            assert position.partition == expected

    async def test_records_of_an_owner_are_read_back_in_append_order(
        self, transport: LogTransport
    ) -> None:
        for i in range(20):
            await transport.append(_item("alice", f"a{i}"))
            await transport.append(_item("bob", f"b{i}"))
        partition = transport.partition_for(b"alice")
        values = [v for _, k, v in await _read_all(transport, partition) if k == b"alice"]
        assert values == [f"a{i}".encode() for i in range(20)]

    async def test_offsets_increase_within_a_partition(self, transport: LogTransport) -> None:
        positions = [await transport.append(_item("alice", str(i))) for i in range(10)]
        assert len({p.partition for p in positions}) == 1
        offsets = [p.offset for p in positions]
        assert offsets == sorted(set(offsets))
        ends = await transport.end_offsets()
        assert ends[positions[0].partition] == offsets[-1] + 1

    async def test_append_many_returns_positions_of_every_record(
        self, transport: LogTransport
    ) -> None:
        items = [_item(owner, f"{owner}{i}") for i in range(5) for owner in ("alice", "bob")]
        positions = await transport.append_many(items)
        assert len(positions) == len(items)
        for item, position in zip(items, positions, strict=True):
            entries = await transport.read(position.partition, position.offset, 1)
            assert entries[0].value == item.value and entries[0].key == item.key

    async def test_an_atomic_append_is_read_back_as_soon_as_it_returns(
        self, transport: LogTransport
    ) -> None:
        # On Kafka the commit returns before the transaction's markers are written: a read
        # at once used to miss the records about half the time.
        for round_ in range(20):
            items = [_item(owner, f"{owner}{round_}") for owner in ("alice", "bob")]
            positions = await transport.append_many(items)
            for item, position in zip(items, positions, strict=True):
                entries = await transport.read(position.partition, position.offset, 1)
                assert [entry.value for entry in entries] == [item.value]
            ends = await transport.end_offsets()
            assert all(ends[p.partition] > p.offset for p in positions)

    async def test_non_atomic_append_many_keeps_each_owners_order(
        self, transport: LogTransport
    ) -> None:
        items = [_item(owner, f"{owner}{i}") for i in range(50) for owner in ("alice", "bob")]
        positions = await transport.append_many(items, atomic=False)
        assert len(positions) == len(items)
        for owner in ("alice", "bob"):
            partition = transport.partition_for(owner.encode())
            values = [v for _, k, v in await _read_all(transport, partition) if k == owner.encode()]
            assert values == [f"{owner}{i}".encode() for i in range(50)]

    @pytest.mark.parametrize("atomic", [False, True])
    async def test_appends_larger_than_a_record_batch_keep_positions_and_order(
        self, transport: LogTransport, atomic: bool
    ) -> None:
        # ~600 kB per owner and call: several of Kafka's record batches (RECORD_BATCH_BYTES),
        # from two callers at once, plus one value larger than a whole batch.
        def items(tag: str) -> list[LogItem]:
            return [
                _item(owner, f"{tag}-{owner}-{i:04d}-" + "x" * 1_000)
                for i in range(300)
                for owner in ("alice", "bob")
            ] + [_item("alice", f"{tag}-alice-big-" + "y" * 300_000)]

        first, second = items("first"), items("second")
        written = await asyncio.gather(
            transport.append_many(first, atomic=atomic),
            transport.append_many(second, atomic=atomic),
        )
        for batch, positions in zip((first, second), written, strict=True):
            assert len(positions) == len(batch)
            for item, position in zip(batch, positions, strict=True):
                assert position.partition == transport.partition_for(item.key)
        for owner in ("alice", "bob"):
            partition = transport.partition_for(owner.encode())
            stored = {
                offset: value
                for offset, key, value in await _read_all(transport, partition)
                if key == owner.encode()
            }
            for batch, positions in zip((first, second), written, strict=True):
                mine = [
                    (position.offset, item.value)
                    for item, position in zip(batch, positions, strict=True)
                    if item.key == owner.encode()
                ]
                assert [stored[offset] for offset, _ in mine] == [value for _, value in mine]
                assert [offset for offset, _ in mine] == sorted(offset for offset, _ in mine)

    async def test_read_respects_offset_and_max_records(self, transport: LogTransport) -> None:
        positions = [await transport.append(_item("alice", str(i))) for i in range(10)]
        partition = positions[0].partition
        page = await transport.read(partition, positions[3].offset, 4)
        assert [e.value for e in page] == [b"3", b"4", b"5", b"6"]
        assert await transport.read(partition, positions[-1].offset + 1, 10) == []

    async def test_same_dedupe_key_is_stored_once(self, transport: LogTransport) -> None:
        first = await transport.append(_item("alice", "once", dedupe_key="alice\x1freq-1"))
        again = await transport.append(_item("alice", "once", dedupe_key="alice\x1freq-1"))
        assert again == first
        values = [v for _, _, v in await _read_all(transport, first.partition)]
        assert values.count(b"once") == 1

    async def test_concurrent_appends_of_one_dedupe_key_write_it_once(
        self, transport: LogTransport
    ) -> None:
        item = _item("alice", "together", dedupe_key="alice\x1freq-9")
        appends = [transport.append_many([item]) for _ in range(3)]
        appends.append(transport.append_many([_item("bob", "b"), item]))
        results = await asyncio.gather(*appends)
        first = results[0][0]
        assert [r[-1] for r in results] == [first] * 4
        values = [v for _, _, v in await _read_all(transport, first.partition)]
        assert values.count(b"together") == 1

    @pytest.mark.parametrize("atomic", [False, True])
    async def test_append_many_writes_each_dedupe_key_once(
        self, transport: LogTransport, atomic: bool
    ) -> None:
        first = await transport.append(_item("alice", "one", dedupe_key="alice\x1freq-1"))
        batch = [
            _item("alice", "one", dedupe_key="alice\x1freq-1"),  # already on the log
            _item("alice", "two", dedupe_key="alice\x1freq-2"),
            _item("alice", "plain"),
            _item("alice", "two", dedupe_key="alice\x1freq-2"),  # repeats one before it
            _item("alice", "three", dedupe_key="alice\x1freq-3"),
        ]
        # Two callers at once with the same keys: every key is written by one of them.
        written = await asyncio.gather(
            transport.append_many(batch, atomic=atomic),
            transport.append_many(batch, atomic=atomic),
        )
        for positions in written:
            assert positions[0] == first
            assert positions[1] == positions[3]
        assert written[0][1] == written[1][1] and written[0][4] == written[1][4]
        values = sorted(
            v for _, k, v in await _read_all(transport, first.partition) if k == b"alice"
        )
        assert values == sorted([b"one", b"two", b"three", b"plain", b"plain"])

    async def test_a_dedupe_key_reused_for_another_write_is_a_conflict(
        self, transport: LogTransport
    ) -> None:
        key = "alice\x1freq-c"
        first = await transport.append(_item("alice", "first", key, b"print-1"))
        assert await transport.append(_item("alice", "first", key, b"print-1")) == first
        assert await transport.append(_item("alice", "unprinted", key)) == first
        with pytest.raises(RequestIdConflict, match="'req-c' of owner 'alice' was already used"):
            await transport.append(_item("alice", "second", key, b"print-2"))
        for atomic in (True, False):
            with pytest.raises(RequestIdConflict):
                await transport.append_many(
                    [_item("alice", "fresh", "alice\x1fnew"), _item("alice", "x", key, b"p")],
                    atomic=atomic,
                )
        with pytest.raises(RequestIdConflict):  # a repeat inside one batch
            await transport.append_many(
                [
                    _item("alice", "a", "alice\x1fpair", b"print-a"),
                    _item("alice", "b", "alice\x1fpair", b"print-b"),
                ]
            )
        values = [v for _, k, v in await _read_all(transport, first.partition) if k == b"alice"]
        assert values == [b"first"]  # a conflict writes nothing, not even the batch's others
        fresh = await transport.append(_item("alice", "fresh", "alice\x1fnew"))
        assert fresh.offset == first.offset + 1

    async def test_written_fingerprints_answer_for_the_keys_an_append_would_dedupe(
        self, transport: LogTransport
    ) -> None:
        await transport.append(_item("alice", "one", "alice\x1fr1", b"print-1"))
        await transport.append(_item("alice", "two", "alice\x1fr2"))
        keys = ["alice\x1fr1", "alice\x1fr2", "alice\x1fr3", "bob\x1fr1"]
        assert await transport.written_fingerprints(keys) == {
            "alice\x1fr1": b"print-1",
            "alice\x1fr2": None,
        }
        many = [f"k\x1f{i}" for i in range(1_200)]
        await transport.append_many([_item("k", "v", key, b"p") for key in many[::2]])
        assert await transport.written_fingerprints(many) == dict.fromkeys(many[::2], b"p")
        await transport.forget_dedupe("alice\x1f")
        assert await transport.written_fingerprints(keys) == {}
        assert await transport.written_fingerprints([]) == {}

    async def test_forgotten_dedupe_keys_are_written_again(self, transport: LogTransport) -> None:
        first = await transport.append(_item("alice", "old", dedupe_key="alice\x1freq-1"))
        kept = await transport.append(_item("alicia", "hers", dedupe_key="alicia\x1freq-1"))
        await transport.forget_dedupe("alice\x1f")  # alice was erased
        again = await transport.append(_item("alice", "new", dedupe_key="alice\x1freq-1"))
        assert again != first
        assert await transport.append(_item("alicia", "x", dedupe_key="alicia\x1freq-1")) == kept
        repeat = await transport.append(_item("alice", "new", dedupe_key="alice\x1freq-1"))
        assert repeat == again

    async def test_records_survive_close_and_reopen(self, settings: Settings) -> None:
        first = open_transport(settings)
        await first.start()
        written = await first.append(_item("alice", "durable"))
        await first.close()
        second = open_transport(settings)
        await second.start()
        try:
            entries = await second.read(written.partition, written.offset, 1)
            assert entries[0].value == b"durable"
            later = await second.append(_item("alice", "later"))
            assert later.offset > written.offset
        finally:
            await second.close()

    async def test_consumer_is_assigned_partitions_and_reads_from_its_seek(
        self, transport: LogTransport
    ) -> None:
        positions = [await transport.append(_item("alice", str(i))) for i in range(6)]
        partition = positions[0].partition
        consumer = transport.consumer(f"contract-{os.getpid()}-{id(self)}")
        assigned: set[int] = set()
        ready = asyncio.Event()

        async def on_assigned(partitions: set[int]) -> None:
            assigned.update(partitions)
            for p in partitions:
                consumer.seek(p, positions[2].offset if p == partition else 0)
            ready.set()

        async def on_revoked(partitions: set[int]) -> None:
            assigned.difference_update(partitions)

        await consumer.start(on_assigned, on_revoked)
        try:
            values: list[bytes] = []
            deadline = asyncio.get_running_loop().time() + 60
            while len(values) < 4 and asyncio.get_running_loop().time() < deadline:
                batches = await consumer.poll(100, 1.0)
                values.extend(e.value for e in batches.get(partition, []))
            assert partition in assigned
            assert values == [b"2", b"3", b"4", b"5"]
        finally:
            await consumer.close()

    async def test_writer_killed_mid_batch_leaves_all_or_nothing(
        self, settings: Settings, tmp_path: Path
    ) -> None:
        count = 20_000
        env = {**os.environ, "PRME_TEST_SETTINGS": msgspec.json.encode(settings).decode()}
        child = subprocess.Popen(
            [sys.executable, str(CHILD), str(count)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None
        line = await asyncio.to_thread(child.stdout.readline)
        assert line.strip() == "appending", child.stderr.read() if child.stderr else line
        child.kill()
        child.wait(timeout=30)

        transport = open_transport(settings)
        await transport.start()
        try:
            marker = await transport.append(_item("crash-owner", "after-crash"))
            values = [
                v for _, k, v in await _read_all(transport, marker.partition) if k == b"crash-owner"
            ]
        finally:
            await transport.close()
        batch = [v for v in values if v.startswith(b"batch-")]
        assert len(batch) in (0, count), f"partial batch of {len(batch)} records survived"
        assert values[-1] == b"after-crash"
