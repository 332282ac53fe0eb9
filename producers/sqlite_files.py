"""Opening a SQLite file in WAL mode when other processes may open it at the same moment.

The processes of ``prme serve --processes N`` and ``prme project --workers N`` share one
data dir: its embedded log, key store and vector cache are opened by all of them at once.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from .paths import make_dir, refused

_FIRST_RETRY_S = 0.005
_LONGEST_RETRY_S = 0.1


def connect_wal(path: Path, *, timeout_s: float = 30.0) -> sqlite3.Connection:
    """The SQLite file at ``path`` (created, with its folder) in WAL mode, autocommit (so
    transactions are explicit), usable from any thread (callers serialise access), waiting
    up to ``timeout_s`` for another connection's lock.

    Switching a file to WAL takes its exclusive lock without SQLite's busy handler (waiting
    there could deadlock), so a process opening a fresh file while another switches it gets
    "database is locked" at once: the switch is retried until ``timeout_s``.

    A file that cannot be opened (a read-only directory, a file where a folder goes) is a
    ConfigurationError naming it."""
    make_dir(path.parent)
    try:
        connection = sqlite3.connect(
            path, timeout=timeout_s, isolation_level=None, check_same_thread=False
        )
    except sqlite3.OperationalError as error:
        raise refused(path, error) from None
    deadline = time.monotonic() + timeout_s
    delay = _FIRST_RETRY_S
    while True:
        try:
            connection.execute("PRAGMA journal_mode=WAL")
            return connection
        except sqlite3.OperationalError as error:
            if "locked" not in str(error):  # the first statement opens the file
                connection.close()
                raise refused(path, error) from None
            if time.monotonic() + delay > deadline:
                connection.close()
                raise
        time.sleep(delay)
        delay = min(2 * delay, _LONGEST_RETRY_S)
