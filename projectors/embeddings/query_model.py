"""The default model's query encoder: an int8 copy of its ONNX graph, made on this machine.

The default model stores its weights as int8 but computes in float: onnxruntime folds the
weights back into float matrices, and a 15-token query spends most of its ~6 ms in float
MatMuls. This copy is quantized dynamically (weights int8 per output channel, activations
quantized per call, ``MatMulInteger``), which encodes the same query in ~2.5-4 ms on cores
with int8 dot products. Its vectors are close to the document session's, not equal: cosine
0.991 or more on LoCoMo's questions (median 0.995; 0.974 and up on one- to three-token
texts), and LoCoMo's default recall within a question of the exact encoder's
(benchmarks/README.md). Documents are always encoded by the exact model, so stored vectors
and the embedding identity do not depend on it.

The copy is made with onnxruntime's own tools (its quantization pre-processing, then
``quantize_dynamic``) from the verified default model, in a child process and a scratch
directory, and installed atomically beside it, with a manifest of what it was made from.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from prme.schemas.config import QueryPrecision

from .model_assets import (
    MODEL_FILE,
    ONNX_SHA256,
    TOKENIZER_FILES,
    ModelAssetError,
    file_digests,
    files_match,
    install_built,
    read_manifest,
    remove_stale_scratch,
    run_child,
    verify_default_model,
    write_manifest,
)

QUERY_MODEL_SUFFIX = "-query"
QUANTIZATION = "dynamic-int8-per-channel"
SCRATCH_PREFIX = ".prme-query-model-"
QUANTIZE_TIMEOUT_S = 600.0

_log = logging.getLogger(__name__)


class QueryModelManifest(msgspec.Struct, frozen=True, kw_only=True):
    """What the query copy was made from and with, and each file's size and sha256."""

    source_onnx_sha256: str
    quantization: str
    tools: dict[str, str]
    files: dict[str, tuple[int, str]]


def int8_dot_products(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this machine's cores have the int8 dot products (VNNI) the copy was measured
    on. Without them onnxruntime's u8s8 kernels may saturate and lose accuracy, and on
    other architectures the copy's vectors were not measured: queries stay exact there."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            return bool({"avx512_vnni", "avx_vnni"} & set(line.partition(":")[2].split()))
    return False


def int8_queries(precision: QueryPrecision) -> bool:
    """Whether the default model's queries go to the int8 copy at ``precision`` here."""
    return precision == "int8" and int8_dot_products()


def query_model_dir(model_dir: Path) -> Path:
    """Where the query copy of the default model in ``model_dir`` lives: beside it."""
    model_dir = Path(model_dir)
    return model_dir.with_name(model_dir.name + QUERY_MODEL_SUFFIX)


def ensure_query_model(model_dir: Path) -> Path:
    """The query copy of the default model assembled in ``model_dir``; made when missing
    or invalid (a few seconds; idempotent, atomic, fast when already present)."""
    target = query_model_dir(model_dir)
    if verify_query_model(target):
        return target
    if not verify_default_model(model_dir):
        raise ModelAssetError(
            f"{model_dir} does not hold the verified default model: its int8 query copy is "
            "made only from that model (`prme models pull`)"
        )
    remove_stale_scratch(target.parent, SCRATCH_PREFIX)
    _log.info("making the default model's int8 query encoder in %s (once, a few seconds)", target)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=SCRATCH_PREFIX, dir=target.parent) as scratch:
        build = Path(scratch) / target.name
        _quantize_in_child(Path(model_dir), build, Path(scratch))
        install_built(build, target, verify_query_model)
    _log.info("made the int8 query encoder in %.1f s", time.monotonic() - started)
    return target


def _quantize_in_child(model_dir: Path, build: Path, scratch: Path) -> None:
    """``quantize_query_model`` in a child process: onnxruntime's quantizer logs on the
    root logger, writes its pre-processed model (~90 MB) to the temp directory (here
    ``scratch``, so a killed build leaves it where the next build removes it) and peaks
    at ~500 MB of memory, none of which belongs in a serving process."""
    run_child(
        [sys.executable, "-m", __name__, str(model_dir), str(build)],
        "making the int8 query encoder",
        QUANTIZE_TIMEOUT_S,
        env={**os.environ, "TMPDIR": str(scratch)},
    )


def quantize_query_model(model_dir: Path, build: Path) -> None:
    """Write the query copy of ``model_dir``'s model into ``build`` (which must not
    exist); the pre-processed model goes to a temporary directory."""
    try:
        from onnxruntime.quantization import QuantType, quantize_dynamic
        from onnxruntime.quantization.shape_inference import quant_pre_process
    except ImportError as error:  # onnx is a dependency; a broken install says so here
        raise ModelAssetError(
            f"cannot make the int8 query encoder ({error}); reinstall prme-memory, or encode "
            "queries with the exact model (PRME_EMBEDDING__QUERY_PRECISION=float)"
        ) from error
    build.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="prme-preprocessed-") as scratch:
        preprocessed = Path(scratch) / MODEL_FILE
        # Symbolic shape inference needs sympy; the ONNX shape inference and onnxruntime's
        # graph optimisation that remain are what the quantizer's pre-processing asks for.
        quant_pre_process(str(model_dir / MODEL_FILE), str(preprocessed), skip_symbolic_shape=True)
        quantize_dynamic(
            preprocessed, build / MODEL_FILE, weight_type=QuantType.QInt8, per_channel=True
        )
    for name in TOKENIZER_FILES:
        shutil.copyfile(model_dir / name, build / name)
    manifest = QueryModelManifest(
        source_onnx_sha256=ONNX_SHA256,
        quantization=QUANTIZATION,
        tools={name: importlib.metadata.version(name) for name in ("onnx", "onnxruntime")},
        files=file_digests(build),
    )
    write_manifest(build, manifest)


def verify_query_model(query_dir: Path, *, rehash: bool = False) -> bool:
    """Whether ``query_dir`` holds a query copy made from the pinned default model. The
    quick check compares the manifest with each file's size; ``rehash=True`` also
    recomputes every file's sha256."""
    manifest = read_manifest(Path(query_dir), QueryModelManifest)
    if manifest is None:
        return False
    if manifest.source_onnx_sha256 != ONNX_SHA256 or manifest.quantization != QUANTIZATION:
        return False
    if set(manifest.files) != {MODEL_FILE, *TOKENIZER_FILES}:
        return False
    return files_match(Path(query_dir), manifest.files, rehash=rehash)


if __name__ == "__main__":  # the child process of _quantize_in_child
    quantize_query_model(Path(sys.argv[1]), Path(sys.argv[2]))
