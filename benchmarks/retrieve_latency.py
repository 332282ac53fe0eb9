"""Retrieve latency p50/p95 at 100k memories, in-process and over HTTP (JSON on stdout).

Two packs are loaded through the real write and projection path (``MemoryEngine``): 100k
memories spread over 1,000 owners, and 100k memories of one owner. Loading 100k texts
through the default model would take ~15 minutes, and vectors of two models are never
comparable, so the packs are built and queried with ``HashedBagOfWordsProvider`` at the
default model's dimension (384): the vector store's cost depends on the dimension and the
point count, not on the model. The default model's query-embedding latency is measured
separately, and the total is stated as ``engine p95 + embed p95``. It is also measured:
each pack is reopened with ``RealModelQueries`` (the hashed documents' identity, queries
embedded by the default model on its query session), so every retrieve embeds its query
with the real model in the loop, overlapping the lexical channel as it does in service
(``with_real_model.<precision>.<layout>``; the model's vectors land anywhere among the
hashed ones, which is what a search costs the same for). Both query precisions
(``embedding.query_precision``: the default model's int8 copy, and the exact model) are
measured, alternating, ``--model-rounds`` times each.

In-process: ``MemoryEngine.retrieve`` wall time. HTTP: the same pack served by
``query.serve.run_server`` (uvicorn, in a thread with its own event loop) and queried
with ``HttpMemoryBackend`` (httpx) from the main loop, after the in-process engine is
closed, over one reused keep-alive connection and with a new connection per request.

Metrics overhead: the spread pack is reopened with Prometheus metrics off and on
(``Settings.metrics.enabled``), alternating, ``--overhead-rounds`` times each; every round
measures retrieve p95 in-process and over HTTP (keep-alive, where the request middleware
runs too). Reported: the median of the rounds' p95 for each, and on/off ratios (target:
on <= 1.05 x off). ``--overhead-only`` builds just the spread pack and measures this.

    python -m benchmarks.retrieve_latency [--memories 100000] [--owners 1000]
        [--queries 200] [--no-http] [--overhead-rounds 5] [--overhead-only]
        [--query-precision int8,float] [--model-rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import (
    LatencySummary,
    chat_turn,
    latency_summary,
    machine,
    median,
    percentile,
    question,
    run_benchmark,
)
from prme.producers.producer import MessageDraft
from prme.producers.transport import Position
from prme.projectors.embeddings.fastembed_provider import (
    QUERY_PRECISIONS,
    FastEmbedProvider,
    QueryPrecision,
)
from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider
from prme.projectors.embeddings.model_assets import ensure_default_model
from prme.query.engine import MemoryEngine
from prme.query.http_client import HttpMemoryBackend
from prme.query.serve import run_server
from prme.schemas.config import QdrantSettings, Settings
from prme.schemas.metrics import Metrics

TARGET_P95_MS = 50.0
TARGET_ONE_OWNER_P95_MS = 12.0
"""Issue 14: 100k memories of one owner, in-process p95 with the query embedding."""
TARGET_METRICS_RATIO = 1.05
LOAD_BATCH = 1000


async def load(engine: MemoryEngine, memories: int, owners: list[str], seed: int) -> float:
    """Append ``memories`` messages round-robin over ``owners``; records/s until projected."""
    rng = random.Random(seed)
    started = time.perf_counter()
    latest: dict[int, Position] = {}
    for start in range(0, memories, LOAD_BATCH):
        drafts = [
            MessageDraft(
                owner=owners[index % len(owners)],
                content=chat_turn(rng, words=rng.randint(12, 40)),
                role="user" if index % 2 else "assistant",
                session_id=f"s{index % 9}",
            )
            for index in range(start, min(start + LOAD_BATCH, memories))
        ]
        for result in await engine.store_many(drafts, wait=False):
            latest[result.token.partition] = result.token
    await engine.wait_for(list(latest.values()), timeout_s=3600)
    return memories / (time.perf_counter() - started)


async def settle_vector_indexes(engine: MemoryEngine, timeout_s: float = 3600) -> dict[str, Any]:
    """Wait until no shard builds (or is due to build) its HNSW index; what each shard
    holds then, and how long the wait took."""
    started = time.perf_counter()
    shards: dict[str, Any] = {}
    for partition, shard in sorted(engine.runner.shards.items()):
        model = shard.models.get("vector")
        wait = getattr(model, "wait_index_idle", None)
        if wait is None:
            continue
        if not await asyncio.to_thread(wait, timeout_s):
            raise TimeoutError(f"p{partition}: the HNSW build did not finish in {timeout_s} s")
        status = model.index_status() if model is not None else None
        if status is not None and status.points > 1:
            shards[f"p{partition}"] = {"points": status.points, "indexed": status.indexed}
    indexed = {name: s for name, s in shards.items() if s["indexed"]}
    return {
        "wait_s": round(time.perf_counter() - started, 2),
        "shards_indexed": len(indexed),
        "shards": len(shards),
        "indexed_shards": indexed,
    }


async def query_latency(
    backend: Any, owners: list[str], queries: int, warmup: int, seed: int
) -> tuple[LatencySummary, dict[str, list[float]]]:
    """Wall time of ``backend.retrieve`` over ``queries`` random (query, owner) pairs."""
    rng = random.Random(seed)
    for _ in range(warmup):
        await backend.retrieve(question(rng), rng.choice(owners))
    samples: list[float] = []
    channels: dict[str, list[float]] = {}
    for _ in range(queries):
        text, owner = question(rng), rng.choice(owners)
        started = time.perf_counter()
        response = await backend.retrieve(text, owner, top_k=10)
        samples.append(time.perf_counter() - started)
        if not response.results:
            raise RuntimeError(f"no results for {text!r} of {owner}")
        for channel in response.receipt.channels:
            channels.setdefault(channel.name, []).append(channel.ms)
    return latency_summary(samples), channels


def channel_summary(channels: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {
        name: {"p50_ms": round(median(ms), 3), "p95_ms": round(percentile(ms, 0.95), 3)}
        for name, ms in channels.items()
    }


class ServerThread:
    """``run_server`` on its own thread and event loop, so the client's loop does not
    share a thread with the server's (sharing one loop added ~45 ms per request)."""

    def __init__(
        self, settings: Settings, provider: HashedBagOfWordsProvider, listener: socket.socket
    ) -> None:
        self._settings = settings
        self._provider = provider
        self._listener = listener
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._shutdown: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="prme-bench-server")

    def start(self) -> None:
        self._thread.start()

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as error:
            self._error = error
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._shutdown = asyncio.Event()
        self._ready.set()
        await run_server(
            self._settings,
            embedding_provider=self._provider,
            sockets=[self._listener],
            shutdown=self._shutdown,
            log_level="warning",
        )

    async def stop(self, timeout_s: float = 120.0) -> None:
        """Ask the server to exit and wait for its thread; re-raise what it raised."""
        if not await asyncio.to_thread(self._ready.wait, timeout_s):
            raise TimeoutError("the server thread did not start")
        if self._loop is not None and self._shutdown is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._shutdown.set)
        await asyncio.to_thread(self._thread.join, timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"the server did not stop within {timeout_s} s")
        if self._error is not None:
            raise self._error


