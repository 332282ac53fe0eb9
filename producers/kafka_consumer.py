"""The Kafka consumer-group member the projector runner reads through."""

from __future__ import annotations

from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.errors import InvalidSessionTimeoutError, KafkaError

from prme.schemas.cluster import ClusterMap, MemberClaim
from prme.schemas.errors import ConfigurationError, TransportError

from .kafka_common import bounded, entry_of, stop_quietly, transport_error
from .kafka_membership import ClusterAssignor
from .transport import LogConsumer, LogEntry, Membership, PartitionsCallback


class _Listener(ConsumerRebalanceListener):
    """Forwards aiokafka's rebalance events as partition-number sets."""

    def __init__(
        self, topic: str, on_assigned: PartitionsCallback, on_revoked: PartitionsCallback
    ) -> None:
        self._topic = topic
        self._on_assigned = on_assigned
        self._on_revoked = on_revoked

    async def on_partitions_revoked(self, revoked: Any) -> None:
        partitions = {tp.partition for tp in revoked if tp.topic == self._topic}
        if partitions:
            await self._on_revoked(partitions)

    async def on_partitions_assigned(self, assigned: Any) -> None:
        # Also when empty: a member with nothing to project has still been assigned.
        await self._on_assigned({tp.partition for tp in assigned if tp.topic == self._topic})


def _anonymous() -> MemberClaim:
    return MemberClaim(url="")


def _ignore(_: ClusterMap) -> None:
    return None


class KafkaLogConsumer(LogConsumer):
    """A consumer-group member: the group gives each partition to one member.

    Offsets are never committed to the broker; the caller seeks to the offsets stored
    with its read models (in ``on_assigned``). Without a seek a partition starts at the
    beginning.
    """

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        group: str,
        *,
        request_timeout_s: float = 30.0,
        client_id: str = "prme",
        session_timeout_ms: int = 10_000,
        heartbeat_interval_ms: int = 3_000,
        membership: Membership | None = None,
    ) -> None:
        """With ``membership`` the group's assignor is PRME's (every member must then be a
        PRME node): owners sticky and balanced, and the cluster map handed to each."""
        self._topic = topic
        self._timeout_s = request_timeout_s
        self._settings: dict[str, Any] = {
            "bootstrap_servers": bootstrap,
            "client_id": f"{client_id}-{group}",
            "group_id": group,
            "enable_auto_commit": False,
            "auto_offset_reset": "earliest",
            "isolation_level": "read_committed",
            "session_timeout_ms": session_timeout_ms,
            "heartbeat_interval_ms": heartbeat_interval_ms,
            "request_timeout_ms": int(request_timeout_s * 1000),
            # A fetch parked at a partition's end holds the connection (a broker answers it
            # in order): after a rebalance the new assignment's first fetch waited behind
            # it for up to Kafka's default 500 ms before a moved partition was served.
            "fetch_max_wait_ms": 100,
            "partition_assignment_strategy": (
                ClusterAssignor(
                    topic,
                    membership.claim if membership else _anonymous,
                    membership.on_map if membership else _ignore,
                    membership.standby_replicas if membership else 0,
                ),
            ),
        }
        self._consumer: AIOKafkaConsumer | None = None

    async def start(self, on_assigned: PartitionsCallback, on_revoked: PartitionsCallback) -> None:
        if self._consumer is not None:
            raise TransportError("consumer already started")
        consumer = AIOKafkaConsumer(**self._settings)
        consumer.subscribe(
            topics=[self._topic], listener=_Listener(self._topic, on_assigned, on_revoked)
        )
        # The first assignment can arrive inside start(), and its callback may seek.
        self._consumer = consumer
        try:
            await bounded(consumer.start(), self._timeout_s, "consumer start")
        except BaseException as error:
            self._consumer = None
            await stop_quietly(consumer.stop(), self._timeout_s)
            if isinstance(error.__cause__, InvalidSessionTimeoutError):
                seconds = self._settings["session_timeout_ms"] / 1000
                raise ConfigurationError(
                    f"kafka: the brokers refuse a session timeout of {seconds:g} s "
                    "(cluster.session_timeout_s, PRME_CLUSTER__SESSION_TIMEOUT_S): they take "
                    "one between their group.min.session.timeout.ms (6 s by default) and "
                    "group.max.session.timeout.ms"
                ) from error
            raise

    async def close(self) -> None:
        consumer, self._consumer = self._consumer, None
        if consumer is None:
            return
        await stop_quietly(consumer.stop(), self._timeout_s)

    def _require(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            raise TransportError("kafka consumer is not started")
        return self._consumer

    def seek(self, partition: int, offset: int) -> None:
        self._require().seek(TopicPartition(self._topic, partition), offset)

    async def position(self, partition: int) -> int:
        tp = TopicPartition(self._topic, partition)
        return int(await bounded(self._require().position(tp), self._timeout_s, "position"))

    def assignment(self) -> set[int]:
        """Partitions currently assigned to this member."""
        return {tp.partition for tp in self._require().assignment() if tp.topic == self._topic}

    def request_rebalance(self) -> None:
        # aiokafka has no public call for it; its coordinator rejoins on this future.
        coordinator = getattr(self._require(), "_coordinator", None)
        if coordinator is not None:
            coordinator.request_rejoin()

    async def poll(self, max_records: int, timeout_s: float) -> dict[int, list[LogEntry]]:
        # getmany has its own deadline; wrapping it in wait_for as well left a cancelled
        # poll hanging (the runner's close waited on it forever).
        consumer = self._require()
        try:
            batches = await consumer.getmany(
                timeout_ms=int(timeout_s * 1000), max_records=max_records
            )
            # getmany drains one partition's fetched records before it returns another's:
            # a backlog in one partition held a write to another behind all of it (a
            # review). What the other partitions have fetched comes along.
            others = [tp for tp in consumer.assignment() if tp not in batches]
            if batches and others:
                batches.update(
                    await consumer.getmany(*others, timeout_ms=0, max_records=max_records)
                )
        except KafkaError as error:
            raise transport_error("poll", error) from error
        return {
            tp.partition: [entry_of(record) for record in records]
            for tp, records in batches.items()
            if records
        }
