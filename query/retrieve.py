"""The retrieval pipeline: channels -> fusion -> time boosts -> score floor -> bundle -> receipt."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

import uuid_utils

from prme.projectors.embeddings.cached import CachedEmbeddingProvider
from prme.projectors.embeddings.protocol import document_query_encoder
from prme.projectors.model import ModelClosed
from prme.projectors.runner import ProjectorRunner
from prme.projectors.shard import Shard
from prme.schemas.config import QuerySettings, Settings
from prme.schemas.errors import ShardUnavailable
from prme.schemas.metrics import Metrics, Stopwatch
from prme.schemas.records import has_visible_text

from .analysis import QueryAnalysis, analyse, speaker_factor
from .bundle import pack
from .fusion import FusionName, best_first, fuse
from .temporal import has_time_expression
from .tokens import TokenCounter
from .types import (
    ChannelReport,
    EmbeddingInfo,
    MemoryResult,
    Receipt,
    ResultEvidence,
    RetrieveResponse,
)

Ranking = list[tuple[str, float]]


class Retriever:
    """Answers ``retrieve`` from the shards a :class:`ProjectorRunner` holds."""

    def __init__(
        self,
        runner: ProjectorRunner,
        settings: Settings,
        counter: TokenCounter,
        metrics: Metrics | None = None,
    ) -> None:
        self._runner = runner
        self._settings = settings
        self._counter = counter
        self._metrics = metrics if metrics is not None else Metrics(enabled=False)

    async def retrieve(
        self,
        query: str,
        owner: str,
        *,
        scope: str | None = None,
        top_k: int = 10,
        token_budget: int = 4096,
        min_score: float | None = None,
        include_archived: bool = False,
        fusion: FusionName | None = None,
    ) -> RetrieveResponse:
        started = time.perf_counter()
        fusion = fusion or self._settings.scoring.fusion
        shard = await self._runner.shard_for(owner)
        clock = self._metrics.stopwatch({"prme.partition": shard.partition, "prme.fusion": fusion})
        speakers = await self._speakers(shard, owner)
        analysis = analyse(query, self._settings.query, speakers, datetime.now(UTC))
        limit = max(self._settings.scoring.candidates, top_k)
        channels, reports, query_vector, embed_query_used = await self._candidates(
            shard, query, analysis, owner, scope, limit, include_archived, clock
        )
        clock.lap("candidates")
        fused = fuse(
            fusion, channels, k=self._settings.scoring.rrf_k, weights=self._settings.scoring.weights
        )
        clock.lap("fusion")
        ranked = best_first(fused.items())
        nodes: dict[str, Any] = {}
        boosts: dict[str, float] = {}
        if analysis.time_cue or analysis.dates or analysis.speakers:
            ranked, nodes, boosts = await self._time_boost(
                shard, owner, analysis, ranked, self._settings.query.time_depth
            )
        cosines = dict(channels.get("vector", []))
        floor_skipped = min_score is not None and query_vector is None
        ranked = await self._head(
            shard,
            owner,
            fusion,
            ranked,
            top_k,
            cosines,
            nodes,
            query_vector,
            None if floor_skipped else min_score,
        )
        clock.lap("stages")
        results = [
            _result(nodes[node_id], score, cosines.get(node_id), floor_skipped)
            for node_id, score in ranked
            if node_id in nodes
        ]
        bundle, costs = pack(results, token_budget, self._counter)
        in_bundle = {item.node_id for item in bundle.items}
        ranks, scores = _channel_positions(channels, {r.node_id for r in results})
        evidence = [
            ResultEvidence(
                node_id=r.node_id,
                event_id=r.event_id,
                ranks=ranks[r.node_id],
                scores=scores[r.node_id],
                fused_score=r.score,
                semantic_relevance=r.semantic_relevance,
                tokens=cost,
                in_bundle=r.node_id in in_bundle,
            )
            for r, cost in zip(results, costs, strict=True)
        ]
        provider = self._runner.provider
        receipt = Receipt(
            request_id=str(uuid_utils.uuid7()),
            owner=owner,
            query=query,
            scope=scope,
            fusion=fusion,
            top_k=top_k,
            min_score=min_score,
            min_score_skipped=floor_skipped,
            channels=reports,
            results=evidence,
            embedding=EmbeddingInfo(
                model_name=provider.model_name,
                model_version=provider.model_version,
                dimension=provider.dimension,
                embed_query_used=embed_query_used,
                mismatch=shard.vector_mismatch,
                query_precision=getattr(provider, "query_precision", None),
            ),
            analysis=_analysis_report(
                analysis,
                self._counter,
                {r.node_id: boosts[r.node_id] for r in results if r.node_id in boosts},
            ),
            elapsed_ms=(time.perf_counter() - started) * 1000,
        )
        clock.lap("bundle")
        clock.total({"prme.results": len(results), "prme.min_score_skipped": floor_skipped})
        self._metrics.retrieve_requests.inc()
        if floor_skipped:
            self._metrics.min_score_skipped.inc()
        return RetrieveResponse(results=results, bundle=bundle, receipt=receipt)

    async def _candidates(
        self,
        shard: Shard,
        query: str,
        analysis: QueryAnalysis,
        owner: str,
        scope: str | None,
        limit: int,
        include_archived: bool,
        clock: Stopwatch,
    ) -> tuple[dict[str, Ranking], list[ChannelReport], list[float] | None, bool]:
        """Every channel's ranking. The lexical (and graph) channels search on the shard's
        thread while the query is embedded and then searched by the vector channel: on the
        shard's second thread when its model asks for it (``search_beside``), else after
        them on the shard's thread. Returns the rankings of the channels that ran, a report per
        channel, the query vector (``None`` when the vector channel did not run) and whether
        ``embed_query`` was used. A channel's ``ms`` is its search time, plus the query
        embedding for the vector channel."""
        vector_channel = asyncio.create_task(
            self._vector_channel(
                shard,
                owner,
                analysis.vector_query,
                clock,
                lambda vector, m: m.search(vector, owner, scope, limit, include_archived),
            )
        )
        calls: dict[str, Callable[[Any], Any]] = {
            "lexical": lambda m: m.search(
                analysis.lexical_query, owner, scope, limit, include_archived
            )
        }
        if self._settings.scoring.graph:
            entities = analysis.entities
            calls["graph"] = lambda m: (
                m.search(owner, scope, entities, limit, include_archived) if entities else []
            )
        try:
            outcomes = await shard.run(_search_all, shard.models, calls)
        except BaseException:  # no answer to wait for: the request failed or was cancelled
            vector_channel.cancel()
            with contextlib.suppress(BaseException):
                await vector_channel
            raise
        embedded, searched = await vector_channel
        if shard.closing:  # its models may have gone mid-search: no partial answer
            raise ShardUnavailable(f"partition {shard.partition} closed during the search")
        outcomes = {**searched, **outcomes}
        vector = embedded.vector
        channels: dict[str, Ranking] = {}
        reports = [embedded.report] if embedded.report is not None else []
        for name, outcome in outcomes.items():
            clock.stage(name, outcome.ms / 1000)
            ms = outcome.ms + (embedded.ms if name == "vector" else 0.0)
            if outcome.error is not None:
                reports.append(ChannelReport(name=name, used=False, ms=ms, error=outcome.error))
                if name == "vector":
                    vector = None
                continue
            channels[name] = [(hit.node_id, hit.score) for hit in outcome.hits]
            reports.append(ChannelReport(name=name, used=True, ms=ms, candidates=len(outcome.hits)))
        return channels, reports, vector, embedded.query_encoder

    async def _vector_channel(
        self,
        shard: Shard,
        owner: str,
        query: str,
        clock: Stopwatch,
        search: Callable[[list[float], Any], Any],
    ) -> tuple[_Embedded, dict[str, _Outcome]]:
        """``query``'s embedding, then ``search(vector, model)``: beside the shard's thread
        when the model says it is worth it (``search_beside``), else (or when a rebuild
        swapped the model meanwhile) on the shard's thread, after the other channels; no
        search when the query could not be embedded."""
        embedded = await self._embed(shard, owner, query, clock)
        vector = embedded.vector
        if vector is None:
            return embedded, {}

        def searched(model: Any) -> Any:
            return search(vector, model)

        if getattr(shard.models.get("vector"), "search_beside", False):
            try:
                outcome = await shard.search_beside(
                    "vector", lambda model: _search_one(model, searched, beside=True)
                )
                return embedded, {"vector": outcome}
            except ModelClosed:
                pass  # swapped by a rebuild: the shard's thread has its replacement
        return embedded, await shard.run(_search_all, shard.models, {"vector": searched})

    async def _embed(self, shard: Shard, owner: str, query: str, clock: Stopwatch) -> _Embedded:
        started = time.perf_counter()
        provider = self._runner.provider
        embed_query = getattr(provider, "embed_query", None)
        # A caching wrapper always has embed_query; it reports whether the wrapped one does.
        query_encoder = bool(getattr(provider, "has_query_encoder", embed_query is not None))
        if shard.vector_mismatch:
            return _Embedded(
                None,
                False,
                0.0,
                ChannelReport(
                    name="vector",
                    used=False,
                    ms=0.0,
                    error="embedding mismatch: the vector store was built by another provider "
                    "identity; run `prme rebuild --model vector`",
                ),
            )
        try:
            if isinstance(provider, CachedEmbeddingProvider):  # the owner's own entries
                vector = await provider.embed_query(query, owner=owner)
            elif embed_query is not None:
                vector = list(await embed_query(query))
            else:
                vector = list((await document_query_encoder(provider)([query]))[0])
        except Exception as error:
            return _Embedded(
                None,
                query_encoder,
                _ms(started),
                ChannelReport(
                    name="vector",
                    used=False,
                    ms=_ms(started),
                    error=f"{type(error).__name__}: {error}",
                ),
            )
        clock.stage("query_embedding", _ms(started) / 1000)
        self._metrics.embed_duration.labels("query").observe(_ms(started) / 1000)
        self._metrics.texts_encoded.labels("query").inc()
        return _Embedded(vector, query_encoder, _ms(started), None)

    async def _nodes(self, shard: Shard, owner: str, node_ids: list[str]) -> dict[str, Any]:
        return await shard.call("graph", lambda graph: graph.get_nodes(owner, node_ids))

    async def _speakers(self, shard: Shard, owner: str) -> list[str]:
        """The owner's speakers, when a query stage uses them and the lexical model is held."""
        query = self._settings.query
        if not (query.speaker_match or query.strip_speakers) or "lexical" not in shard.models:
            return []
        try:
            return await shard.call("lexical", lambda lexical: lexical.speakers(owner))
        except Exception:  # the lexical channel reports its own failure; the stage just idles
            return []

    async def _time_boost(
        self,
        shard: Shard,
        owner: str,
        analysis: QueryAnalysis,
        ranked: Ranking,
        limit: int,
    ) -> tuple[Ranking, dict[str, Any], dict[str, float]]:
        """Multiply the fused score of the first ``limit`` candidates by their time factor
        (see :func:`time_factor`); returns the new ranking, the nodes read and the factors
        other than 1."""
        head = ranked[:limit]
        nodes = await self._nodes(shard, owner, [node_id for node_id, _ in head])
        settings = self._settings.query
        boosts: dict[str, float] = {}
        for node_id, _ in head:
            node = nodes.get(node_id)
            if node is None:
                continue
            factor = time_factor(
                analysis, node.text, node.occurred_at or node.recorded_at, settings
            )
            factor *= speaker_factor(analysis, node.speaker, settings)
            if factor != 1.0:
                boosts[node_id] = factor
        if not boosts:
            return ranked, nodes, boosts
        return boosted(head, boosts) + list(ranked[limit:]), nodes, boosts

    async def _head(
        self,
        shard: Shard,
        owner: str,
        fusion: str,
        ranked: Ranking,
        top_k: int,
        cosines: dict[str, float],
        nodes: dict[str, Any],
        query_vector: list[float] | None,
        min_score: float | None,
    ) -> Ranking:
        """The first ``top_k`` candidates that pass the floor. Cosines for candidates the
        vector channel did not return, and the nodes of the candidates, are read only as
        far down the ranking as needed (in pages of ``2 * top_k``, one hop to the shard's
        thread per page), and added to ``cosines`` and ``nodes``."""
        head: Ranking = []
        page = max(2 * top_k, 20)
        scoring = query_vector is not None and "vector" in shard.models
        for start in range(0, len(ranked), page):
            chunk = ranked[start : start + page]
            unscored = [n for n, _ in chunk if n not in cosines] if scoring else []
            unread = [node_id for node_id, _ in chunk if node_id not in nodes]

            def read(unscored: list[str] = unscored, unread: list[str] = unread) -> Any:
                # Models are looked up here, on the shard's thread: a rebuild may have
                # swapped them since the previous hop.
                vector, graph = shard.models.get("vector"), shard.models["graph"]
                scores_for = getattr(vector, "scores_for", None)
                scored = (
                    scores_for(query_vector, owner, unscored) if unscored and scores_for else {}
                )
                return scored, graph.get_nodes(owner, unread) if unread else {}  # type: ignore[attr-defined]

            scored, read_nodes = await shard.run(read)
            cosines.update(scored)
            nodes.update(read_nodes)
            for node_id, score in chunk:
                node = nodes.get(node_id)
                if node is not None and not has_visible_text(node.text):
                    continue  # no text to recall (an image-only or tool-call-only message)
                if min_score is None or _passes(fusion, min_score, score, cosines.get(node_id)):
                    head.append((node_id, score))
                    if len(head) == top_k:
                        return head
        return head


