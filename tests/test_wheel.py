"""The wheel carries every module of the source tree, and each imports from the wheel."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

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


def test_the_wheel_holds_and_imports_every_module(tmp_path: Path) -> None:
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
            str(tmp_path / "dist"),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("prme-*.whl")
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
