"""Token counts for bundles: the remembered counts are the counts, and the memory is bounded."""

from __future__ import annotations

from prme.query.tokens import TokenCounter


def test_remembered_counts_equal_fresh_ones_and_the_oldest_are_dropped() -> None:
    texts = [
        f"- [2026-01-0{i % 9 + 1} 10:00] (Ana, s{i}) we met at café {i}, twice!" for i in range(40)
    ]
    fresh = [TokenCounter(cached=0).count(t) for t in texts]
    counter = TokenCounter(cached=25)
    assert counter.count_many(texts[:10] + texts[:10]) == fresh[:10] + fresh[:10]
    assert counter.count_many(texts) == fresh  # half remembered, half counted now
    assert len(counter._counts) == 25
    assert list(counter._counts) == texts[15:]  # least recently used dropped first
    assert counter.count_many([]) == []
