"""Projection throughput and freshness (JSON on stdout).

Throughput: messages already on a local log are projected into fresh shards by a
``ProjectorRunner`` (start to caught-up), once with the default model (``FastEmbedProvider``,
all-MiniLM-L6-v2 int8) and once with the trivial ``HashedBagOfWordsProvider``; runs are
interleaved and medians quoted. Every ``embed`` call is timed through a wrapper provider,
so the share of projection time spent outside embedding is measured directly.

Freshness: with a runner caught up and idle, one message is appended at a time and the
time until each read model of its shard has applied it is taken from a wrapper around
each model (stamped when ``apply`` returns), plus the time until ``runner.wait_applied``
(read-your-writes) returns. Measured on the local log and on Kafka, with each provider.

    python -m benchmarks.projection [--messages 20000] [--real-messages 3000] [--runs 3]
        [--samples 100] [--bootstrap HOST:PORT | --no-kafka] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import (
    LatencySummary,
    add_broker_options,
    add_workload_options,
    chat_turn,
    kafka_broker,
    latency_summary,
    machine,
    median,
    ratio,
    run_benchmark,
)
from prme.producers.kafka_log import KafkaLogTransport
from prme.producers.local_log import LocalLogTransport
from prme.producers.producer import MessageDraft, Producer
from prme.producers.transport import LogTransport
from prme.projectors.embeddings.fastembed_provider import FastEmbedProvider
from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider
from prme.projectors.embeddings.model_assets import ensure_default_model
from prme.projectors.embeddings.protocol import EmbeddingProvider, array_encoder
from prme.projectors.embeddings.validation import validate_matrix
from prme.projectors.model import Commit, ProjectedRecord, ReadModel, StagedCommits
from prme.projectors.runner import ProjectorRunner
from prme.schemas.config import Settings

Stamps = dict[tuple[int, int], dict[str, float]]


class TimedProvider:
    """Delegates to ``inner`` and adds the wall time of every ``embed`` call to ``seconds``."""

    def __init__(self, inner: EmbeddingProvider) -> None:
        self.inner = inner
        self.seconds = 0.0
        self.texts = 0

    @property
    def model_name(self) -> str:
        return self.inner.model_name

    @property
    def model_version(self) -> str:
        return self.inner.model_version

    @property
    def dimension(self) -> int:
        return self.inner.dimension

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        started = time.perf_counter()
        vectors = await self.inner.embed(texts)
        self.seconds += time.perf_counter() - started
        self.texts += len(texts)
        return vectors

    async def embed_array(self, texts: Sequence[str]) -> np.ndarray:
        """The inner provider's array path when it has one (else its ``embed``), timed."""
        started = time.perf_counter()
        encode = array_encoder(self.inner)
        if encode is not None:
            matrix = await encode(texts)
        else:
            matrix = validate_matrix(self.inner, len(texts), await self.inner.embed(texts))
        self.seconds += time.perf_counter() - started
        self.texts += len(texts)
        return matrix


class StampedModel:
    """A read model that records, per applied offset, when its ``apply`` (or, for a model
    that stages its batches, its commit) returned."""

    def __init__(self, inner: ReadModel, partition: int, stamps: Stamps) -> None:
        self.name = inner.name
        self._inner = inner
        self._partition = partition
        self._stamps = stamps

    def applied_offset(self) -> int:
        return self._inner.applied_offset()

    def apply(self, batch: list[ProjectedRecord]) -> None:
        self._inner.apply(batch)
        self._stamp(batch)

    def stage(self, batch: list[ProjectedRecord]) -> Commit | None:
        """The inner model's ``stage``, stamped when its commit returns (the shard stages
        any model that has ``stage``; one that does not is applied here)."""
        if not isinstance(self._inner, StagedCommits):
            self.apply(batch)
            return None
        commit = self._inner.stage(batch)
        if commit is None:
            return None

        def stamped() -> None:
            commit()
            self._stamp(batch)

        return stamped

    def _stamp(self, batch: list[ProjectedRecord]) -> None:
        now = time.perf_counter()
        for item in batch:
            self._stamps.setdefault((self._partition, item.offset), {})[self.name] = now

    def digest(self) -> str:
        return self._inner.digest()

    def close(self) -> None:
        self._inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def drafts(count: int, owners: int, seed: int) -> list[MessageDraft]:
    rng = random.Random(seed)
    return [
        MessageDraft(
            owner=f"user-{rng.randrange(owners):04d}",
            content=chat_turn(rng, words=rng.randint(12, 40)),
            role="user" if index % 2 else "assistant",
            session_id=f"s{index % 5}",
        )
        for index in range(count)
    ]