class _Embedded(NamedTuple):
    vector: list[float] | None
    query_encoder: bool
    ms: float
    report: ChannelReport | None
    """Why the vector channel cannot run (``None`` when ``vector`` is set)."""


class _Outcome(NamedTuple):
    hits: list[Any]
    ms: float
    error: str | None


def _search_all(
    models: Mapping[str, Any], calls: dict[str, Callable[[Any], Any]]
) -> dict[str, _Outcome]:
    """Run each channel's search on its model (on the shard's thread); a failing channel
    reports its error and leaves the others running."""
    outcomes: dict[str, _Outcome] = {}
    for name, call in calls.items():
        model = models.get(name)
        if model is None:
            outcomes[name] = _Outcome([], 0.0, f"KeyError: {name!r}")
            continue
        outcomes[name] = _search_one(model, call)
    return outcomes


def _search_one(model: Any, call: Callable[[Any], Any], *, beside: bool = False) -> _Outcome:
    """``call(model)`` timed; its error, if any, reported (the channel does not run).
    ``beside`` the shard's thread, a closed model is raised instead: a rebuild may have
    swapped it, and the shard's thread has the one that replaced it."""
    started = time.perf_counter()
    try:
        hits = call(model)
    except Exception as error:
        if beside and isinstance(error, ModelClosed):
            raise
        return _Outcome([], _ms(started), f"{type(error).__name__}: {error}")
    return _Outcome(hits, _ms(started), None)


