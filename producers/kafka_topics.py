"""Creating PRME's Kafka topics: how many replicas, how many must be in sync.

Unset, both follow the cluster: ``replication_factor = min(3, brokers)`` and
``min.insync.replicas = replication_factor - 1`` (at least 1). On one broker that is 1/1;
on three it is 3/2, so one broker can die without losing an acknowledged write (the
producers use ``acks=all``) or stopping writes.
"""

from __future__ import annotations

import asyncio

import msgspec
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from prme.schemas.errors import TransportError

from .kafka_common import bounded

MAX_REPLICATION = 3
_TOPIC_EXISTS = 36
RETENTION_FOREVER = {"retention.ms": "-1", "retention.bytes": "-1"}


class Replication(msgspec.Struct, frozen=True):
    factor: int
    min_insync: int


def derive_replication(
    brokers: int, factor: int | None = None, min_insync: int | None = None
) -> Replication:
    """The replication for a cluster of ``brokers``; explicit values win."""
    if brokers <= 0:
        raise TransportError("kafka: the cluster describes no brokers")
    chosen = factor if factor is not None else min(MAX_REPLICATION, brokers)
    if chosen <= 0:
        raise TransportError(f"kafka: replication factor must be positive, got {chosen}")
    isr = min_insync if min_insync is not None else max(1, chosen - 1)
    if not 1 <= isr <= chosen:
        raise TransportError(
            f"kafka: min.insync.replicas {isr} must be between 1 and the replication factor "
            f"{chosen}"
        )
    return Replication(chosen, isr)


async def cluster_replication(
    admin: AIOKafkaAdminClient,
    timeout_s: float,
    factor: int | None = None,
    min_insync: int | None = None,
) -> Replication:
    """:func:`derive_replication` for the cluster ``admin`` is connected to."""
    if factor is not None and min_insync is not None:
        return derive_replication(factor, factor, min_insync)
    cluster = await bounded(admin.describe_cluster(), timeout_s, "describe cluster")
    return derive_replication(len(cluster.get("brokers") or []), factor, min_insync)


async def create_topic(
    admin: AIOKafkaAdminClient,
    name: str,
    partitions: int,
    replication: Replication,
    timeout_s: float,
    configs: dict[str, str] | None = None,
) -> int:
    """Create topic ``name`` unless it exists (an existing topic keeps its settings);
    returns its partition count."""
    topic = NewTopic(
        name,
        num_partitions=partitions,
        replication_factor=replication.factor,
        topic_configs={"min.insync.replicas": str(replication.min_insync), **(configs or {})},
    )
    timeout_ms = int(timeout_s * 1000)
    response = await bounded(
        admin.create_topics([topic], timeout_ms=timeout_ms), timeout_s, f"create topic {name}"
    )
    for error in response.topic_errors:
        code, message = error[1], error[2] if len(error) > 2 else None
        if code not in (0, _TOPIC_EXISTS):
            raise TransportError(f"kafka: cannot create topic {name}: {code} {message}")
    return await partition_count(admin, name, timeout_s)


async def partition_count(admin: AIOKafkaAdminClient, name: str, timeout_s: float) -> int:
    """The partition count of ``name``, waiting (bounded) for its metadata to appear."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        topics = await bounded(admin.describe_topics([name]), timeout_s, f"describe topic {name}")
        found = [t for t in topics if t["topic"] == name and t["error_code"] == 0]
        if found and found[0]["partitions"]:
            return len(found[0]["partitions"])
        if loop.time() >= deadline:
            raise TransportError(f"kafka: topic {name} has no metadata after creation")
        await asyncio.sleep(0.1)  # metadata propagation poll interval
