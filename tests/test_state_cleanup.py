"""A node deletes the read models of partitions it let go of, after
``cluster.state_cleanup_delay_s`` (no copy keeps what the new owner erases)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from prme import MemoryEngine
from prme.projectors.runner import remove_stale_staging
from prme.projectors.shard import shard_directory
from prme.projectors.state_cleanup import DISCARDED_SUFFIX, StateCleaner
from prme.schemas.config import Settings
from prme.schemas.errors import ConfigurationError


def _shards(root: Path, *partitions: int) -> None:
    for partition in partitions:
        (shard_directory(root, partition) / "history").mkdir(parents=True)


def _cleaner(
    root: Path, in_use: set[int], removed: list[int], standing: list[bool] | None = None
) -> StateCleaner:
    @contextlib.asynccontextmanager
    async def lock(partition: int) -> AsyncIterator[None]:
        yield

    async def note(partition: int) -> None:
        assert not shard_directory(root, partition).exists()  # called once it is gone
        removed.append(partition)

    def on_disk() -> list[int]:
        return sorted(int(d.name[1:]) for d in (root / "shards").iterdir() if d.name[1:].isdigit())

    return StateCleaner(
        root,
        60.0,
        in_use=lambda: set(in_use),
        on_disk=on_disk,
        partition_lock=lock,
        removed=note,
        may_sweep=lambda: standing is None or standing[0],
    )


async def test_a_directory_unused_for_the_delay_is_deleted_and_one_in_use_never(
    tmp_path: Path,
) -> None:
    _shards(tmp_path, 0, 1, 2)
    in_use = {1}
    removed: list[int] = []
    cleaner = _cleaner(tmp_path, in_use, removed)
    assert await cleaner.sweep(now=100.0) == []  # 0 and 2 unused from now on
    in_use.add(0)
    assert await cleaner.sweep(now=130.0) == []
    in_use.discard(0)  # used again in between: its 60 s start over
    assert await cleaner.sweep(now=161.0) == [2]
    assert removed == [2]
    assert not shard_directory(tmp_path, 2).exists()
    assert not list((tmp_path / "shards").glob("*.discarded"))
    assert shard_directory(tmp_path, 0).exists() and shard_directory(tmp_path, 1).exists()
    assert await cleaner.sweep(now=220.0) == []
    assert await cleaner.sweep(now=231.0) == [0]
    assert shard_directory(tmp_path, 1).exists()


async def _nothing(partition: int) -> None:
    pass


async def test_nothing_counts_as_unused_while_the_node_is_not_a_member_in_good_standing(
    tmp_path: Path,
) -> None:
    """Before its first assignment, while refused by the group, or once its projector
    failed (a shard built from another log is kept for the operator), the clock stands."""
    _shards(tmp_path, 0, 1)
    removed: list[int] = []
    standing = [False]
    cleaner = _cleaner(tmp_path, set(), removed, standing)
    assert await cleaner.sweep(now=100.0) == []
    assert await cleaner.sweep(now=1_000.0) == []
    standing[0] = True  # the clock starts now, not at 100
    assert await cleaner.sweep(now=1_030.0) == []
    standing[0] = False
    assert await cleaner.sweep(now=1_100.0) == []
    standing[0] = True
    assert await cleaner.sweep(now=1_130.0) == []
    assert await cleaner.sweep(now=1_191.0) == [0, 1]
    assert removed == [0, 1]


async def test_a_partition_taken_while_waiting_for_its_lock_is_kept(tmp_path: Path) -> None:
    _shards(tmp_path, 3)
    in_use: set[int] = set()
    held = asyncio.Lock()

    cleaner = StateCleaner(
        tmp_path,
        0.0,
        in_use=lambda: set(in_use),
        on_disk=lambda: [3] if shard_directory(tmp_path, 3).exists() else [],
        partition_lock=lambda partition: held,
        removed=_nothing,
    )
    async with held:
        sweeping = asyncio.create_task(cleaner.sweep())
        await asyncio.sleep(0.05)
        in_use.add(3)  # the group gave it back while the sweep waited
    assert await sweeping == []
    assert shard_directory(tmp_path, 3).exists()


def test_a_cleanup_killed_mid_way_is_finished_at_the_next_start(tmp_path: Path) -> None:
    _shards(tmp_path, 4)
    discarded = tmp_path / "shards" / "p4.discarded"
    shard_directory(tmp_path, 4).rename(discarded)
    assert remove_stale_staging(tmp_path) == [discarded]
    assert not discarded.exists()


def test_the_delay_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="state_cleanup_delay_s"):
        Settings.from_env({"PRME_CLUSTER__STATE_CLEANUP_DELAY_S": "-1"})


@pytest.mark.kafka
async def test_an_old_copy_of_a_moved_partition_does_not_outlive_an_erasure(
    kafka_settings: Settings, hashed_provider: Any, tmp_path: Path
) -> None:
    fast = kafka_settings.replace(cluster={"state_cleanup_delay_s": 1.0})
    first = await MemoryEngine.create(settings=fast, embedding_provider=hashed_provider)
    second: MemoryEngine | None = None
    try:
        owners = [f"user{i}" for i in range(16)]
        for owner in owners:
            await first.store(f"{owner} keeps a secret diary", owner)
        assert set(first.runner.shards) == {0, 1, 2, 3}
        assert set(first.runner.vector_cache.owners()) == set(owners)
        first_dir = Path(fast.data_dir)
        second = await MemoryEngine.create(
            settings=fast.replace(data_dir=str(tmp_path / "second")),
            embedding_provider=hashed_provider,
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while loop.time() < deadline and not (second.runner.shards and first.runner.shards):
            await asyncio.sleep(0.2)
        moved = set(second.runner.shards)
        assert moved and not moved & set(first.runner.shards)
        owner = next(
            o for o in owners if second.runner.transport.partition_for(o.encode()) in moved
        )
        await second.erase_owner(owner)

        def left(partition: int) -> bool:  # renamed to p<N>.discarded first, then deleted
            directory = shard_directory(first_dir, partition)
            discarded = directory.with_name(directory.name + DISCARDED_SUFFIX)
            return directory.exists() or discarded.exists()

        while loop.time() < deadline and any(left(p) for p in moved):
            await asyncio.sleep(0.2)
        for partition in moved:
            assert not left(partition)
        partition_of = first.runner.transport.partition_for
        cached = set(first.runner.vector_cache.owners())  # the node-wide cache forgot them too
        assert cached == {o for o in owners if partition_of(o.encode()) not in moved}
        kept = [p.name for p in (first_dir / "shards").iterdir()]
        assert sorted(kept) == sorted(f"p{p}" for p in first.runner.shards)
        remaining = next(
            o
            for o in owners
            if first.runner.transport.partition_for(o.encode()) in first.runner.shards
        )
        assert [r.text for r in (await first.retrieve("secret diary", remaining)).results] == [
            f"{remaining} keeps a secret diary"
        ]
    finally:
        if second is not None:
            await second.close()
        await first.close()


async def test_a_use_between_two_sweeps_restarts_the_delay(tmp_path: Path) -> None:
    """Found by a cluster trial (reading the code): a partition used briefly between two
    sweeps kept its first "unused since" and went early. Closing a shard reports it."""
    _shards(tmp_path, 5)
    removed: list[int] = []
    cleaner = _cleaner(tmp_path, set(), removed)
    assert await cleaner.sweep(now=100.0) == []  # unused since 100
    cleaner.released(5, now=150.0)  # opened and closed again between the sweeps
    assert await cleaner.sweep(now=170.0) == []  # 60 s from 100, but 20 from 150
    assert await cleaner.sweep(now=211.0) == [5]


async def test_after_a_restart_the_delay_counts_from_the_last_write(tmp_path: Path) -> None:
    """Found by a cluster trial: the clock started at every start of the node, so a node
    restarted more often than the delay kept an erased owner's stale copy for good. The
    first sweep of a process dates a directory by its newest file, as Kafka Streams does."""
    _shards(tmp_path, 0, 1, 2)
    hour_ago = time.time() - 3600
    for partition in (0, 2):
        written = shard_directory(tmp_path, partition) / "history" / "history.sqlite3"
        written.write_bytes(b"read model")
        os.utime(written, (hour_ago, hour_ago))
    (shard_directory(tmp_path, 1) / "history" / "history.sqlite3").write_bytes(b"fresh")
    removed: list[int] = []
    in_use = {2}
    cleaner = _cleaner(tmp_path, in_use, removed)
    assert await cleaner.sweep(now=100.0) == [0]  # unused for an hour: gone at once
    assert shard_directory(tmp_path, 1).exists()  # written just now: its 60 s from now
    in_use.clear()  # let go of in this process: the clock is this process's own
    assert await cleaner.sweep(now=150.0) == []
    assert await cleaner.sweep(now=161.0) == [1]
    assert await cleaner.sweep(now=209.0) == []
    assert await cleaner.sweep(now=211.0) == [2]


async def test_a_quiet_partition_in_use_until_a_restart_counts_as_used_then(
    tmp_path: Path,
) -> None:
    """From a review: a partition served until a restart but written to an hour ago went
    at the new process's first sweep; a sweep now stamps the directories in use."""
    _shards(tmp_path, 4)
    written = shard_directory(tmp_path, 4) / "history" / "history.sqlite3"
    written.write_bytes(b"read model")
    hour_ago = time.time() - 3600
    os.utime(written, (hour_ago, hour_ago))
    in_use = {4}
    before_restart = _cleaner(tmp_path, in_use, [])
    assert await before_restart.sweep(now=100.0) == []  # in use: stamped
    in_use.clear()  # the first map after the restart gives it to another node
    removed: list[int] = []
    after_restart = _cleaner(tmp_path, in_use, removed)
    assert await after_restart.sweep(now=5.0) == []  # used moments ago: its 60 s from there
    assert await after_restart.sweep(now=66.0) == [4]
