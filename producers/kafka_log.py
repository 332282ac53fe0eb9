"""The Kafka log transport: aiokafka against an Apache Kafka broker.

Appends go through an idempotent producer (``acks=all``); ``append_many`` goes through a
transactional producer so a batch is all or nothing; every reader uses
``isolation_level="read_committed"`` so an aborted or unfinished transaction is never
seen: a transaction that fails before its commit is sent was not written. Transaction markers take offsets, so offsets within a partition increase but may
have gaps.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from prme.schemas.cluster import ClusterMap
from prme.schemas.errors import AppendUnconfirmed, ConfigurationError, TransportError

from .kafka_batches import RECORD_BATCH_BYTES, enqueue_batches
from .kafka_common import bounded, entry_of, reading, standalone_reader, stop_quietly
from .kafka_consumer import KafkaLogConsumer
from .kafka_group import GroupDescription, describe_group
from .kafka_membership import read_cluster_map
from .kafka_topics import RETENTION_FOREVER, Replication, cluster_replication, create_topic
from .partitioner import Partitioner
from .transport import (
    FirstWrites,
    LogEntry,
    LogItem,
    Membership,
    Position,
    check_same_write,
)

T = TypeVar("T")

DEFAULT_TOPIC = "prme.events"
_OWN_WRITES_POLL_S = 0.002
_OWN_WRITES_WAIT_S = 1.0
"""How long a read waits for this transport's own writes to become visible (a transaction's
markers land within milliseconds); past it, something else holds the partition back (a
transaction of another producer, a recreated topic) and the read answers what is visible."""
DEDUPE_CAPACITY = 100_000
DEDUPE_TTL_S = 60.0
"""How long a process answers a request id from its map. A later retry is appended again:
the same event, which the projectors apply once (``projectors/repeats.py``), so the map
only saves log records. The bound matters after an erasure, which only the erasing
process's map learns of: another process would answer the owner's reused request id with
the erased write's position for as long as it kept the entry (the same window as its
cached data keys, ``keys.WRITE_TTL_S``)."""


class DedupeCache:
    """A bounded LRU map ``dedupe_key -> (Position, fingerprint)`` whose entries expire
    ``ttl_s`` after they were written."""

    def __init__(
        self,
        capacity: int,
        ttl_s: float = DEDUPE_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._capacity = capacity
        self._ttl_s = ttl_s
        self._clock = clock
        self._positions: OrderedDict[str, tuple[Position, bytes | None, float]] = OrderedDict()

    def held(self, key: str) -> tuple[Position, bytes | None] | None:
        """The first write's position and fingerprint (``None`` once expired)."""
        held = self._positions.get(key)
        if held is None:
            return None
        if self._clock() - held[2] > self._ttl_s:
            del self._positions[key]
            return None
        self._positions.move_to_end(key)
        return held[0], held[1]

    def forget(self, prefix: str) -> None:
        for key in [key for key in self._positions if key.startswith(prefix)]:
            del self._positions[key]

    def put(self, key: str, position: Position, fingerprint: bytes | None = None) -> None:
        self._positions[key] = (position, fingerprint, self._clock())
        self._positions.move_to_end(key)
        while len(self._positions) > self._capacity:
            self._positions.popitem(last=False)


