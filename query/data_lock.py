"""One data directory, one process: an exclusive lock on ``<data dir>/prme.lock``.

The read-model engines hold file locks of their own, but they fail deep inside (a
qdrant-edge ``WouldBlock``) and only once a shard opens; this lock fails at once, with the
holder's pid. The processes a ``prme serve --processes N`` or ``prme project --workers N``
starts share their parent's directory (each projects other partitions): a process may open
a directory whose lock its parent holds when it was started with the lock's token in its
environment (:meth:`DataDirLock.child_environment`), so any other child of the holder (a
script it runs, an adapter's subprocess) is refused like any other process.

Such a member must not outlive the holder: killed (``kill -9``), the holder's lock went
with it while its members went on using the directory, and a second ``prme serve`` took
the lock beside them (a cluster trial). So the members inherit the lock's descriptor
(:meth:`DataDirLock.child_fds`; a flock belongs to the open file, so it stays held while
any member lives) and the read end of a pipe only the holder can write to: a member sees
its end of file when the holder is gone, however it ended, and stops (SIGTERM to itself,
the clean stop).
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import signal
import stat
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Self

from prme.producers.paths import make_dir, refused
from prme.schemas.errors import DataDirInUse

LOCK_FILE = "prme.lock"
TOKEN_ENV = "PRME_DATA_LOCK_TOKEN"
"""Set by the holder in the environment of the members it starts (and nowhere else)."""
HOLDER_FD_ENV = "PRME_DATA_LOCK_HOLDER_FD"
"""The descriptor, in a member, of the pipe whose end of file says the holder is gone."""
_log = logging.getLogger("prme")


class DataDirLock:
    """Held from :meth:`acquire` until :meth:`release` (or the process exits)."""

    def __init__(self, path: Path, fd: int | None, token: str) -> None:
        self.path = path
        self._fd = fd
        self._token = token
        self._link: tuple[int, int] | None = None
        """The pipe its members watch: (read end, write end), made for the first member."""

    @classmethod
    def acquire(cls, directory: Path) -> Self:
        """The lock of ``directory`` (created where missing); DataDirInUse while another
        process holds it, ConfigurationError naming a directory that cannot be used."""
        make_dir(directory)
        path = directory / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as error:
            raise refused(path, error) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            token = os.environ.get(TOKEN_ENV, "")
            if holder is not None and holder[0] == os.getppid() and token == holder[2] != "":
                _stop_with_holder(os.environ.pop(HOLDER_FD_ENV, None))
                return cls(path, None, token)  # our parent's: it split the partitions among us
            if _held_here(path):
                raise DataDirInUse(
                    f"the data directory {str(directory)!r} is already open in this process "
                    "(sync MemoryClients and the adapters of one directory share one engine; "
                    "an AsyncMemoryClient or a MemoryEngine opens its own): use the client "
                    "that holds it, or close it first"
                ) from None
            who = f"pid {holder[0]} ({holder[1]})" if holder else "another process"
            raise DataDirInUse(
                f"the data directory {str(directory)!r} is open in another process, {who}: "
                "a data directory is opened by one process at a time (give this one its own "
                "data directory, or reach that process over HTTP: MemoryClient(url=...))"
            ) from None
        token = secrets.token_hex(16)
        command = " ".join(os.path.basename(a) for a in sys.argv[:2])
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {token} {command}\n".encode())
        return cls(path, fd, token)

    @property
    def held(self) -> bool:
        """False when this process runs under its parent's lock."""
        return self._fd is not None

    def child_environment(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) with the token that lets a
        process started with it open the directory under this lock, and where it reads of
        this process's end (start it with :meth:`child_fds` passed; without them it does
        not watch this process)."""
        environment = {**(os.environ if base is None else base), TOKEN_ENV: self._token}
        if self._fd is not None:
            environment[HOLDER_FD_ENV] = str(self._holder_link()[0])
        return environment

    def child_fds(self) -> tuple[int, ...]:
        """The descriptors a member inherits (``subprocess.Popen(pass_fds=...)``): the
        lock's, which keeps it held while the member lives, and the read end of the pipe
        whose end of file tells the member this process is gone."""
        if self._fd is None:
            return ()
        return (self._fd, self._holder_link()[0])

    def _holder_link(self) -> tuple[int, int]:
        if self._link is None:
            self._link = os.pipe()  # not inheritable: only passed, read end only
        return self._link

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing drops the flock (once no member holds it too)
        link, self._link = self._link, None
        for end in link or ():
            os.close(end)


def _stop_with_holder(fd: str | None) -> None:
    """In a member: SIGTERM this process once the lock's holder is gone (the pipe's end of
    file), from a daemon thread blocked on the read."""
    if not fd or not fd.isdigit():
        return
    try:
        linked = stat.S_ISFIFO(os.fstat(int(fd)).st_mode)
    except OSError:  # started without child_fds(): nothing to watch
        linked = False
    if not linked:
        _log.warning("started without the lock holder's pipe: not watching the holder")
        return

    def watch() -> None:
        try:
            while os.read(int(fd), 1):
                pass
        except OSError:
            pass
        _log.error("the process holding the data directory's lock is gone: stopping")
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="prme-holder-watch", daemon=True).start()


def _held_here(path: Path) -> bool:
    """Whether this process has the lock file at ``path`` open (on Linux, by its open
    descriptors: the pid the holder wrote is 1 in every container sharing a volume)."""
    try:
        wanted = os.stat(path)
        descriptors = os.listdir("/proc/self/fd")
    except OSError:
        return False
    for name in descriptors:
        try:
            found = os.stat(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if (found.st_dev, found.st_ino) == (wanted.st_dev, wanted.st_ino):
            return True
    return False


def _holder(fd: int) -> tuple[int, str, str] | None:
    """``(pid, command, token)`` of the lock's holder, from the line it wrote."""
    try:
        text = os.pread(fd, 256, 0).decode(errors="replace").strip()
        pid, _, rest = text.partition(" ")
        token, _, command = rest.partition(" ")
        return int(pid), command or "?", token
    except (OSError, ValueError):
        return None
