"""Fusion rules on hand-computed examples."""

from __future__ import annotations

import math

import pytest

from prme.query.fusion import fuse, rrf, weighted, zscore

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
