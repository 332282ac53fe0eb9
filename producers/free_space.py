"""Refusing writes while the data directory's file system is nearly full.

The read models write into memory-mapped files (qdrant-edge's segments, Tantivy's), and a
page of such a file that the disk has no room for ends the process with SIGBUS instead of
an error. So appends stop while less than ``limits.min_free_bytes`` is free, leaving that
much for the projector to apply what the log already holds; a rebuild, which writes a
second copy of the models it rebuilds, checks for room before it starts.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from prme.schemas.errors import InsufficientSpace

FREE_SPACE_CHECK_S = 1.0
"""How long one look at the free space is trusted (appends may come thousands a second)."""


def free_bytes(directory: Path) -> int | None:
    """Free bytes for an unprivileged writer on ``directory``'s file system (its nearest
    existing ancestor's); None when it cannot be told."""
    path = directory
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def size_text(count: int) -> str:
    """``count`` bytes for a person: 1.5 GiB, 300.0 MiB, 12 KiB."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit in ("B", "KiB") else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


class FreeSpaceGuard:
    """Says why nothing may be appended to a pack in ``directory`` now (see the module's
    docstring), looking at the file system at most once a :data:`FREE_SPACE_CHECK_S`."""

    def __init__(
        self,
        directory: Path,
        min_free_bytes: int,
        *,
        free: Callable[[Path], int | None] = free_bytes,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._directory = directory
        self._min_free_bytes = min_free_bytes
        self._free = free
        self._clock = clock
        self._checked_at: float | None = None
        self._reason: str | None = None

    def refusal(self) -> str | None:
        if self._min_free_bytes <= 0:
            return None
        now = self._clock()
        if self._checked_at is None or now - self._checked_at >= FREE_SPACE_CHECK_S:
            self._checked_at = now
            self._reason = self._look()
        return self._reason

    def _look(self) -> str | None:
        free = self._free(self._directory)
        if free is None or free >= self._min_free_bytes:
            return None
        return (
            f"the file system of {self._directory} has {size_text(free)} free, less than "
            f"limits.min_free_bytes ({size_text(self._min_free_bytes)}, "
            "PRME_LIMITS__MIN_FREE_BYTES): free some space (the read models write into "
            "memory-mapped files, which a full disk turns into a crash)"
        )


def allocated_bytes(directories: Iterable[Path]) -> int:
    """The disk space the files under ``directories`` take (allocated blocks: the engines'
    sparse files count for what they hold, not their length)."""
    total = 0
    for directory in directories:
        for folder, _, names in os.walk(directory):
            for name in names:
                try:
                    total += os.lstat(os.path.join(folder, name)).st_blocks * 512
                except OSError:  # removed meanwhile
                    continue
    return total


def check_room(
    directory: Path,
    needed: int,
    what: str,
    min_free_bytes: int,
    *,
    free: Callable[[Path], int | None] = free_bytes,
) -> None:
    """``InsufficientSpace`` unless ``directory``'s file system has ``needed`` bytes free
    beyond ``min_free_bytes`` (which 0 turns off, with the check)."""
    if min_free_bytes <= 0:
        return
    available = free(directory)
    if available is None or available >= needed + min_free_bytes:
        return
    raise InsufficientSpace(
        f"the file system of {directory} has {size_text(available)} free; {what} needs about "
        f"{size_text(needed)} more, plus limits.min_free_bytes ({size_text(min_free_bytes)}, "
        "PRME_LIMITS__MIN_FREE_BYTES): free some space first (or set it to 0 to skip this "
        "check, at the risk of a crash when the disk fills)"
    )


def first_refusal(*checks: Callable[[], str | None] | None) -> Callable[[], str | None]:
    """One refusal of several: the first that refuses."""
    present = [check for check in checks if check is not None]

    def refusal() -> str | None:
        for check in present:
            reason = check()
            if reason is not None:
                return reason
        return None

    return refusal
