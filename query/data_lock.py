"""One data directory, one process: an exclusive lock on ``<data dir>/prme.lock``.

The read-model engines hold file locks of their own, but they fail deep inside (a
qdrant-edge ``WouldBlock``) and only once a shard opens; this lock fails at once, with the
holder's pid. The processes a ``prme serve --processes N`` or ``prme project --workers N``
starts share their parent's directory (each projects other partitions), so a process may
open a directory whose lock its parent holds.
"""

from __future__ import annotations

import fcntl
import os
import sys
from pathlib import Path
from typing import Self

from prme.schemas.errors import DataDirInUse

LOCK_FILE = "prme.lock"


class DataDirLock:
    """Held from :meth:`acquire` until :meth:`release` (or the process exits)."""

    def __init__(self, path: Path, fd: int | None) -> None:
        self.path = path
        self._fd = fd

    @classmethod
    def acquire(cls, directory: Path) -> Self:
        path = directory / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            if holder is not None and holder[0] == os.getppid():
                return cls(path, None)  # our parent's: it split the partitions among us
            who = f"pid {holder[0]} ({holder[1]})" if holder else "another process"
            raise DataDirInUse(
                f"{directory} is open in another process, {who}: a data directory is opened "
                "by one process at a time (give this one its own --data-dir, or reach that "
                "one over HTTP)"
            ) from None
        os.ftruncate(fd, 0)
        os.write(
            fd, f"{os.getpid()} {' '.join(os.path.basename(a) for a in sys.argv[:2])}\n".encode()
        )
        return cls(path, fd)

    @property
    def held(self) -> bool:
        """False when this process runs under its parent's lock."""
        return self._fd is not None

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing drops the flock


def _holder(fd: int) -> tuple[int, str] | None:
    try:
        text = os.pread(fd, 256, 0).decode(errors="replace").strip()
        pid, _, command = text.partition(" ")
        return int(pid), command or "?"
    except (OSError, ValueError):
        return None