class KafkaLogTransport:
    """:class:`~prme.producers.transport.LogTransport` on a Kafka topic keyed by owner.

    ``dedupe_key`` idempotency is kept in a bounded in-process LRU (``dedupe_capacity``
    keys, each for ``DEDUPE_TTL_S``): a retry through the same transport instance returns
    the first position and writes nothing. Kafka cannot look keys up itself, so a key the
    map does not hold is asked of ``first_writes`` (a node's events read models, for the
    partitions it projects); a retry that neither knows (another node's write, not yet
    applied here) is written again, and projectors deduplicate it downstream by event id.
    """

    def __init__(
        self,
        bootstrap: str,
        topic: str = DEFAULT_TOPIC,
        partitions: int = 12,
        *,
        request_timeout_s: float = 30.0,
        client_id: str = "prme",
        transactional_id: str | None = None,
        replication_factor: int | None = None,
        min_insync_replicas: int | None = None,
        dedupe_capacity: int = DEDUPE_CAPACITY,
    ) -> None:
        if partitions <= 0:
            raise ConfigurationError("partitions must be positive")
        self._bootstrap = bootstrap
        self._topic = topic
        self._partitions = partitions
        self._partitioner = Partitioner(partitions)
        self._timeout_s = request_timeout_s
        self._client_id = client_id
        self._stable_txn_id = transactional_id
        self._replication_factor = replication_factor
        self._min_insync = min_insync_replicas
        self._replication: Replication | None = None
        self._dedupe = DedupeCache(dedupe_capacity)
        self.dedupe_hits = 0
        """Appends answered from the dedupe map (or a same-key append in flight)."""
        self._in_flight: dict[str, asyncio.Future[Position]] = {}
        self._in_flight_prints: dict[str, bytes | None] = {}
        """The fingerprint of each key in flight (a conflicting append must not wait)."""
        self.first_writes: FirstWrites | None = None
        """Where a key the map misses is looked up (set by the node that projects)."""
        self._admin: AIOKafkaAdminClient | None = None
        self._producer: AIOKafkaProducer | None = None
        self._txn_producer: AIOKafkaProducer | None = None
        self._txn_lock = asyncio.Lock()
        self._enqueue_lock = asyncio.Lock()
        self._reader: AIOKafkaConsumer | None = None
        self._read_lock = asyncio.Lock()
        self._written: dict[int, int] = {}
        """Per partition, the last offset this transport wrote (see ``_ends_with_own``)."""

    @property
    def partitions(self) -> int:
        return self._partitions

    @property
    def topic(self) -> str:
        return self._topic

    @property
    def replication(self) -> Replication | None:
        """How this transport's topics are replicated (known once started)."""
        return self._replication

    @property
    def bootstrap(self) -> str:
        return self._bootstrap

    @property
    def _timeout_ms(self) -> int:
        return int(self._timeout_s * 1000)

    async def start(self) -> None:
        """Connect, create the topic if missing, and start the producer and the reader."""
        if self._producer is not None:
            return
        try:
            self._admin = AIOKafkaAdminClient(
                bootstrap_servers=self._bootstrap,
                client_id=f"{self._client_id}-admin",
                request_timeout_ms=self._timeout_ms,
            )
            await bounded(self._admin.start(), self._timeout_s, "admin connect")
            self._replication = await cluster_replication(
                self._admin, self._timeout_s, self._replication_factor, self._min_insync
            )
            await self.ensure_topic(self._topic, self._partitions)
            producer = AIOKafkaProducer(
                bootstrap_servers=self._bootstrap,
                client_id=self._client_id,
                enable_idempotence=True,
                acks="all",
                request_timeout_ms=self._timeout_ms,
                max_batch_size=RECORD_BATCH_BYTES,
            )
            await bounded(producer.start(), self._timeout_s, "producer start")
            self._producer = producer
            reader = standalone_reader(
                self._bootstrap,
                f"{self._client_id}-reader",
                self._timeout_ms,
                isolation_level="read_committed",
            )
            await bounded(reader.start(), self._timeout_s, "reader start")
            self._reader = reader
            # A topic just created answers NOT_LEADER for ~0.1 s after its metadata shows
            # leaders; the reader's offset request waits that out quietly, so the first
            # appends are not retried with a warning per partition.
            await self.end_offsets()
            if self._stable_txn_id is not None:
                # Initialising a stable transactional id fences a crashed predecessor and
                # aborts its open transaction, which would otherwise hold back the LSO.
                await self._transactional_producer()
        except BaseException:
            await self.close()
            raise

    async def ensure_topic(
        self, name: str, partitions: int | None = None, configs: dict[str, str] | None = None
    ) -> int:
        """Create topic ``name`` (unlimited retention) unless it exists; its partition count.

        Used for the events topic and the dead-letter topic, replicated as
        :mod:`~prme.producers.kafka_topics` derives from the cluster unless configured.
        When the events topic already exists with a different partition count, raises
        :class:`ConfigurationError`: owners would map to other partitions than the local
        transport gives them.
        """
        if self._admin is None or self._replication is None:
            raise TransportError("kafka transport is not started")
        wanted = partitions if partitions is not None else self._partitions
        actual = await create_topic(
            self._admin,
            name,
            wanted,
            self._replication,
            self._timeout_s,
            {**RETENTION_FOREVER, **(configs or {})},
        )
        if name == self._topic and actual != self._partitions:
            raise ConfigurationError(
                f"topic {name} has {actual} partitions but this transport is configured "
                f"for {self._partitions}"
            )
        return actual

    async def close(self) -> None:
        """Stop every client this transport holds; safe to call twice."""
        clients: list[Any] = [self._reader, self._txn_producer, self._producer, self._admin]
        self._reader = self._txn_producer = self._producer = None
        self._admin = None
        for client in clients:
            if client is None:
                continue
            stop = client.close() if isinstance(client, AIOKafkaAdminClient) else client.stop()
            await stop_quietly(stop, self._timeout_s)

    def partition_for(self, key: bytes) -> int:
        return self._partitioner(key)

    async def append(self, item: LogItem) -> Position:
        """Append one record; a repeated ``dedupe_key`` returns the first position."""
        key = item.dedupe_key
        if key is None:
            return await self._send(item)
        await self._recall([key])
        known = self._dedupe.held(key)
        if known is not None:
            check_same_write(item, known[1])
            self.dedupe_hits += 1
            return known[0]
        pending = self._in_flight.get(key)
        if pending is not None:
            check_same_write(item, self._in_flight_prints.get(key))
            self.dedupe_hits += 1
            return await asyncio.shield(pending)
        future: asyncio.Future[Position] = asyncio.get_running_loop().create_future()
        self._in_flight[key] = future
        self._in_flight_prints[key] = item.fingerprint
        try:
            position = await self._send(item)
        except BaseException as error:
            future.set_exception(error)
            future.exception()  # marks it retrieved when nobody else was waiting
            raise
        finally:
            del self._in_flight[key]
            del self._in_flight_prints[key]
        self._dedupe.put(key, position, item.fingerprint)
        future.set_result(position)
        return position

    async def _send(self, item: LogItem) -> Position:
        producer = self._require(self._producer)
        partition = self.partition_for(item.key)
        metadata = await bounded(
            producer.send_and_wait(self._topic, item.value, key=item.key, partition=partition),
            self._timeout_s,
            "append",
            may_land=True,
        )
        position = Position(metadata.partition, metadata.offset)
        self._note_written([position])
        return position

    async def forget_dedupe(self, prefix: str) -> None:
        self._dedupe.forget(prefix)

    async def _recall(self, keys: Iterable[str | None]) -> None:
        """Put in the map the first writes ``first_writes`` knows of the keys that neither
        the map nor an append in flight holds (the caller then checks the map as usual)."""
        unknown = [
            key
            for key in dict.fromkeys(keys)
            if key is not None and key not in self._in_flight and self._dedupe.held(key) is None
        ]
        if not unknown or self.first_writes is None:
            return
        for key, (position, fingerprint) in (await self.first_writes(unknown)).items():
            if self._dedupe.held(key) is None:
                self._dedupe.put(key, position, fingerprint)

    async def written_fingerprints(self, keys: Sequence[str]) -> dict[str, bytes | None]:
        await self._recall(keys)
        found: dict[str, bytes | None] = {}
        for key in keys:
            held = self._dedupe.held(key)
            if held is not None:
                found[key] = held[1]
            elif key in self._in_flight:
                found[key] = self._in_flight_prints.get(key)
        return found

    async def append_many(self, items: Sequence[LogItem], *, atomic: bool = True) -> list[Position]:
        """Append all items in one Kafka transaction: every item is committed or none is
        (one item to write goes without a transaction: it is all or nothing by itself).

        Items whose ``dedupe_key`` was already appended through this transport (or is
        being appended, or repeats one earlier in ``items``) are not written again and get
        the first position. With ``atomic=False`` the items go through the idempotent
        producer instead (no transaction: faster, and a failure may leave some of them
        written); either way they go as record batches.
        """
        if not atomic and all(item.dedupe_key is None for item in items):
            return await self._send_many(items)
        await self._recall(item.dedupe_key for item in items)
        positions: list[Position | None] = [None] * len(items)
        batch_keys: dict[str, int] = {}
        to_write: list[int] = []
        pending: dict[int, asyncio.Future[Position]] = {}  # keys another append is writing
        hits = 0
        for index, item in enumerate(items):
            key = item.dedupe_key
            known = self._dedupe.held(key) if key is not None else None
            if known is not None:
                check_same_write(item, known[1])
                positions[index] = known[0]
                hits += 1
            elif key is not None and key in batch_keys:
                check_same_write(item, items[batch_keys[key]].fingerprint)
                hits += 1
                continue  # a repeat inside the batch: filled from its first occurrence
            elif key is not None and key in self._in_flight:
                check_same_write(item, self._in_flight_prints.get(key))
                pending[index] = self._in_flight[key]
                hits += 1
            else:
                if key is not None:
                    batch_keys[key] = index
                to_write.append(index)
        self.dedupe_hits += hits  # checked whole: a conflict writes nothing, counts nothing
        if to_write:
            send = (
                self._send_many
                if not atomic
                else self._send_transaction
                if len(to_write) > 1
                else self._send_alone
            )
            written = await self._send_claimed([items[i] for i in to_write], list(batch_keys), send)
            for index, position in zip(to_write, written, strict=True):
                positions[index] = position
        for index, future in pending.items():
            positions[index] = await asyncio.shield(future)
        for index, item in enumerate(items):
            if positions[index] is None and item.dedupe_key is not None:
                positions[index] = positions[batch_keys[item.dedupe_key]]
        return [p for p in positions if p is not None]

    async def _send_claimed(
        self,
        items: list[LogItem],
        keys: list[str],
        send: Callable[[Sequence[LogItem]], Awaitable[list[Position]]],
    ) -> list[Position]:
        """``send(items)`` with ``keys`` (theirs) marked in flight meanwhile, so a
        concurrent append of one of them waits for this one's position instead of writing
        the record again."""
        loop = asyncio.get_running_loop()
        futures = {key: loop.create_future() for key in keys}
        self._in_flight.update(futures)
        self._in_flight_prints.update(
            (item.dedupe_key, item.fingerprint) for item in items if item.dedupe_key is not None
        )
        try:
            written = await send(items)
        except BaseException as error:
            for future in futures.values():
                future.set_exception(error)
                future.exception()  # marks it retrieved when nobody else was waiting
            raise
        finally:
            for key in keys:
                del self._in_flight[key]
                self._in_flight_prints.pop(key, None)
        for item, position in zip(items, written, strict=True):
            if item.dedupe_key is not None:
                self._dedupe.put(item.dedupe_key, position, item.fingerprint)
                futures[item.dedupe_key].set_result(position)
        return written

    async def _send_many(self, items: Sequence[LogItem]) -> list[Position]:
        """Enqueue every item on the idempotent producer as record batches, then await them
        together (dedupe keys are ``append_many``'s to check)."""
        producer = self._require(self._producer)
        # Enqueueing waits when a partition's queue is full; the lock keeps batches appended
        # at once from interleaving there, so each owner's records keep the callers' order.
        async with self._enqueue_lock:
            enqueued = await enqueue_batches(producer, self._topic, self._addressed(items))
        positions = await bounded(enqueued.positions(), self._timeout_s, "append", may_land=True)
        self._note_written(positions)
        return positions

    async def _send_alone(self, items: Sequence[LogItem]) -> list[Position]:
        """One record of an atomic append: all or nothing by itself, so it goes through the
        idempotent producer (a transaction would cost a round trip to the coordinator and,
        begun right after another, often a ~20 ms wait for the last one's markers:
        CONCURRENT_TRANSACTIONS). It takes the transactions' lock, so atomic appends keep
        their call order and none of this transport's transactions is open meanwhile."""
        async with self._txn_lock:
            return await self._send_many(items)

    def _addressed(self, items: Sequence[LogItem]) -> list[tuple[int, bytes, bytes]]:
        return [(self.partition_for(item.key), item.key, item.value) for item in items]

    async def _send_transaction(self, items: Sequence[LogItem]) -> list[Position]:
        """``items`` in one transaction, within the request timeout. Until its commit is
        asked for, nothing of a transaction can be read (it is aborted, and every reader
        is ``read_committed``): a failure or a timeout then is a ``TransportError``,
        nothing written. Once the commit is asked for, the brokers may complete it
        however long its answer takes: a timeout then is ``AppendUnconfirmed``."""
        async with self._txn_lock:
            producer = await self._transactional_producer()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self._timeout_s
            try:
                await bounded(producer.begin_transaction(), self._timeout_s, "atomic append")
            except BaseException:
                await self._abandon(producer, abort=False)
                raise
            try:
                positions = await bounded(
                    self._produce(producer, items), deadline - loop.time(), "atomic append"
                )
                if deadline - loop.time() <= 0:
                    raise TimeoutError  # no time left to commit it
            except BaseException as error:
                await self._abandon(producer, abort=True)
                if isinstance(error, TransportError | TimeoutError):
                    what = (
                        str(error) or f"kafka: atomic append timed out after {self._timeout_s:g}s"
                    )
                    raise TransportError(
                        f"{what}; its transaction was aborted, never committed: nothing of "
                        "it was written (safe to send again)"
                    ) from error
                raise
            try:
                await bounded(
                    producer.commit_transaction(),
                    deadline - loop.time(),
                    "atomic append's commit",
                    may_land=True,
                )
            except AppendUnconfirmed as error:
                await self._abandon(producer, abort=False)
                raise AppendUnconfirmed(
                    f"kafka: the log did not confirm the atomic append's commit within "
                    f"{self._timeout_s:g}s; the commit was sent and may still complete, "
                    "every record then appended (a retry with the same request_id is "
                    "written once)"
                ) from error
            except BaseException as error:
                # A commit the brokers refused leaves the transaction open: it is aborted
                # (aiokafka refuses to abort a committing one).
                await self._abandon(producer, abort=isinstance(error, TransportError))
                raise
        self._note_written(positions)  # committed
        return positions

    async def _produce(
        self, producer: AIOKafkaProducer, items: Sequence[LogItem]
    ) -> list[Position]:
        enqueued = await enqueue_batches(producer, self._topic, self._addressed(items))
        return await enqueued.positions()

    async def _abandon(self, producer: AIOKafkaProducer, *, abort: bool) -> None:
        """Drop the transactional producer after a failed transaction (it may be fenced or
        in a fatal state: the next batch starts a fresh one). ``abort``: abort its open
        transaction first, so the partitions' ``read_committed`` readers move past it at
        once rather than after the broker's transaction timeout (60 s); within the request
        timeout, since its outcome is settled either way (it is never committed)."""
        self._txn_producer = None
        try:
            if abort:
                # aiokafka asserts the state an abort starts from (a fatal one cannot).
                with contextlib.suppress(KafkaError, AssertionError, TimeoutError):
                    await asyncio.wait_for(producer.abort_transaction(), self._timeout_s)
        finally:
            await stop_quietly(producer.stop(), self._timeout_s)

    def _note_written(self, positions: Sequence[Position]) -> None:
        for position in positions:
            if position.offset > self._written.get(position.partition, -1):
                self._written[position.partition] = position.offset

    async def _transactional_producer(self) -> AIOKafkaProducer:
        self._require(self._producer)
        if self._txn_producer is None:
            producer = AIOKafkaProducer(
                bootstrap_servers=self._bootstrap,
                client_id=f"{self._client_id}-txn",
                transactional_id=self._stable_txn_id or f"{self._client_id}-{uuid.uuid4()}",
                enable_idempotence=True,
                acks="all",
                request_timeout_ms=self._timeout_ms,
                max_batch_size=RECORD_BATCH_BYTES,
            )
            await bounded(producer.start(), self._timeout_s, "transactional producer start")
            self._txn_producer = producer
        return self._txn_producer

    async def read(self, partition: int, offset: int, max_records: int = 500) -> list[LogEntry]:
        """Committed records of ``partition`` from ``offset`` on; ``[]`` at the end."""
        if not 0 <= partition < self._partitions:
            raise ValueError(f"partition {partition} out of range 0..{self._partitions - 1}")
        if offset < 0 or max_records <= 0:
            raise ValueError("offset must be >= 0 and max_records > 0")
        reader = self._require(self._reader)
        tp = TopicPartition(self._topic, partition)
        end = (await self._ends_with_own(reader, [tp]))[tp]
        async with self._read_lock:
            if offset >= end:
                return []
            with reading(reader, tp, offset):
                return await bounded(
                    self._read_until(reader, tp, end, max_records), self._timeout_s, "read"
                )

    @staticmethod
    async def _read_until(
        reader: AIOKafkaConsumer, tp: TopicPartition, end: int, max_records: int
    ) -> list[LogEntry]:
        entries: list[LogEntry] = []
        while len(entries) < max_records:
            batch = await reader.getmany(tp, timeout_ms=200, max_records=max_records - len(entries))
            entries.extend(entry_of(record) for record in batch.get(tp, []))
            # Aborted records and transaction markers advance the position without records.
            if await reader.position(tp) >= end:
                break
        return entries

    async def end_offsets(self) -> dict[int, int]:
        """Next offset per partition as a read_committed reader sees it (the LSO)."""
        reader = self._require(self._reader)
        tps = [TopicPartition(self._topic, p) for p in range(self._partitions)]
        ends = await self._ends_with_own(reader, tps)
        return {tp.partition: offset for tp, offset in ends.items()}

    async def _ends_with_own(
        self, reader: AIOKafkaConsumer, tps: list[TopicPartition]
    ) -> dict[TopicPartition, int]:
        """The end offsets of ``tps``, once they include what this transport wrote there, so
        a read right after an append sees it: a commit returns before the broker has
        written the transaction's markers, and a read_committed reader sees nothing past
        the first open transaction (the LSO) until then. Waits at most
        ``_OWN_WRITES_WAIT_S``; a partition still behind then is no longer waited for."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _OWN_WRITES_WAIT_S
        while True:
            ends = await bounded(reader.end_offsets(tps), self._timeout_s, "end offsets")
            behind = [tp for tp in tps if ends[tp] <= self._written.get(tp.partition, -1)]
            if not behind:
                return ends
            if loop.time() >= deadline:
                for tp in behind:
                    self._written.pop(tp.partition, None)
                return ends
            await asyncio.sleep(_OWN_WRITES_POLL_S)

    async def describe_group(self, group: str, topic: str | None = None) -> GroupDescription:
        """Consumer group ``group``'s state, and its members with the partitions of
        ``topic`` (default: this one) each holds, as the group coordinator describes them."""
        if self._admin is None:
            raise TransportError("kafka transport is not started")
        return await describe_group(self._admin, topic or self._topic, group, self._timeout_s)

    async def cluster_map(self, group: str) -> ClusterMap | None:
        """The cluster map group ``group``'s leader handed out (None while it rebalances)."""
        if self._admin is None:
            raise TransportError("kafka transport is not started")
        return await read_cluster_map(self._admin, group, self._timeout_s)

    def consumer(self, group: str, membership: Membership | None = None) -> KafkaLogConsumer:
        return KafkaLogConsumer(
            self._bootstrap,
            self._topic,
            group,
            request_timeout_s=self._timeout_s,
            client_id=self._client_id,
            membership=membership,
            **(
                {}
                if membership is None
                else {
                    "session_timeout_ms": int(membership.session_timeout_s * 1000),
                    # a survivor learns of a rebalance at its next heartbeat
                    "heartbeat_interval_ms": int(membership.session_timeout_s * 100),
                }
            ),
        )

    async def __aenter__(self) -> KafkaLogTransport:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @staticmethod
    def _require(client: T | None) -> T:
        if client is None:
            raise TransportError("kafka transport is not started")
        return client
