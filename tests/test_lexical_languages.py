"""An index built before accent folding and per-character words keeps its tokenizer (so its
queries match its terms) until ``prme rebuild --model lexical`` builds it again."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import msgspec
import pytest
import tantivy
from hypothesis import given, settings
from hypothesis import strategies as st

from prme import MemoryEngine
from prme.cli import render_status
from prme.producers.partitioner import partition_for_key
from prme.projectors.status import node_status
from prme.projectors.stores import lexical
from prme.projectors.stores.lexical import LexicalModel
from prme.projectors.stores.lexical_terms import search_form
from prme.schemas.config import Settings as PRMESettings
from prme.schemas.errors import InvalidInput

from .lexical_contract import legacy_schema
from .record_builders import RecordLog


def found(model: LexicalModel, query: str) -> list[str]:
    return [hit.node_id for hit in model.search(query, "alice", None, 10)]


def test_a_legacy_index_keeps_its_tokenizer_for_old_and_new_documents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    log = RecordLog()
    cafe = log.message("alice", "Lunch at the Café Landtmann, booked for two")
    with monkeypatch.context() as patched:
        patched.setattr(lexical, "_schema", legacy_schema)
        with LexicalModel(tmp_path / "old") as model:
            model.apply(log.records)
    later = log.message("alice", "Dinner at the café by the river", session="s2")
    kanji = log.message("alice", "我昨天在东京喝了咖啡", session="s3")

    with caplog.at_level(logging.WARNING, "prme.projectors.stores.lexical"):
        model = LexicalModel(tmp_path / "old")
    with model:
        model.apply(log.records)
        assert found(model, "book") == [cafe]  # stems as before
        assert found(model, "cafe") == []
        assert sorted(found(model, "café")) == sorted([cafe, later])
        assert found(model, "咖啡") == []  # the run is one word
        assert found(model, "我昨天在东京喝了咖啡") == [kanji]
    assert "prme rebuild --model lexical" in caplog.text

    with LexicalModel(tmp_path / "new") as rebuilt:
        rebuilt.apply(log.records)
        assert sorted(found(rebuilt, "cafe")) == sorted([cafe, later])
        assert found(rebuilt, "咖啡") == [kanji]
        assert found(rebuilt, "book") == [cafe]


async def test_rebuilding_the_lexical_model_upgrades_a_legacy_index(
    local_settings: PRMESettings, hashed_provider: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    with monkeypatch.context() as patched:
        patched.setattr(lexical, "_schema", legacy_schema)
        engine = await MemoryEngine.create(
            settings=local_settings, embedding_provider=hashed_provider
        )
        try:
            await engine.store("We had lunch at the Café Landtmann in Wien.", "alice")
            await engine.store("The dentist appointment moved to Tuesday.", "alice")
        finally:
            await engine.close()

    engine = await MemoryEngine.open(settings=local_settings, embedding_provider=hashed_provider)
    try:
        before = await engine.retrieve("cafe", "alice")
        assert all("lexical" not in found.ranks for found in before.receipt.results)
        status = msgspec.to_builtins(await node_status(engine.runner))
        # The one partition whose index the earlier build made (the others have no records).
        assert status["lexical_legacy_partitions"] == [partition_for_key(b"alice", 4)]
        assert "prme rebuild --model lexical" in render_status(status)
        await engine.rebuild(models=["lexical"])
        status = msgspec.to_builtins(await node_status(engine.runner))
        assert status["lexical_legacy_partitions"] == []
        assert "earlier terms" not in render_status(status)
        after = await engine.retrieve("cafe", "alice")
        assert after.results[0].text == "We had lunch at the Café Landtmann in Wien."
        assert after.receipt.results[0].ranks["lexical"] == 1
    finally:
        await engine.close()


_MIXED = "ΌόάΐςΣi\u0307Aaé \u0301\u0308\u05b8\u05c1\u064e\u0640ﾞﾟｶ咖啡İёЁ ש"


@settings(max_examples=300, deadline=None)
@given(
    st.text(alphabet=st.characters(codec="utf-8"), max_size=40)
    | st.text(alphabet=st.sampled_from(_MIXED), max_size=12)
)
def test_the_search_form_is_ascii_unchanged_and_stable(text: str) -> None:
    form = search_form(text)
    assert search_form(form) == form
    if text.isascii():
        assert form == text


def test_a_mark_reordered_beside_a_greek_letter_is_left_out_too() -> None:
    """A review found mixed-script text that changed on a second pass, so a purge re-formed
    the stored text: NFD puts a Hebrew point of ``ό`` before its accent, which the first
    pass then does not see beside the letter."""
    text = "\u03cc\u05b8 test"  # ό and a Hebrew qamats
    assert search_form(text) == "\u03bf test"
    assert search_form(search_form(text)) == search_form(text)


async def test_a_lone_surrogate_in_a_query_is_invalid_input(
    local_settings: PRMESettings, hashed_provider: Any
) -> None:
    """Only in-process (JSON refuses one): the lexical channel failed on it with
    ``UnicodeEncodeError`` in the receipt."""
    async with await MemoryEngine.create(
        settings=local_settings, embedding_provider=hashed_provider
    ) as engine:
        with pytest.raises(InvalidInput, match="lone surrogate .* at \\$\\.query"):
            await engine.retrieve("caf\ud800", "alice")


def test_a_query_of_thousands_of_characters_builds_a_bounded_query(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A review found that one run of 5,461 different characters (16 KiB, the default
    ``limits.max_query_bytes``) built 21,843 clauses, ~28x the largest English query."""
    log = RecordLog()
    coffee = log.message("alice", "我昨天在东京喝了咖啡")
    sizes: list[int] = []
    boolean_query = tantivy.Query.boolean_query

    def counting(clauses: list[Any]) -> tantivy.Query:
        sizes.append(len(clauses))
        return boolean_query(clauses)

    query = "咖啡" + "".join(chr(0x4E00 + n) for n in range(5_461))
    with LexicalModel(tmp_path / "lexical") as model:
        model.apply(log.records)
        monkeypatch.setattr(tantivy.Query, "boolean_query", counting)
        assert found(model, query) == [coffee]
    words = lexical.MAX_QUERY_TERMS
    assert max(sizes) <= 3 * words + words


