"""A compacted Kafka topic co-partitioned with the events topic: the vector changelog.

Records go to explicit partition numbers (the owner's events partition), so a node that is
handed events partition N finds that partition's state in changelog partition N. Kafka
keeps the latest value per key; a ``None`` value is a tombstone, removed by compaction
after ``delete.retention.ms``. Nothing here knows what the keys or values mean.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import OutOfOrderSequenceNumber, UnknownProducerId

from prme.schemas.errors import ConfigurationError, TransportError, TransportUnavailable

from .kafka_batches import RECORD_BATCH_BYTES, enqueue_batches
from .kafka_common import (
    bounded,
    positive_partitions,
    reading,
    standalone_reader,
    started,
    stop_quietly,
)
from .kafka_topics import Replication, cluster_replication, create_topic

CHANGELOG_SUFFIX = ".vectors"
PRODUCER_STATE_LOST = (OutOfOrderSequenceNumber, UnknownProducerId)
"""Errors after which an idempotent producer sends nothing more: it is replaced."""
COMPACTED = {"cleanup.policy": "compact"}
_FETCH_BYTES = 8 * 1024 * 1024


class ChangelogEntry(msgspec.Struct, frozen=True):
    """One changelog record; ``value`` is ``None`` for a tombstone."""

    offset: int
    key: bytes
    value: bytes | None


async def _read_range(
    reader: AIOKafkaConsumer, tp: TopicPartition, offset: int, end: int, max_records: int
) -> tuple[list[ChangelogEntry], int]:
    """Up to ``max_records`` records of ``tp`` in ``[offset, end)`` and the next offset."""
    entries: list[ChangelogEntry] = []
    with reading(reader, tp, offset):
        position = await reader.position(tp)
        while len(entries) < max_records and position < end:
            batch = await reader.getmany(tp, timeout_ms=200, max_records=max_records - len(entries))
            for record in batch.get(tp, []):
                if record.offset >= end:
                    break
                entries.append(ChangelogEntry(record.offset, record.key or b"", record.value))
            position = await reader.position(tp)
    return entries, min(position, end)


class KafkaChangelog:
    """Publish keyed values to chosen partitions of a compacted topic; read a partition
    back from an offset. Writes use an idempotent producer with ``acks=all``."""

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        partitions: int,
        *,
        request_timeout_s: float = 30.0,
        client_id: str = "prme-changelog",
        replication_factor: int | None = None,
        min_insync_replicas: int | None = None,
        configs: dict[str, str] | None = None,
    ) -> None:
        self._topic = topic
        self._partitions = positive_partitions(partitions)
        self._bootstrap = bootstrap
        self._client_id = client_id
        self._timeout_s = request_timeout_s
        # How the topic is created when it is missing:
        self._configs = {**COMPACTED, **(configs or {})}
        self._replication_factor = replication_factor
        self._min_insync = min_insync_replicas
        self._producer: AIOKafkaProducer | None = None
        self._broken: AIOKafkaProducer | None = None
        """The producer a publish found broken, until the next publish replaces it."""
        self._renewal = asyncio.Lock()
        self._reader: AIOKafkaConsumer | None = None
        self._read_lock = asyncio.Lock()
        self.replication: Replication | None = None

    async def start(self) -> None:
        """Create the topic unless it exists (with the events topic's partition count)
        and start the producer and the reader."""
        if self._producer is not None:
            return
        timeout_ms = int(self._timeout_s * 1000)
        admin = AIOKafkaAdminClient(
            bootstrap_servers=self._bootstrap,
            client_id=f"{self._client_id}-admin",
            request_timeout_ms=timeout_ms,
        )
        try:
            await bounded(admin.start(), self._timeout_s, "admin connect")
            self.replication = await cluster_replication(
                admin, self._timeout_s, self._replication_factor, self._min_insync
            )
            actual = await create_topic(
                admin,
                self._topic,
                self._partitions,
                self.replication,
                self._timeout_s,
                self._configs,
            )
        finally:
            await stop_quietly(admin.close(), self._timeout_s)
        if actual != self._partitions:
            raise ConfigurationError(
                f"topic {self._topic} has {actual} partitions but the events topic has "
                f"{self._partitions}: the changelog must be co-partitioned"
            )
        try:
            self._producer = await self._started_producer()
            self._reader = await started(
                standalone_reader(
                    self._bootstrap,
                    f"{self._client_id}-reader",
                    timeout_ms,
                    max_partition_fetch_bytes=_FETCH_BYTES,
                    fetch_max_bytes=4 * _FETCH_BYTES,
                ),
                self._timeout_s,
                "changelog reader start",
            )
            await self.end_offsets(range(self._partitions))  # as KafkaLogTransport.start
        except BaseException:
            await self.close()
            raise

    async def _started_producer(self) -> AIOKafkaProducer:
        return await started(
            AIOKafkaProducer(
                bootstrap_servers=self._bootstrap,
                client_id=self._client_id,
                enable_idempotence=True,
                acks="all",
                max_batch_size=RECORD_BATCH_BYTES,
                max_request_size=_FETCH_BYTES,
                request_timeout_ms=int(self._timeout_s * 1000),
            ),
            self._timeout_s,
            "changelog producer start",
        )

    async def close(self) -> None:
        """Stop the producer and the reader; safe to call twice."""
        clients: list[Any] = [self._reader, self._producer]
        self._reader = self._producer = self._broken = None
        for client in clients:
            if client is not None:
                await stop_quietly(client.stop(), self._timeout_s)

    @property
    def topic(self) -> str:
        return self._topic

    @property
    def partitions(self) -> int:
        return self._partitions

    async def publish(self, partition: int, records: Sequence[tuple[bytes, bytes | None]]) -> None:
        """Write ``(key, value)`` pairs to ``partition`` and wait until all are acknowledged
        (``value=None`` writes a tombstone)."""
        if not records:
            return
        self._check(partition)
        producer = self._require(self._producer)
        if self._broken is not None:
            producer = await self._renewed()
        addressed = [(partition, key, value) for key, value in records]
        try:
            enqueued = await enqueue_batches(producer, self._topic, addressed)
            await bounded(enqueued.positions(), self._timeout_s, "changelog publish")
        except TransportError as error:
            if not isinstance(error.__cause__, PRODUCER_STATE_LOST):
                raise
            if self._broken is None and self._producer is producer:
                self._broken = producer
            raise TransportUnavailable(
                f"{error}: the changelog producer is started anew, publish again"
            ) from error

    async def _renewed(self) -> AIOKafkaProducer:
        """The producer that replaces the broken one, started first (publishes beside the
        renewal wait for it; one that fails to start is tried again by the next publish,
        as a ``TransportUnavailable``), then the broken one stopped. Its idempotence state
        is what the broker no longer accepts: batches that timed out during an outage left
        a gap in its sequence numbers, and it fails every send after (aiokafka, unlike
        Kafka's Java producer, does not bump its epoch); a new producer gets a new id."""
        async with self._renewal:
            broken = self._broken
            if broken is None:  # renewed while this publish waited
                return self._require(self._producer)
            stop_broken = broken.stop  # (before the identity test below narrows ``broken``)
            try:
                fresh = await self._started_producer()
            except TransportError as error:
                raise TransportUnavailable(
                    f"{error}: the changelog producer could not be started anew yet"
                ) from error
            if self._producer is not broken:  # closed meanwhile
                await stop_quietly(fresh.stop(), self._timeout_s)
                return self._require(self._producer)
            self._producer, self._broken = fresh, None
            await stop_quietly(stop_broken(), self._timeout_s)
            return fresh

    async def end_offset(self, partition: int) -> int:
        """The offset the next record of ``partition`` will get."""
        return (await self.end_offsets([partition]))[partition]

    async def end_offsets(self, partitions: Iterable[int]) -> dict[int, int]:
        """:meth:`end_offset` of each of ``partitions``, asked in one request."""
        wanted = sorted(set(partitions))
        if not wanted:
            return {}
        for partition in wanted:
            self._check(partition)
        reader = self._require(self._reader)
        tps = [TopicPartition(self._topic, partition) for partition in wanted]
        ends = await bounded(reader.end_offsets(tps), self._timeout_s, "changelog end offset")
        return {tp.partition: int(ends[tp]) for tp in tps}

    async def read(
        self, partition: int, offset: int, end: int, max_records: int = 5000
    ) -> tuple[list[ChangelogEntry], int]:
        """Records of ``partition`` in ``[offset, end)`` (at most ``max_records``) and the
        offset to read from next; compaction leaves gaps, so that may pass the last
        record's offset + 1."""
        self._check(partition)
        if offset >= end:
            return [], offset
        reader = self._require(self._reader)
        async with self._read_lock:
            return await bounded(
                _read_range(
                    reader, TopicPartition(self._topic, partition), offset, end, max_records
                ),
                self._timeout_s,
                "changelog read",
            )

    def _check(self, partition: int) -> None:
        if not 0 <= partition < self._partitions:
            raise ValueError(f"partition {partition} out of range 0..{self._partitions - 1}")

    @staticmethod
    def _require(client: Any) -> Any:
        if client is None:
            raise TransportError("kafka changelog is not started")
        return client

    async def __aenter__(self) -> KafkaChangelog:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
