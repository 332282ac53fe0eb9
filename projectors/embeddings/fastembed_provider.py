"""``FastEmbedProvider``: local ONNX embeddings through fastembed.

The model loads lazily on the first ``embed`` (construction never loads or downloads
weights). Texts are encoded sorted by length, because fastembed pads each batch to its
longest text, and the results are returned in input order.

Queries go through :meth:`FastEmbedProvider.embed_interactive`, on a second session with
``query_threads`` ONNX threads (one by default). A query is a few texts, and onnxruntime's
intra-op pool spins its threads between operators: for one short query two threads cost
about twice the CPU of one for ~15 % less wall time, CPU that a serving process's event
loop and its other queries need. For the default model, on cores with int8 dot products,
that session runs its int8 copy (``query_model``: ~2x faster, cosine ~0.995 to the
documents' vectors for questions) unless ``query_precision`` is ``"float"``; otherwise it
gives the document vectors bit for bit (with ``query_threads=None``, from the documents'
session itself).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, get_args

import fastembed
import numpy as np
from fastembed import TextEmbedding

from prme.schemas.config import QueryPrecision, Settings
from prme.schemas.errors import InvalidEmbedding

from .model_assets import (
    DEFAULT_MODEL_NAME,
    MAX_LENGTH,
    MODEL_FILE,
    ONNX_SHA256,
    ensure_default_model,
    sha256_file,
    verify_default_model,
)
from .query_model import ensure_query_model, int8_queries
from .validation import check_texts, validate_matrix

__all__ = ["DEFAULT_MODEL_NAME", "FastEmbedProvider", "QueryPrecision", "registered_model"]

QUERY_PRECISIONS: tuple[QueryPrecision, ...] = get_args(QueryPrecision)

_log = logging.getLogger(__name__)


def registered_model(model_name: str) -> dict[str, Any] | None:
    """fastembed's metadata for ``model_name`` (no weights are loaded), or ``None``."""
    wanted = model_name.lower()
    for description in TextEmbedding.list_supported_models():
        if str(description["model"]).lower() == wanted:
            return description
    return None


