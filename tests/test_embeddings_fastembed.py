"""FastEmbedProvider: dimension inference, lazy loading, versioning, sorted-batch encoding,
and the seed's runnable subclass example on the real default model."""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from prme.projectors.embeddings import fastembed_provider, query_model
from prme.projectors.embeddings.cached import CachedEmbeddingProvider
from prme.projectors.embeddings.fastembed_provider import QueryPrecision
from prme.projectors.embeddings.model_assets import (
    DEFAULT_MODEL_DIRNAME,
    MANIFEST_FILE,
    ONNX_SHA256,
    TOKENIZER_FILES,
    ModelAssetError,
)
from prme.projectors.embeddings.protocol import EmbeddingProvider, QueryEmbeddingProvider
from prme.projectors.embeddings.query_model import (
    ensure_query_model,
    int8_dot_products,
    query_model_dir,
    verify_query_model,
)
from prme.projectors.embeddings.validation import validate_vectors
from prme.query.engine import MemoryEngine, default_provider
from prme.schemas.config import Settings
from prme.storage.embedding import DEFAULT_MODEL_NAME, FastEmbedProvider


class BGEWithQueryInstruction(FastEmbedProvider):
    """The seed's example, verbatim apart from the default MiniLM model standing in for BGE."""

    @property
    def model_version(self) -> str:
        return super().model_version + ":bge-query-instruction-v1"

    async def embed_query(self, text: str) -> list[float]:
        instruction = "Represent this sentence for searching relevant passages: "
        return (await self.embed([instruction + text]))[0]


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    x, y = np.asarray(a), np.asarray(b)
    return float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y)))


# --- metadata only: nothing loaded or downloaded -----------------------------------------


def test_registered_model_dimension_is_inferred_without_loading(tmp_path: Path) -> None:
    provider = FastEmbedProvider("BAAI/bge-small-en-v1.5", models_dir=tmp_path)
    assert provider.dimension == 384
    assert FastEmbedProvider("BAAI/bge-base-en-v1.5", models_dir=tmp_path).dimension == 768
    assert "bge-small-en-v1.5" in provider.model_version.lower()
    assert list(tmp_path.iterdir()) == []


def test_default_model_is_neither_assembled_nor_loaded_at_construction(tmp_path: Path) -> None:
    provider = FastEmbedProvider(models_dir=tmp_path)
    assert provider.model_name == DEFAULT_MODEL_NAME
    assert provider.dimension == 384
    assert list(tmp_path.iterdir()) == []


def test_unregistered_model_must_declare_its_dimension(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="declare its dimension"):
        FastEmbedProvider("acme/private-encoder", models_dir=tmp_path)
    declared = FastEmbedProvider("acme/private-encoder", dimension=512, models_dir=tmp_path)
    assert declared.dimension == 512


def test_declared_dimension_must_match_a_registered_model() -> None:
    with pytest.raises(ValueError, match="384-d"):
        FastEmbedProvider(DEFAULT_MODEL_NAME, dimension=768)
    assert FastEmbedProvider(DEFAULT_MODEL_NAME, dimension=384).dimension == 384


