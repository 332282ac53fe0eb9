"""The bulk of a rebuild in child processes, so a rebuild uses more than the one core a
Python process gets (its projection holds the GIL for most of each record).

``ProjectorRunner.rebuild(processes=N)`` splits the partitions among up to N children
(:func:`workers_for`: only where a worker's start pays), each
``python -m prme.projectors.rebuild_worker``: a child reads its :class:`RebuildJob`
(pickled, length-prefixed) from stdin, opens the log, the key store and the vector cache
the settings name, replays each of its partitions into the partition's staging directory
(``ProjectorRunner.stage``, the same code an in-process rebuild runs) and exits. It
reports each chunk it applied as a line ``applied PARTITION COUNT`` on stdout, each
partition it finished as ``staged PARTITION OFFSET`` (the offset it applied), and last
its vector-cache lookups, ``cache HITS MISSES`` (a miss is a text it encoded), which the
parent adds to its own cache's counts. As each partition is reported staged, the parent
applies what arrived since, under the partition's lock, and swaps it in, while the
workers stage the rest.

A child exits when its stdin reaches EOF (the parent died): a rebuild never outlives the
process that runs it, and what a dead one leaves is a staging directory the next start
removes. The embedding provider goes to the children pickled; one that does not pickle
(a custom provider holding a lock or a session) rebuilds in the parent, as before; when
a worker fails (the reason is logged), the parent rebuilds the partitions no worker had
reported staged.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prme.producers.factory import open_transport
from prme.schemas.config import Settings

from .embeddings.protocol import EmbeddingProvider
from .model import ModelName

if TYPE_CHECKING:
    from .runner import ProjectorRunner, StagedPartition

_log = logging.getLogger(__name__)


MIN_RECORDS_PER_WORKER = 5_000
"""A worker takes ~2 s to start (imports, opening the log and the stores): a smaller share
rebuilds faster in the parent."""


def workers_for(targets: dict[int, int], processes: int) -> int:
    """How many of ``processes`` workers to start for partitions ``targets`` (log ends):
    none below 2 (the parent rebuilds), never more than one per partition or per
    :data:`MIN_RECORDS_PER_WORKER` records."""
    busy = sum(1 for end in targets.values() if end > 0)
    by_size = sum(targets.values()) // max(1, MIN_RECORDS_PER_WORKER)
    chosen = min(processes, busy, by_size)
    return chosen if chosen > 1 else 1


def default_processes() -> int:
    """How many workers ``prme rebuild`` starts unless told: the cores, at most 4."""
    return min(4, os.cpu_count() or 1)


@dataclass(frozen=True)
class RebuildJob:
    """What one child stages: ``partitions`` maps each of its partitions to the log end
    the rebuild started from (for its progress log; it replays to the end it finds)."""

    settings: Settings
    provider: EmbeddingProvider
    partitions: dict[int, int]
    models: tuple[ModelName, ...]


def shares(targets: dict[int, int], processes: int) -> list[dict[int, int]]:
    """``targets`` split into at most ``processes`` non-empty shares of about the same
    number of records (largest partitions first, each to the lightest share)."""
    split: list[dict[int, int]] = [{} for _ in range(min(processes, len(targets)))]
    loads = [0] * len(split)
    for partition, target in sorted(targets.items(), key=lambda item: (-item[1], item[0])):
        lightest = loads.index(min(loads))
        split[lightest][partition] = target
        loads[lightest] += target
    return [share for share in split if share]


async def replay_in_processes(
    runner: ProjectorRunner,
    targets: dict[int, int],
    models: Sequence[ModelName],
    processes: int,
    progress: Callable[[int], None] | None,
    staged: Callable[[int, StagedPartition], None],
) -> None:
    """Stage the partitions of ``targets`` in up to ``processes`` children, calling
    ``staged(partition, what)`` as each partition's staging is complete and closed (the
    caller swaps it in while the workers go on). Partitions never reported were not staged
    (rebuild them in this process): all of them when the workers cannot be used (the
    provider does not pickle, qdrant-client's local mode holds its directory for one
    process), those a failed worker had not finished (logged with its error)."""
    if runner.settings.qdrant.path:
        _log.info("rebuilding in this process: qdrant.path is opened by one process at a time")
        return
    settings = runner.settings.replace(log={"transactional_id": None})  # never fence ours
    try:
        pickle.dumps(runner.provider)
    except Exception as error:  # noqa: BLE001 - any reason a provider cannot travel
        _log.info("rebuilding in this process: the embedding provider does not pickle (%s)", error)
        return
    jobs = [
        RebuildJob(settings, runner.provider, share, tuple(models))
        for share in shares(targets, processes)
    ]
    replayed: dict[int, int] = dict.fromkeys(targets, 0)
    offsets: dict[int, int] = {}
    children: list[asyncio.subprocess.Process] = []
    followers: list[asyncio.Task[None]] = []
    from .runner import StagedPartition

    def finished(partition: int, offset: int) -> None:
        offsets[partition] = offset
        staged(partition, StagedPartition(replayed[partition], offset))

    try:
        for job in jobs:
            children.append(await _start(job))
        followers = [
            asyncio.create_task(_follow(runner, child, replayed, finished, progress))
            for child in children
        ]
        await asyncio.gather(*followers)
    except (OSError, WorkerFailed) as error:
        _log.warning(
            "rebuilding in this process what no worker staged: a rebuild worker failed: %s",
            error,
        )
        return
    finally:
        for child in children:
            if child.returncode is None:
                child.kill()
                await child.wait()
        for follower in followers:
            follower.cancel()
        await asyncio.gather(*followers, return_exceptions=True)
    missing = sorted(set(targets) - set(offsets))
    if missing:
        _log.warning("rebuilding in this process: the workers did not stage %s", missing)


class WorkerFailed(Exception):
    """A rebuild worker exited with an error (its last stderr lines are the message)."""


async def _start(job: RebuildJob) -> asyncio.subprocess.Process:
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "prme.projectors.rebuild_worker",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert child.stdin is not None
    data = pickle.dumps(job)
    child.stdin.write(len(data).to_bytes(8, "big") + data)
    await child.stdin.drain()  # stdin stays open: its EOF tells the child we are gone
    return child


async def _follow(
    runner: ProjectorRunner,
    child: asyncio.subprocess.Process,
    replayed: dict[int, int],
    finished: Callable[[int, int], None],
    progress: Callable[[int], None] | None,
) -> None:
    assert child.stdout is not None and child.stderr is not None
    errors = asyncio.ensure_future(child.stderr.read())
    cache, replayed_metric = runner.vector_cache, runner.metrics.rebuild_replayed
    async for line in child.stdout:
        try:
            kind, first, second = line.decode().split()
            numbers = int(first), int(second)
        except ValueError:  # not one of ours (a library printing): shown, not parsed
            _log.info("rebuild worker %d: %s", child.pid, line.decode(errors="replace").strip())
            continue
        if kind == "cache":
            cache.hits += numbers[0]
            cache.misses += numbers[1]
        elif kind == "staged":
            finished(*numbers)
        elif kind == "applied":
            replayed[numbers[0]] += numbers[1]
            replayed_metric.labels(str(numbers[0])).set(replayed[numbers[0]])
            if progress is not None:
                progress(numbers[1])
    code = await child.wait()
    tail = (await errors).decode(errors="replace").strip().splitlines()[-20:]
    if code != 0:
        raise WorkerFailed(f"worker {child.pid} exited with {code}:\n" + "\n".join(tail))
    for text in tail:  # warnings of a worker that succeeded (dead letters, say)
        _log.info("rebuild worker %d: %s", child.pid, text)


def _exit_with_parent() -> None:
    while os.read(0, 1 << 16):  # empty at EOF: the parent closed its end or died
        pass
    os._exit(1)


async def _run(job: RebuildJob) -> None:
    from .runner import ProjectorRunner

    transport = open_transport(job.settings)
    await transport.start()
    runner = ProjectorRunner(job.settings, transport, job.provider)
    try:
        await runner.keys.start()
        for partition, target in job.partitions.items():

            def report(count: int, partition: int = partition) -> None:
                print("applied", partition, count, flush=True)

            staged = await runner.stage(partition, job.models, target, report)
            print("staged", partition, staged.offset, flush=True)
        print("cache", runner.vector_cache.hits, runner.vector_cache.misses, flush=True)
    finally:
        await runner.close()
        await transport.close()


def _read_exactly(size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = os.read(0, size - len(data))
        if not chunk:
            raise SystemExit("rebuild worker: stdin ended before the job did")
        data += chunk
    return data


def main() -> None:
    size = int.from_bytes(_read_exactly(8), "big")
    job: Any = pickle.loads(_read_exactly(size))
    if not isinstance(job, RebuildJob):
        raise SystemExit("rebuild worker: stdin did not hold a RebuildJob")
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    asyncio.run(_run(job))


if __name__ == "__main__":  # run as the package module, so the job unpickles to its class
    from prme.projectors.rebuild_worker import main as package_main

    package_main()