class FastEmbedProvider:
    """Document embeddings from a fastembed ONNX model (same recipe for queries: this
    class has no ``embed_query``; subclass it to add a query recipe)."""

    def __init__(
        self,
        model_name: str = DEFAULT_MODEL_NAME,
        *,
        dimension: int | None = None,
        model_path: Path | None = None,
        models_dir: Path | None = None,
        batch_size: int = 32,
        threads: int | None = None,
        query_threads: int | None = 1,
        query_precision: QueryPrecision = "int8",
    ) -> None:
        """``query_precision``: ``"int8"`` encodes the default model's queries on its
        int8 copy where the cores have int8 dot products (elsewhere, and for other models,
        at the documents' precision); ``"float"`` on the exact model."""
        if not isinstance(model_name, str) or not model_name.strip():
            raise InvalidEmbedding(f"model_name must be a non-empty str, got {model_name!r}")
        if dimension is not None and (
            isinstance(dimension, bool) or not isinstance(dimension, int) or dimension <= 0
        ):
            raise InvalidEmbedding(f"dimension must be a positive int, got {dimension!r}")
        _check_positive("batch_size", batch_size)
        for name, value in (("threads", threads), ("query_threads", query_threads)):
            if value is not None:
                _check_positive(name, value, " or None")
        if query_precision not in QUERY_PRECISIONS:
            raise InvalidEmbedding(
                f"query_precision must be one of {', '.join(QUERY_PRECISIONS)}, "
                f"got {query_precision!r}"
            )
        description = registered_model(model_name)
        if description is None:
            if dimension is None:
                raise InvalidEmbedding(
                    f"model {model_name!r} is not registered with fastembed: declare its "
                    "dimension explicitly (FastEmbedProvider(..., dimension=N))"
                )
        elif dimension is None:
            dimension = int(description["dim"])
        elif dimension != int(description["dim"]):
            raise InvalidEmbedding(
                f"model {model_name!r} produces {description['dim']}-d vectors, "
                f"not the declared {dimension}"
            )
        self._model_name = model_name
        self._dimension = dimension
        self._description = description
        self._model_path = Path(model_path) if model_path is not None else None
        self._models_dir = Path(models_dir) if models_dir is not None else None
        self._batch_size = batch_size
        self._threads = threads
        self._query_threads = query_threads
        self._is_default = model_name.lower() == DEFAULT_MODEL_NAME.lower()
        self._version = self._describe_version()
        self._int8_queries = int8_queries(query_precision) and self._assembled_default()
        self._model: TextEmbedding | None = None
        self._query_model: TextEmbedding | None = None
        self._load_lock = threading.Lock()
        self._copy_lock = threading.Lock()
        """Held while the int8 copy is made: not the load lock, which a first document
        embed needs meanwhile."""

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the loaded model (another process loads its own on first use)."""
        state = dict(self.__dict__)
        state["_model"] = state["_query_model"] = None
        del state["_load_lock"], state["_copy_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(
            {"_query_threads": 1, "_query_model": None, "_int8_queries": False, **state}
        )
        self._load_lock = threading.Lock()
        self._copy_lock = threading.Lock()

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def model_version(self) -> str:
        return self._version

    @property
    def dimension(self) -> int:
        return self._dimension

    @property
    def query_precision(self) -> QueryPrecision:
        """What queries are encoded at: ``"int8"`` on the default model's int8 copy, else
        ``"float"`` (asked for, another model, cores without int8 dot products, a copy that
        could not be made, or a subclass whose own recipe encodes its queries)."""
        return "int8" if self._queries_on_copy() else "float"

    def _queries_on_copy(self) -> bool:
        """Whether queries go to the int8 copy: asked for, available, and not taken by a
        subclass's own query or document recipe."""
        own_recipe = self._recipe_overridden() or callable(getattr(self, "embed_query", None))
        return self._int8_queries and not own_recipe

    @property
    def batch_size(self) -> int:
        return self._batch_size

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """One vector per text, in input order (encoded in a worker thread)."""
        batch = check_texts(texts)
        if not batch:
            return []
        return await asyncio.to_thread(self.encode_sync, batch)

    async def embed_interactive(self, texts: Sequence[str]) -> list[list[float]]:
        """The document recipe's vectors on the query session (``query_threads`` ONNX
        threads), for the few texts a query asks at a time: for the default model, from its
        int8 copy (cosine ~0.995 to :meth:`embed`'s) unless ``query_precision`` is
        ``"float"``; otherwise :meth:`embed`'s, bit for bit. A
        subclass that overrides ``embed`` or ``encode_sync`` (its own document recipe) is
        answered by its ``embed``, so queries never bypass that recipe."""
        if self._recipe_overridden():
            return await self.embed(texts)
        batch = check_texts(texts)
        if not batch:
            return []
        return await asyncio.to_thread(self._encode_queries_sync, batch)

    async def embed_array(self, texts: Sequence[str]) -> np.ndarray:
        """The vectors :meth:`embed` gives, as one float32 array (no Python float per
        component); a subclass with its own document recipe is answered by its ``embed``."""
        batch = check_texts(texts)
        if self._recipe_overridden():
            return validate_matrix(self, len(batch), await self.embed(batch))
        if not batch:
            return np.zeros((0, self._dimension), dtype=np.float32)
        return await asyncio.to_thread(self._encode_array_sync, batch)

    def _recipe_overridden(self) -> bool:
        cls = type(self)
        return (
            cls.embed is not FastEmbedProvider.embed
            or cls.encode_sync is not FastEmbedProvider.encode_sync
            or "embed" in self.__dict__
            or "encode_sync" in self.__dict__
        )

    def encode_sync(self, texts: Sequence[str]) -> list[list[float]]:
        """The blocking encoder behind ``embed``: sort by length, encode in batches of
        ``batch_size``, restore input order."""
        batch = check_texts(texts)
        if not batch:
            return []
        return self._encode(self._loaded(), batch)

    def _encode_array_sync(self, batch: list[str]) -> np.ndarray:
        """On a worker thread, as ``encode_sync``: the first call loads the model."""
        return self._encode_array(self._loaded(), batch)

    def _encode_queries_sync(self, batch: list[str]) -> list[list[float]]:
        """On a worker thread: loading the query session (a first query) may assemble the
        model and takes the load lock, neither of which belongs on the event loop. The int8
        copy encodes one text per call: it quantizes a call's activations with one scale, so
        texts encoded together (and their padding) would move each other's vectors, and a
        query's results would depend on the queries coalesced with it."""
        model = self._loaded_for_queries()
        return self._encode(model, batch, batch_size=1 if self._int8_queries else None)

    def _encode(
        self, model: TextEmbedding, batch: list[str], *, batch_size: int | None = None
    ) -> list[list[float]]:
        vectors: list[list[float]] = self._encode_array(model, batch, batch_size).tolist()
        return vectors

    def _encode_array(
        self, model: TextEmbedding, batch: list[str], batch_size: int | None = None
    ) -> np.ndarray:
        order = sorted(range(len(batch)), key=lambda index: len(batch[index]))
        encoded = model.embed(
            [batch[index] for index in order], batch_size=batch_size or self._batch_size
        )
        stacked = np.stack(list(encoded))
        vectors = np.empty_like(stacked)
        vectors[order] = stacked
        return vectors

    def _loaded(self) -> TextEmbedding:
        with self._load_lock:
            if self._model is None:
                self._model = self._load(self._threads)
            return self._model

    def _loaded_for_queries(self) -> TextEmbedding:
        """The query session, loaded on the first query: the default model's int8 copy
        (``query_precision``); else the document session itself when ``query_threads`` is
        ``None`` or equal to ``threads``; else a second session of the same model."""
        if not self._int8_queries and self._query_threads in (None, self._threads):
            return self._loaded()
        with self._load_lock:
            if self._query_model is None:
                copy = self._query_copy() if self._int8_queries else None
                self._query_model = self._load(self._query_session_threads(), model_dir=copy)
            return self._query_model

    def _query_copy(self) -> Path | None:
        """The int8 copy's directory, made if missing; ``None``, and exact queries from
        then on, when it cannot be made for any reason: a read-only directory, a damaged
        model the quantizer cannot parse (which then fails where the exact model loads, as
        before the copy existed)."""
        try:
            with self._copy_lock:
                return ensure_query_model(self._model_dir())
        except Exception as error:
            self._int8_queries = False
            _log.warning(
                "the default model's int8 query encoder cannot be made (%s): queries are "
                "encoded on the exact model (set PRME_EMBEDDING__QUERY_PRECISION=float to "
                "use it without trying)",
                error,
            )
            return None

    def _query_session_threads(self) -> int | None:
        return self._threads if self._query_threads is None else self._query_threads

    def prepare(self) -> None:
        """Fetch the model's files if they are missing, as the first embed would, without
        loading the model (milliseconds when they are on disk): a node checks this before
        it joins its group, so a model that cannot be had fails the start, not the
        projector of a node that holds partitions. Raises what fastembed raises."""
        self._load(self._threads, lazily=True)

    def prepare_queries(self) -> None:
        """Make the default model's int8 query copy when queries use it and it is missing
        (a few seconds, once per machine): what serves queries calls this as it starts, so
        no query waits for it (a projector alone never does). A copy that cannot be made
        is logged, and queries are encoded on the exact model instead."""
        if self._queries_on_copy():
            copy = self._query_copy()
            if copy is not None:
                _log.info(
                    "queries are encoded on the default model's int8 copy in %s "
                    "(PRME_EMBEDDING__QUERY_PRECISION=float: on the exact model)",
                    copy,
                )

    def _assembled_default(self) -> bool:
        """Whether this provider runs the default model as ``prme models pull`` assembles
        it: the model the int8 query copy is made from (and was measured on)."""
        if not self._is_default:
            return False
        return self._model_path is None or verify_default_model(self._model_path)

    def _model_dir(self) -> Path:
        """``model_path``, or the assembled default model's directory."""
        return self._model_path or ensure_default_model(self._models_dir or Settings().models_path)

    def _load(
        self, threads: int | None, *, lazily: bool = False, model_dir: Path | None = None
    ) -> TextEmbedding:
        """A session with ``threads`` ONNX threads of the model, or of the one in
        ``model_dir`` (the int8 query copy)."""
        if self._description is None:
            raise InvalidEmbedding(
                f"model {self._model_name!r} is not registered with fastembed; register it "
                "with TextEmbedding.add_custom_model before the first embed"
            )
        options: dict[str, Any] = {"threads": threads}
        if model_dir is None and (self._model_path is not None or self._is_default):
            model_dir = self._model_dir()
        if model_dir is not None:
            options["specific_model_path"] = str(model_dir)
        elif self._models_dir is not None:
            options["cache_dir"] = str(self._models_dir)
        return TextEmbedding(self._model_name, lazy_load=lazily, **options)

    def _describe_version(self) -> str:
        recipe = "doc=plain:query=plain"
        default_version = f"onnx-int8:{ONNX_SHA256[:12]}:{recipe}:maxlen={MAX_LENGTH}:norm=l2"
        if self._model_path is None:
            if self._is_default:
                return default_version
            source = ""
            if self._description is not None:
                sources = self._description.get("sources") or {}
                source = str(sources.get("hf") or sources.get("url") or "")
            return f"fastembed-{fastembed.__version__}:{source or self._model_name}:{recipe}"
        model_file = MODEL_FILE
        if self._description is not None:
            model_file = str(self._description.get("model_file") or MODEL_FILE)
        digest = _sha256_file(self._model_path / model_file)
        if self._is_default and digest == ONNX_SHA256:
            return default_version
        return f"onnx:{digest[:12]}:{recipe}:fastembed-{fastembed.__version__}"


def _check_positive(name: str, value: object, alternative: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidEmbedding(f"{name} must be a positive int{alternative}, got {value!r}")


def _sha256_file(path: Path) -> str:
    try:
        return sha256_file(path)
    except OSError as error:
        raise InvalidEmbedding(f"cannot read the model file {path}: {error}") from error
