"""The read models a shard holds, declared once: the runner, the shard, rebuild and the
digests iterate this registry.

Each entry names the model, says how it opens, which record kinds change it, and which
query surfaces (methods the query layer calls on it) it offers. Adding a read model is
one module under ``stores/``, one line in ``READ_MODELS`` and a subclass of the read
model contract suite (``tests/read_model_contract.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from prme.schemas.config import Settings
from prme.schemas.errors import ConfigurationError
from prme.schemas.records import CONTROL_KINDS, KINDS, LIFECYCLE_KINDS

from .backends import VectorBackend
from .embeddings.protocol import EmbeddingIdentity
from .model import ModelName, ReadModel
from .stores.events import EventsModel
from .stores.graph import GraphModel
from .stores.history import HistoryModel
from .stores.lexical import LexicalModel
from .stores.sqlite_base import stored_offset_of


@dataclass(frozen=True)
class ModelContext:
    """What opening one read model of one shard may use."""

    directory: Path
    """The model's own directory (``<shard>/<name>``), created before ``open`` runs."""
    partition: int
    settings: Settings
    identity: EmbeddingIdentity
    vectors: VectorBackend


@dataclass(frozen=True)
class ReadModelSpec:
    name: ModelName
    open: Callable[[ModelContext], ReadModel]
    kinds: frozenset[str]
    """The record kinds that change this model (it still tracks every offset)."""
    surfaces: tuple[str, ...]
    """The methods the query layer calls on this model."""


SQLITE_FILES: dict[ModelName, str] = {
    "graph": "graph.sqlite3",
    "history": "history.sqlite3",
    "events": "events.sqlite3",
}
"""The models kept in one SQLite file each (``<shard>/<name>/<file>``)."""

_LIFECYCLE = LIFECYCLE_KINDS | {"owner_erased"}
_HISTORY = CONTROL_KINDS | {"message"}

READ_MODELS: dict[ModelName, ReadModelSpec] = {
    spec.name: spec
    for spec in (
        ReadModelSpec(
            "vector",
            lambda c: c.vectors.open(c.directory, c.partition, c.identity),
            frozenset({"message"}) | _LIFECYCLE,
            ("search", "scores_for"),
        ),
        ReadModelSpec(
            "lexical",
            lambda c: LexicalModel(c.directory, c.settings.lexical),
            _HISTORY | _LIFECYCLE,
            ("search", "speakers"),
        ),
        ReadModelSpec(
            "graph",
            lambda c: GraphModel(c.directory / SQLITE_FILES["graph"]),
            frozenset({"message"}) | _LIFECYCLE,
            ("search", "get_nodes", "node_state"),
        ),
        ReadModelSpec(
            "history",
            lambda c: HistoryModel(c.directory / SQLITE_FILES["history"]),
            _HISTORY | {"owner_erased"},
            ("messages",),
        ),
        ReadModelSpec(
            "events",
            lambda c: EventsModel(c.directory / SQLITE_FILES["events"], c.partition),
            KINDS,
            ("get",),
        ),
    )
}

MODEL_NAMES: tuple[ModelName, ...] = tuple(READ_MODELS)


def stored_offset(shard_directory: Path) -> int:
    """The offset a shard on disk has applied, as its SQLite models' tracking rows say (the
    smallest), without opening it: a cheap estimate, since the vector and lexical models
    commit the same batches beside them (``-1``: no such file)."""
    return min(
        stored_offset_of(shard_directory / name / file, name) for name, file in SQLITE_FILES.items()
    )


def read_model(name: str) -> ReadModelSpec:
    """The registry entry of ``name`` (ConfigurationError naming the known ones)."""
    try:
        return READ_MODELS[name]
    except KeyError:
        known = ", ".join(READ_MODELS)
        raise ConfigurationError(f"unknown read model {name!r} (known: {known})") from None


def read_models(names: Iterable[str]) -> tuple[ReadModelSpec, ...]:
    """The entries of ``names``, all checked before any is used."""
    return tuple(read_model(name) for name in names)


def open_read_model(spec: ReadModelSpec, context: ModelContext) -> ReadModel:
    context.directory.mkdir(parents=True, exist_ok=True)
    return spec.open(context)
