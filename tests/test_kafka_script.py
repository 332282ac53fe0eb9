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


def test_cluster_ids_never_start_with_a_dash() -> None:
    """Found in a test run: an id such as "-Xy..." reached the storage tool as ``-t -Xy...``,
    which it reads as a missing value ("expected one argument"): every 3-broker test of
    the run errored, about 1 run in 64."""
    python = Path(__file__).resolve().parents[1] / ".venv" / "bin" / "python"
    script = (
        f'source <(sed -n "/^new_cluster_id()/,/^}}/p" "{SCRIPT}"); '
        f'PYTHON="{python if python.exists() else "python3"}"; '
        'die() { echo "DIED: $*"; exit 1; }; '
        "for i in $(seq 300); do new_cluster_id; done"
    )
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    ids = result.stdout.split()
    assert len(ids) == 300 and len(set(ids)) == 300  # 1 - (63/64)**300: 99 % to catch it
    assert all(len(i) == 22 and not i.startswith("-") for i in ids), [
        i for i in ids if i.startswith("-")
    ]
