"""One-owner retrieval with the HNSW index built with and without int8 codes (JSON on
stdout).

One pack of ``--memories`` memories of a single owner is loaded through ``MemoryEngine``
with ``HashedBagOfWordsProvider`` at 384 dimensions and no index (``index_threshold`` 0),
then copied twice. Each copy is opened with the default ``index_threshold``, one with
``qdrant.index_quantization`` off and one on, and the HNSW build its open starts is timed
until it is swapped in (``build_s``). Then both engines answer ``--rounds`` rounds of
``--queries`` in-process retrieves (``top_k`` 10), alternating which goes first; reported
are the medians over rounds of each round's p50 and p95 and of the vector channel's p50,
and the ratios of the quantized side to the float side.

    python -m benchmarks.index_quantization [--memories 100000] [--rounds 6] [--queries 100]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.common import machine, median, ratio, run_benchmark
from benchmarks.retrieve_latency import load, query_latency, settle_vector_indexes
from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider
from prme.query.engine import MemoryEngine
from prme.schemas.config import QdrantSettings, Settings

OWNER = "user-solo"
SIDES = {"float": False, "int8": True}


def pack_settings(directory: Path, *, threshold: int, quantization: bool) -> Settings:
    return Settings(
        data_dir=str(directory),
        qdrant=QdrantSettings(index_threshold=threshold, index_quantization=quantization),
    )


async def measure(arguments: argparse.Namespace, work: Path) -> dict[str, Any]:
    provider = HashedBagOfWordsProvider(dimension=384)
    base = work / "base"
    engine = await MemoryEngine.create(
        base,
        settings=pack_settings(base, threshold=0, quantization=False),
        embedding_provider=provider,
    )
    try:
        load_rate = await load(engine, arguments.memories, [OWNER], seed=1)
    finally:
        await engine.close()
    engines: dict[str, MemoryEngine] = {}
    builds: dict[str, dict[str, Any]] = {}
    try:
        for side, quantization in SIDES.items():
            directory = work / side
            shutil.copytree(base, directory)
            settings = pack_settings(
                directory, threshold=arguments.index_threshold, quantization=quantization
            )
            started = time.perf_counter()
            engines[side] = await MemoryEngine.open(settings=settings, embedding_provider=provider)
            indexes = await settle_vector_indexes(engines[side])
            builds[side] = {"build_s": round(time.perf_counter() - started, 2), **indexes}
        rounds: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
        for index in range(arguments.rounds):
            order = list(SIDES) if index % 2 == 0 else list(SIDES)[::-1]
            for side in order:
                summary, channels = await query_latency(
                    engines[side], [OWNER], arguments.queries, arguments.warmup, seed=100 + index
                )
                rounds[side].append(
                    {
                        "p50_ms": summary.p50_ms,
                        "p95_ms": summary.p95_ms,
                        "vector_p50_ms": statistics.median(channels["vector"]),
                    }
                )
    finally:
        for opened in engines.values():
            await opened.close()

    def side_report(side: str) -> dict[str, Any]:
        figures = rounds[side]
        return {
            **builds[side],
            "p50_ms": round(median([f["p50_ms"] for f in figures]), 3),
            "p95_ms": round(median([f["p95_ms"] for f in figures]), 3),
            "vector_p50_ms": round(median([f["vector_p50_ms"] for f in figures]), 3),
            "rounds": figures,
        }

    sides = {side: side_report(side) for side in SIDES}
    return {
        "benchmark": "index_quantization",
        "machine": machine(),
        "memories": arguments.memories,
        "load_records_per_s": round(load_rate, 1),
        "index_threshold": arguments.index_threshold,
        "queries_per_round": arguments.queries,
        "sides": sides,
        "int8_to_float": {
            key: ratio(sides["int8"][key], sides["float"][key])
            for key in ("build_s", "p50_ms", "p95_ms", "vector_p50_ms")
        },
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memories", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--queries", type=int, default=100, help="retrieves per round")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument(
        "--index-threshold",
        type=int,
        default=QdrantSettings().index_threshold,
        help="qdrant.index_threshold the copies are opened with (a build starts at open)",
    )
    run_benchmark(parser, measure, argv)


if __name__ == "__main__":
    main()
