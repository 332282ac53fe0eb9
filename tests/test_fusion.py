"""Fusion rules on hand-computed examples."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prme.query.fusion import best_first, fuse, rrf, weighted, zscore

CHANNELS = {
    "vector": [("a", 0.9), ("b", 0.5), ("c", 0.1)],
    "lexical": [("b", 4.0), ("d", 2.0)],
}


def test_rrf_sums_reciprocal_ranks_with_k() -> None:
    fused = rrf(CHANNELS, k=60)
    assert fused == pytest.approx({"a": 1 / 61, "b": 1 / 62 + 1 / 61, "c": 1 / 63, "d": 1 / 62})


def test_rrf_weights_scale_each_channel() -> None:
    fused = rrf(CHANNELS, k=10, weights={"vector": 2.0, "lexical": 0.5})
    assert fused["b"] == pytest.approx(2.0 / 12 + 0.5 / 11)


def test_weighted_averages_clipped_cosine_and_best_normalised_scores() -> None:
    fused = weighted(CHANNELS)
    assert fused == pytest.approx({"a": 0.45, "b": 0.75, "c": 0.05, "d": 0.25})


def test_weighted_clips_cosines_to_unit_interval() -> None:
    fused = weighted({"vector": [("a", 1.2), ("b", -0.3)]})
    assert fused == pytest.approx({"a": 1.0, "b": 0.0})


def test_zscore_standardises_each_channel_and_clips_negatives() -> None:
    fused = zscore(CHANNELS)
    std = math.sqrt((0.4**2 + 0 + 0.4**2) / 3)
    assert fused == pytest.approx({"a": 0.4 / std, "b": 0.0 + 1.0, "c": 0.0, "d": 0.0})


def test_zscore_channel_with_equal_scores_gives_each_one() -> None:
    assert zscore({"lexical": [("a", 3.0), ("b", 3.0)]}) == {"a": 1.0, "b": 1.0}


def test_zscore_weights_multiply_standard_scores() -> None:
    fused = zscore(CHANNELS, weights={"vector": 0.0, "lexical": 2.0})
    assert fused["b"] == pytest.approx(2.0)
    assert fused["a"] == 0.0


def test_zscore_is_scale_invariant_per_channel() -> None:
    scaled = {
        "vector": CHANNELS["vector"],
        "lexical": [(n, s * 100) for n, s in CHANNELS["lexical"]],
    }
    assert zscore(scaled) == pytest.approx(zscore(CHANNELS))


def test_zscore_skips_empty_channels() -> None:
    assert zscore({"vector": [], "lexical": [("a", 1.0)]}) == {"a": 1.0}


def test_fuse_dispatches_and_rejects_unknown_rules() -> None:
    assert fuse("rrf", CHANNELS, k=60) == rrf(CHANNELS, 60)
    assert fuse("weighted", CHANNELS) == weighted(CHANNELS)
    assert fuse("zscore", CHANNELS) == zscore(CHANNELS)
    with pytest.raises(ValueError, match="unknown fusion"):
        fuse("borda", CHANNELS)  # type: ignore[arg-type]


def _zscore_as_written(channels: dict[str, list[tuple[str, float]]]) -> dict[str, float]:
    """The rule as the module's docstring states it, term by term."""
    fused: dict[str, float] = {}
    for ranking in channels.values():
        if not ranking:
            continue
        scores = [score for _, score in ranking]
        mean = sum(scores) / len(scores)
        std = math.sqrt(sum((s - mean) ** 2 for s in scores) / len(scores))
        for node_id, score in ranking:
            z = 1.0 if std == 0 else max(0.0, (score - mean) / std)
            fused[node_id] = fused.get(node_id, 0.0) + 1.0 * z
    return fused


_SCORES = st.floats(-1e6, 1e6, allow_nan=False).map(lambda x: round(x, 3))
_RANKING = st.lists(st.tuples(st.sampled_from("abcdefghij"), _SCORES), max_size=30)


@given(st.dictionaries(st.sampled_from(["vector", "lexical", "graph"]), _RANKING))
def test_zscore_equals_the_rule_as_written_to_the_last_bit(
    channels: dict[str, list[tuple[str, float]]],
) -> None:
    assert zscore(channels) == _zscore_as_written(channels)


@given(st.dictionaries(st.text("abc", max_size=3), st.sampled_from([0.0, -0.0, 1.5, 2.0, -3.0])))
def test_best_first_orders_by_score_then_node_id(scores: dict[str, float]) -> None:
    assert best_first(scores.items()) == sorted(scores.items(), key=lambda i: (-i[1], i[0]))
