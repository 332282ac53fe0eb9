"""Many records sent as Kafka record batches built here, with aiokafka's batch API.

``AIOKafkaProducer.send`` pays ~10 µs of Python per record (a coroutine, a future, the
accumulator's bookkeeping), and its batches are ``max_batch_size`` bytes (16 KiB unless
set) while the producer has one request in flight per broker. Building the batches here
(``create_batch``, one ``append`` per record) and handing each whole to ``send_batch``
costs ~3 µs per record and sends larger requests: 3x the records per second of the
per-record path on the same broker (``benchmarks/ingest_throughput.py``). Idempotence and
transactions apply to these batches as to the producer's own: the sender stamps the
producer id and sequence numbers when it drains a batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from aiokafka.producer.message_accumulator import BatchBuilder
from aiokafka.structs import RecordMetadata

from prme.schemas.errors import AppendUnconfirmed, TransportError, TransportUnavailable

from .kafka_common import passes
from .transport import Position

RECORD_BATCH_BYTES = 256 * 1024
"""``max_batch_size`` of prme's producers: a quarter of the broker's default
``message.max.bytes`` (1 MiB), so a full batch is always accepted."""


MAX_RECORD_BYTES = 1_000_000
"""The largest key plus value a record may have: a batch of it alone stays under the
broker's default ``message.max.bytes`` (1,048,588). ``AIOKafkaProducer.send`` refused larger
records before sending; ``send_batch`` does not, and a batch the broker refuses has used up
its sequence numbers, so the idempotent producer's later batches to that partition would
fail (``OutOfOrderSequenceNumber``)."""


class EnqueuedBatches:
    """The batches one ``enqueue_batches`` call handed to the producer; ``positions()``
    waits for them and answers each record's position, in the order given."""

    def __init__(self, count: int) -> None:
        self._count = count
        self._sent: list[tuple[asyncio.Future[RecordMetadata], list[int]]] = []

    def add(self, delivery: asyncio.Future[RecordMetadata], indexes: list[int]) -> None:
        self._sent.append((delivery, indexes))

    def abandon(self) -> None:
        """Nobody will await these deliveries: retrieve each one's failure when it comes,
        so none is logged as never retrieved."""
        for delivery, _ in self._sent:
            delivery.add_done_callback(_retrieve)

    async def positions(self) -> list[Position]:
        # Every batch's outcome is collected (a failed batch's exception is retrieved even
        # when an earlier one failed too); the first failure is raised.
        outcomes = await asyncio.gather(
            *(delivery for delivery, _ in self._sent), return_exceptions=True
        )
        delivered: list[RecordMetadata] = []
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
            delivered.append(outcome)
        positions: list[Position | None] = [None] * self._count
        for metadata, (_, indexes) in zip(delivered, self._sent, strict=True):
            # A batch's records take consecutive offsets from its base offset.
            for relative, index in enumerate(indexes):
                positions[index] = Position(metadata.partition, metadata.offset + relative)
        return [position for position in positions if position is not None]


def _retrieve(delivery: asyncio.Future[RecordMetadata]) -> None:
    if not delivery.cancelled():
        delivery.exception()


async def enqueue_batches(
    producer: AIOKafkaProducer,
    topic: str,
    records: Sequence[tuple[int, bytes, bytes | None]],
) -> EnqueuedBatches:
    """Hand ``records`` (``(partition, key, value)``; a ``None`` value is a tombstone) to
    ``producer`` as record batches, one open batch per partition, each partition's records
    in the order given. Returns once every batch is enqueued (a full partition queue waits
    for the sender to take its last batch); delivery is awaited with ``positions()``.
    Callers that enqueue concurrently must take turns (a lock) for their records to keep
    their order in a partition. A record over ``MAX_RECORD_BYTES`` raises
    ``TransportError`` before anything is sent."""
    for _, key, value in records:
        size = len(key) + len(value or b"")
        if size > MAX_RECORD_BYTES:
            raise TransportError(
                f"kafka: a record of {size} bytes is over the {MAX_RECORD_BYTES} a record may "
                "have; nothing was sent"
            )
    enqueued = EnqueuedBatches(len(records))
    open_batches: dict[int, tuple[BatchBuilder, list[int]]] = {}
    sent = 0

    async def send(batch: BatchBuilder, partition: int, indexes: list[int]) -> None:
        nonlocal sent
        try:
            future = await producer.send_batch(batch, topic, partition=partition)
        except KafkaError as error:  # no room in the producer's queue, a broker down ...
            if sent:
                raise AppendUnconfirmed(
                    f"kafka: {sent} of the append's batches were enqueued before the next "
                    f"could not be ({error!r}): they may still be appended (a retry with "
                    "the same request_id is written once)"
                ) from error
            kind = TransportUnavailable if passes(error) else TransportError
            raise kind(
                f"kafka: the append could not be enqueued ({error!r}): nothing was sent"
            ) from error
        sent += 1
        enqueued.add(future, indexes)

    try:
        for index, (partition, key, value) in enumerate(records):
            held = open_batches.get(partition)
            if held is None:
                held = open_batches[partition] = (producer.create_batch(), [])
            batch, indexes = held
            if batch.append(timestamp=None, key=key, value=value) is None:
                await send(batch, partition, indexes)
                batch, indexes = producer.create_batch(), []
                open_batches[partition] = (batch, indexes)
                # An empty batch takes any first record (a larger one makes a batch of one).
                batch.append(timestamp=None, key=key, value=value)
            indexes.append(index)
        for partition, (batch, indexes) in open_batches.items():
            await send(batch, partition, indexes)
    except BaseException:
        enqueued.abandon()  # the caller gets this error, not the positions
        raise
    return enqueued