async def over_http(
    settings: Settings,
    provider: HashedBagOfWordsProvider,
    owners: list[str],
    queries: int,
    warmup: int,
    modes: tuple[str, ...] = ("keepalive", "new_connection_per_request"),
) -> dict[str, LatencySummary]:
    """Serve the pack with ``run_server`` on a loopback socket, in its own thread and event
    loop, and query it with httpx from this loop."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    # Listening before the server runs: the first request waits in the backlog until the
    # server has opened the pack, so no readiness polling is needed.
    listener.listen(128)
    port = listener.getsockname()[1]
    server = ServerThread(settings, provider, listener)
    server.start()
    url = f"http://127.0.0.1:{port}"
    no_keepalive = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_keepalive_connections=0))
    clients = {
        "keepalive": HttpMemoryBackend(url, timeout_s=300),
        "new_connection_per_request": HttpMemoryBackend(url, timeout_s=300, transport=no_keepalive),
    }
    for name in set(clients) - set(modes):
        await clients.pop(name).close()
    summaries: dict[str, LatencySummary] = {}
    try:
        for name, client in clients.items():
            summaries[name], _ = await query_latency(client, owners, queries, warmup, seed=5)
    finally:
        for client in clients.values():
            await client.close()
        await server.stop()
        listener.close()
    return summaries


def pack_settings(directory: Path, arguments: argparse.Namespace) -> Settings:
    """The benchmark pack's settings: ``directory``, with the models from ``--models-dir``."""
    return Settings(
        data_dir=str(directory),
        models_dir=str(arguments.models_dir),
        qdrant=QdrantSettings(index_threshold=arguments.index_threshold),
    )


