"""Token counts for bundles: the remembered counts are the counts, and the memory is bounded."""

from __future__ import annotations

from pathlib import Path

import pytest

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
    kept = TokenCounter(cached=25)
    kept.count_many(texts[15:])
    assert list(counter._counts) == list(kept._counts)  # least recently used dropped first
    assert counter.count_many([]) == []
    assert not any(b"caf" in digest for digest in counter._counts)  # digests, not texts


@pytest.mark.model
def test_the_model_tokenizer_counts_the_same_remembered_or_not() -> None:
    from prme.schemas.config import Settings

    tokenizer = next(Path(Settings().models_path).rglob("tokenizer.json"), None)
    assert tokenizer is not None, "make model provisions the default model"
    lines = [f"- [2026-01-02 10:00] (Ana, s1) we met at café {i}, twice!" for i in range(10)]
    fresh = [TokenCounter(tokenizer).count(line) for line in lines]
    counter = TokenCounter(tokenizer, cached=5)
    assert counter.name == "wordpiece"
    assert counter.count_many(lines) == fresh
    assert counter.count_many(lines[::-1]) == fresh[::-1]


@pytest.mark.model
@pytest.mark.parametrize("unit", ["ฉันชอบกินข้าวผัดกุ้ง", "\U0001f600", "ＷＩＦＩ"])
def test_text_the_vocabulary_does_not_know_counts_by_its_length(unit: str) -> None:
    """Found by a new-user trial: a 20,000-character Thai memory counted 18 tokens (each
    unknown word one ``[UNK]``), so it filled a bundle of 100."""
    from prme.schemas.config import Settings

    tokenizer = next(Path(Settings().models_path).rglob("tokenizer.json"), None)
    assert tokenizer is not None, "make model provisions the default model"
    text = unit * 200
    counter = TokenCounter(tokenizer)
    assert counter.count(text) >= len(text)
    assert counter.count_many([text]) == [counter.count(text)]
    assert counter.count("the cafe is open") == 4  # known words keep their count


def test_the_stand_in_count_counts_a_run_of_chinese_by_its_length() -> None:
    assert TokenCounter().count("我喜欢喝咖啡 and tea") == 6 + 2


@pytest.mark.model
def test_a_batch_with_unknown_pieces_counts_as_each_text_alone() -> None:
    from prme.schemas.config import Settings

    tokenizer = next(Path(Settings().models_path).rglob("tokenizer.json"), None)
    assert tokenizer is not None, "make model provisions the default model"
    texts = ["we met at the cafe", "so happy \U0001f600\U0001f600", "ข้าวผัด at noon", "plain"]
    counter = TokenCounter(tokenizer, cached=0)
    assert counter.count_many(texts) == [counter.count(text) for text in texts]
