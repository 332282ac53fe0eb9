"""A replicated Kafka (three real brokers on loopback): a broker killed during ingest or
during projection loses nothing and duplicates nothing; the vector changelog lets a fresh
node project a partition without encoding a text; erasure leaves no changelog entry."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from prme.producers.factory import open_key_store, open_transport, open_vector_changelog
from prme.producers.ingest import ingest_lines
from prme.producers.kafka_changelog import KafkaChangelog
from prme.producers.producer import MessageDraft, Producer
from prme.producers.sealing import keys_for
from prme.producers.transport import LogItem
from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider
from prme.projectors.runner import ProjectorRunner
from prme.projectors.vector_changelog import ChangelogKey
from prme.schemas.config import Settings
from prme.schemas.errors import AppendUnconfirmed
from prme.schemas.records import Message
from prme.schemas.sealing import Sealer

from .conftest import KafkaCluster
from .test_convergence import child_log, digests, run_child

pytestmark = pytest.mark.kafka

LINES = 20_000
PROJECTED = 2_500
"""Lines in the log the projection tests project (the first of the ingest file)."""
PARTITIONS = 4


def cluster_settings(cluster: KafkaCluster, topic: str, data_dir: Path, **log: object) -> Settings:
    return Settings(data_dir=str(data_dir)).replace(
        log={
            "transport": "kafka",
            "bootstrap": cluster.bootstrap,
            "topic": topic,
            "dlq_topic": topic + ".dlq",
            "partitions": PARTITIONS,
            **log,
        }
    )


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            pytest.fail(f"{what}: not within {timeout_s:.0f}s")
        time.sleep(0.2)  # condition poll interval (each check asks the brokers)


async def log_end(settings: Settings, topic: str | None = None) -> int:
    """How many offsets the topic's partitions hold together (0 while it does not exist)."""
    name = topic or settings.log.topic
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.log.bootstrap)
    await consumer.start()
    try:
        if name not in await consumer.topics():
            return 0
        partitions = range(settings.log.partitions)  # the changelog is co-partitioned
        ends = await consumer.end_offsets([TopicPartition(name, p) for p in partitions])
        return sum(ends.values())
    finally:
        await consumer.stop()


async def leader_of(settings: Settings, topic: str, partition: int = 0) -> int:
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.log.bootstrap)
    await admin.start()
    try:
        (described,) = await admin.describe_topics([topic])
        return next(
            int(p["leader"]) for p in described["partitions"] if p["partition"] == partition
        )
    finally:
        await admin.close()


async def line_counts(settings: Settings) -> Counter[str]:
    """How often each ingested line (its ``line N`` marker) is on the log."""
    transport, keys, sealer = open_transport(settings), open_key_store(settings), Sealer()
    counts: Counter[str] = Counter()
    await transport.start()
    await keys.start()
    try:
        for partition in range(settings.log.partitions):
            offset = 0
            while entries := await transport.read(partition, offset, 2000):
                found = await keys_for(keys, (entry.value for entry in entries))
                for entry in entries:
                    record, _ = sealer.open_with(entry.value, found)  # sealed by prme ingest
                    assert isinstance(record, Message) and isinstance(record.content, str)
                    counts[record.content.split(":", 1)[0]] += 1
                offset = entries[-1].offset + 1
    finally:
        await keys.close()
        await transport.close()
    return counts


def write_lines(path: Path, count: int = LINES) -> None:
    rng = random.Random(5)
    words = "Aurora deploy approval Friday tea hiking Alps Paris guitar sister budget launch"
    vocabulary = words.split()
    with path.open("w") as out:
        for number in range(count):
            text = " ".join(rng.choice(vocabulary) for _ in range(rng.randrange(3, 12)))
            line = {
                "owner": f"owner{rng.randrange(40)}",
                "session": f"s{rng.randrange(3)}",
                "name": "Ann" if number % 2 else None,
                "content": f"line {number}: {text}",
            }
            out.write(json.dumps(line) + "\n")


