"""An index built before accent folding and per-character words keeps its tokenizer (so its
queries match its terms) until ``prme rebuild --model lexical`` builds it again."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import tantivy

from prme import MemoryEngine
from prme.projectors.stores import lexical
from prme.projectors.stores.lexical import LexicalModel
from prme.schemas.config import Settings

from .record_builders import RecordLog


def legacy_schema() -> tantivy.Schema:
    """The lexical schema as builds before 2026-12-07 wrote it (``en_stem`` search fields)."""
    builder = tantivy.SchemaBuilder()
    for name in ("node_id", "owner", "scope", "session_id", "state"):
        builder.add_text_field(name, stored=True, tokenizer_name="raw", index_option="basic")
    builder.add_text_field("text", stored=True, tokenizer_name="en_stem", index_option="position")
    builder.add_text_field("context", stored=True, tokenizer_name="en_stem", index_option="freq")
    builder.add_text_field("speaker", stored=True, tokenizer_name="en_stem", index_option="freq")
    builder.add_integer_field("offset", stored=True, indexed=True)
    builder.add_integer_field("node_id_high", fast=True)
    builder.add_integer_field("node_id_low", fast=True)
    return builder.build()


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

    with caplog.at_level(logging.INFO, "prme.projectors.stores.lexical"):
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
    local_settings: Settings, hashed_provider: Any, monkeypatch: pytest.MonkeyPatch
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
        await engine.rebuild(models=["lexical"])
        after = await engine.retrieve("cafe", "alice")
        assert after.results[0].text == "We had lunch at the Café Landtmann in Wien."
        assert after.receipt.results[0].ranks["lexical"] == 1
    finally:
        await engine.close()
