"""Takeover restore speed: a partition projected by a node that never held it, from the
vector changelog (0 texts encoded) vs re-embedding every message (JSON on stdout).

Messages are written to a fresh Kafka topic (not timed). A seeding run projects them with
the default model (all-MiniLM-L6-v2 int8) and publishes the vector changelog
``<topic>.vectors``. Then, interleaved, ``--runs`` times each: a fresh node (empty data
directory, its own consumer group) projects the topic with the changelog switched off —
re-embedding, what a takeover cost before — and a fresh node projects it restoring the
changelog first. Both are timed from the partition's assignment to ``catch_up()`` (the
consumer group's join before it, the same for both, is reported apart); medians are
quoted, and every text the model is asked to encode is counted.

    python -m benchmarks.restore [--messages 2000] [--runs 3] [--partitions 1]
        [--bootstrap HOST:PORT] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.common import (
    add_broker_options,
    add_workload_options,
    kafka_broker,
    machine,
    median,
    ratio,
    run_benchmark,
)
from benchmarks.projection import TimedProvider, drafts, real_provider
from prme.producers.factory import open_transport
from prme.producers.producer import Producer
from prme.projectors.runner import ProjectorRunner
from prme.schemas.config import Settings


async def fill_topic(settings: Settings, messages: int, owners: int) -> None:
    transport = open_transport(settings)
    await transport.start()
    try:
        producer = Producer(transport)
        batch = drafts(messages, owners, seed=messages)
        for start in range(0, len(batch), 500):
            records = [producer.build_message(d) for d in batch[start : start + 500]]
            await producer.append_records(records, atomic=False)
    finally:
        await transport.close()


async def take_over(
    settings: Settings, provider: TimedProvider, timeout_s: float
) -> dict[str, float]:
    """A fresh node projects the whole topic; seconds, texts encoded, restore figures."""
    transport = open_transport(settings)
    await transport.start()
    runner = ProjectorRunner(
        settings, transport, provider, group=f"prme-bench-restore-{uuid.uuid4().hex[:8]}"
    )
    provider.seconds, provider.texts = 0.0, 0
    try:
        started = time.perf_counter()
        await runner.start()
        while not runner.shards:  # the consumer group's join is the same for both kinds
            await asyncio.sleep(0.005)  # assignment poll interval
        assigned = time.perf_counter()
        await runner.catch_up(timeout_s=timeout_s)
        elapsed = time.perf_counter() - assigned
        join = assigned - started
        if runner.dead_letter_count:
            raise RuntimeError(f"{runner.dead_letter_count} records were dead-lettered")
    finally:
        await runner.close()
        await transport.close()
    return {
        "seconds": elapsed,
        "join_seconds": join,
        "texts_encoded": provider.texts,
        "embed_seconds": provider.seconds,
        "changelog_records": sum(r.records for r in runner.restores),
        "changelog_seconds": sum(r.seconds for r in runner.restores),
    }


async def measure(arguments: argparse.Namespace, work: Path) -> dict[str, Any]:
    provider = TimedProvider(real_provider(arguments.models_dir))
    await provider.inner.embed(["warm the model up outside the timings"])
    with kafka_broker(arguments.bootstrap, work / "kafka") as bootstrap:
        topic = f"prme-bench-restore-{uuid.uuid4().hex[:10]}"
        base = Settings(data_dir=str(work / "unused")).replace(
            log={
                "transport": "kafka",
                "bootstrap": bootstrap,
                "topic": topic,
                "dlq_topic": topic + ".dlq",
                "partitions": arguments.partitions,
            }
        )
        await fill_topic(base, arguments.messages, arguments.owners)
        seed = await take_over(
            base.replace(data_dir=str(work / "seed")), provider, arguments.timeout_s
        )
        runs: dict[str, list[dict[str, float]]] = {"reembed": [], "changelog": []}
        for run in range(arguments.runs):
            runs["reembed"].append(
                await take_over(
                    base.replace(
                        data_dir=str(work / f"reembed-{run}"), log={"vector_changelog": False}
                    ),
                    provider,
                    arguments.timeout_s,
                )
            )
            runs["changelog"].append(
                await take_over(
                    base.replace(data_dir=str(work / f"changelog-{run}")),
                    provider,
                    arguments.timeout_s,
                )
            )
    count = arguments.messages
    figures: dict[str, Any] = {}
    for name, results in runs.items():
        seconds = median([r["seconds"] for r in results])
        figures[name] = {
            "records_per_s": round(count / seconds, 1),
            "seconds": round(seconds, 3),
            "group_join_seconds": round(median([r["join_seconds"] for r in results]), 3),
            "texts_encoded": max(int(r["texts_encoded"]) for r in results),
            "embed_seconds": round(median([r["embed_seconds"] for r in results]), 3),
            "changelog_records": int(median([r["changelog_records"] for r in results])),
            "changelog_load_seconds": round(median([r["changelog_seconds"] for r in results]), 3),
            "runs_records_per_s": [round(count / r["seconds"], 1) for r in results],
        }
    return {
        "benchmark": "restore",
        "machine": machine(),
        "model": provider.model_name,
        "messages": count,
        "owners": arguments.owners,
        "partitions": arguments.partitions,
        "runs": arguments.runs,
        "seed_run": {
            "records_per_s": round(count / seed["seconds"], 1),
            "texts_encoded": int(seed["texts_encoded"]),
        },
        "takeover": figures,
        "changelog_to_reembed_records_per_s": ratio(
            figures["changelog"]["records_per_s"], figures["reembed"]["records_per_s"]
        ),
        "method": (
            "fresh data directory and consumer group per run, partition assigned to "
            "catch_up() (group join reported apart); "
            "reembed: vector changelog off; changelog: restored from <topic>.vectors first"
        ),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_options(parser, messages=2_000, owners=50, partitions=1)
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--models-dir", type=Path, default=Settings().models_path)
    add_broker_options(parser, local_only=False)
    run_benchmark(parser, measure, argv)


if __name__ == "__main__":
    main()
