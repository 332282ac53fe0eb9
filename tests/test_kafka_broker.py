"""The broker the Kafka fixture provides is a real, working Kafka."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from prme.producers.kafka_topics import partition_count

pytestmark = pytest.mark.kafka


async def test_broker_describes_a_cluster_of_one(kafka_bootstrap: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap, request_timeout_ms=10_000)
    await asyncio.wait_for(admin.start(), 30)
    try:
        cluster = await asyncio.wait_for(admin.describe_cluster(), 30)
    finally:
        await admin.close()
    assert len(cluster["brokers"]) == 1
    assert cluster["controller_id"] >= 0


async def test_created_topic_round_trips_a_record(kafka_bootstrap: str, kafka_topic: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap, request_timeout_ms=10_000)
    await asyncio.wait_for(admin.start(), 30)
    try:
        await asyncio.wait_for(admin.create_topics([NewTopic(kafka_topic, 3, 1)]), 30)
        # A created topic reaches the broker's metadata a moment later: wait for it.
        partitions = await partition_count(admin, kafka_topic, 30)
    finally:
        await admin.close()
    assert partitions == 3

    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    await asyncio.wait_for(producer.start(), 30)
    try:
        sent = await asyncio.wait_for(
            producer.send_and_wait(kafka_topic, b"hello", key=b"alice", partition=2), 30
        )
    finally:
        await producer.stop()

    consumer = AIOKafkaConsumer(bootstrap_servers=kafka_bootstrap, enable_auto_commit=False)
    await asyncio.wait_for(consumer.start(), 30)
    try:
        tp = TopicPartition(kafka_topic, 2)
        consumer.assign([tp])
        consumer.seek(tp, sent.offset)
        record = await asyncio.wait_for(consumer.getone(tp), 30)
    finally:
        await consumer.stop()
    assert (record.key, record.value, record.offset) == (b"alice", b"hello", sent.offset)