async def fill_log(path: Path, partitions: int, messages: list[MessageDraft]) -> None:
    transport = LocalLogTransport(path, partitions)
    await transport.start()
    try:
        producer = Producer(transport)
        for start in range(0, len(messages), 500):
            chunk = messages[start : start + 500]
            await producer.append_records([producer.build_message(d) for d in chunk])
    finally:
        await transport.close()


async def project_once(
    log: Path, data: Path, partitions: int, provider: TimedProvider, timeout_s: float
) -> dict[str, float]:
    """Project the whole log at ``log`` into fresh shards under ``data``."""
    settings = Settings(data_dir=str(data)).replace(log={"partitions": partitions})
    transport = LocalLogTransport(log, partitions)
    await transport.start()
    runner = ProjectorRunner(settings, transport, provider)
    provider.seconds, provider.texts = 0.0, 0
    try:
        started = time.perf_counter()
        await runner.start()
        await runner.catch_up(timeout_s=timeout_s)
        elapsed = time.perf_counter() - started
        if runner.dead_letter_count:
            raise RuntimeError(f"{runner.dead_letter_count} records were dead-lettered")
    finally:
        await runner.close()
        await transport.close()
    return {"seconds": elapsed, "embed_seconds": provider.seconds, "texts": provider.texts}


async def freshness(
    transport: LogTransport,
    data: Path,
    provider: EmbeddingProvider,
    samples: int,
    owners: int,
    seed: int,
) -> dict[str, LatencySummary]:
    """Append one message at a time to an idle, caught-up runner; latency to each model."""
    settings = Settings(data_dir=str(data)).replace(log={"partitions": transport.partitions})
    await transport.start()
    runner = ProjectorRunner(
        settings, transport, provider, group=f"prme-bench-{uuid.uuid4().hex[:8]}"
    )
    producer = Producer(transport)
    rng = random.Random(seed)
    names = [f"fresh-{index}" for index in range(owners)]
    stamps: Stamps = {}
    series: dict[str, list[float]] = {"append_ack": [], "wait_applied": []}
    try:
        await runner.start()
        for owner in names:  # opens each owner's shard and waits out the group join
            receipt = await producer.append_message(
                MessageDraft(owner=owner, content=chat_turn(rng))
            )
            await runner.wait_applied(receipt.position.partition, receipt.position.offset, 120)
        for shard in runner.shards.values():
            for name, model in list(shard.models.items()):
                shard.models[name] = StampedModel(model, shard.partition, stamps)  # type: ignore[assignment]
        for index in range(samples):
            draft = MessageDraft(owner=names[index % owners], content=chat_turn(rng))
            started = time.perf_counter()
            receipt = await producer.append_message(draft)
            acked = time.perf_counter()
            position = receipt.position
            await runner.wait_applied(position.partition, position.offset, 60)
            visible = time.perf_counter()
            series["append_ack"].append(acked - started)
            series["wait_applied"].append(visible - started)
            for model, stamp in stamps[(position.partition, position.offset)].items():
                series.setdefault(model, []).append(stamp - started)
    finally:
        await runner.close()
        await transport.close()
    return {name: latency_summary(values) for name, values in series.items()}


def real_provider(models_dir: Path) -> FastEmbedProvider:
    return FastEmbedProvider(model_path=ensure_default_model(models_dir))