class Ingested(msgspec.Struct):
    settings: Settings
    returncode: int
    output: str
    killed_while_running: bool
    killed: int


@pytest.fixture(scope="module")
def ingested(kafka_cluster: KafkaCluster, tmp_path_factory: pytest.TempPathFactory) -> Ingested:
    """``prme ingest`` of 20k lines with the leader of partition 0 SIGKILLed part-way; the
    broker is started again once the ingest has ended."""
    root = tmp_path_factory.mktemp("ingest")
    topic = f"prme-repl-{uuid.uuid4().hex[:10]}"
    settings = cluster_settings(kafka_cluster, topic, root / "unused")
    lines = root / "lines.jsonl"
    write_lines(lines)
    env = {
        "PATH": "/usr/bin:/bin",
        "PRME_LOG__TRANSPORT": "kafka",
        "PRME_LOG__BOOTSTRAP": kafka_cluster.bootstrap,
        "PRME_LOG__TOPIC": topic,
        "PRME_LOG__PARTITIONS": str(PARTITIONS),
    }
    command = [sys.executable, "-m", "prme.cli", "ingest", str(lines), "--quiet"]
    # Small batches keep the ingest running for several seconds, so the kill lands inside.
    ingest = subprocess.Popen(
        [*command, "--batch-size", "50"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        wait_until(
            lambda: asyncio.run(log_end(settings)) >= 2000 or ingest.poll() is not None,
            120,
            "ingest writes its first 2000 lines",
        )
        victim = asyncio.run(leader_of(settings, topic))
        running = ingest.poll() is None
        kafka_cluster.kill(victim)
        output, _ = ingest.communicate(timeout=300)
    finally:
        if ingest.poll() is None:
            ingest.kill()
    kafka_cluster.start(victim)
    return Ingested(settings, ingest.returncode, output.decode(), running, victim)


async def replication_of(settings: Settings, topic: str) -> tuple[set[int], str]:
    """Replica counts of the topic's partitions and its ``min.insync.replicas``."""
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.log.bootstrap)
    await admin.start()
    try:
        (described,) = await admin.describe_topics([topic])
        (response,) = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, topic, {"min.insync.replicas": None})]
        )
    finally:
        await admin.close()
    configs = {entry[0]: entry[1] for entry in response.resources[0][4]}
    return {len(p["replicas"]) for p in described["partitions"]}, configs["min.insync.replicas"]


def test_topics_prme_creates_on_three_brokers_have_three_replicas_two_in_sync(
    ingested: Ingested,
) -> None:
    assert asyncio.run(replication_of(ingested.settings, ingested.settings.log.topic)) == (
        {3},
        "2",
    )


def test_ingest_keeps_every_line_exactly_once_when_a_broker_dies(ingested: Ingested) -> None:
    assert ingested.killed_while_running, "the ingest ended before the broker was killed"
    assert ingested.returncode == 0, ingested.output[-3000:]
    summary = json.loads(ingested.output.strip().splitlines()[-1])
    assert summary["written"] == LINES
    counts = asyncio.run(line_counts(ingested.settings))
    assert len(counts) == LINES
    assert [line for line, count in counts.items() if count != 1] == []


def project(settings: Settings, group: str) -> subprocess.Popen[str]:
    return run_child(settings, f"{group}-{uuid.uuid4().hex[:6]}")


def finish(child: subprocess.Popen[str], settings: Settings) -> int:
    """Wait for a projector child to catch up; returns how many texts it encoded."""
    out, _ = child.communicate(timeout=600)
    log = child_log(settings).read_text()
    assert child.returncode == 0 and "caught-up" in out, log[-3000:]
    assert "dead letter" not in log, log[-3000:]
    return int(out.split("encoded ")[1].split()[0])