def _channel_positions(
    channels: Mapping[str, Ranking], node_ids: set[str]
) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, float]]]:
    """For each of ``node_ids``, its rank (1-based) and raw score in each channel that
    returned it, by channel in ``channels``' order."""
    ranks: dict[str, dict[str, int]] = {node_id: {} for node_id in node_ids}
    scores: dict[str, dict[str, float]] = {node_id: {} for node_id in node_ids}
    for name, ranking in channels.items():
        for rank, (node_id, score) in enumerate(ranking, start=1):
            if node_id in node_ids:
                ranks[node_id][name] = rank
                scores[node_id][name] = score
    return ranks, scores


def boosted(head: Ranking, boosts: dict[str, float]) -> Ranking:
    """``head`` rescored by each candidate's factor and sorted. A boosted candidate scores
    at least the lowest positive score of the head before its factor: zscore fusion clips
    candidates below a channel's mean to 0, which no factor would lift (a memory that
    occurred in the span the question names stayed under every positive one)."""
    positive = [score for _, score in head if score > 0]
    floor = min(positive) if positive else 0.0
    rescored = [
        (node_id, (max(score, floor) if node_id in boosts else score) * boosts.get(node_id, 1.0))
        for node_id, score in head
    ]
    return best_first(rescored)


def time_factor(
    analysis: QueryAnalysis, text: str, occurred_at: datetime | None, settings: QuerySettings
) -> float:
    """``1 + time_boost`` when the query asks for a time and ``text`` states one, times
    ``1 + date_boost`` when ``occurred_at`` falls in a span the query names (a caller
    passes a memory's ``recorded_at`` when it has no ``occurred_at``)."""
    factor = 1.0
    if analysis.time_cue and has_time_expression(text):
        factor *= 1.0 + settings.time_boost
    slack = timedelta(days=settings.date_slack_days)
    if (
        analysis.dates
        and occurred_at is not None
        and any(span.contains(occurred_at, slack) for span in analysis.dates)
    ):
        factor *= 1.0 + settings.date_boost
    return factor


