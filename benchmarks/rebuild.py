"""``prme rebuild`` against the engines' own write speed (JSON on stdout).

An N-message pack is written to a local log and projected with the model-free hashed
provider (384 dimensions; the first projection is timed too). Then, in the same run:

* **rebuild**: ``MemoryEngine.rebuild`` of every read model with the model unchanged (the
  code ``prme rebuild`` runs; the CLI cannot reopen a pack built with a custom provider, so
  it runs in-process like the other benchmarks), with ``--processes`` rebuild workers as
  ``prme rebuild`` defaults to, and then in one process, alternating, with the texts each
  encoded counted (the vector cache should answer all of them: 0);
* **floors** (``benchmarks/rebuild_floors.py``, in a child process that holds the content
  read back from the pack): the same content written straight into each engine, as fast
  as this code knows how: every vector point (id, vector, payload) upserted into a fresh qdrant-edge
  shard in chunks of 4,096; every lexical document added to a fresh Tantivy index with the
  same schema and one commit per partition; every row of the graph, history, events and
  lexical-sidecar SQLite files inserted with ``executemany`` into fresh files with the same
  schema, one transaction per table. The summed floor is the time a rebuild would take if
  it did nothing but write its results.

Runs alternate (rebuild, floors, rebuild, ...); medians are quoted.

    python -m benchmarks.rebuild [--messages 20000] [--owners 200] [--runs 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from benchmarks.common import add_workload_options, machine, median, ratio, run_benchmark
from benchmarks.projection import TimedProvider, drafts, fill_log
from benchmarks.rebuild_floors import DIMENSION, FloorWriter
from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider
from prme.projectors.rebuild_worker import default_processes
from prme.projectors.registry import MODEL_NAMES
from prme.query.engine import MemoryEngine
from prme.schemas.config import Settings


def settings_for(data: Path, partitions: int) -> Settings:
    return Settings(data_dir=str(data)).replace(
        log={"transport": "local", "partitions": partitions}
    )


async def build_pack(data: Path, partitions: int, messages: int, owners: int) -> dict[str, float]:
    """Write the log and project it once (timed: opening the engine catches up)."""
    await fill_log(data / "log.sqlite3", partitions, drafts(messages, owners, seed=messages))
    provider = TimedProvider(HashedBagOfWordsProvider(dimension=DIMENSION))
    settings = settings_for(data, partitions).replace(log={"request_timeout_s": 360.0})
    started = time.perf_counter()
    engine = await MemoryEngine.open(
        settings=settings, embedding_provider=provider, create_if_missing=True
    )
    seconds = time.perf_counter() - started
    await engine.close()
    return {"seconds": seconds, "records_per_s": messages / seconds, "texts": provider.texts}


async def rebuild_once(data: Path, partitions: int, processes: int = 1) -> dict[str, float]:
    provider = TimedProvider(HashedBagOfWordsProvider(dimension=DIMENSION))
    settings = settings_for(data, partitions)
    async with await MemoryEngine.open(settings=settings, embedding_provider=provider) as engine:
        await engine.runner.catch_up(timeout_s=600)
        cache = engine.runner.vector_cache
        misses = cache.misses
        started = time.perf_counter()
        replayed = await engine.rebuild(MODEL_NAMES, processes=processes)
        seconds = time.perf_counter() - started
        # A cache miss is a text encoded (in this process or a rebuild worker).
        texts = cache.misses - misses
    return {"seconds": seconds, "records": sum(replayed.values()), "texts": texts}


async def measure(arguments: argparse.Namespace, work: Path) -> dict[str, Any]:
    data = work / "pack"
    first = await build_pack(data, arguments.partitions, arguments.messages, arguments.owners)
    rebuilds: list[dict[str, float]] = []
    in_process: list[dict[str, float]] = []
    floors: list[dict[str, float]] = []
    async with FloorWriter(data, work / "floors") as writer:
        for _ in range(arguments.runs):
            rebuilds.append(await rebuild_once(data, arguments.partitions, arguments.processes))
            if arguments.processes > 1:
                in_process.append(await rebuild_once(data, arguments.partitions))
            floors.append(await writer.once())
    rebuild_s = median([r["seconds"] for r in rebuilds])
    floor_parts = {key: round(median([f[key] for f in floors]), 3) for key in floors[0]}
    one_process: dict[str, Any] = {}
    if in_process:
        one_s = median([r["seconds"] for r in in_process])
        one_process = {
            "seconds": round(one_s, 3),
            "runs_seconds": [round(r["seconds"], 3) for r in in_process],
            "texts_encoded": max(int(r["texts"]) for r in in_process),
            "processes_to_one_process": ratio(rebuild_s, one_s),
        }
    return {
        "benchmark": "rebuild",
        "machine": machine(),
        "messages": arguments.messages,
        "owners": arguments.owners,
        "partitions": arguments.partitions,
        "runs": arguments.runs,
        "first_projection": {
            "seconds": round(first["seconds"], 3),
            "records_per_s": round(first["records_per_s"], 1),
        },
        "rebuild": {
            "processes": arguments.processes,
            "seconds": round(rebuild_s, 3),
            "records_per_s": round(arguments.messages / rebuild_s, 1),
            "texts_encoded": max(int(r["texts"]) for r in rebuilds),
            "records_replayed": int(rebuilds[0]["records"]),
            "runs_seconds": [round(r["seconds"], 3) for r in rebuilds],
        },
        "rebuild_in_one_process": one_process,
        "floors_seconds": floor_parts,
        "floor_points": writer.records,
        "rebuild_to_summed_floors": ratio(rebuild_s, floor_parts["sum"]),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_options(parser, messages=20_000, owners=200, partitions=12)
    parser.add_argument(
        "--processes",
        type=int,
        default=default_processes(),
        help="rebuild worker processes, as `prme rebuild` defaults to; above 1 the rebuild "
        "in one process is timed too, alternating",
    )
    run_benchmark(parser, measure, argv)


if __name__ == "__main__":
    main()
