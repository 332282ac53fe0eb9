"""The lexical contract on the Tantivy index with its SQLite window sidecar, plus what is
specific to them."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from prme.projectors.stores.lexical import LexicalModel
from prme.schemas.config import LexicalSettings

from .lexical_contract import LexicalIndexContract, MakeIndex, full_log


class TestTantivyLexicalIndex(LexicalIndexContract):
    @pytest.fixture
    def make_index(self, tmp_path: Path) -> Iterator[MakeIndex]:
        opened: list[LexicalModel] = []

        def make(store: str = "a", settings: LexicalSettings | None = None) -> LexicalModel:
            model = LexicalModel(tmp_path / store, settings or LexicalSettings())
            opened.append(model)
            return model

        yield make
        for model in opened:
            model.close()


def test_replay_after_a_crash_between_sidecar_and_index_commits_repairs_the_index(
    tmp_path: Path,
) -> None:
    log = full_log()
    split = 37
    with LexicalModel(tmp_path / "live") as live:
        live.apply(log.records[:split])
    shutil.copytree(tmp_path / "live", tmp_path / "crashed")
    with LexicalModel(tmp_path / "live") as live:
        live.apply(log.records[split:])
        expected = live.digest()
    # The sidecar committed the second batch; the index did not.
    shutil.copy(tmp_path / "live" / "windows.sqlite3", tmp_path / "crashed" / "windows.sqlite3")

    with LexicalModel(tmp_path / "crashed") as crashed:
        assert crashed.applied_offset() == split - 1
        for start in range(split, len(log.records), 4):
            crashed.apply(log.records[start : start + 4])
        assert crashed.digest() == expected


def test_a_second_writer_on_the_same_index_is_refused(tmp_path: Path) -> None:
    with LexicalModel(tmp_path / "lexical"), pytest.raises(ValueError, match="LockBusy"):
        LexicalModel(tmp_path / "lexical")
