"""A data directory, or a file in one, that the file system refuses: said in one line that
names the path (a read-only disk, a missing permission, a file where a folder goes), as a
:class:`ConfigurationError`, instead of an ``OSError`` or ``sqlite3`` traceback."""

from __future__ import annotations

import os
from pathlib import Path

from prme.schemas.errors import ConfigurationError

NOT_WRITABLE = (
    "is not writable: PRME writes in its data directory even to read a pack (its lock, "
    "SQLite's write-ahead logs); use a writable one, or a copy of the pack in one"
)


def make_dir(directory: Path) -> None:
    """``directory`` and its parents, created where missing."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise refused(directory, error) from None


def refused(path: Path, error: OSError | Exception) -> ConfigurationError:
    """Why ``path`` cannot be opened or made, naming it (``error``: what the file system,
    or SQLite, said)."""
    blocker = file_in_the_way(path)
    if blocker is not None and blocker != path:
        return ConfigurationError(f"cannot open {path}: {blocker} is a file, not a directory")
    folder = path if path.is_dir() else path.parent
    if folder.is_dir() and not os.access(folder, os.W_OK | os.X_OK):
        return ConfigurationError(f"cannot open {path}: {folder} {NOT_WRITABLE}")
    reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
    return ConfigurationError(f"cannot open {path}: {reason}")


def file_in_the_way(directory: Path) -> Path | None:
    """The file at ``directory`` or above it that keeps it from being a directory."""
    for candidate in (directory, *directory.parents):
        if candidate.exists():
            return None if candidate.is_dir() else candidate
    return None