def _passes(fusion: str, floor: float, fused: float, cosine: float | None) -> bool:
    if fusion == "weighted":
        return fused >= floor
    return cosine is not None and cosine >= floor


_NODE_FIELDS = MemoryResult.__struct_fields__[: MemoryResult.__struct_fields__.index("score")]
"""The fields of a result that are the stored node's (``node_id`` .. ``occurred_at``)."""


def _result(node: Any, score: float, cosine: float | None, floor_skipped: bool) -> MemoryResult:
    return MemoryResult(
        **{name: getattr(node, name) for name in _NODE_FIELDS},
        score=score,
        semantic_relevance=cosine,
        metadata={"min_score_skipped": True} if floor_skipped else {},
    )


def _analysis_report(
    analysis: QueryAnalysis, counter: TokenCounter, boosts: dict[str, float]
) -> dict[str, Any]:
    return {
        "lexical_query": analysis.lexical_query,
        "vector_query": analysis.vector_query,
        "speakers": analysis.speakers,
        "entities": analysis.entities,
        "time_cue": analysis.time_cue,
        "dates": [
            {"text": s.text, "start": s.start.isoformat(), "end": s.end.isoformat()}
            for s in analysis.dates
        ],
        "boosts": boosts,
        "stages": analysis.stages,
        "tokenizer": counter.name,
    }


def _ms(started: float) -> float:
    return (time.perf_counter() - started) * 1000
