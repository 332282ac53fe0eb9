"""Ingest throughput of ``prme ingest`` on the local log and on Kafka, next to a bare
aiokafka producer sending the same bytes in the same run (JSON on stdout).

The prme figures run the CLI's own code path in-process: ``producers.ingest.ingest_lines``
with a ``Producer`` over the transport (what ``prme ingest FILE`` does, minus the progress
bar), reading a generated JSONL file of ~300-byte lines. ``prme_kafka`` is what ``prme
ingest`` does on Kafka by default: lines built in the forked worker and sealed with the
owners' data keys from the ``<topic>.keys`` topic; ``prme_kafka_plain`` the same with
``log.seal_records`` off, ``prme_kafka_inline`` sealed but built in-process. The baseline
is an ``AIOKafkaProducer`` (``acks=all``, idempotent, no transactions) sending the same
keys to the same partitions: ``bare_aiokafka`` the sealed values prme writes (same sizes;
one key per owner) with ``send`` per record, as the issue's baseline; ``bare_aiokafka_plain``
the plain encoded records. prme's transport hands the producer record batches it builds
(``producers/kafka_batches.py``); ``bare_aiokafka_batches`` sends the sealed values the same
way, with no prme code: the floor of the engine, reported beside the baseline. Runs are
interleaved so machine noise hits each alike; medians are quoted.

    python -m benchmarks.ingest_throughput [--messages 100000] [--runs 3]
        [--bootstrap HOST:PORT | --no-kafka] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec
from aiokafka import AIOKafkaProducer

from benchmarks.common import (
    add_broker_options,
    add_workload_options,
    chat_turn,
    kafka_broker,
    machine,
    median,
    ratio,
    run_benchmark,
)
from prme.producers.factory import open_key_store
from prme.producers.ingest import INGEST_BATCH, ingest_lines, message_from_line
from prme.producers.ingest_build import builder_process
from prme.producers.kafka_batches import RECORD_BATCH_BYTES
from prme.producers.kafka_log import KafkaLogTransport
from prme.producers.keys import KeyStore, LocalKeyStore
from prme.producers.local_log import LocalLogTransport
from prme.producers.partitioner import partition_for_key
from prme.producers.producer import Producer
from prme.producers.transport import LogTransport
from prme.schemas.config import LogSettings, Settings
from prme.schemas.sealing import Sealer, new_data_key


def write_jsonl(path: Path, messages: int, owners: int, seed: int = 7) -> dict[str, float]:
    """``messages`` ingest lines (~300 bytes each) spread over ``owners``; their sizes."""
    rng = random.Random(seed)
    encoder = msgspec.json.Encoder()
    total = 0
    with open(path, "wb") as handle:
        for index in range(messages):
            line = encoder.encode(
                {
                    "owner": f"user-{rng.randrange(owners):05d}",
                    "session": f"s{index % 7}",
                    "role": "user" if index % 2 else "assistant",
                    "content": chat_turn(rng, words=34),
                }
            )
            total += len(line) + 1
            handle.write(line + b"\n")
    return {"lines": messages, "mean_line_bytes": round(total / messages, 1)}


def encoded_items(path: Path, partitions: int) -> list[tuple[bytes, bytes, int]]:
    """``(key, value, partition)`` of every line, encoded exactly as prme would write it."""
    producer = Producer(LocalLogTransport(path.with_suffix(".unused"), partitions))
    items: list[tuple[bytes, bytes, int]] = []
    with open(path, "rb") as handle:
        for line in handle:
            _, item = message_from_line(line, producer)
            items.append((item.key, item.value, partition_for_key(item.key, partitions)))
    return items


def sealed_items(items: list[tuple[bytes, bytes, int]]) -> list[tuple[bytes, bytes, int]]:
    """``items`` sealed as prme seals them, with one fresh data key per owner."""
    sealer = Sealer()
    keys = {key: new_data_key() for key, _, _ in items}
    return [(key, sealer.seal(value, keys[key]), partition) for key, value, partition in items]


def kafka_keys(bootstrap: str, topic: str, partitions: int) -> KeyStore:
    """The key store ``prme ingest`` opens on Kafka for ``topic`` (``<topic>.keys``)."""
    log = LogSettings(transport="kafka", bootstrap=bootstrap, topic=topic, partitions=partitions)
    return open_key_store(Settings(log=log))


async def prme_ingest(
    path: Path,
    transport: LogTransport,
    batch_size: int,
    *,
    built: bool = True,
    keys: KeyStore | None = None,
) -> float:
    """Records/s of ``ingest_lines`` from ``path`` through ``transport`` (started here);
    with ``built``, lines are built in a worker process as ``prme ingest`` does for a large
    file (forked before the transport starts; the process starts on the first chunk,
    inside the timing); with ``keys``, records are sealed as ``prme ingest`` seals them."""
    builder = builder_process() if built else None
    await transport.start()
    if keys is not None:
        await keys.start()
    try:
        with open(path, "rb") as handle:
            summary = await ingest_lines(
                handle, Producer(transport, keys=keys), batch_size=batch_size, builder=builder
            )
    finally:
        if keys is not None:
            await keys.close()
        await transport.close()
        if builder is not None:
            builder.shutdown()
    if summary.errors or summary.written != summary.lines:
        raise RuntimeError(f"ingest wrote {summary.written} of {summary.lines} lines")
    return summary.records_per_s


def build_only(path: Path, partitions: int) -> float:
    """Records/s of parsing, validating and encoding the lines without appending them."""
    started = time.perf_counter()
    count = len(encoded_items(path, partitions))
    return count / (time.perf_counter() - started)


async def bare_aiokafka(
    bootstrap: str,
    topic: str,
    partitions: int,
    items: list[tuple[bytes, bytes, int]],
    *,
    batch_api_chunk: int | None = None,
) -> float:
    """Records/s of a plain idempotent ``acks=all`` producer sending ``items``: ``send`` per
    record (the issue's baseline), or with ``batch_api_chunk``, through aiokafka's batch API
    (``create_batch``/``send_batch``, batches of ``RECORD_BATCH_BYTES`` as prme's) in chunks
    of that many items, with no prme code: the engine's floor."""
    # The prme transport creates the topic with the same settings, outside the timing.
    async with KafkaLogTransport(bootstrap, topic, partitions) as admin:
        batch_options = {} if batch_api_chunk is None else {"max_batch_size": RECORD_BATCH_BYTES}
        producer = AIOKafkaProducer(
            bootstrap_servers=bootstrap,
            client_id="prme-bench-bare",
            acks="all",
            enable_idempotence=True,
            **batch_options,
        )
        await producer.start()
        try:
            started = time.perf_counter()
            if batch_api_chunk is None:
                deliveries = [
                    await producer.send(topic, value, key=key, partition=partition)
                    for key, value, partition in items
                ]
            else:
                deliveries = await send_batches(producer, topic, items, batch_api_chunk)
            await asyncio.gather(*deliveries)
            elapsed = time.perf_counter() - started
        finally:
            await producer.stop()
        written = sum((await admin.end_offsets()).values())
    if written != len(items):
        raise RuntimeError(f"bare producer wrote {written} of {len(items)} records")
    return len(items) / elapsed


async def send_batches(
    producer: AIOKafkaProducer, topic: str, items: list[tuple[bytes, bytes, int]], chunk: int
) -> list[asyncio.Future[Any]]:
    """``items`` handed to ``producer`` as record batches, one open batch per partition in
    each chunk of ``chunk`` items; the batches' deliveries."""
    deliveries = []
    for first in range(0, len(items), chunk):
        open_batches: dict[int, Any] = {}
        for key, value, partition in items[first : first + chunk]:
            batch = open_batches.get(partition)
            if batch is None:
                batch = open_batches[partition] = producer.create_batch()
            if batch.append(timestamp=None, key=key, value=value) is None:
                deliveries.append(await producer.send_batch(batch, topic, partition=partition))
                batch = open_batches[partition] = producer.create_batch()
                batch.append(timestamp=None, key=key, value=value)
        for partition, batch in open_batches.items():
            deliveries.append(await producer.send_batch(batch, topic, partition=partition))
    return deliveries


async def measure(arguments: argparse.Namespace, work: Path) -> dict[str, Any]:
    source = work / "messages.jsonl"
    sizes = write_jsonl(source, arguments.messages, arguments.owners)
    partitions = arguments.partitions
    plain_items = encoded_items(source, partitions)
    items = sealed_items(plain_items)
    sizes["mean_value_bytes"] = round(sum(len(v) for _, v, _ in plain_items) / len(items), 1)
    sizes["mean_sealed_value_bytes"] = round(sum(len(v) for _, v, _ in items) / len(items), 1)
    rates: dict[str, list[float]] = {"local": [], "local_sealed": [], "build_only": []}
    broker = (
        kafka_broker(arguments.bootstrap, work / "kafka")
        if arguments.kafka
        else contextlib.nullcontext(None)
    )
    with broker as bootstrap:
        if bootstrap is not None:
            for name in ("prme_kafka", "prme_kafka_plain", "prme_kafka_inline"):
                rates[name] = []
            rates["bare_aiokafka"] = []
            rates["bare_aiokafka_plain"] = []
            rates["bare_aiokafka_batches"] = []
        for run in range(arguments.runs):
            rates["build_only"].append(build_only(source, partitions))
            local = LocalLogTransport(work / f"local-{run}" / "log.sqlite3", partitions)
            rates["local"].append(await prme_ingest(source, local, arguments.batch_size))
            sealed_dir = work / f"local-sealed-{run}"
            rates["local_sealed"].append(
                await prme_ingest(
                    source,
                    LocalLogTransport(sealed_dir / "log.sqlite3", partitions),
                    arguments.batch_size,
                    keys=LocalKeyStore(sealed_dir / "keys.sqlite3"),
                )
            )
            if bootstrap is None:
                continue
            topic = f"prme-bench-ingest-{uuid.uuid4().hex[:10]}"
            for name, suffix, built, sealed in (
                ("prme_kafka", "", True, True),
                ("prme_kafka_plain", "-plain", True, False),
                ("prme_kafka_inline", "-inline", False, True),
            ):
                kafka = KafkaLogTransport(bootstrap, topic + suffix, partitions)
                keys = kafka_keys(bootstrap, topic + suffix, partitions) if sealed else None
                rates[name].append(
                    await prme_ingest(source, kafka, arguments.batch_size, built=built, keys=keys)
                )
            bare_topic = f"prme-bench-bare-{uuid.uuid4().hex[:10]}"
            rates["bare_aiokafka"].append(
                await bare_aiokafka(bootstrap, bare_topic, partitions, items)
            )
            rates["bare_aiokafka_plain"].append(
                await bare_aiokafka(bootstrap, bare_topic + "-plain", partitions, plain_items)
            )
            rates["bare_aiokafka_batches"].append(
                await bare_aiokafka(
                    bootstrap,
                    bare_topic + "-batches",
                    partitions,
                    items,
                    batch_api_chunk=arguments.batch_size,
                )
            )
    medians = {name: round(median(values), 1) for name, values in rates.items()}
    bare = medians.get("bare_aiokafka", 0.0)
    bare_plain = medians.get("bare_aiokafka_plain", 0.0)
    return {
        "benchmark": "ingest_throughput",
        "machine": machine(),
        "code_path": (
            "in-process producers.ingest.ingest_lines + Producer, as `prme ingest` runs it "
            "(no progress bar); append_many(atomic=False) per batch: the idempotent producer, "
            "no transaction; prme_kafka builds and seals lines in a forked worker process "
            "(as prme ingest does for a large file; keys from <topic>.keys), "
            "prme_kafka_plain does not seal, prme_kafka_inline builds in-process"
        ),
        "baseline": (
            "bare AIOKafkaProducer, acks=all, enable_idempotence=True, no transactions, same "
            "keys/partitions, all sends in flight then awaited: bare_aiokafka sends the "
            "sealed values (the bytes prme writes) with send() per record, "
            "bare_aiokafka_plain the plain ones; bare_aiokafka_batches the sealed values "
            "through create_batch/send_batch in RECORD_BATCH_BYTES batches (the engine's floor)"
        ),
        "messages": arguments.messages,
        "owners": arguments.owners,
        "partitions": partitions,
        "batch_size": arguments.batch_size,
        "runs": arguments.runs,
        "input": sizes,
        "records_per_s": medians,
        "runs_records_per_s": {k: [round(v, 1) for v in vs] for k, vs in rates.items()},
        "ratios": {
            "prme_kafka_to_bare_aiokafka": ratio(medians.get("prme_kafka", 0.0), bare),
            "prme_kafka_inline_to_bare_aiokafka": ratio(
                medians.get("prme_kafka_inline", 0.0), bare
            ),
            "prme_kafka_plain_to_bare_aiokafka_plain": ratio(
                medians.get("prme_kafka_plain", 0.0), bare_plain
            ),
            "prme_kafka_to_bare_aiokafka_plain": ratio(medians.get("prme_kafka", 0.0), bare_plain),
            "prme_kafka_to_bare_aiokafka_batches": ratio(
                medians.get("prme_kafka", 0.0), medians.get("bare_aiokafka_batches", 0.0)
            ),
            "local_to_bare_aiokafka": ratio(medians["local"], bare),
            "local_to_build_only": ratio(medians["local"], medians["build_only"]),
        },
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_options(parser, messages=100_000, owners=1000, partitions=12)
    parser.add_argument(
        "--batch-size", type=int, default=INGEST_BATCH, help="lines per append, as `prme ingest`"
    )
    add_broker_options(parser)
    run_benchmark(parser, measure, argv)


if __name__ == "__main__":
    main()