async def layout(
    name: str,
    directory: Path,
    provider: HashedBagOfWordsProvider,
    arguments: argparse.Namespace,
    owners: list[str],
) -> dict[str, Any]:
    settings = pack_settings(directory, arguments)
    engine = await MemoryEngine.create(directory, settings=settings, embedding_provider=provider)
    try:
        load_rate = await load(engine, arguments.memories, owners, seed=len(owners))
        indexes = await settle_vector_indexes(engine)
        summary, channels = await query_latency(
            engine, owners, arguments.queries, arguments.warmup, seed=3
        )
    finally:
        await engine.close()
    report: dict[str, Any] = {
        "memories": arguments.memories,
        "owners": len(owners),
        "memories_per_owner": arguments.memories // len(owners),
        "load_records_per_s": round(load_rate, 1),
        "index_threshold": arguments.index_threshold,
        "vector_indexes": indexes,
        "in_process": summary,
        "in_process_channels": channel_summary(channels),
        "in_process_meets_target": summary.p95_ms <= TARGET_P95_MS,
    }
    if arguments.http:
        report["http"] = await over_http(
            settings, provider, owners, arguments.queries, arguments.warmup
        )
    return report


async def metrics_overhead(
    base: Settings,
    provider: HashedBagOfWordsProvider,
    arguments: argparse.Namespace,
    owners: list[str],
) -> dict[str, Any]:
    """p95 with metrics off and on over the pack ``base`` names, alternating rounds (see
    module doc)."""
    p95: dict[str, dict[str, list[float]]] = {
        "in_process": {"off": [], "on": []},
        "http_keepalive": {"off": [], "on": []},
    }
    for round_ in range(arguments.overhead_rounds):
        for state in ("off", "on"):
            settings = base.replace(metrics={"enabled": state == "on"})
            engine = await MemoryEngine.open(settings=settings, embedding_provider=provider)
            try:
                summary, _ = await query_latency(
                    engine, owners, arguments.queries, arguments.warmup, seed=11 + round_
                )
            finally:
                await engine.close()
            p95["in_process"][state].append(summary.p95_ms)
            if arguments.http:
                served = await over_http(
                    settings, provider, owners, arguments.queries, arguments.warmup, ("keepalive",)
                )
                p95["http_keepalive"][state].append(served["keepalive"].p95_ms)
    report: dict[str, Any] = {
        "rounds": arguments.overhead_rounds,
        "target_ratio": TARGET_METRICS_RATIO,
        "recording_cost": recording_cost_us(),
    }
    for path, runs in p95.items():
        if not runs["on"]:
            continue
        off, on = median(runs["off"]), median(runs["on"])
        report[path] = {
            "p95_ms_off_rounds": [round(v, 3) for v in runs["off"]],
            "p95_ms_on_rounds": [round(v, 3) for v in runs["on"]],
            "p95_ms_off_median": round(off, 3),
            "p95_ms_on_median": round(on, 3),
            "ratio_on_to_off": round(on / off, 3),
            "meets_target": on / off <= TARGET_METRICS_RATIO,
        }
    return report


def recording_cost_us(repeats: int = 5, requests: int = 20_000) -> dict[str, Any]:
    """What the metric calls of one HTTP retrieve cost, in microseconds (median of
    ``repeats`` runs of ``requests``): the same calls the middleware and the retriever make,
    on a live registry. Steadier than the p95s, which this machine's load moves."""
    metrics = Metrics(enabled=True)
    runs: list[float] = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(requests):
            metrics.http_in_flight.inc()
            clock = metrics.stopwatch()
            metrics.retrieve_duration.labels("query_embedding").observe(0.004)
            metrics.embed_duration.labels("query").observe(0.004)
            metrics.texts_encoded.labels("query").inc()
            metrics.retrieve_duration.labels("lexical").observe(0.002)
            metrics.retrieve_duration.labels("vector").observe(0.003)
            for stage in ("candidates", "fusion", "stages", "bundle"):
                clock.lap(stage)
            clock.total()
            metrics.retrieve_requests.inc()
            metrics.http_in_flight.dec()
            metrics.http_request_duration.labels("/v1/retrieve", "POST", "2xx").observe(0.01)
        runs.append((time.perf_counter() - started) / requests * 1e6)
    return {"per_request_us_median": round(median(runs), 2), "runs_us": [round(r, 2) for r in runs]}