@pytest.mark.parametrize(
    "kwargs",
    [
        {"model_name": ""},
        {"dimension": 0},
        {"dimension": True},
        {"batch_size": 0},
        {"threads": 0},
        {"query_threads": -1},
        {"query_threads": True},
        {"query_precision": "fp16"},
        {"threads": "2"},
    ],
)
def test_invalid_construction_arguments_raise(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        FastEmbedProvider(**kwargs)  # type: ignore[arg-type]


def test_default_model_version_names_the_artifact_and_the_recipe() -> None:
    version = FastEmbedProvider().model_version
    assert ONNX_SHA256[:12] in version
    for part in ("int8", "doc=plain", "query=plain", "maxlen=256", "norm=l2"):
        assert part in version
    assert FastEmbedProvider().model_version == version


def test_the_base_provider_is_document_only() -> None:
    provider = FastEmbedProvider()
    assert isinstance(provider, EmbeddingProvider)
    assert not isinstance(provider, QueryEmbeddingProvider)
    assert not CachedEmbeddingProvider(provider).has_query_encoder


async def test_an_unregistered_model_fails_clearly_on_first_embed(tmp_path: Path) -> None:
    provider = FastEmbedProvider("acme/private-encoder", dimension=8, models_dir=tmp_path)
    with pytest.raises(ValueError, match="not registered"):
        await provider.embed(["hello"])


async def test_empty_input_needs_no_model(tmp_path: Path) -> None:
    assert await FastEmbedProvider(models_dir=tmp_path).embed([]) == []
    assert list(tmp_path.iterdir()) == []


# --- the real default model --------------------------------------------------------------


@pytest.fixture(scope="module")
def minilm(default_model_dir: Path) -> FastEmbedProvider:
    return FastEmbedProvider(model_path=default_model_dir)


CHAT = [
    "Caroline: I went to the LGBTQ support group yesterday and it was so powerful.",
    "ok",
    "Melanie: That's wonderful! What did you talk about there, and who else came along?",
    "Caroline: Mostly about transitioning, the people were so welcoming and kind to me.",
    "Melanie: I painted a lake sunrise last year; painting is my way of relaxing after work.",
    "hi!",
    "Caroline: I'm thinking about adopting children and becoming a counselor someday.",
]


@pytest.mark.model
async def test_model_path_to_the_assembled_model_has_the_default_version(
    minilm: FastEmbedProvider,
) -> None:
    assert minilm.model_version == FastEmbedProvider().model_version


@pytest.mark.model
async def test_sorted_batches_give_the_same_vectors_as_one_by_one_in_input_order(
    minilm: FastEmbedProvider, default_model_dir: Path
) -> None:
    small_batches = FastEmbedProvider(model_path=default_model_dir, batch_size=3)
    batched = await small_batches.embed(CHAT)
    alone = [(await minilm.embed([text]))[0] for text in CHAT]
    assert validate_vectors(minilm, len(CHAT), batched)
    for got, expected in zip(batched, alone, strict=True):
        assert cosine(got, expected) > 0.9999
    assert cosine(batched[0], batched[3]) < 0.9999  # distinct texts stay distinct
    assert all(abs(np.linalg.norm(vector) - 1.0) < 1e-4 for vector in batched)


@pytest.mark.model
async def test_encoding_runs_off_the_event_loop_thread(default_model_dir: Path) -> None:
    threads: list[int] = []

    class Recording(FastEmbedProvider):
        def encode_sync(self, texts: Sequence[str]) -> list[list[float]]:
            threads.append(threading.get_ident())
            return super().encode_sync(texts)

    vectors = await Recording(model_path=default_model_dir).embed(["hello there"])
    assert len(vectors[0]) == 384
    assert threads and threads[0] != threading.get_ident()


@pytest.mark.model
async def test_the_array_path_loads_and_encodes_off_the_event_loop_thread(
    default_model_dir: Path,
) -> None:
    """Found in review: ``embed_array`` loaded the model (an ONNX session, ~0.3 s) on the
    event loop before handing the encoding to a thread."""
    provider = FastEmbedProvider(model_path=default_model_dir)
    loads: list[int] = []
    load = provider._loaded

    def recording() -> Any:
        loads.append(threading.get_ident())
        return load()

    provider._loaded = recording  # type: ignore[method-assign]
    matrix = await provider.embed_array(["hello there"])
    assert matrix.shape == (1, 384)
    assert loads and loads[0] != threading.get_ident()


@pytest.mark.model
async def test_default_provider_loads_the_assembled_model_from_models_dir(
    default_model_dir: Path,
) -> None:
    provider = FastEmbedProvider(models_dir=default_model_dir.parent)
    reference = FastEmbedProvider(model_path=default_model_dir)
    [vector] = await provider.embed(["Aurora needs approval before deployment."])
    [expected] = await reference.embed(["Aurora needs approval before deployment."])
    assert cosine(vector, expected) > 0.9999


@pytest.mark.model
async def test_seed_example_subclass_embeds_queries_with_its_instruction(
    default_model_dir: Path,
) -> None:
    base = FastEmbedProvider(model_path=default_model_dir)
    provider = CachedEmbeddingProvider(BGEWithQueryInstruction(model_path=default_model_dir))
    assert provider.has_query_encoder
    assert provider.query_precision == "float"  # its own recipe encodes its queries
    assert provider.model_version == base.model_version + ":bge-query-instruction-v1"
    assert provider.dimension == 384

    memory, unrelated = await provider.embed(
        ["Aurora needs approval before deployment.", "Melanie painted a lake sunrise."]
    )
    query = await provider.embed_query("Aurora deployment policy")
    plain_query = (await base.embed(["Aurora deployment policy"]))[0]
    assert cosine(query, plain_query) < 0.999  # the instruction changes the query vector
    assert cosine(query, memory) > cosine(query, unrelated)
    assert cosine(query, memory) > 0.4
    assert await provider.embed_query("Aurora deployment policy") == query
    assert provider.cache_info().entries == 3


@pytest.mark.model
@pytest.mark.parametrize("precision", ["int8", "float"])
async def test_default_model_queries_encoded_together_equal_those_encoded_alone(
    default_model_dir: Path, precision: QueryPrecision
) -> None:
    questions = [
        "what did Caroline say about the adoption agency",
        "when is the deployment",
        "Melanie's pottery class in July and the lake sunrise painting she made",
        "dog",
    ]
    alone = [
        await FastEmbedProvider(
            model_path=default_model_dir, query_precision=precision
        ).embed_interactive([q])
        for q in questions
    ]
    calls: list[int] = []

    class Counted(FastEmbedProvider):
        async def embed_interactive(self, texts: Sequence[str]) -> list[list[float]]:
            calls.append(len(texts))
            return await super().embed_interactive(texts)

    cached = CachedEmbeddingProvider(
        Counted(model_path=default_model_dir, query_precision=precision)
    )
    together = await asyncio.gather(*(cached.embed_query(q) for q in questions))
    assert calls == [4]  # asked for at once: one batch, on the query session
    for [expected], vector in zip(alone, together, strict=True):
        assert max(abs(a - b) for a, b in zip(expected, vector, strict=True)) < 1e-6


def _session_threads(model: object) -> int:
    session = model.model.model  # type: ignore[attr-defined]  # fastembed's ONNX session
    return int(session.get_session_options().intra_op_num_threads)


@pytest.mark.model
async def test_queries_use_a_one_thread_session_that_gives_the_same_vectors_bit_for_bit(
    default_model_dir: Path,
) -> None:
    loads: list[tuple[int | None, int]] = []

    class Spied(FastEmbedProvider):
        def _load(self, threads: int | None, **options: Any) -> Any:
            loads.append((threads, threading.get_ident()))
            return super()._load(threads, **options)

    provider = Spied(model_path=default_model_dir, threads=2, query_precision="float")
    queries = await provider.embed_interactive(CHAT)
    assert provider._query_model is not None and provider._model is None
    assert [threads for threads, _ in loads] == [1]
    assert loads[0][1] != threading.get_ident()  # loaded on a worker, not the event loop
    documents = await provider.embed(CHAT)
    alone = [(await provider.embed_interactive([text]))[0] for text in CHAT]
    assert queries == documents == alone
    assert [threads for threads, _ in loads] == [1, 2]
    assert _session_threads(provider._query_model) == 1
    assert _session_threads(provider._loaded()) == 2
    loaded = FastEmbedProvider(model_path=default_model_dir, threads=2, query_precision="float")
    await loaded.embed_interactive(CHAT[:1])
    await loaded.embed(CHAT[:1])
    copy = pickle.loads(pickle.dumps(loaded))  # sessions stay behind; a copy loads its own
    assert copy._model is None and copy._query_model is None
    assert await copy.embed_interactive(CHAT[:2]) == documents[:2]


@pytest.mark.model
@pytest.mark.parametrize(("threads", "query_threads"), [(1, 1), (2, None), (None, None)])
async def test_equal_thread_counts_or_none_share_one_session(
    default_model_dir: Path, threads: int | None, query_threads: int | None
) -> None:
    provider = FastEmbedProvider(
        model_path=default_model_dir,
        threads=threads,
        query_threads=query_threads,
        query_precision="float",
    )
    await provider.embed_interactive(["hello"])
    assert provider._model is not None and provider._query_model is None
    assert provider._loaded_for_queries() is provider._loaded()


def _session_path(model: object) -> Path:
    return Path(model.model.model._model_path)  # type: ignore[attr-defined]


@pytest.mark.model
async def test_default_model_queries_run_on_its_int8_copy_close_to_the_exact_vectors(
    default_model_dir: Path,
) -> None:
    provider = FastEmbedProvider(model_path=default_model_dir)
    queries = await provider.embed_interactive(CHAT)
    documents = await provider.embed(CHAT)
    assert _session_path(provider._model).parent == default_model_dir
    if not int8_dot_products():  # the copy was measured on VNNI cores only: exact elsewhere
        assert provider.query_precision == "float" and queries == documents
        return
    assert provider.query_precision == "int8"
    assert _session_path(provider._query_model).parent == query_model_dir(default_model_dir)
    assert verify_query_model(query_model_dir(default_model_dir), rehash=True)
    for query, document in zip(queries, documents, strict=True):
        assert query != document
        assert cosine(query, document) > 0.97  # 0.974 for "no" and "lol"; ~0.995 questions
    # Not batched: each text's vector is the same whatever is encoded beside it.
    assert [(await provider.embed_interactive([text]))[0] for text in CHAT] == queries
    exact = FastEmbedProvider(model_path=default_model_dir, query_precision="float")
    assert await exact.embed_interactive(CHAT) == documents
    # The precision is the queries' alone: the stored vectors' identity is the same.
    assert provider.model_version == exact.model_version


@pytest.mark.model
def test_the_query_copy_is_made_beside_the_model_verified_and_made_again_when_damaged(
    default_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model_dir = tmp_path / DEFAULT_MODEL_DIRNAME
    shutil.copytree(default_model_dir, model_dir)
    provider = FastEmbedProvider(model_path=model_dir)
    provider.prepare()  # a projector's start: no copy
    query_dir = query_model_dir(model_dir)
    assert not query_dir.exists()
    killed = tmp_path / ".prme-query-model-killed"  # a build killed an hour ago
    (killed / "pre.quant.x").mkdir(parents=True)
    os.utime(killed, (time.time() - 7200, time.time() - 7200))
    running = tmp_path / ".prme-query-model-running"  # another process's, at work now
    running.mkdir()
    temp_before = set(Path(tempfile.gettempdir()).glob("pre.quant.*"))
    with caplog.at_level(logging.DEBUG):
        ensure_query_model(model_dir)  # what a serving node's start does where queries use it
    messages = [record.getMessage() for record in caplog.records]
    assert any("making the default model's int8 query encoder" in m for m in messages)
    assert any("made the int8 query encoder in" in m for m in messages)
    # onnxruntime's quantizer ran in a child: none of its root-logger lines, no temp files.
    assert not [r for r in caplog.records if r.name == "root"]
    assert set(Path(tempfile.gettempdir()).glob("pre.quant.*")) == temp_before
    assert not killed.exists() and running.exists()
    running.rmdir()
    assert query_dir == tmp_path / f"{DEFAULT_MODEL_DIRNAME}-query"
    assert {path.name for path in query_dir.iterdir()} == {
        "model.onnx",
        MANIFEST_FILE,
        *TOKENIZER_FILES,
    }
    assert verify_query_model(query_dir, rehash=True)
    made = (query_dir / "model.onnx").stat().st_mtime_ns
    assert ensure_query_model(model_dir) == query_dir
    assert (query_dir / "model.onnx").stat().st_mtime_ns == made
    with open(query_dir / "model.onnx", "r+b") as handle:
        handle.truncate(1000)
    assert not verify_query_model(query_dir)
    assert ensure_query_model(model_dir) == query_dir
    assert verify_query_model(query_dir, rehash=True)
    assert [path.name for path in tmp_path.iterdir() if path.name.startswith(".")] == []


@pytest.mark.model
async def test_a_copy_that_cannot_be_made_leaves_queries_exact_with_one_warning(
    default_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def unwritable(model_dir: Path) -> Path:
        raise OSError(30, "Read-only file system", str(model_dir.parent))

    monkeypatch.setattr(fastembed_provider, "ensure_query_model", unwritable)
    monkeypatch.setattr(query_model, "int8_dot_products", lambda: True)
    provider = FastEmbedProvider(model_path=default_model_dir)
    assert provider.query_precision == "int8"
    with caplog.at_level(logging.WARNING, logger=fastembed_provider.__name__):
        provider.prepare_queries()  # a serving node's start: no failure
        queries = await provider.embed_interactive(CHAT[:3])
        assert await provider.embed_interactive(CHAT[3:]) == await provider.embed(CHAT[3:])
    assert queries == await provider.embed(CHAT[:3])
    assert provider.query_precision == "float"
    [warning] = [r for r in caplog.records if "int8 query encoder" in r.getMessage()]
    assert "Read-only file system" in warning.getMessage()
    assert "PRME_EMBEDDING__QUERY_PRECISION=float" in warning.getMessage()


@pytest.mark.model
async def test_documents_are_embedded_while_the_query_copy_is_being_made(
    default_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy takes seconds at an engine's start; the projector's first embed, which
    loads the document session, does not wait for it."""
    building = threading.Event()
    finish = threading.Event()

    def slow_copy(model_dir: Path) -> Path:
        building.set()
        finish.wait(30)
        return query_model_dir(default_model_dir)

    monkeypatch.setattr(query_model, "int8_dot_products", lambda: True)
    monkeypatch.setattr(fastembed_provider, "ensure_query_model", slow_copy)
    provider = FastEmbedProvider(model_path=default_model_dir)
    preparing = asyncio.create_task(asyncio.to_thread(provider.prepare_queries))
    try:
        assert await asyncio.to_thread(building.wait, 30)
        [vector] = await asyncio.wait_for(provider.embed(["the back door"]), 20)
        assert len(vector) == 384 and not preparing.done()
    finally:
        finish.set()
        await preparing


@pytest.mark.model
def test_a_damaged_model_fails_no_start_for_its_query_copy(
    default_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Garbage of the right size passes the quick check; the quantizer cannot parse it. A
    serving node still starts (its first embed fails, as it did before the copy existed)."""
    monkeypatch.setattr(query_model, "int8_dot_products", lambda: True)
    model_dir = tmp_path / DEFAULT_MODEL_DIRNAME
    shutil.copytree(default_model_dir, model_dir)
    onnx = model_dir / "model.onnx"
    onnx.write_bytes(b"\0" * onnx.stat().st_size)
    provider = FastEmbedProvider(model_path=model_dir)
    with caplog.at_level(logging.WARNING, logger=fastembed_provider.__name__):
        provider.prepare_queries()
    assert provider.query_precision == "float"
    assert any("int8 query encoder" in r.getMessage() for r in caplog.records)
    assert not query_model_dir(model_dir).exists()
    assert [p.name for p in tmp_path.iterdir()] == [DEFAULT_MODEL_DIRNAME]  # no scratch left


@pytest.mark.model
async def test_cores_without_int8_dot_products_encode_queries_exactly_and_make_no_copy(
    default_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(query_model, "int8_dot_products", lambda: False)
    model_dir = tmp_path / DEFAULT_MODEL_DIRNAME
    shutil.copytree(default_model_dir, model_dir)
    provider = FastEmbedProvider(model_path=model_dir)
    assert provider.query_precision == "float"
    provider.prepare_queries()
    assert await provider.embed_interactive(CHAT[:2]) == await provider.embed(CHAT[:2])
    assert not query_model_dir(model_dir).exists()


def test_int8_dot_products_are_read_from_the_cpu_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    monkeypatch.setattr(query_model.platform, "machine", lambda: "x86_64")
    for flags, expected in (
        ("fpu avx2 avx512f avx512_vnni", True),
        ("fpu avx2 avx_vnni", True),
        ("fpu avx2 avx512f", False),
    ):
        cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        assert query_model.int8_dot_products(cpuinfo) is expected
    assert not query_model.int8_dot_products(tmp_path / "missing")
    monkeypatch.setattr(query_model.platform, "machine", lambda: "arm64")
    cpuinfo.write_text("flags\t\t: avx512_vnni\n")
    assert not query_model.int8_dot_products(cpuinfo)  # never measured there


def test_the_query_precision_reaches_the_default_provider_and_survives_pickling(
    tmp_path: Path,
) -> None:
    base = Settings(models_dir=str(tmp_path))
    for precision in ("float", "int8"):
        settings = base.replace(embedding={"query_precision": precision})
        provider = default_provider(settings)._provider  # type: ignore[attr-defined]
        expected = "int8" if precision == "int8" and int8_dot_products() else "float"
        assert provider.query_precision == expected
        assert pickle.loads(pickle.dumps(provider)).query_precision == expected
    assert list(tmp_path.iterdir()) == []  # nothing made by construction


@pytest.mark.model
async def test_a_model_directory_that_is_not_the_assembled_default_encodes_queries_exactly(
    default_model_dir: Path, tmp_path: Path
) -> None:
    loose = tmp_path / "loose-copy"
    loose.mkdir()
    for name in ("model.onnx", *TOKENIZER_FILES):  # no manifest: not `prme models pull`'s
        shutil.copyfile(default_model_dir / name, loose / name)
    provider = FastEmbedProvider(model_path=loose)
    assert await provider.embed_interactive(CHAT[:2]) == await provider.embed(CHAT[:2])
    assert not query_model_dir(loose).exists()
    with pytest.raises(ModelAssetError, match="verified default model"):
        ensure_query_model(loose)


@pytest.mark.model
async def test_a_subclass_document_recipe_still_encodes_its_queries(
    default_model_dir: Path,
) -> None:
    class Prefixed(FastEmbedProvider):
        async def embed(self, texts: Sequence[str]) -> list[list[float]]:
            return await super().embed(["passage: " + text for text in texts])

    class PrefixedSync(FastEmbedProvider):
        def encode_sync(self, texts: Sequence[str]) -> list[list[float]]:
            return super().encode_sync(["passage: " + text for text in texts])

    plain = FastEmbedProvider(model_path=default_model_dir)
    [unprefixed] = await plain.embed(["when is the deployment"])
    for provider in (
        Prefixed(model_path=default_model_dir),
        PrefixedSync(model_path=default_model_dir),
    ):
        [expected] = await provider.embed(["when is the deployment"])
        assert expected != unprefixed
        assert await provider.embed_interactive(["when is the deployment"]) == [expected]
        assert (await provider.embed_array(["when is the deployment"])).tolist() == [expected]
        cached = CachedEmbeddingProvider(provider)
        assert await cached.embed_query("when is the deployment") == expected


@pytest.mark.model
async def test_an_engine_makes_the_query_copy_as_it_starts(
    default_model_dir: Path, tmp_path: Path
) -> None:
    models = tmp_path / "models"
    shutil.copytree(default_model_dir, models / DEFAULT_MODEL_DIRNAME)
    settings = Settings(data_dir=str(tmp_path / "pack"), models_dir=str(models))
    async with await MemoryEngine.create(settings=settings) as engine:
        made = query_model_dir(models / DEFAULT_MODEL_DIRNAME).exists()
        await engine.store("The blue door is the back entrance.", "alice")
        response = await engine.retrieve("which door is the back entrance", "alice")
    assert made == int8_dot_products()
    # The receipt says how the query was encoded.
    expected = "int8" if int8_dot_products() else "float"
    assert response.receipt.embedding.query_precision == expected
    assert response.results[0].text == "The blue door is the back entrance."
