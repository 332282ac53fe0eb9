"""Delete the shard directories of partitions a node let go of (Kafka Streams'
``state.cleanup.delay.ms``).

A node keeps the read models of a partition it lost for a while: the group may give the
partition back (a rolling restart, a rebalance that undoes itself), and a kept shard
resumes from its offset instead of replaying the log. Kept for good, such a copy would
also keep what the partition's new owner later erases (an owner's erasure reaches only the
copies that apply the log). So a directory that no shard, parked shard or standby of this
node has used for ``cluster.state_cleanup_delay_s`` is deleted, with what the node-wide
vector cache holds for the partition's owners; if the partition comes back later, it is
restored like a partition this node never held. The clock runs only while the node is a
member in good standing: before its first assignment, while the group refuses it, and once
its projector has failed (a shard built from another log is kept for the operator), no
directory counts as unused. At the first sweep after the process starts, a directory's
clock starts at the last time one of its files was written (as Kafka Streams reads a task
directory's last modification), not at the start: a node restarted more often than the
delay kept an erased owner's stale copy for good (a cluster trial). Every sweep touches
:data:`USED_STAMP` in the directories in use, and a release in the one let go of, so a
quiet partition served until a restart counts as used then, not at its last write.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from .shard import shard_directory
from .tasks import cancel_and_wait

DISCARDED_SUFFIX = ".discarded"
"""``shards/p<N>.discarded/``: a directory being deleted (renamed first, so a process
killed mid-way never leaves a half-deleted shard to be opened)."""
USED_STAMP = "used.stamp"
"""An empty file whose modification time says when a shard directory was last in use."""
_log = logging.getLogger("prme.projector")


class StateCleaner:
    """Sweeps ``data_dir/shards`` every ``interval_s`` (a fraction of ``delay_s``)."""

    def __init__(
        self,
        data_dir: Path,
        delay_s: float,
        *,
        in_use: Callable[[], set[int]],
        on_disk: Callable[[], list[int]],
        partition_lock: Callable[[int], contextlib.AbstractAsyncContextManager[None]],
        removed: Callable[[int], Awaitable[None]],
        may_sweep: Callable[[], bool] = lambda: True,
    ) -> None:
        self._data_dir = data_dir
        self._delay_s = delay_s
        self._in_use = in_use
        self._on_disk = on_disk
        self._partition_lock = partition_lock
        self._removed = removed
        self._may_sweep = may_sweep
        self._unused_since: dict[int, float] = {}
        self._swept = False
        """A sweep in good standing ran in this process (the clocks it starts are its own)."""
        self._task: asyncio.Task[None] | None = None

    @property
    def interval_s(self) -> float:
        return min(30.0, max(0.5, self._delay_s / 4))

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="prme-state-cleanup"
            )

    async def close(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def _run(self) -> None:
        while True:
            try:
                await self.sweep()
            except asyncio.CancelledError:
                raise
            except Exception:  # a disk error: the copies stay until the next sweep
                _log.exception("removing shards this node let go of failed")
            await asyncio.sleep(self.interval_s)

    def released(self, partition: int, now: float | None = None) -> None:
        """``partition``'s directory stopped being used now: its delay counts from here."""
        self._unused_since[partition] = time.monotonic() if now is None else now
        self._stamp(partition)

    def _stamp_all(self, partitions: list[int]) -> None:
        for partition in partitions:
            self._stamp(partition)

    def _stamp(self, partition: int) -> None:
        directory = shard_directory(self._data_dir, partition)
        with contextlib.suppress(OSError):  # gone meanwhile: nothing to date
            if directory.is_dir():
                (directory / USED_STAMP).touch()

    async def sweep(self, now: float | None = None) -> list[int]:
        """Delete the directories unused for ``delay_s``; returns their partitions."""
        now = time.monotonic() if now is None else now
        if not self._may_sweep():
            self._unused_since.clear()
            return []
        on_disk, in_use = set(self._on_disk()), self._in_use()
        unused = on_disk - in_use
        await asyncio.to_thread(self._stamp_all, sorted(on_disk & in_use))
        for partition in set(self._unused_since) - unused:
            del self._unused_since[partition]
        removed = []
        for partition in sorted(unused):
            if partition not in self._unused_since:
                idle = 0.0 if self._swept else await asyncio.to_thread(self._idle_s, partition)
                self._unused_since[partition] = now - idle
            since = self._unused_since[partition]
            if now - since < self._delay_s:
                continue
            async with self._claimed(partition) as free:
                if not free:
                    continue
                discarded = self._discard(partition)
                await self._removed(partition)
            self._unused_since.pop(partition, None)
            removed.append(partition)
            _log.info(
                "partition %d: removed its read models, unused here for %.0fs",
                partition,
                now - since,
            )
            await asyncio.to_thread(shutil.rmtree, discarded, True)
        self._swept = True
        return removed

    def _idle_s(self, partition: int) -> float:
        """Seconds since a file of ``partition``'s directory was last written."""
        newest = 0.0
        for folder, _, files in os.walk(shard_directory(self._data_dir, partition)):
            for name in files:
                with contextlib.suppress(OSError):  # deleted meanwhile
                    newest = max(newest, os.stat(os.path.join(folder, name)).st_mtime)
        return max(0.0, time.time() - newest) if newest else 0.0

    @contextlib.asynccontextmanager
    async def _claimed(self, partition: int) -> AsyncIterator[bool]:
        """The partition's lock, and whether it is still unused once held."""
        async with self._partition_lock(partition):
            yield self._may_sweep() and partition not in self._in_use()

    def _discard(self, partition: int) -> Path:
        directory = shard_directory(self._data_dir, partition)
        discarded = directory.with_name(directory.name + DISCARDED_SUFFIX)
        shutil.rmtree(discarded, ignore_errors=True)
        directory.rename(discarded)
        return discarded
