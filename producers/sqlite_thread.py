"""A SQLite connection that lives on one worker thread (the embedded log, the key store).

SQLite connections belong to the thread that made them, and a write must not block the
event loop: every call on the connection goes through ``_run`` to the one thread.
"""

from __future__ import annotations

import asyncio
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prme.schemas.errors import TransportError


def failed_write(
    connection: sqlite3.Connection, error: BaseException, failed: str, meaning: str
) -> None:
    """After a write transaction failed with ``error``: roll back what SQLite did not (it
    rolls a full disk's transaction back itself, and a second ROLLBACK raised "no
    transaction is active", hiding the cause), and for an ``OperationalError`` (a full
    disk, a read-only file) raise a ``TransportError`` (503, not 500): "``failed``
    (error): ``meaning``"."""
    if connection.in_transaction:
        connection.execute("ROLLBACK")
    if isinstance(error, sqlite3.OperationalError):
        raise TransportError(f"{failed} ({error}): {meaning}") from error


class SqliteThread:
    """Subclasses open ``self._connection`` in ``_open`` (called on the thread)."""

    _what = "the SQLite file"
    """Named in the error for a call before ``start`` or after ``close``."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._connection: sqlite3.Connection | None = None

    def _open(self) -> None:
        raise NotImplementedError

    async def _start_thread(self, name: str) -> bool:
        """Start the thread and open the connection on it; False if already started."""
        if self._executor is not None:
            return False
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        await self._run(self._open)
        return True

    async def close(self) -> None:
        if self._executor is None:
            return
        await self._run(self._close_connection)
        self._executor.shutdown(wait=True)
        self._executor = None

    def _close_connection(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    async def _run(self, function: Any, *args: Any) -> Any:
        if self._executor is None:
            raise TransportError(f"{self._what} is not started")
        return await asyncio.get_running_loop().run_in_executor(self._executor, function, *args)

    def _require_connection(self) -> sqlite3.Connection:
        if self._connection is None:
            raise TransportError(f"{self._what} is not started")
        return self._connection
