"""The wheel carries every module of the source tree, each imports from the wheel, and the
wheel installs under its own distribution name (``prme-memory``: ``prme`` on the package
index is another project) with its extras."""

from __future__ import annotations

import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {
    "prme": ROOT / "prme",
    "prme.schemas": ROOT / "schemas",
    "prme.producers": ROOT / "producers",
    "prme.projectors": ROOT / "projectors",
    "prme.query": ROOT / "query",
    "prme.adapters": ROOT / "adapters",
}

IMPORT_ALL = """
import importlib, sys
root = sys.argv[1]
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__name__.lower()
                    and "editable" not in getattr(f, "__name__", "").lower()]
sys.path.insert(0, root)
for name in sys.argv[2:]:
    module = importlib.import_module(name)
    assert module.__file__.startswith(root), (name, module.__file__)
print("imported", len(sys.argv) - 2)
"""


def source_modules() -> set[str]:
    modules: set[str] = set()
    for package, directory in PACKAGE_DIRS.items():
        for path in directory.rglob("*.py"):
            relative = path.relative_to(directory).with_suffix("")
            parts = [p for p in relative.parts if p != "__init__"]
            modules.add(".".join([package, *parts]))
    return modules


DISTRIBUTION = "prme-memory"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(dist),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (built,) = dist.glob("*.whl")
    return built


def test_the_wheel_is_named_prme_memory(wheel: Path) -> None:
    assert wheel.name.startswith("prme_memory-")
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(metadata).decode().splitlines()
    assert f"Name: {DISTRIBUTION}" in lines
    assert 'Requires-Dist: langchain-core<2,>=0.3; extra == "langchain"' in lines


INSTALLED = """
import importlib.metadata, sys
import prme
from prme.integrations.langchain import PRMERetriever
assert prme.__file__.startswith(sys.prefix), prme.__file__
print(importlib.metadata.version("prme-memory"), prme.__version__)
"""


def test_pip_installs_the_wheel_with_the_langchain_extra(wheel: Path, tmp_path: Path) -> None:
    """Offline and fast: a fresh virtualenv that sees this environment's site-packages as
    plain paths (so its dependencies count as installed, but this checkout's editable
    install does not), where pip must resolve ``<wheel>[langchain]`` from what is there."""
    target = tmp_path / "venv"
    venv.create(target, with_pip=False)
    python = target / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(purelib, "outer.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
    install = subprocess.run(
        [*pip, "install", "--no-index", "--no-build-isolation", f"{wheel}[langchain]"],
        capture_output=True,
        text=True,
    )
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-2000:]
    result = subprocess.run(
        [str(python), "-c", INSTALLED], capture_output=True, text=True, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["0.1.0", "0.1.0"]
    entry = target / "bin" / "prme"
    assert entry.exists()
    version = subprocess.run([str(entry), "--version"], capture_output=True, text=True)
    assert version.stdout.strip() == "prme 0.1.0 (prme-memory)"


def test_the_wheel_holds_and_imports_every_module(wheel: Path, tmp_path: Path) -> None:
    unpacked = tmp_path / "unpacked"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(unpacked)
        names = archive.namelist()
        entry_points = next(n for n in names if n.endswith("entry_points.txt"))
        assert "prme = prme.cli:main" in archive.read(entry_points).decode()
    in_wheel = {
        name[:-3].replace("/", ".").removesuffix(".__init__")
        for name in names
        if name.endswith(".py")
    }
    expected = source_modules()
    assert expected - in_wheel == set()
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL, str(unpacked), *sorted(expected)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"imported {len(expected)}" in result.stdout
