"""Token counts for bundles: the remembered counts are the counts, and the memory is bounded."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


def _model_tokenizer() -> Path:
    from prme.schemas.config import Settings

    tokenizer = next(Path(Settings().models_path).rglob("tokenizer.json"), None)
    assert tokenizer is not None, "make model provisions the default model"
    return tokenizer


@functools.cache
def _shared_counter() -> TokenCounter:
    """One counter for every example: its remembered chunks carry over between them."""
    return TokenCounter(_model_tokenizer(), cached=0)


_PIECES = [
    *"aZ09 .,!?'\"-$%()[]#@_~",
    " ",
    "\t",
    "\n",
    "\r\n",
    "\x00",
    "\x1f",
    "\x0b",
    "\x0c",
    "\x7f",
    "\u00a0",
    "\u200b",
    "\u3000",
    "é",
    "e\u0301",
    "’",
    "İ",
    "我喜欢",
    "ข้าว",
    "\U0001f600",
    "ＷＩＦＩ",
    "[CLS]",
    "[UNK]",
    "[cls]",
    "##",
    "caroline",
    "Melanie",
    "unaffable",
    "x" * 101,
    "pottery's",
    "have",
    "\u6168\u6576",  # "have"'s bytes as two 2-byte characters
]


@pytest.mark.model
@settings(max_examples=150, deadline=None, database=None)
@given(
    texts=st.lists(
        st.lists(st.sampled_from(_PIECES) | st.text(max_size=6), max_size=40).map("".join),
        max_size=8,
    )
)
def test_counting_chunk_by_chunk_gives_the_tokenizer_s_count(texts: list[str]) -> None:
    """A text is counted as the sum of its chunks between ASCII spaces, tabs and line
    breaks (each chunk's count remembered): the same count as the whole text tokenized,
    whatever the text (control characters, which BERT drops and so joins their
    neighbours; other whitespace; CJK; added tokens; words past 100 characters)."""
    counter = _shared_counter()
    assert counter._chunked
    assert counter.count_many(texts) == [counter.count(text) for text in texts]
    # Again, now from the remembered chunks, in another order.
    assert counter.count_many(texts[::-1]) == [counter.count(text) for text in texts[::-1]]


@pytest.mark.model
def test_remembered_chunks_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    import prme.query.tokens as tokens

    monkeypatch.setattr(tokens, "CACHED_CHUNKS", 10)
    counter = TokenCounter(_model_tokenizer(), cached=0)
    texts = [f"word{i} and word{i + 1}, again" for i in range(30)]
    assert counter.count_many(texts) == [counter.count(text) for text in texts]
    assert len(counter._chunk_counts) <= 10
    for text in texts:
        assert counter.count_many([text]) == [counter.count(text)]
        assert len(counter._chunk_counts) <= 10
    assert all(isinstance(key, int) for key in counter._chunk_counts)  # no text kept


def test_a_tokenizer_whose_tokens_may_span_spaces_counts_whole_texts(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "▁a": 1, "▁b": 2, "▁a▁b": 3}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    counter = TokenCounter(path, cached=0)
    assert not counter._chunked
    assert counter.count_many(["a b"]) == [counter.count("a b")] == [1]


@pytest.mark.model
def test_chunks_whose_strings_share_their_bytes_are_counted_apart() -> None:
    """Found by a review: ``hash(str)`` hashes a string's internal bytes, so "have" (one byte
    a character) and "慨敶" (U+6168 U+6576, two) share a hash in every process, and keyed by
    it one took the other's count (2 tokens for "have")."""
    assert hash("have") == hash("\u6168\u6576")
    counter = TokenCounter(_model_tokenizer(), cached=0)
    assert counter.count_many(["see \u6168\u6576"]) == [counter.count("see \u6168\u6576")]
    assert counter.count_many(["I have it", "have"]) == [3, 1]
    assert counter.count_many(["have"]) == [counter.count("have")] == [1]
