"""deploy/kafka/kafka.sh says plainly when its readiness probe cannot run."""

from __future__ import annotations

import os
import subprocess
import time
import venv
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "deploy" / "kafka" / "kafka.sh"


def test_a_probe_interpreter_without_aiokafka_is_reported_before_anything_starts(
    tmp_path: Path,
) -> None:
    bare = tmp_path / "bare"
    venv.create(bare, with_pip=False)  # an interpreter that surely lacks aiokafka
    data = tmp_path / "kafka-data"
    started = time.monotonic()
    result = subprocess.run(
        ["bash", str(SCRIPT), "start", str(data)],
        env={**os.environ, "PRME_PYTHON": str(bare / "bin" / "python")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "cannot import" in result.stderr and "aiokafka" in result.stderr
    assert "ModuleNotFoundError" in result.stderr
    assert "not ready after" not in result.stderr
    assert not data.exists()  # no broker started, nothing formatted
    assert time.monotonic() - started < 30


def test_without_prme_python_the_probe_uses_the_project_virtualenv(tmp_path: Path) -> None:
    """A copy of the script in a project whose .venv lacks aiokafka names that .venv's
    interpreter (not the system python3) in its error."""
    project = tmp_path / "project"
    (project / "deploy" / "kafka").mkdir(parents=True)
    copy = project / "deploy" / "kafka" / "kafka.sh"
    copy.write_text(SCRIPT.read_text())
    venv.create(project / ".venv", with_pip=False)
    env = {k: v for k, v in os.environ.items() if k != "PRME_PYTHON"}
    result = subprocess.run(
        ["bash", str(copy), "start", str(tmp_path / "data")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert f"{project}/.venv/bin/python cannot import it" in result.stderr