async def embed_latency(provider: FastEmbedProvider, queries: int) -> LatencySummary:
    """The default model's time to embed one short query (no cache), on the query session
    (``embed_interactive``) that retrieval uses."""
    await provider.embed_interactive(["warm the model up outside the timings"])
    rng = random.Random(9)
    samples: list[float] = []
    for _ in range(queries):
        text = question(rng)
        started = time.perf_counter()
        await provider.embed_interactive([text])
        samples.append(time.perf_counter() - started)
    return latency_summary(samples)


class RealModelQueries(HashedBagOfWordsProvider):
    """The hashed provider's identity and documents; queries embedded by the default model
    (``embed_interactive``, the path retrieval takes for a provider without
    ``embed_query``), so a retrieve pays the real query embedding."""

    def __init__(self, model: FastEmbedProvider, dimension: int) -> None:
        super().__init__(dimension)
        if model.dimension != dimension:
            raise ValueError(f"the default model has {model.dimension} dimensions, not {dimension}")
        self._model = model
        self.queries_embedded = 0

    async def embed_interactive(self, texts: Sequence[str]) -> list[list[float]]:
        self.queries_embedded += len(texts)
        return await self._model.embed_interactive(texts)


async def real_query_latency(
    settings: Settings, model: FastEmbedProvider, arguments: argparse.Namespace, owners: list[str]
) -> dict[str, Any]:
    """In-process retrieve latency of the pack ``settings`` name with each query embedded
    by the default model, and how many queries the model embedded."""
    provider = RealModelQueries(model, arguments.dimension)
    engine = await MemoryEngine.open(settings=settings, embedding_provider=provider)
    try:
        summary, channels = await query_latency(
            engine, owners, arguments.queries, arguments.warmup, seed=17
        )
    finally:
        await engine.close()
    return {
        "in_process": summary,
        "channels": channel_summary(channels),
        "queries_embedded_by_model": provider.queries_embedded,
    }


def with_model_summary(
    layouts: dict[str, Any], embed: LatencySummary, rounds: dict[str, list[dict[str, Any]]]
) -> dict[str, dict[str, Any]]:
    """Per layout: the estimate (hashed-query p95 + embedding p95), every round measured
    with the model in the loop, and the medians of the rounds' p50 and p95."""
    totals: dict[str, dict[str, Any]] = {}
    for name, measured in rounds.items():
        p95 = median([m["in_process"].p95_ms for m in measured])
        totals[name] = {
            "p95_total_estimate_ms": round(layouts[name]["in_process"].p95_ms + embed.p95_ms, 3),
            "rounds": measured,
            "p50_ms_median": round(median([m["in_process"].p50_ms for m in measured]), 3),
            "p95_ms_median": round(p95, 3),
            "meets_target": p95 <= TARGET_P95_MS,
        }
    totals["single_owner"]["meets_one_owner_target"] = (
        totals["single_owner"]["p95_ms_median"] <= TARGET_ONE_OWNER_P95_MS
    )
    return totals


