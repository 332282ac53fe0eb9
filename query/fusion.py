"""Fusion of per-channel rankings into one score per node.

Each channel gives ``[(node_id, raw score), ...]`` best first. Three rules:

- ``rrf``: reciprocal rank fusion, ``sum_c w_c / (k + rank_c)`` with 1-based ranks and
  k = 60 by default (equal weights unless configured).
- ``weighted``: ``sum_c w_c * s_c / sum_c w_c`` over the channels that ran, where ``s_c`` is
  the cosine for the vector channel (clipped to [0, 1]) and the raw score divided by the
  channel's best score for the others; a node a channel did not return scores 0 there.
- ``zscore``: ``sum_c w_c * max(0, (raw - mean_c) / std_c)``, each channel standardised over
  its own candidates (a channel whose candidates all score the same gives each 1.0).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from operator import itemgetter
from typing import Literal

Ranking = Sequence[tuple[str, float]]
FusionName = Literal["rrf", "weighted", "zscore"]


def rrf(
    channels: Mapping[str, Ranking], k: int = 60, weights: Mapping[str, float] | None = None
) -> dict[str, float]:
    fused: dict[str, float] = {}
    for name, ranking in channels.items():
        weight = _weight(weights, name)
        for rank, (node_id, _) in enumerate(ranking, start=1):
            fused[node_id] = fused.get(node_id, 0.0) + weight / (k + rank)
    return fused


def weighted(
    channels: Mapping[str, Ranking], weights: Mapping[str, float] | None = None
) -> dict[str, float]:
    total_weight = sum(_weight(weights, name) for name in channels)
    if total_weight <= 0:
        return {}
    fused: dict[str, float] = {}
    for name, ranking in channels.items():
        weight = _weight(weights, name)
        for node_id, score in _normalised(name, ranking):
            fused[node_id] = fused.get(node_id, 0.0) + weight * score / total_weight
        for node_id, _ in ranking:
            fused.setdefault(node_id, 0.0)
    return fused


def zscore(
    channels: Mapping[str, Ranking], weights: Mapping[str, float] | None = None
) -> dict[str, float]:
    fused: dict[str, float] = {}
    for name, ranking in channels.items():
        if not ranking:
            continue
        weight = _weight(weights, name)
        scores = [score for _, score in ranking]
        mean = sum(scores) / len(scores)
        std = math.sqrt(sum([(s - mean) ** 2 for s in scores]) / len(scores))
        get = fused.get
        if std == 0:
            for node_id, _ in ranking:
                fused[node_id] = get(node_id, 0.0) + weight
            continue
        for node_id, score in ranking:
            z = (score - mean) / std
            fused[node_id] = get(node_id, 0.0) + (weight * z if z > 0.0 else 0.0)
    return fused


def best_first(scored: Iterable[tuple[str, float]]) -> list[tuple[str, float]]:
    """``(node_id, score)`` pairs by score, best first, equal scores by node id: as sorting
    by ``(-score, node_id)``, in two stable sorts on C keys (~3x faster for a retrieve's
    ~1,000 candidates)."""
    ranked = sorted(scored, key=_NODE_ID)
    ranked.sort(key=_SCORE, reverse=True)  # reverse keeps equal scores in node-id order
    return ranked


_NODE_ID = itemgetter(0)
_SCORE = itemgetter(1)


def fuse(
    fusion: FusionName,
    channels: Mapping[str, Ranking],
    *,
    k: int = 60,
    weights: Mapping[str, float] | None = None,
) -> dict[str, float]:
    if fusion == "rrf":
        return rrf(channels, k, weights)
    if fusion == "weighted":
        return weighted(channels, weights)
    if fusion == "zscore":
        return zscore(channels, weights)
    raise ValueError(f"unknown fusion {fusion!r} (rrf, weighted or zscore)")


def _normalised(name: str, ranking: Ranking) -> list[tuple[str, float]]:
    if name == "vector":
        return [(node_id, min(1.0, max(0.0, score))) for node_id, score in ranking]
    best = max((score for _, score in ranking), default=0.0)
    if best <= 0:
        return [(node_id, 0.0) for node_id, _ in ranking]
    return [(node_id, max(0.0, score) / best) for node_id, score in ranking]


def _weight(weights: Mapping[str, float] | None, name: str) -> float:
    return 1.0 if weights is None else float(weights.get(name, 1.0))
