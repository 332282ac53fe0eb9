"""Standby replicas: warm copies of partitions another node owns, applied continuously.

The group leader names each partition's standbys in the cluster map
(``cluster.standby_replicas``). A standby shard is an ordinary shard in this node's data
directory, read from the log (not through the group: the owner holds the partition there)
and applied like the owner applies it, vectors from the changelog included. When the
owner dies the leader hands the partition to its most caught-up standby, and the runner
promotes the open shard: it is served as soon as it reaches the log end, which a standby
is a poll away from, instead of after a replay of the whole partition.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from prme.producers.transport import LogTransport

from .shard import Shard
from .tasks import cancel_and_wait

POLL_S = 0.2
"""How often a caught-up standby asks the log for more."""
CHUNK = 4096
"""Records read (and applied as one batch) at a time."""
RETRY_S = 5.0
"""How long the loop waits after a failure before it tries again."""
_log = logging.getLogger("prme.standby")


class StandbyKeeper:
    """Opens, applies and closes this node's standby shards as the map asks."""

    def __init__(
        self,
        transport: LogTransport,
        open_shard: Callable[[int], Awaitable[Shard]],
        apply: Callable[[int, Shard, list[object]], Awaitable[bool]],
        lock: Callable[[int], asyncio.Lock],
        may_open: Callable[[], bool] = lambda: True,
        closed: Callable[[int], None] = lambda partition: None,
        after_pass: Callable[[], None] = lambda: None,
    ) -> None:
        """``may_open``: whether new standbys may open now (a node catching up on the
        partitions it owns opens none: a new standby replays its whole partition);
        ``closed``: told of each standby closed because the map no longer asks for it;
        ``after_pass``: called after each pass over the standbys (``caught_up`` is new)."""
        self._transport = transport
        self._closed = closed
        self._may_open = may_open
        self._open_shard = open_shard
        self._apply = apply
        self._lock = lock
        self.shards: dict[int, Shard] = {}
        self._wanted: set[int] = set()
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.caught_up: set[int] = set()
        """Standbys whose last read reached the log's end (and was applied)."""
        self._after_pass = after_pass
        self.failure: BaseException | None = None
        """The last failure, until a pass over every standby succeeds again (the owners
        still serve meanwhile; only the copies fall behind)."""

    def want(self, partitions: set[int], owned: set[int]) -> None:
        """The standbys the newest map gives this node (opened and closed by the loop);
        those it now owns stay open until :meth:`take` hands them to the runner."""
        self._wanted = set(partitions) | (set(self.shards) & owned)
        self._changed.set()
        if self._task is None and partitions:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="prme-standbys")

    @property
    def wanted(self) -> set[int]:
        """The partitions the map asks this node to keep copies of (open or not yet)."""
        return set(self._wanted)

    def take(self, partition: int) -> Shard | None:
        """Hand a standby shard over (its partition became this node's); None if not
        kept here. The caller holds the partition's lock."""
        self._wanted.discard(partition)
        self.caught_up.discard(partition)
        return self.shards.pop(partition, None)

    def positions(self) -> dict[int, int]:
        return {p: s.position for p, s in self.shards.items()}

    async def close(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        for partition in list(self.shards):
            async with self._lock(partition):
                shard = self.shards.pop(partition, None)
                if shard is not None:
                    await shard.close()

    async def _run(self) -> None:
        while True:
            try:
                await self._reconcile()
                applied = 0
                for partition in list(self.shards):
                    applied += await self._step(partition)
                self.failure = None
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the owners still serve; the copies fall behind
                self.failure = error
                _log.exception("standby replicas failed; trying again in %.0fs", RETRY_S)
                self._after_pass()  # the copies that did catch up are still ready
                await asyncio.sleep(RETRY_S)
                continue
            self._after_pass()
            if not applied:
                self._changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), POLL_S)

    async def _reconcile(self) -> None:
        for partition in sorted(set(self.shards) - self._wanted):
            async with self._lock(partition):
                shard = self.shards.pop(partition, None)
                self.caught_up.discard(partition)
                if shard is not None:
                    await shard.close()
                    self._closed(partition)
                    _log.info("standby of partition %d closed", partition)
        if not self._may_open():
            return
        for partition in sorted(self._wanted - set(self.shards)):
            async with self._lock(partition):
                if partition in self._wanted and partition not in self.shards:
                    self.shards[partition] = await self._open_shard(partition)
                    _log.info("standby of partition %d opened", partition)

    async def _step(self, partition: int) -> int:
        async with self._lock(partition):
            shard = self.shards.get(partition)
            if shard is None:
                return 0
            await shard.ensure_open()
            start = max(shard.position, shard.applied_offset()) + 1
            entries = await self._transport.read(partition, start, CHUNK)
            applied = bool(entries) and await self._apply(partition, shard, list(entries))
            if len(entries) < CHUNK and (applied or not entries):
                self.caught_up.add(partition)
            else:
                self.caught_up.discard(partition)
            return len(entries) if applied else 0