async def measure(arguments: argparse.Namespace, work: Path) -> dict[str, Any]:
    provider = HashedBagOfWordsProvider(dimension=arguments.dimension)
    spread = [f"user-{index:04d}" for index in range(arguments.owners)]
    if arguments.overhead_only:
        settings = Settings(data_dir=str(work / "spread"), models_dir=str(arguments.models_dir))
        engine = await MemoryEngine.create(settings=settings, embedding_provider=provider)
        try:
            await load(engine, arguments.memories, spread, seed=len(spread))
        finally:
            await engine.close()
        return {
            "benchmark": "retrieve_latency",
            "machine": machine(),
            "memories": arguments.memories,
            "owners": len(spread),
            "queries": arguments.queries,
            "metrics_overhead": await metrics_overhead(
                pack_settings(work / "spread", arguments), provider, arguments, spread
            ),
        }
    layouts = {"spread": spread, "single_owner": ["user-solo"]}
    results = {
        name: await layout(name, work / name, provider, arguments, owners)
        for name, owners in layouts.items()
    }
    model_dir = ensure_default_model(arguments.models_dir)
    precisions: list[QueryPrecision] = arguments.query_precision
    models = {p: FastEmbedProvider(model_path=model_dir, query_precision=p) for p in precisions}
    embeds = {p: await embed_latency(models[p], arguments.queries) for p in precisions}
    rounds: dict[str, dict[str, list[dict[str, Any]]]] = {
        p: {name: [] for name in layouts} for p in precisions
    }
    for _ in range(arguments.model_rounds):  # the precisions alternate, round by round
        for precision in precisions:
            for name, owners in layouts.items():
                rounds[precision][name].append(
                    await real_query_latency(
                        pack_settings(work / name, arguments), models[precision], arguments, owners
                    )
                )
    totals = {
        precision: with_model_summary(results, embeds[precision], rounds[precision])
        for precision in precisions
    }
    return {
        "benchmark": "retrieve_latency",
        "machine": machine(),
        "method": (
            "packs built and queried with HashedBagOfWordsProvider at dimension "
            f"{arguments.dimension} (vector-store cost depends on dimension and point "
            "count, not the model); the default model's query embedding is timed "
            "separately (total p95 estimate = engine p95 + embed p95) and in the loop "
            "(with_real_model.*.measured: queries embedded by the default model)"
        ),
        "target_p95_ms": TARGET_P95_MS,
        "target_one_owner_with_model_p95_ms": TARGET_ONE_OWNER_P95_MS,
        "top_k": 10,
        "queries": arguments.queries,
        "layouts": results,
        "model_rounds": arguments.model_rounds,
        # int8 asked for on cores without int8 dot products runs exact: say so.
        "query_precision_in_effect": {p: models[p].query_precision for p in precisions},
        "real_model_embed_query": embeds,
        "with_real_model": totals,
        "metrics_overhead": await metrics_overhead(
            pack_settings(work / "spread", arguments), provider, arguments, spread
        ),
        "http_note": (
            "server (run_server: uvicorn) in its own thread and event loop, client (httpx, "
            "HttpMemoryBackend) in the main loop of the same process; keepalive reuses one "
            "connection, the other opens a new connection per request"
            if arguments.http
            else "skipped (--no-http)"
        ),
    }


def precisions_argument(text: str) -> list[QueryPrecision]:
    """``int8,float``: query precisions, each one of ``QUERY_PRECISIONS``, once."""
    chosen = [part.strip() for part in text.split(",") if part.strip()]
    wrong = [part for part in chosen if part not in QUERY_PRECISIONS]
    if not chosen or wrong or len(set(chosen)) != len(chosen):
        raise argparse.ArgumentTypeError(
            f"a comma-separated list of distinct precisions from {', '.join(QUERY_PRECISIONS)}"
        )
    return [p for p in QUERY_PRECISIONS if p in chosen]


def rounds_argument(text: str) -> int:
    rounds = int(text)
    if rounds < 1:
        raise argparse.ArgumentTypeError(f"at least 1 round, not {rounds}")
    return rounds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memories", type=int, default=100_000)
    parser.add_argument("--owners", type=int, default=1000, help="owners of the spread pack")
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--dimension", type=int, default=384)
    parser.add_argument("--models-dir", type=Path, default=Settings().models_path)
    parser.add_argument(
        "--index-threshold",
        type=int,
        default=QdrantSettings().index_threshold,
        help="qdrant.index_threshold of the packs (0: exact scans only, as before issue 14)",
    )
    parser.add_argument("--no-http", dest="http", action="store_false")
    parser.add_argument(
        "--overhead-rounds", type=int, default=5, help="metrics off/on rounds (default 5)"
    )
    parser.add_argument(
        "--overhead-only", action="store_true", help="only the metrics on/off comparison"
    )
    parser.add_argument(
        "--query-precision",
        type=precisions_argument,
        default=["int8", "float"],
        help="the default model's query precisions measured with the model in the loop, "
        "alternating (default int8,float)",
    )
    parser.add_argument(
        "--model-rounds",
        type=rounds_argument,
        default=3,
        help="rounds with the model in the loop (at least 1)",
    )
    run_benchmark(parser, measure, argv)


if __name__ == "__main__":
    main()
