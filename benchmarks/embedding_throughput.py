"""Embedding throughput of the default model on this machine (JSON on stdout).

Encodes ~20-word sentences in batches of 64 with ``FastEmbedProvider`` (median of several
runs), then the same number of texts, half of them repeats, through a fresh
``CachedEmbeddingProvider`` per run, and reports both rates and their ratio.

    python -m benchmarks.embedding_throughput [--sentences 256] [--runs 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import machine, run_benchmark
from prme.projectors.embeddings.cached import CachedEmbeddingProvider
from prme.projectors.embeddings.fastembed_provider import FastEmbedProvider
from prme.projectors.embeddings.model_assets import ensure_default_model
from prme.schemas.config import Settings

VOCABULARY = (
    "the project deadline moved to friday because the client asked for another review of "
    "budget numbers and marketing plan while caroline joined a support group melanie "
    "painted sunrise over lake after long week at work team shipped new release with "
    "faster search better memory lower latency during busy morning meeting about hiring "
    "two engineers next quarter and travel plans for conference in berlin"
)
WORDS = VOCABULARY.split(" ")


def sentences(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=20)).capitalize() + "." for _ in range(count)]


def half_repeated(count: int, seed: int) -> list[str]:
    """``count`` texts: ``count // 2`` distinct ones, each appearing twice, shuffled."""
    unique = sentences(count // 2, seed)
    workload = unique + unique
    random.Random(seed + 1).shuffle(workload)
    return workload


async def encode_all(provider: Any, texts: Sequence[str], batch: int) -> float:
    started = time.perf_counter()
    for start in range(0, len(texts), batch):
        await provider.embed(texts[start : start + batch])
    return len(texts) / (time.perf_counter() - started)


async def measure(arguments: argparse.Namespace, work: Path) -> dict[str, Any]:
    model_dir = ensure_default_model(arguments.models_dir)
    provider = FastEmbedProvider(
        model_path=model_dir, batch_size=arguments.batch_size, threads=arguments.threads
    )
    await provider.embed(sentences(8, seed=-1))  # load the model outside the timings
    plain: list[float] = []
    cached: list[float] = []
    for run in range(arguments.runs):
        plain.append(await encode_all(provider, sentences(arguments.sentences, run), 64))
        wrapper = CachedEmbeddingProvider(provider, max_entries=arguments.sentences)
        workload = half_repeated(arguments.sentences, 1000 + run)
        cached.append(await encode_all(wrapper, workload, 64))
    plain_median = statistics.median(plain)
    cached_median = statistics.median(cached)
    return {
        "model": provider.model_name,
        "model_version": provider.model_version,
        "machine": machine(),
        "sentence_words": 20,
        "call_batch": 64,
        "encoder_batch": arguments.batch_size,
        "sentences_per_run": arguments.sentences,
        "runs": arguments.runs,
        "plain_sentences_per_s": round(plain_median, 1),
        "plain_runs": [round(rate, 1) for rate in plain],
        "cached_50pct_repeat_sentences_per_s": round(cached_median, 1),
        "cached_runs": [round(rate, 1) for rate in cached],
        "cached_to_plain_ratio": round(cached_median / plain_median, 2),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sentences", type=int, default=256)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="encoder batch size")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--models-dir", type=Path, default=Settings().models_path)
    run_benchmark(parser, measure, argv)


if __name__ == "__main__":
    main()