@pytest.fixture(scope="module")
def projected_log(
    kafka_cluster: KafkaCluster, tmp_path_factory: pytest.TempPathFactory
) -> Settings:
    """A topic holding the first PROJECTED lines of the ingest file (written without fault)."""
    root = tmp_path_factory.mktemp("projected")
    settings = cluster_settings(kafka_cluster, f"prme-proj-{uuid.uuid4().hex[:10]}", root / "x")
    lines = root / "lines.jsonl"
    write_lines(lines, PROJECTED)

    async def write() -> None:
        transport = open_transport(settings)
        await transport.start()
        try:
            with lines.open("rb") as source:
                summary = await ingest_lines(source, Producer(transport))
            assert summary.written == PROJECTED
        finally:
            await transport.close()

    asyncio.run(write())
    return settings


@pytest.fixture(scope="module")
def clean_digests(projected_log: Settings, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Read-model digests of the log projected with no fault and no changelog."""
    settings = projected_log.replace(
        data_dir=str(tmp_path_factory.mktemp("clean") / "pack"), log={"vector_changelog": False}
    )
    assert finish(project(settings, "clean"), settings) > 0
    return asyncio.run(digests(settings))


class Faulted(msgspec.Struct):
    settings: Settings
    killed_while_running: bool
    encoded: int


@pytest.fixture(scope="module")
def faulted(
    projected_log: Settings, kafka_cluster: KafkaCluster, tmp_path_factory: pytest.TempPathFactory
) -> Faulted:
    """The same log projected (publishing the vector changelog) while the leader of the
    changelog's partition 0 is SIGKILLed; the broker returns after the run or 10 s (a dead
    broker is fenced after 6 s: its partitions have moved by then)."""
    settings = projected_log.replace(data_dir=str(tmp_path_factory.mktemp("faulted") / "pack"))
    changelog = settings.log.topic + ".vectors"
    child = project(settings, "faulted")
    try:
        wait_until(
            lambda: child.poll() is not None or asyncio.run(log_end(settings, changelog)) >= 600,
            300,
            "the projector publishes its first 600 vectors",
        )
        victim = asyncio.run(leader_of(settings, changelog))
        running = child.poll() is None
        kafka_cluster.kill(victim)
        deadline = time.monotonic() + 10
        while child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)  # the broker stays down for the rest of the run or 10 s
        kafka_cluster.start(victim)
        encoded = finish(child, settings)
    finally:
        if child.poll() is None:
            child.kill()
    return Faulted(settings, running, encoded)


def test_projection_converges_when_a_broker_dies(faulted: Faulted, clean_digests: dict) -> None:
    assert faulted.killed_while_running, "the projection ended before the broker was killed"
    assert faulted.encoded > 0
    assert clean_digests and asyncio.run(digests(faulted.settings)) == clean_digests
    changelog = faulted.settings.log.topic + ".vectors"
    assert asyncio.run(replication_of(faulted.settings, changelog)) == ({3}, "2")


def test_a_fresh_node_restores_vectors_from_the_changelog_and_encodes_nothing(
    faulted: Faulted, clean_digests: dict, tmp_path: Path
) -> None:
    settings = faulted.settings.replace(data_dir=str(tmp_path / "fresh"))
    assert finish(project(settings, "fresh"), settings) == 0
    assert asyncio.run(digests(settings)) == clean_digests


# -- erasure ------------------------------------------------------------------------------

COMPACT_FAST = {
    "segment.ms": "500",
    "min.cleanable.dirty.ratio": "0.01",
    "max.compaction.lag.ms": "500",
    "delete.retention.ms": "0",
}


def same_partition_owners(partitions: int) -> tuple[str, str]:
    from prme.producers.partitioner import partition_for_key

    target = partition_for_key(b"erin", partitions)
    other = next(
        f"neighbour{i}"
        for i in range(1000)
        if partition_for_key(f"neighbour{i}".encode(), partitions) == target
    )
    return "erin", other


async def owners_on_changelog(changelog: KafkaChangelog, partition: int) -> Counter[str]:
    """Records per owner in one changelog partition (tombstones included)."""
    owners: Counter[str] = Counter()
    end = await changelog.end_offset(partition)
    offset = 0
    while offset < end:
        entries, offset = await changelog.read(partition, offset, end)
        for entry in entries:
            key = ChangelogKey.decode(entry.key)
            assert key is not None
            owners[key.owner] += 1
    return owners


async def test_erasing_an_owner_leaves_no_changelog_entry_of_theirs_after_compaction(
    kafka_cluster: KafkaCluster, tmp_path: Path
) -> None:
    topic = f"prme-erase-{uuid.uuid4().hex[:10]}"
    settings = cluster_settings(
        kafka_cluster, topic, tmp_path / "pack", vector_changelog_configs=COMPACT_FAST
    )
    erased, neighbour = same_partition_owners(PARTITIONS)
    transport = open_transport(settings)
    await transport.start()
    producer = Producer(transport)
    runner = ProjectorRunner(settings, transport, HashedBagOfWordsProvider(), group=topic)
    changelog = open_vector_changelog(settings)
    assert changelog is not None
    await changelog.start()
    try:
        await runner.start()
        for owner in (erased, neighbour):
            for number in range(30):
                draft = MessageDraft(owner=owner, content=f"{owner} note {number}")
                await producer.append_message(draft)
        await runner.catch_up(60)
        partition = transport.partition_for(erased.encode())
        before = await owners_on_changelog(changelog, partition)
        assert before[erased] == 30 and before[neighbour] == 30
        await producer.append_records([producer.build_control("owner_erased", erased)])
        await runner.catch_up(60)
        deadline = time.monotonic() + 150
        filler = 0
        while (owners := await owners_on_changelog(changelog, partition))[erased]:
            assert time.monotonic() < deadline, f"still on the changelog: {owners}"
            # New records roll the active segment, so the cleaner can reach the old ones.
            await asyncio.sleep(1)
            filler += 1
            await producer.append_message(
                MessageDraft(owner=neighbour, content=f"{neighbour} filler {filler}")
            )
            await runner.catch_up(60)
        assert owners[neighbour] > 0
    finally:
        await runner.close()
        await changelog.close()
        await transport.close()


@pytest.mark.asyncio
async def test_an_append_the_brokers_do_not_confirm_says_it_may_still_land(
    kafka_cluster: KafkaCluster, tmp_path: Path
) -> None:
    """From an operator trial: with two of three brokers down (min ISR 2) an append timed
    out as `transport_unavailable`, and the record reached the log once the brokers came
    back (aiokafka keeps it queued): the client was told it failed. It now says the log may
    still take it (`AppendUnconfirmed`, HTTP 504 `append_unconfirmed`)."""
    topic = f"prme-unconfirmed-{uuid.uuid4().hex[:10]}"
    settings = cluster_settings(kafka_cluster, topic, tmp_path, request_timeout_s=4.0)
    transport = open_transport(settings)
    await transport.start()
    try:
        await transport.append(LogItem(b"owner", b"before"))
        kafka_cluster.kill(1)
        kafka_cluster.kill(2)
        try:
            with pytest.raises(AppendUnconfirmed, match="may still be appended"):
                await transport.append(LogItem(b"owner", b"unconfirmed"))
        finally:
            kafka_cluster.start(1)
            kafka_cluster.start(2)
        partition = transport.partition_for(b"owner")
        deadline = time.monotonic() + 120
        values: list[bytes] = []
        while b"unconfirmed" not in values:
            assert time.monotonic() < deadline, values
            await asyncio.sleep(0.5)  # poll interval while the producer delivers it
            values = [entry.value for entry in await transport.read(partition, 0, 10)]
        assert values == [b"before", b"unconfirmed"]
    finally:
        await transport.close()
