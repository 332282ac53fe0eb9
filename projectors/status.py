"""Where the projector of this process stands, per partition: log end, applied offset, lag.

One computation serves ``GET /v1/ready``, the lag series of ``GET /metrics`` and
``prme status``. Lag counts records, not offsets: on Kafka a transaction's commit marker
takes an offset no record has, so the lag is the log end minus the next offset the
consumer reads (which has stepped over the markers), never ``end - 1 - applied``.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any, Literal

import msgspec

from prme.schemas.cluster import TopicRefused
from prme.schemas.metrics import Metrics, transport_label

from .runner import ProjectorRunner

STATUS_TIMEOUT_S = 2.0
"""How long ``/v1/ready``, ``/metrics`` and ``/v1/status`` wait for the log (end offsets,
the oldest unapplied record, the group's description). They waited for the transport's
``request_timeout_s`` (30 s): a Prometheus scrape (10 s) lost every series, the
transport-error counters included, exactly while Kafka was unreachable, and readiness
probes timed out. Past it they answer with the last log ends read, marked stale."""


class LogEnds(msgspec.Struct, frozen=True, kw_only=True):
    """The log's end offsets as a status saw them."""

    ends: dict[int, int]
    """Per partition; the last ones read when ``unavailable`` (empty if none ever was)."""
    unavailable: str | None = None
    """Why the log did not answer this time (None: ``ends`` are current)."""
    age_s: float | None = 0.0
    """Seconds since ``ends`` were read (None: never)."""


async def read_log_ends(runner: ProjectorRunner, timeout_s: float = STATUS_TIMEOUT_S) -> LogEnds:
    """The log ends, waiting at most ``timeout_s``; else the last ones read, marked stale."""
    transport = runner.transport
    try:
        ends = await asyncio.wait_for(transport.end_offsets(), timeout_s)
    except Exception as error:
        runner.metrics.transport_errors.labels(transport_label(transport), "end_offsets").inc()
        if isinstance(error, TimeoutError):
            reason = f"the log did not answer within {timeout_s:g}s"
        else:
            reason = f"the log did not answer: {error}"
        known, read_at = runner.known_log_ends
        age = None if read_at is None else time.monotonic() - read_at
        return LogEnds(ends=dict(known), unavailable=reason, age_s=age)
    runner.known_log_ends = (dict(ends), time.monotonic())
    return LogEnds(ends=ends)


class PartitionStatus(msgspec.Struct, frozen=True, kw_only=True):
    partition: int
    log_end: int
    """The offset the next record appended to this partition will get."""
    applied_offset: int
    """The last offset every live read model has applied (-1: none)."""
    next_offset: int
    """The offset the projector reads next (past transaction markers)."""
    lag_records: int
    lag_seconds: float
    """Age of the oldest record not yet applied; 0 when caught up."""
    dead_letters: int
    """Records of this partition dead-lettered by this process since it started."""
    size_bytes: dict[str, int] = {}
    """Bytes on disk per read model (filled when asked for)."""
    log_end_stale: bool = False
    """The log did not answer: ``log_end`` (and the lag) is the last one read (0 if none
    was), and ``lag_seconds`` is not measured."""


async def partition_statuses(
    runner: ProjectorRunner,
    *,
    sizes: bool = False,
    ends: LogEnds | None = None,
    timeout_s: float = STATUS_TIMEOUT_S,
) -> list[PartitionStatus]:
    """The status of every partition this process projects, in partition order, from
    ``ends`` (read here if not given); the log is waited for at most ``timeout_s``."""
    transport = runner.transport
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    if ends is None:
        ends = await read_log_ends(runner, timeout_s)
    stale = ends.unavailable is not None
    now_ms = time.time() * 1000
    statuses: list[PartitionStatus] = []
    for partition, shard in sorted(runner.shards.items()):
        end = ends.ends.get(partition, 0)
        following = runner.next_offset(partition)
        lag = max(0, end - following)
        age = 0.0
        if lag and not stale:
            try:
                oldest = await asyncio.wait_for(
                    transport.read(partition, following, 1), max(0.0, deadline - loop.time())
                )
            except Exception:  # the log stopped answering meanwhile: the age goes unmeasured
                oldest = None
                stale = True
            if oldest:
                age = max(0.0, (now_ms - oldest[0].timestamp_ms) / 1000)
            elif oldest is not None:  # only aborted records or markers were left
                lag = 0
        statuses.append(
            PartitionStatus(
                partition=partition,
                log_end=end,
                applied_offset=shard.applied_offset() if shard.models else -1,
                next_offset=following,
                lag_records=lag,
                lag_seconds=age,
                dead_letters=runner.dead_letters_by_partition.get(partition, 0),
                size_bytes=model_sizes(shard.directory) if sizes else {},
                log_end_stale=stale,
            )
        )
    return statuses


class EmbeddingStatus(msgspec.Struct, frozen=True, kw_only=True):
    model_name: str
    model_version: str
    dimension: int
    mismatched_partitions: list[int]
    """Partitions whose vector model was built by another identity (rebuild them)."""
    query_precision: str | None = None
    """How queries are encoded (``embedding.query_precision`` in effect: ``int8`` on the
    default model's int8 copy, ``float`` on the exact model; ``None``: the provider does
    not say)."""


PartitionState = Literal[
    "serving", "not_serving", "unreachable", "unowned", "rebalancing", "worker", "unknown"
]


class PartitionHealth(msgspec.Struct, frozen=True, kw_only=True):
    partition: int
    state: PartitionState
    """``serving``: its owner answers and has caught up (the only healthy state);
    ``not_serving``: its owner answers but is still restoring it (or has not taken it up);
    ``unreachable``: its owner does not answer (killed: the group moves the partition once
    the owner's session timeout passes); ``unowned``: no member holds it; ``rebalancing``:
    the group is handing partitions out; ``worker``: a member that serves no requests (a
    ``prme project`` worker) holds it; ``unknown``: the group's description did not
    answer."""
    owner: str | None = None
    """The URL of the node that holds it ("": a worker; None: nobody, or unknown)."""


class ClusterHealth(msgspec.Struct, frozen=True, kw_only=True):
    healthy: bool
    """Every partition of the topic has a live owner that serves it (``prme status``
    exits 0 only then)."""
    partitions: list[PartitionHealth]
    problems: list[str] = []
    """One line per reason it is not healthy (``prme status`` prints each after
    ``DEGRADED:``)."""


class NodeStatus(msgspec.Struct, frozen=True, kw_only=True):
    """What ``prme status`` shows: this process's partitions and the group around it."""

    transport: str
    group: str
    partitions: list[PartitionStatus]
    lag_records: int
    dead_letters: int
    embedding: EmbeddingStatus
    group_members: list[Any] | None = None
    """On Kafka, every member of the consumer group and the partitions it holds."""
    group_state: str | None = None
    """On Kafka, the group's state as its coordinator describes it (``Stable``, or
    ``PreparingRebalance`` / ``CompletingRebalance`` while it rebalances); None on the
    embedded log, or when the group's description did not answer."""
    refused: list[str] = []
    """Nodes the group gave nothing because their cluster secret is not the others'."""
    duplicates: list[str] = []
    """URLs of nodes the group gave nothing because another member advertises them too."""
    topic: str = ""
    """The topic the group reads (its map's)."""
    other_topic: list[TopicRefused] = []
    """Nodes the group gave nothing because they read another topic."""
    failure: str | None = None
    """Why this process's projector stopped (it then left the group); None while it runs."""
    log_unavailable: str | None = None
    """Why the log did not answer this status (log ends and lag are then the last known)."""
    log_end_age_s: float | None = 0.0
    """Seconds since the log ends shown were read (None: never)."""
    cluster: ClusterHealth | None = None
    """Whether every partition of the topic has a live owner serving it: filled by the
    service (``query/cluster_health.py``), which asks the other owners."""
    lexical_legacy_partitions: list[int] = []
    """This process's partitions whose lexical index has the terms of before 2026-12-07 (no
    accent folding, a run of CJK characters one word): ``prme rebuild --model lexical``."""


async def node_status(runner: ProjectorRunner) -> NodeStatus:
    """The status of this process: partitions with sizes on disk, and on Kafka the group."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + STATUS_TIMEOUT_S
    ends = await read_log_ends(runner)
    partitions = await partition_statuses(
        runner, sizes=True, ends=ends, timeout_s=max(0.0, deadline - loop.time())
    )
    describe = getattr(runner.transport, "describe_group", None)
    group = None
    if describe is not None and ends.unavailable is None:
        # A node the group refused for reading another topic lists the members with the
        # partitions of the group's topic, which are the ones they hold.
        topic = None if runner.cluster_map is None else runner.cluster_map.topic or None
        try:
            group = await asyncio.wait_for(
                describe(runner.group, topic), max(0.1, deadline - loop.time())
            )
        except Exception:  # the group's coordinator did not answer in time: left out
            group = None
    identity = runner.identity
    return NodeStatus(
        transport=transport_label(runner.transport),
        group=runner.group,
        partitions=partitions,
        lag_records=sum(p.lag_records for p in partitions),
        dead_letters=runner.dead_letter_count,
        embedding=EmbeddingStatus(
            model_name=identity.model_name,
            model_version=identity.model_version,
            dimension=identity.dimension,
            mismatched_partitions=sorted(
                p for p, shard in runner.shards.items() if shard.vector_mismatch
            ),
            query_precision=getattr(runner.provider, "query_precision", None),
        ),
        lexical_legacy_partitions=sorted(
            p for p, shard in runner.shards.items() if shard.lexical_legacy
        ),
        group_members=None if group is None else group.members,
        group_state=None if group is None else group.state,
        refused=[] if runner.cluster_map is None else list(runner.cluster_map.refused),
        duplicates=[]
        if runner.cluster_map is None
        else sorted(runner.cluster_map.duplicates.values()),
        topic="" if runner.cluster_map is None else runner.cluster_map.topic,
        other_topic=[] if runner.cluster_map is None else list(runner.cluster_map.other_topic),
        failure=projector_failure(runner),
        log_unavailable=ends.unavailable,
        log_end_age_s=ends.age_s,
    )


def projector_failure(runner: ProjectorRunner) -> str | None:
    """Why this process's projector stopped, and what became of its partitions; None
    while it runs."""
    failure = runner.failure
    if failure is None:
        return None
    if runner.left_group.is_set() and transport_label(runner.transport) == "kafka":
        moved = f"; this node left consumer group {runner.group}, its partitions moved to the "
        moved += "other members: restart it once the cause is fixed"
    else:
        moved = ""
    return f"the projector stopped: {failure!r}{moved}"


def record_statuses(
    metrics: Metrics, statuses: list[PartitionStatus], ends: LogEnds | None = None
) -> None:
    """Set the per-partition gauges (partitions no longer held disappear), and with
    ``ends`` the age of the log ends they come from."""
    if ends is not None:
        metrics.log_end_age.set(-1 if ends.age_s is None else ends.age_s)
    gauges = (metrics.lag_records, metrics.lag_seconds, metrics.log_end_offset)
    for gauge in (*gauges, metrics.applied_offset):
        gauge.clear()
    for status in statuses:
        label = str(status.partition)
        metrics.lag_records.labels(label).set(status.lag_records)
        metrics.lag_seconds.labels(label).set(status.lag_seconds)
        metrics.log_end_offset.labels(label).set(status.log_end)
        metrics.applied_offset.labels(label).set(status.applied_offset)


def model_sizes(directory: Path) -> dict[str, int]:
    """Bytes on disk per read model directory under a shard ``directory``: the blocks
    allocated, as ``du`` counts them (qdrant's files are sparse: their apparent size is
    several times what they take)."""
    if not directory.exists():
        return {}
    sizes: dict[str, int] = {}
    for model in sorted(p for p in directory.iterdir() if p.is_dir()):
        sizes[model.name] = sum(_allocated(f.stat()) for f in model.rglob("*") if f.is_file())
    return sizes


def _allocated(stat: os.stat_result) -> int:
    blocks = getattr(stat, "st_blocks", None)  # absent on Windows
    return stat.st_size if blocks is None else blocks * 512
