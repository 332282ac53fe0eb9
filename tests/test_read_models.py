"""Every registered read model passes the read-model contract; an unknown name is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from prme import MemoryEngine
from prme.projectors.registry import MODEL_NAMES, READ_MODELS, read_model
from prme.projectors.shard import Shard
from prme.schemas.config import Settings
from prme.schemas.errors import ConfigurationError
from prme.schemas.records import KINDS

from .read_model_contract import ReadModelContract
from .vector_contract import IDENTITY


class TestVectorReadModel(ReadModelContract):
    model_name = "vector"


class TestLexicalReadModel(ReadModelContract):
    model_name = "lexical"


class TestGraphReadModel(ReadModelContract):
    model_name = "graph"


class TestHistoryReadModel(ReadModelContract):
    model_name = "history"


class TestEventsReadModel(ReadModelContract):
    model_name = "events"


def test_every_registered_model_has_a_contract_subclass() -> None:
    tested = {c.model_name for c in ReadModelContract.__subclasses__()}
    assert tested == set(READ_MODELS) == set(MODEL_NAMES)


def test_every_record_kind_changes_some_read_model() -> None:
    assert set().union(*(spec.kinds for spec in READ_MODELS.values())) == KINDS


def test_an_unknown_read_model_is_a_clear_error() -> None:
    with pytest.raises(ConfigurationError, match=r"unknown read model 'vectr' \(known: vector"):
        read_model("vectr")


def test_a_shard_refuses_an_unknown_model_before_opening_anything(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="unknown read model 'summary'"):
        Shard(tmp_path / "p0", 0, Settings(), IDENTITY, models=["events", "summary"])
    assert not (tmp_path / "p0").exists()


async def test_rebuild_of_an_unknown_model_replays_nothing(
    local_settings: Settings, hashed_provider: Any
) -> None:
    async with await MemoryEngine.create(
        settings=local_settings, embedding_provider=hashed_provider
    ) as engine:
        await engine.store("kept as it was", "alice")
        with pytest.raises(ConfigurationError, match="unknown read model 'lexicon'"):
            await engine.rebuild(["lexicon"])
        assert not list(local_settings.data_path.glob("shards/*.rebuild"))
        response = await engine.retrieve("kept", "alice")
        assert [r.text for r in response.results] == ["kept as it was"]


def test_rows_in_runs_an_in_list_longer_than_sqlite_takes_in_chunks() -> None:
    import sqlite3

    from prme.projectors.stores.sqlite_base import IN_CHUNK, rows_in

    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE t (id INTEGER, owner TEXT)")
    db.executemany("INSERT INTO t VALUES (?, ?)", [(i, "a" if i % 2 else "b") for i in range(3000)])
    wanted = list(range(2 * IN_CHUNK + 7))
    rows = rows_in(
        lambda sql, params: db.execute(sql, params).fetchall(),
        "SELECT id FROM t WHERE id IN ({marks}) AND owner = ?",
        wanted,
        "a",
    )
    assert sorted(row[0] for row in rows) == [i for i in wanted if i % 2]
