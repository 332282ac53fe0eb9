"""The transport contract on a real Kafka broker, plus what only Kafka shows."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from prme.producers.kafka_consumer import KafkaLogConsumer
from prme.producers.kafka_log import KafkaLogTransport
from prme.producers.transport import LogItem
from prme.schemas.config import Settings
from prme.schemas.errors import AppendUnconfirmed, ConfigurationError, TransportError

from .conftest import PrivateBroker
from .transport_contract import TransportContract

pytestmark = pytest.mark.kafka

PARTITIONS = 4


class TestKafkaTransport(TransportContract):
    @pytest.fixture
    def settings(self, tmp_path: Path, kafka_bootstrap: str, kafka_topic: str) -> Settings:
        return Settings(data_dir=str(tmp_path / "data")).replace(
            log={
                "transport": "kafka",
                "bootstrap": kafka_bootstrap,
                "topic": kafka_topic,
                "partitions": PARTITIONS,
                "request_timeout_s": 30.0,
                "transactional_id": f"prme-test-{uuid.uuid4().hex}",
            }
        )


@pytest.fixture
async def transport(kafka_bootstrap: str, kafka_topic: str) -> AsyncIterator[KafkaLogTransport]:
    transport = KafkaLogTransport(kafka_bootstrap, kafka_topic, PARTITIONS)
    await transport.start()
    yield transport
    await transport.close()


def _item(owner: str, value: str, dedupe_key: str | None = None) -> LogItem:
    return LogItem(owner.encode(), value.encode(), dedupe_key)


async def _create_topic(bootstrap: str, topic: str, configs: dict[str, str]) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
    await asyncio.wait_for(admin.start(), 30)
    try:
        topic_spec = NewTopic(topic, PARTITIONS, 1, topic_configs=configs)
        await asyncio.wait_for(admin.create_topics([topic_spec]), 30)
    finally:
        await admin.close()


async def test_topic_is_created_with_unlimited_retention(
    transport: KafkaLogTransport, kafka_bootstrap: str, kafka_topic: str
) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap, request_timeout_ms=10_000)
    await asyncio.wait_for(admin.start(), 30)
    try:
        [response] = await asyncio.wait_for(
            admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, kafka_topic)]), 30
        )
    finally:
        await admin.close()
    configs = {entry[0]: entry[1] for entry in response.resources[0][4]}
    assert configs["retention.ms"] == "-1"
    assert configs["retention.bytes"] == "-1"


async def test_existing_topic_with_another_partition_count_is_refused(
    kafka_bootstrap: str, kafka_topic: str
) -> None:
    await _create_topic(kafka_bootstrap, kafka_topic, {})
    transport = KafkaLogTransport(kafka_bootstrap, kafka_topic, PARTITIONS * 2)
    with pytest.raises(ConfigurationError, match=f"has {PARTITIONS} partitions"):
        await transport.start()
    await transport.close()


async def test_failed_atomic_append_leaves_nothing_visible(
    kafka_bootstrap: str, kafka_topic: str
) -> None:
    # The broker rejects the oversized record after the others were sent in the same
    # transaction; the transaction aborts and read_committed readers see none of them.
    await _create_topic(kafka_bootstrap, kafka_topic, {"max.message.bytes": "2000"})
    transport = KafkaLogTransport(kafka_bootstrap, kafka_topic, PARTITIONS)
    await transport.start()
    try:
        before = await transport.end_offsets()
        small = [_item(owner, "small") for owner in ("alice", "bob", "carol")]
        oversized = LogItem(b"alice", b"x" * 10_000)
        with pytest.raises(TransportError):
            await transport.append_many([*small, oversized])
        for partition in range(PARTITIONS):
            assert await transport.read(partition, before[partition]) == []
        after = await transport.append_many([_item("alice", "next")])
        entries = await transport.read(after[0].partition, before[after[0].partition])
        assert [e.value for e in entries] == [b"next"]
    finally:
        await transport.close()


async def test_an_atomic_append_that_times_out_before_its_commit_was_not_written(
    private_kafka: PrivateBroker, kafka_topic: str
) -> None:
    """From a review: an atomic append (a transaction) that timed out said
    AppendUnconfirmed, "may still be appended" (HTTP 504), though its transaction had not
    been asked to commit, so nothing of it could ever be read; and it waited for
    aiokafka's abort as long as the broker took (while it hung, until it came back). It
    is now TransportError (503: nothing written, send it again) within the request
    timeout, and its abort is bounded too."""
    timeout_s = 2.0
    txn_id = f"prme-test-{uuid.uuid4().hex}"

    def transport(timeout_s: float) -> KafkaLogTransport:
        return KafkaLogTransport(
            private_kafka.bootstrap,
            kafka_topic,
            1,
            request_timeout_s=timeout_s,
            transactional_id=txn_id,
        )

    writer = transport(timeout_s)
    await writer.start()
    loop = asyncio.get_running_loop()
    try:
        await writer.append_many([_item("alice", "a1"), _item("alice", "a2")])
        private_kafka.pause()
        try:
            started = loop.time()
            with pytest.raises(TransportError) as raised:
                await asyncio.wait_for(
                    writer.append_many([_item("alice", "b1"), _item("alice", "b2")]),
                    10 * timeout_s,  # the test's own bound: before, it waited until resumed
                )
            took = loop.time() - started
        finally:
            private_kafka.resume()
    finally:
        await writer.close()
    assert not isinstance(raised.value, AppendUnconfirmed), raised.value
    assert "nothing of it was written" in str(raised.value)
    assert took < 3 * timeout_s + 2, took  # the append, the abort, the producer's stop
    # Nothing of it ever lands: a writer with the same transactional id fences the first
    # (the broker aborts what that one left open), and reads see only what was committed.
    after = transport(60.0)
    await after.start()
    try:
        await after.append_many([_item("alice", "c1"), _item("alice", "c2")])
        values = [entry.value for entry in await after.read(0, 0)]
        assert values == [b"a1", b"a2", b"c1", b"c2"]
    finally:
        await after.close()


async def test_an_atomic_append_of_one_record_needs_no_transaction(
    transport: KafkaLogTransport,
) -> None:
    # One record is all or nothing by itself: no transaction (and no ~20 ms wait for the
    # previous one's markers when writes follow each other).
    positions = [(await transport.append_many([_item("alice", f"m{i}")]))[0] for i in range(5)]
    assert transport._txn_producer is None
    values = [e.value for e in await transport.read(positions[0].partition, positions[0].offset)]
    assert values == [f"m{i}".encode() for i in range(5)]
    await transport.append_many([_item("alice", "x"), _item("bob", "y")])
    assert transport._txn_producer is not None  # two records: one transaction


async def test_a_one_record_atomic_append_keeps_its_place_behind_a_transaction(
    transport: KafkaLogTransport,
) -> None:
    # Issued while a two-record transaction is under way, the one-record append (no
    # transaction of its own) still lands after it, as atomic appends always did.
    await asyncio.gather(
        transport.append_many([_item("alice", "first"), _item("alice", "second")]),
        transport.append_many([_item("alice", "third")]),
    )
    partition = transport.partition_for(b"alice")
    assert [e.value for e in await transport.read(partition, 0)] == [b"first", b"second", b"third"]


async def test_a_record_too_large_for_kafka_is_refused_before_anything_is_sent(
    transport: KafkaLogTransport,
) -> None:
    # Sent, the broker would refuse its batch after the idempotent producer had used its
    # sequence numbers, and every later append to the partition would fail.
    for atomic in (True, False):
        with pytest.raises(TransportError, match="nothing was sent"):
            await transport.append_many(
                [_item("alice", "small"), LogItem(b"alice", b"x" * 1_500_000)], atomic=atomic
            )
    after = await transport.append_many([_item("alice", "next")])
    await transport.append_many([_item("alice", "and"), _item("alice", "more")], atomic=False)
    values = [e.value for e in await transport.read(after[0].partition, 0)]
    assert values == [b"next", b"and", b"more"]


async def test_reads_behind_another_producers_open_transaction_answer_what_is_visible(
    transport: KafkaLogTransport, kafka_bootstrap: str
) -> None:
    partition = transport.partition_for(b"alice")
    neighbour = next(
        o for o in ("bob", "carol", "dave") if transport.partition_for(o.encode()) != partition
    )
    elsewhere = transport.partition_for(neighbour.encode())
    other = AIOKafkaProducer(
        bootstrap_servers=kafka_bootstrap, transactional_id=f"other-{uuid.uuid4().hex}"
    )
    await other.start()
    try:
        await other.begin_transaction()
        await (await other.send(transport.topic, b"open", key=b"alice", partition=partition))
        await transport.append_many([_item("alice", "a"), _item("alice", "b")])
        finished: list[str] = []

        async def read(name: str, at: int) -> list[bytes]:
            values = [e.value for e in await transport.read(at, 0)]
            finished.append(name)
            return values

        await transport.append_many([_item(neighbour, "free")])
        held, free = await asyncio.gather(read("held", partition), read("free", elsewhere))
        # Our records sit behind the other producer's open transaction: the read answers
        # what is visible instead of failing, and holds no read of another partition.
        assert held == [] and free == [b"free"] and finished == ["free", "held"]
        assert (await transport.end_offsets())[partition] == 0
        await other.abort_transaction()
        # Once the abort's markers are written (the read no longer waits for them: it gave
        # up on that partition above), the records are there.
        for _ in range(200):
            values = [e.value for e in await transport.read(partition, 0)]
            if values:
                break
            await asyncio.sleep(0.05)
        assert values == [b"a", b"b"]
    finally:
        await other.stop()


async def test_open_transaction_is_invisible_until_committed(
    transport: KafkaLogTransport,
) -> None:
    partition = transport.partition_for(b"alice")
    committed = await transport.append(_item("alice", "committed"))
    producer = await transport._transactional_producer()
    await producer.begin_transaction()
    await (await producer.send(transport.topic, b"pending", key=b"alice", partition=partition))
    assert (await transport.end_offsets())[partition] == committed.offset + 1
    assert [e.value for e in await transport.read(partition, 0)] == [b"committed"]
    await producer.abort_transaction()
    assert [e.value for e in await transport.read(partition, 0)] == [b"committed"]


async def test_dedupe_key_in_a_batch_returns_the_first_position(
    transport: KafkaLogTransport,
) -> None:
    first = await transport.append(_item("alice", "one", dedupe_key="k1"))
    positions = await transport.append_many(
        [
            _item("alice", "one", dedupe_key="k1"),
            _item("alice", "two", dedupe_key="k2"),
            _item("alice", "two", dedupe_key="k2"),
        ]
    )
    assert positions[0] == first
    assert positions[1] == positions[2]
    values = [e.value for e in await transport.read(first.partition, 0)]
    assert values == [b"one", b"two"]


async def test_concurrent_appends_with_one_dedupe_key_write_once(
    transport: KafkaLogTransport,
) -> None:
    positions = await asyncio.gather(
        *(transport.append(_item("alice", "same", dedupe_key="req-1")) for _ in range(5))
    )
    assert len(set(positions)) == 1
    assert [e.value for e in await transport.read(positions[0].partition, 0)] == [b"same"]


async def test_group_members_split_partitions_and_revoke_on_rebalance(
    transport: KafkaLogTransport,
) -> None:
    group = f"group-{uuid.uuid4().hex}"
    assigned: dict[str, set[int]] = {"a": set(), "b": set()}
    revoked: dict[str, list[set[int]]] = {"a": [], "b": []}
    changed = asyncio.Event()

    def callbacks(name: str):  # type: ignore[no-untyped-def]
        async def on_assigned(partitions: set[int]) -> None:
            assigned[name] = set(partitions)
            changed.set()

        async def on_revoked(partitions: set[int]) -> None:
            revoked[name].append(set(partitions))
            assigned[name] -= partitions
            changed.set()

        return on_assigned, on_revoked

    async def wait_until(condition, timeout_s: float = 45.0) -> None:  # type: ignore[no-untyped-def]
        async def loop() -> None:
            while not condition():
                changed.clear()
                await asyncio.wait_for(changed.wait(), timeout_s)

        await asyncio.wait_for(loop(), timeout_s)

    first, second = transport.consumer(group), transport.consumer(group)
    await first.start(*callbacks("a"))
    polling = {"a": first}
    stop = asyncio.Event()

    async def keep_polling() -> None:
        while not stop.is_set():
            for consumer in list(polling.values()):
                await consumer.poll(100, 0.2)

    poller = asyncio.create_task(keep_polling())
    try:
        await wait_until(lambda: assigned["a"] == set(range(PARTITIONS)))
        await second.start(*callbacks("b"))
        polling["b"] = second
        await wait_until(
            lambda: (
                bool(assigned["a"])
                and bool(assigned["b"])
                and assigned["a"] | assigned["b"] == set(range(PARTITIONS))
            )
        )
        assert not assigned["a"] & assigned["b"]
        assert revoked["a"] and revoked["a"][0] == set(range(PARTITIONS))
        assert first.assignment() == assigned["a"]
        # The coordinator's description: settled (`prme status` reads a rebalance from it).
        described = await transport.describe_group(group)
        assert described.state == "Stable"
        held = sorted(p for member in described.members for p in member.partitions)
        assert held == list(range(PARTITIONS))
    finally:
        stop.set()
        await poller
        await first.close()
        await second.close()


async def test_operations_before_start_fail_clearly(kafka_bootstrap: str) -> None:
    transport = KafkaLogTransport(kafka_bootstrap, "never-started", PARTITIONS)
    with pytest.raises(TransportError, match="not started"):
        await transport.append(_item("alice", "x"))


async def test_unreachable_broker_fails_within_the_timeout() -> None:
    transport = KafkaLogTransport("127.0.0.1:1", "t", PARTITIONS, request_timeout_s=2.0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(TransportError):
        await transport.start()
    assert loop.time() - started < 10


async def test_reads_and_end_offsets_are_not_held_up_by_an_idle_fetch(
    transport: KafkaLogTransport,
) -> None:
    """A standby and a promotion alternate end-offset and read calls over partitions at
    their end. The reader used to leave a fetch parked at the broker for 500 ms after each
    read, and the broker answers a connection in order: every call behind it waited that
    long (40 calls took over 15 s; now well under one)."""
    positions = [await transport.append(_item(f"owner-{n}", "v")) for n in range(8)]
    partitions = sorted({p.partition for p in positions})
    started = asyncio.get_running_loop().time()
    for _ in range(20 // len(partitions) + 1):
        for partition in partitions:
            ends = await transport.end_offsets()
            assert len(await transport.read(partition, ends[partition] - 1, 10)) == 1
    assert asyncio.get_running_loop().time() - started < 6.0


async def test_a_session_timeout_the_brokers_refuse_is_a_settings_error(
    kafka_bootstrap: str, transport: KafkaLogTransport, kafka_topic: str
) -> None:
    """From a cluster trial: 0.5 s gave "consumer start failed: InvalidSessionTimeoutError()",
    which named neither the setting nor the range."""
    consumer = KafkaLogConsumer(
        kafka_bootstrap, kafka_topic, f"group-{uuid.uuid4().hex[:8]}", session_timeout_ms=500
    )

    async def nothing(_: set[int]) -> None:
        return None

    with pytest.raises(ConfigurationError, match=r"refuse a session timeout of 0\.5 s"):
        await consumer.start(nothing, nothing)
    await consumer.close()
