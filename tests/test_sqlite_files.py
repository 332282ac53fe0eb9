"""Opening the SQLite files several processes of one data dir share."""

from __future__ import annotations

import multiprocessing
import sqlite3
from pathlib import Path
from typing import Any

from prme.producers.sqlite_files import connect_wal

PROCESSES = 6
ROUNDS = 80


def _open_each_at_once(paths: list[Path], barrier: Any, errors: Any) -> None:
    for path in paths:
        barrier.wait(timeout=60)
        try:
            connection = connect_wal(path)
            connection.execute("CREATE TABLE IF NOT EXISTS t (x)")
            connection.close()
        except sqlite3.Error as error:
            errors.put(f"{path.name}: {error}")


def test_processes_opening_a_fresh_file_at_the_same_moment_all_get_it_in_wal_mode(
    tmp_path: Path,
) -> None:
    # Before connect_wal, ~1-3 % of such opens failed at once with "database is locked"
    # (`prme project --workers 2` lost a worker on its fresh vector cache).
    paths = [tmp_path / f"round{n}.sqlite3" for n in range(ROUNDS)]
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(PROCESSES)
    errors = context.Queue()
    workers = [
        context.Process(target=_open_each_at_once, args=(paths, barrier, errors))
        for _ in range(PROCESSES)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert failures == []
    assert [worker.exitcode for worker in workers] == [0] * PROCESSES
    for path in paths:
        with sqlite3.connect(path) as connection:
            assert connection.execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_a_lock_held_past_the_timeout_is_still_an_error(tmp_path: Path) -> None:
    path = tmp_path / "held.sqlite3"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN EXCLUSIVE")
    try:
        try:
            connect_wal(path, timeout_s=0.2)
        except sqlite3.OperationalError as error:
            assert "locked" in str(error)
        else:
            raise AssertionError("opened a file another connection holds exclusively")
    finally:
        holder.execute("ROLLBACK")
        holder.close()