def test_an_index_rewritten_after_an_erasure_keeps_its_search_form(tmp_path: Path) -> None:
    log = RecordLog()
    coffee = log.message("alice", "新しいiPhone手机でカフェを探した")
    log.message("bob", "bob's note")
    log.erase("bob")
    with LexicalModel(tmp_path / "lexical") as model:
        model.apply(log.records)
        model.purge()
        assert found(model, "手机") == [coffee]
        assert found(model, "カフェ") == [coffee]
        assert found(model, "iphone") == [coffee]


@pytest.mark.parametrize(
    ("stored", "query"),
    [("मैं दिल्ली में हिन्दी पढ़ता हूँ", "हिन्दी"), ("ฉันชอบกินข้าว ที่ กรุงเทพ", "กรุงเทพ")],
)
async def test_stopword_stripping_keeps_words_with_vowel_signs_whole(
    local_settings: PRMESettings, hashed_provider: Any, stored: str, query: str
) -> None:
    """Found by a new-user trial: the default ``strip_stopwords`` stage split ``हिन्दी`` at
    its vowel signs (Python's ``\\w`` leaves combining marks out), so the lexical channel
    searched ``ह न द`` and found nothing."""
    async with await MemoryEngine.create(
        settings=local_settings, embedding_provider=hashed_provider
    ) as engine:
        await engine.store(stored, "alice")
        await engine.store("The dentist appointment moved to Tuesday.", "alice")
        response = await engine.retrieve(query, "alice")
    assert response.receipt.analysis["lexical_query"] == query
    assert response.results[0].text == stored
    assert response.receipt.results[0].ranks["lexical"] == 1
