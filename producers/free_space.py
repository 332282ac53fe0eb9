"""Stopping writes short of a full disk.

The read models write into memory-mapped files (qdrant-edge's segments and WAL, Tantivy's),
and a page of such a file that the disk has no room for ends the process with SIGBUS
instead of an error. So, with ``limits.min_free_bytes`` as the reserve:
- appends to the embedded log stop while less than the reserve is free (erasures excepted:
  they are small, and a privacy duty), leaving it for the projector to apply what the log
  already holds;
- the projector stops applying while less than half of it is free, and a pack opens only
  with room for a WAL segment per vector shard beyond that half (opening a vector shard may
  start one);
- a rebuild, and a vector store's rewrite, check for room for their copy first.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from prme.schemas.config import Settings
from prme.schemas.errors import InsufficientSpace

_WHY = "the read models write into memory-mapped files, which a full disk turns into a crash"
_SETTING = "PRME_LIMITS__MIN_FREE_BYTES"


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
    """Says why ``directory``'s file system is too full for a step now: with less free than
    ``min_free_bytes`` times ``share`` (``what`` names the step's consequence). It looks
    every time: one ``statvfs``, a few microseconds, and a cached answer let a burst of
    writes run past the floor."""

    def __init__(
        self,
        directory: Path,
        min_free_bytes: int,
        *,
        share: float = 1.0,
        what: str = "free some space",
        free: Callable[[Path], int | None] = free_bytes,
    ) -> None:
        self._directory = directory
        self._min_free_bytes = min_free_bytes
        self._floor = int(min_free_bytes * share)
        self._share = share
        self._what = what
        self._free = free

    def refusal(self) -> str | None:
        if self._min_free_bytes <= 0:
            return None
        free = self._free(self._directory)
        if free is None or free >= self._floor:
            return None
        reserve = f"limits.min_free_bytes ({size_text(self._min_free_bytes)}, {_SETTING})"
        floor = reserve if self._share == 1.0 else f"half of {reserve}"
        return (
            f"the file system of {self._directory} has {size_text(free)} free, less than "
            f"{floor}: {self._what} ({_WHY})"
        )


def append_room(settings: Settings) -> Callable[[], str | None] | None:
    """What refuses an append for want of room (``Producer``'s ``room``): on the embedded
    log only, whose file is in the data directory (on Kafka the log is the brokers')."""
    if settings.log.transport != "local":
        return None
    return FreeSpaceGuard(settings.data_path, settings.limits.min_free_bytes).refusal


def applying_guard(directory: Path, min_free_bytes: int) -> FreeSpaceGuard:
    """What holds the projector of the pack in ``directory``."""
    return FreeSpaceGuard(
        directory, min_free_bytes, share=0.5, what="free some space: read models wait for it"
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
        f"{_SETTING}): free some space first (or set it to 0 to skip this check: {_WHY})"
    )


VECTOR_WAL_SEGMENT_BYTES = 32 * 1024 * 1024
"""A qdrant-edge WAL segment (``wal/open-N``), which opening a vector shard may start and
fill through its memory map: a pack reopened on a disk without room for them crashed."""


def check_room_to_open(directory: Path, vector_shards: int, min_free_bytes: int) -> None:
    """``InsufficientSpace`` unless ``directory``'s file system has room for a WAL segment
    per vector shard beyond half of ``min_free_bytes`` (0: no check)."""
    if min_free_bytes <= 0:
        return
    available = free_bytes(directory)
    needed = vector_shards * VECTOR_WAL_SEGMENT_BYTES + min_free_bytes // 2
    if available is None or available >= needed:
        return
    segments = (
        f", and a {size_text(VECTOR_WAL_SEGMENT_BYTES)} WAL segment for each of its "
        f"{vector_shards} vector shards"
        if vector_shards
        else ""
    )
    raise InsufficientSpace(
        f"the pack does not open: the file system of {directory} has {size_text(available)} "
        f"free, and opening it needs about {size_text(needed)} (half of "
        f"limits.min_free_bytes, {size_text(min_free_bytes)}, {_SETTING}{segments}): free "
        f"some space first, or lower that setting ({_WHY})"
    )