async def measure(arguments: argparse.Namespace, work: Path) -> dict[str, Any]:
    partitions = arguments.partitions
    providers: dict[str, tuple[TimedProvider, int]] = {
        "hashed": (TimedProvider(HashedBagOfWordsProvider(dimension=384)), arguments.messages)
    }
    if arguments.real_messages > 0:
        real = real_provider(arguments.models_dir)
        await real.embed(["warm the model up outside the timings"])
        providers["real"] = (TimedProvider(real), arguments.real_messages)
    logs: dict[int, Path] = {}
    for _, count in providers.values():
        if count not in logs:
            logs[count] = work / f"log-{count}.sqlite3"
            await fill_log(logs[count], partitions, drafts(count, arguments.owners, seed=count))
    results: dict[str, list[dict[str, float]]] = {name: [] for name in providers}
    for run in range(arguments.runs):
        for name, (provider, count) in providers.items():
            data = work / f"project-{name}-{run}"
            results[name].append(
                await project_once(logs[count], data, partitions, provider, arguments.timeout_s)
            )
    throughput: dict[str, Any] = {}
    for name, (provider, count) in providers.items():
        seconds = median([r["seconds"] for r in results[name]])
        embed = median([r["embed_seconds"] for r in results[name]])
        throughput[name] = {
            "model": provider.model_name,
            "messages": count,
            "records_per_s": round(count / seconds, 1),
            "seconds": round(seconds, 3),
            "embed_seconds": round(embed, 3),
            "outside_embedding_seconds": round(seconds - embed, 3),
            "outside_embedding_share": round((seconds - embed) / seconds, 3),
            "runs_records_per_s": [round(count / r["seconds"], 1) for r in results[name]],
        }
    fresh: dict[str, dict[str, Any]] = {}
    broker = (
        kafka_broker(arguments.bootstrap, work / "kafka")
        if arguments.kafka
        else contextlib.nullcontext(None)
    )
    with broker as bootstrap:
        transports: dict[str, Callable[[], LogTransport]] = {
            "local": lambda: LocalLogTransport(
                work / f"fresh-{uuid.uuid4().hex}.sqlite3", partitions
            )
        }
        if bootstrap is not None:
            transports["kafka"] = lambda: KafkaLogTransport(
                bootstrap, f"prme-bench-fresh-{uuid.uuid4().hex[:10]}", partitions
            )
        for transport_name, make in transports.items():
            fresh[transport_name] = {}
            for name, (provider, _) in providers.items():
                data = work / f"fresh-{transport_name}-{name}"
                fresh[transport_name][name] = await freshness(
                    make(), data, provider.inner, arguments.samples, arguments.fresh_owners, 11
                )
    report: dict[str, Any] = {
        "benchmark": "projection",
        "machine": machine(),
        "partitions": partitions,
        "owners": arguments.owners,
        "runs": arguments.runs,
        "throughput": throughput,
        "freshness_ms": fresh,
        "freshness_method": (
            "sequential single-message appends to an idle, caught-up runner; per model: "
            "until that model's apply() returned; wait_applied: until runner.wait_applied "
            "returned (read-your-writes); append_ack: until the append was acknowledged"
        ),
    }
    if "real" in throughput:
        report["hashed_to_real_records_per_s"] = ratio(
            throughput["hashed"]["records_per_s"], throughput["real"]["records_per_s"]
        )
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_options(
        parser,
        messages=20_000,
        owners=200,
        partitions=12,
        messages_help="messages projected with the trivial model",
    )
    parser.add_argument(
        "--real-messages",
        type=int,
        default=3_000,
        help="messages projected with the default model (0 skips the real model)",
    )
    parser.add_argument("--samples", type=int, default=100, help="freshness samples per case")
    parser.add_argument("--fresh-owners", type=int, default=4)
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--models-dir", type=Path, default=Settings().models_path)
    add_broker_options(parser)
    run_benchmark(parser, measure, argv)


if __name__ == "__main__":
    main()
