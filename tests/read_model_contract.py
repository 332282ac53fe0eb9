"""The contract every registered read model passes, whatever it stores.

Subclass ``ReadModelContract`` with ``model_name`` set to the registry name (see
``tests/test_read_models.py``); the model is opened through the registry, as a shard
opens it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from prme.projectors.backends import VectorBackend
from prme.projectors.model import ProjectedRecord, ReadModel
from prme.projectors.registry import ModelContext, open_read_model, read_model
from prme.schemas.config import Settings

from .record_builders import archived, cleared, projected
from .vector_contract import IDENTITY, basis, message, node_of


def batch() -> list[ProjectedRecord]:
    """Messages of two owners with vectors, then a control and a lifecycle record."""
    items = [
        message(0, basis(1, 0), owner="alice"),
        message(1, basis(0, 1), owner="bob"),
        message(2, basis(1, 1), owner="alice", session_id="s2"),
    ]
    controls = [cleared("e0003", owner="bob"), archived("e0004", node_of(items[0]))]
    return [*items, *projected(controls, start=3)]


OpenModel = Callable[..., ReadModel]
"""``open_model(store="a")``: the model in its own directory ``store``."""


class ReadModelContract:
    model_name: str

    @pytest.fixture
    def open_model(self, tmp_path: Path) -> Iterator[OpenModel]:
        opened: list[ReadModel] = []
        vectors = VectorBackend.from_settings(Settings())

        def open_at(store: str = "a") -> ReadModel:
            context = ModelContext(
                directory=tmp_path / store / self.model_name,
                partition=0,
                settings=Settings(),
                identity=IDENTITY,
                vectors=vectors,
            )
            model = open_read_model(read_model(self.model_name), context)
            opened.append(model)
            return model

        yield open_at
        for model in opened:
            model.close()

    def test_is_the_model_the_registry_names(self, open_model: OpenModel) -> None:
        model = open_model()
        spec = read_model(self.model_name)
        assert model.name == spec.name == self.model_name
        for surface in spec.surfaces:
            assert callable(getattr(model, surface, None)), surface

    def test_a_fresh_model_has_applied_nothing(self, open_model: OpenModel) -> None:
        assert open_model().applied_offset() == -1

    def test_the_applied_offset_and_content_survive_a_reopen(self, open_model: OpenModel) -> None:
        model = open_model()
        empty = model.digest()
        model.apply(batch())
        assert model.applied_offset() == 4
        digest = model.digest()
        assert digest != empty
        model.close()
        reopened = open_model()
        assert reopened.applied_offset() == 4
        assert reopened.digest() == digest

    def test_the_digest_is_of_content_not_of_files_or_batching(self, open_model: OpenModel) -> None:
        whole, split = open_model("whole"), open_model("split")
        whole.apply(batch())
        split.apply(batch()[:2])
        split.apply(batch()[2:])
        assert whole.digest() == split.digest()
