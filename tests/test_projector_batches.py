"""How the projector batches: batches grow while it is behind, a rebuild reports its
progress, and the history and events models keep the bytes the log gave them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sqlite3
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from prme import MemoryEngine
from prme.producers.factory import open_transport
from prme.producers.partitioner import partition_for_key
from prme.producers.producer import MessageDraft, Producer
from prme.producers.transport import LogItem, LogTransport
from prme.projectors import rebuild_worker
from prme.projectors import runner as runner_module
from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider
from prme.projectors.model import ProjectedRecord
from prme.projectors.runner import (
    MAX_BATCH_FACTOR,
    MIN_BATCH,
    REBUILD_CONCURRENCY,
    STAGING_SUFFIX,
    ProjectorRunner,
    StagedPartition,
    next_batch_size,
)
from prme.projectors.shard import Shard
from prme.projectors.stores.graph import GraphModel
from prme.projectors.stores.lexical import LexicalModel
from prme.schemas.codec import decode_record, encode_record
from prme.schemas.config import Settings
from prme.schemas.errors import InvalidInput, ShardUnavailable
from tests.record_builders import msg, projected


def test_the_batch_size_doubles_while_polls_come_back_full_and_resets_after() -> None:
    full = {0: [object()] * 64}
    size = 64
    sizes = []
    for _ in range(8):
        size = next_batch_size(size, full if size == 64 else {0: [object()] * size}, 64)
        sizes.append(size)
    assert sizes == [128, 256, 512, 1024, 64 * MAX_BATCH_FACTOR, 64 * MAX_BATCH_FACTOR] + sizes[6:]
    assert max(sizes) == 64 * MAX_BATCH_FACTOR
    assert next_batch_size(1024, {0: [object()] * 10, 1: [object()] * 3}, 64) == 64
    # Never more than about APPLY_BUDGET_S of records at the last poll's cost per record.
    assert next_batch_size(512, {0: [object()] * 512}, 64, per_record_s=0.01) == 200
    assert next_batch_size(64, {0: [object()] * 3}, 64, per_record_s=1.0) == MIN_BATCH


async def _fill(settings: Settings, count: int, owners: int) -> None:
    transport = open_transport(settings)
    await transport.start()
    try:
        producer = Producer(transport)
        drafts = [
            MessageDraft(owner=f"user{i % owners}", session_id=f"s{i % 3}", content=f"note {i}")
            for i in range(count)
        ]
        for start in range(0, count, 500):
            await producer.append_records(
                [producer.build_message(d) for d in drafts[start : start + 500]]
            )
    finally:
        await transport.close()


async def test_a_runner_that_is_behind_applies_larger_batches(local_settings: Settings) -> None:
    settings = local_settings.replace(log={"partitions": 1})
    await _fill(settings, 1200, owners=3)
    sizes: list[int] = []
    transport = open_transport(settings)
    await transport.start()
    runner = ProjectorRunner(settings, transport, HashedBagOfWordsProvider(), batch_size=32)
    try:
        await runner.start()
        await runner.shards[0].ensure_open()
        events = runner.shards[0].models["events"]
        apply = events.apply

        def recording(batch: list[ProjectedRecord]) -> None:
            sizes.append(len(batch))
            apply(batch)

        # The runner polls from start(), so its first batch may land before this patch.
        events.apply = recording  # type: ignore[method-assign]
        await runner.catch_up(timeout_s=120)
        applied = events.applied_offset()
    finally:
        await runner.close()
        await transport.close()
    assert applied == 1199
    assert 1200 - (32 + 64) <= sum(sizes) <= 1200  # at most the first two polls missed
    assert max(sizes) > 32 * 4


class _CostlyProvider(HashedBagOfWordsProvider):
    """40 ms a text, off the event loop, as long texts for a model on a busy machine."""

    async def embed(self, texts: Any) -> list[list[float]]:
        await asyncio.sleep(0.04 * len(texts))
        return await super().embed(texts)


@pytest.mark.parametrize("transport", ["local", pytest.param("kafka", marks=pytest.mark.kafka)])
async def test_a_small_write_is_not_held_behind_another_partitions_costly_backlog(
    transport: str, request: pytest.FixtureRequest
) -> None:
    """From a new-user trial: a batch of 1,000 long texts for the model held a one-record
    write to an idle partition 10 to 47 s (504 write_unconfirmed): the runner polled 256
    to 512 records of the busy partition, embedded them in one call while the other shard
    waited, and woke read-your-writes waiters only after the whole poll. Polls are now
    sized to about 2 s of the last poll's cost, shards take turns at the provider by
    chunks, and each shard's progress wakes its waiters. On Kafka a poll also returned one
    partition's fetched records before another's: it now takes what the others fetched."""
    settings = request.getfixturevalue(f"{transport}_settings").replace(log={"partitions": 2})
    busy, idle = (
        "busy-owner",
        next(f"idle-{i}" for i in range(100) if partition_for_key(f"idle-{i}".encode(), 2) == 1),
    )
    assert partition_for_key(busy.encode(), 2) == 0
    log = open_transport(settings)
    await log.start()
    runner = ProjectorRunner(settings, log, _CostlyProvider())
    producer = Producer(log)
    try:
        await runner.start()
        for i in range(3):  # the runner times a poll of the costly records
            await producer.append_message(MessageDraft(owner=busy, content=f"warm {i}"))
        await runner.catch_up(timeout_s=60)
        backlog = [
            producer.build_message(MessageDraft(owner=busy, content=f"long text {i}"))
            for i in range(400)
        ]
        await producer.append_records(backlog)
        await asyncio.sleep(0.3)  # the runner is into the backlog
        started = time.monotonic()
        receipt = await producer.append_message(MessageDraft(owner=idle, content="small"))
        await runner.wait_applied(receipt.position.partition, receipt.position.offset, 60)
        waited = time.monotonic() - started
    finally:
        await runner.close()
        await log.close()
    assert waited < 6.0, waited  # 256 texts at 40 ms: >10 s before


@contextlib.asynccontextmanager
async def _started(
    settings: Settings, provider: Any, **options: Any
) -> AsyncIterator[tuple[ProjectorRunner, LogTransport]]:
    """A started runner over ``settings``' log, and the log; both closed afterwards."""
    transport = open_transport(settings)
    await transport.start()
    runner = ProjectorRunner(settings, transport, provider, **options)
    try:
        await runner.start()
        yield runner, transport
    finally:
        await runner.close()
        await transport.close()


class _Turns:
    """Tracks the gated steps (a shard decoding a batch, a shard writing one) in progress
    at once, per gate the shard holds; each step is made to take 0.1 s, longer than an
    embedding, so steps that are not kept apart do overlap."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.running: dict[int, int] = {}
        self.most: dict[int, int] = {}
        self.gates_together = 0
        """Steps that began while a step under another gate was running."""
        self.threads: list[int] = []
        """The threads (shards) in a gated step now."""
        self._lock = threading.Lock()
        for name in ("_project", "_apply_all"):
            monkeypatch.setattr(Shard, name, self._counted(getattr(Shard, name)))

    def busy(self) -> bool:
        return any(self.running.values())

    def busy_elsewhere(self) -> bool:
        """Whether a shard other than the calling thread's is in a gated step."""
        with self._lock:
            return any(thread != threading.get_ident() for thread in self.threads)

    def _counted(self, step: Any) -> Any:
        def counted(shard: Shard, *args: Any) -> Any:
            gate = id(shard.apply_gate)
            with self._lock:
                self.gates_together += any(n for g, n in self.running.items() if g != gate)
                self.running[gate] = self.running.get(gate, 0) + 1
                self.most[gate] = max(self.most.get(gate, 0), self.running[gate])
                self.threads.append(threading.get_ident())
            done = False

            def end() -> None:
                nonlocal done
                with self._lock:
                    if not done:
                        done = True
                        self.running[gate] -= 1
                        self.threads.remove(threading.get_ident())

            if step.__name__ == "_apply_all":  # its gated part ends where it releases the gate
                release = args[-1]

                def released() -> None:
                    end()
                    release()

                args = (*args[:-1], released)
            try:
                time.sleep(0.1)
                return step(shard, *args)
            finally:
                end()

        return counted


class _SlowProvider(HashedBagOfWordsProvider):
    """Embeds after an await, as a model off the event loop does; counts the moments a
    shard's gated step was running meanwhile."""

    def __init__(self, turns: _Turns) -> None:
        super().__init__()
        self.turns = turns
        self.overlapped = 0

    async def embed(self, texts: Any) -> list[list[float]]:
        for _ in range(10):
            await asyncio.sleep(0.005)
            self.overlapped += self.turns.busy()
        return await super().embed(texts)


async def test_shards_take_turns_to_decode_and_write_but_not_to_embed(
    local_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decoding and the models' writes hold the GIL: two shards doing them at once only
    contend for it. So owned shards take turns at those steps, while others wait for their
    vectors; a rebuild's partitions (staged two at a time) take turns behind a second gate,
    which never holds up the owned shards' batches."""
    monkeypatch.setattr(runner_module, "REPLAY_CHUNK", 50)
    await _fill(local_settings, 800, owners=16)
    turns = _Turns(monkeypatch)
    provider = _SlowProvider(turns)
    async with _started(local_settings, provider, batch_size=32) as (runner, transport):
        await runner.catch_up(timeout_s=120)
        applied = {p: shard.applied_offset() for p, shard in runner.shards.items()}
        assert len(turns.most) == 1 and turns.most.popitem()[1] == 1
        assert provider.overlapped > 0
        assert turns.gates_together == 0

        rebuild = asyncio.ensure_future(runner.rebuild(processes=1))
        producer = Producer(transport)
        written = 0
        while not rebuild.done() and written < 40:  # live batches during the rebuild
            draft = MessageDraft(owner=f"user{written % 16}", content=f"later {written}")
            receipt = await producer.append_message(draft)
            await runner.wait_applied(receipt.position.partition, receipt.position.offset, 60)
            written += 1
        replayed = await rebuild
    assert sum(offset + 1 for offset in applied.values()) == 800
    assert 800 <= sum(replayed.values()) <= 800 + written
    assert written > 0
    assert len(turns.most) == 2  # the owned shards' gate and the background one
    assert set(turns.most.values()) == {1}
    assert turns.gates_together > 0


async def test_a_shard_commits_its_lexical_batch_while_another_takes_the_gate(
    local_settings: Settings, hashed_provider: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tantivy's commit waits on its indexing threads without the GIL, so a shard commits
    its lexical batch after freeing the apply gate: another shard decodes or writes
    meanwhile, the gated steps still take turns, and every batch ends up committed."""
    await _fill(local_settings, 600, owners=16)
    turns = _Turns(monkeypatch)
    stage = LexicalModel.stage
    beside: list[bool] = []  # per commit: whether another shard's gated step ran meanwhile

    def slowly_committed(model: LexicalModel, batch: list[ProjectedRecord]) -> Any:
        commit = stage(model, batch)
        if commit is None:
            return None

        def commit_slowly() -> None:
            time.sleep(0.15)
            beside.append(turns.busy_elsewhere())
            commit()

        return commit_slowly

    monkeypatch.setattr(LexicalModel, "stage", slowly_committed)
    async with _started(local_settings, hashed_provider, batch_size=32) as (runner, transport):
        await runner.catch_up(timeout_s=120)
        offsets = {
            partition: {name: m.applied_offset() for name, m in shard.models.items()}
            for partition, shard in runner.shards.items()
        }
        ends = await transport.end_offsets()
    assert any(beside) and len(beside) >= 4
    assert len(turns.most) == 1 and turns.most.popitem()[1] == 1
    assert turns.gates_together == 0
    for partition, applied in offsets.items():
        assert set(applied.values()) == {ends[partition] - 1}, (partition, applied)


async def test_a_model_failing_after_the_lexical_stage_still_gets_the_batch_committed(
    local_settings: Settings, hashed_provider: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A staged lexical batch is committed even when a model after it fails with an
    error that stops the projector, as the whole ``apply`` of each model before it was;
    the failing model keeps its offset and applies the batch after a restart."""
    settings = local_settings.replace(log={"partitions": 1})
    await _fill(settings, 40, owners=2)

    def full_disk(model: Any, batch: list[ProjectedRecord]) -> None:
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patched:
        patched.setattr(GraphModel, "apply", full_disk)
        async with _started(settings, hashed_provider) as (runner, _):
            with pytest.raises(ShardUnavailable, match="No space left"):
                await runner.catch_up(timeout_s=60)
            models = runner.shards[0].models
            assert models["lexical"].applied_offset() == 39
            assert models["graph"].applied_offset() == -1
    async with _started(settings, hashed_provider) as (runner, _):
        await runner.catch_up(timeout_s=60)
        assert {m.applied_offset() for m in runner.shards[0].models.values()} == {39}


class _Staging:
    """A read model that stages its batches; its commit fails with ``error`` if given."""

    def __init__(self, name: str, error: BaseException | None = None) -> None:
        self.name = name
        self.error = error
        self.committed: list[int] = []

    def applied_offset(self) -> int:
        return -1

    def stage(self, batch: list[ProjectedRecord]) -> Any:
        def commit() -> None:
            if self.error is not None:
                raise self.error
            self.committed.extend(item.offset for item in batch)

        return commit

    def apply(self, batch: list[ProjectedRecord]) -> None:
        self.stage(batch)()

    def digest(self) -> str:
        return ""

    def close(self) -> None:
        pass


class _Failing:
    """A read model that does not stage, and fails with an error that is not a record's."""

    def __init__(self, name: str) -> None:
        self.name = name

    def applied_offset(self) -> int:
        return -1

    def apply(self, batch: list[ProjectedRecord]) -> None:
        raise OSError(28, "No space left on device")

    def digest(self) -> str:
        return ""

    def close(self) -> None:
        pass


def test_every_staged_commit_runs_when_a_model_or_a_commit_fails(
    local_settings: Settings, hashed_provider: Any
) -> None:
    shard = partition_zero(local_settings, hashed_provider)
    batch = projected([msg(f"e{i}", f"text {i}") for i in range(3)])
    released: list[bool] = []
    first, second = _Staging("one", OSError(5, "I/O error")), _Staging("two")
    with pytest.raises(OSError, match="I/O error"):
        shard._apply_all({"one": first, "two": second}, batch, lambda: released.append(True))
    assert second.committed == [0, 1, 2] and released == [True]

    staged, failing = _Staging("one"), _Failing("two")
    with pytest.raises(OSError, match="No space") as raised:
        shard._apply_all({"one": staged, "two": failing}, batch, lambda: released.append(True))
    assert staged.committed == [0, 1, 2] and released == [True, True]
    assert not getattr(raised.value, "__notes__", [])

    broken, failing = _Staging("one", OSError(5, "I/O error")), _Failing("two")
    with pytest.raises(OSError, match="No space") as raised:
        shard._apply_all({"one": broken, "two": failing}, batch, lambda: released.append(True))
    assert "a staged commit failed too" in " ".join(raised.value.__notes__)


async def test_a_batch_that_fails_in_a_model_is_still_timed(
    local_settings: Settings, hashed_provider: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``prme_projector_apply_duration_seconds`` counts a batch whose ``apply`` raised (it
    is then applied one record at a time), as it did before models could stage."""
    settings = local_settings.replace(log={"partitions": 1})
    await _fill(settings, 40, owners=2)
    apply = GraphModel.apply

    def refuses_batches(model: GraphModel, batch: list[ProjectedRecord]) -> None:
        if len(batch) > 1:
            raise InvalidInput("one at a time, please")
        apply(model, batch)

    monkeypatch.setattr(GraphModel, "apply", refuses_batches)
    engine = await MemoryEngine.create(settings=settings, embedding_provider=hashed_provider)
    try:
        await engine.runner.catch_up(timeout_s=60)
        registry = engine.metrics.registry
        counts = {
            name: registry.get_sample_value(
                "prme_projector_apply_duration_seconds_count", {"model": name}
            )
            for name in ("graph", "lexical")
        }
        assert engine.runner.dead_letter_count == 0
    finally:
        await engine.close()
    assert counts["graph"] is not None and counts["graph"] >= 1
    assert counts["lexical"] is not None and counts["lexical"] >= 1


async def test_a_rebuilds_last_catch_up_takes_the_owned_shards_turn(
    local_settings: Settings, hashed_provider: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The records written during a rebuild are replayed into the staged shard under the
    partition's lock, which the partition's live batches wait on: that last replay takes
    the owned shards' gate, not a turn behind the background gate's replay chunks."""
    settings = local_settings.replace(log={"partitions": 1})
    await _fill(settings, 300, owners=3)
    gates: list[tuple[str, int, object]] = []  # (shard folder, first offset, gate held)
    apply_all = Shard._apply_all

    def noted(shard: Shard, live: Any, projected: list[ProjectedRecord], release: Any) -> Any:
        gates.append((shard.directory.name, projected[0].offset, shard.apply_gate))
        return apply_all(shard, live, projected, release)

    monkeypatch.setattr(Shard, "_apply_all", noted)
    transport = open_transport(settings)
    await transport.start()
    runner = ProjectorRunner(settings, transport, hashed_provider)
    replay = runner._replay
    producer = Producer(transport)

    async def writes_after_the_bulk(staged: Shard, partition: int, *args: Any) -> int:
        replayed = await replay(staged, partition, *args)
        if staged.apply_gate is runner._background_gate:  # the bulk: now write 20 more
            for index in range(20):
                await producer.append_message(MessageDraft(owner="user0", content=f"late {index}"))
        return replayed

    monkeypatch.setattr(runner, "_replay", writes_after_the_bulk)
    try:
        await runner.start()
        await runner.catch_up(timeout_s=60)
        replayed = await runner.rebuild(processes=1)
        await runner.catch_up(timeout_s=60)
    finally:
        await runner.close()
        await transport.close()
    assert replayed == {0: 320}
    staged = [(o, gate) for folder, o, gate in gates if folder.endswith(STAGING_SUFFIX)]
    assert {gate for o, gate in staged if o < 300} == {runner._background_gate}
    assert {gate for o, gate in staged if o >= 300} == {runner._apply_gate}
    assert runner._apply_gate is not runner._background_gate


@pytest.mark.parametrize("processes", [1, 2])
async def test_rebuild_reports_progress_and_keeps_every_digest(
    local_settings: Settings,
    hashed_provider: Any,
    processes: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await _fill(local_settings, 600, owners=7)
    reported: list[int] = []
    workers: list[object] = []
    start = rebuild_worker._start

    async def counted(job: rebuild_worker.RebuildJob) -> Any:
        workers.append(job)
        return await start(job)

    monkeypatch.setattr(rebuild_worker, "_start", counted)
    monkeypatch.setattr(rebuild_worker, "MIN_RECORDS_PER_WORKER", 1)  # a small pack
    async with await MemoryEngine.open(
        settings=local_settings, embedding_provider=hashed_provider, create_if_missing=True
    ) as engine:
        before = {p: s.digests() for p, s in engine.runner.shards.items() if s.models}
        cache = engine.runner.vector_cache
        hits, misses = cache.hits, cache.misses
        replayed = await engine.rebuild(progress=reported.append, processes=processes)
        after = {p: s.digests() for p, s in engine.runner.shards.items() if s.models}
        # Every text came from the vector cache, in this process or in the workers.
        assert (cache.hits - hits, cache.misses - misses) == (600, 0)
    assert sum(reported) == sum(replayed.values()) == 600
    assert len(replayed) > 1
    assert after == before
    assert len(workers) == (0 if processes == 1 else processes)
    assert not list((Path(local_settings.data_dir) / "shards").glob("*.rebuild"))


class _RefusedInAWorker(HashedBagOfWordsProvider):
    """Pickles, but does not unpickle in another process (as a provider whose class the
    worker cannot import)."""

    def __reduce__(self) -> Any:
        return (_made_in, (os.getpid(), self.dimension))


def _made_in(pid: int, dimension: int) -> _RefusedInAWorker:
    if os.getpid() != pid:
        raise RuntimeError("this provider stays in the process that made it")
    return _RefusedInAWorker(dimension)


def test_workers_are_started_only_for_shares_worth_their_start() -> None:
    per = rebuild_worker.MIN_RECORDS_PER_WORKER
    assert rebuild_worker.workers_for({0: 6, 1: 0}, 4) == 1  # a demo pack: in this process
    assert rebuild_worker.workers_for({p: per for p in range(12)}, 4) == 4
    assert rebuild_worker.workers_for({0: 10 * per, 1: 0}, 4) == 1  # one busy partition
    assert rebuild_worker.workers_for({0: per, 1: per, 2: 1}, 4) == 2
    assert rebuild_worker.workers_for({p: per for p in range(12)}, 1) == 1


@pytest.fixture
def small_packs_use_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rebuild_worker, "MIN_RECORDS_PER_WORKER", 1)


async def _rebuild_with_workers(
    settings: Settings, provider: Any, caplog: pytest.LogCaptureFixture
) -> str:
    """Rebuild 200 records asking for 2 workers; checks every digest is kept and no staging
    directory is left; returns what the rebuild logged."""
    await _fill(settings, 200, owners=5)
    async with await MemoryEngine.open(
        settings=settings, embedding_provider=provider, create_if_missing=True
    ) as engine:
        before = {p: s.digests() for p, s in engine.runner.shards.items() if s.models}
        with caplog.at_level(logging.INFO, logger="prme.projectors.rebuild_worker"):
            replayed = await engine.rebuild(processes=2)
        after = {p: s.digests() for p, s in engine.runner.shards.items() if s.models}
    assert sum(replayed.values()) == 200 and after == before
    assert not list((Path(settings.data_dir) / "shards").glob("*.rebuild"))
    return caplog.text


@pytest.mark.usefixtures("small_packs_use_workers")
async def test_a_failed_worker_leaves_the_rebuild_to_this_process(
    local_settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    logged = await _rebuild_with_workers(local_settings, _RefusedInAWorker(), caplog)
    assert "a rebuild worker failed" in logged
    assert "stays in the process that made it" in logged


async def _digests(engine: MemoryEngine) -> dict[int, dict[str, str]]:
    return {p: s.digests() for p, s in engine.runner.shards.items() if s.models}


async def _rebuilt(
    settings: Settings, provider: Any, processes: int
) -> tuple[dict[int, dict[str, str]], dict[int, int]]:
    """Rebuild the pack in ``settings``; its digests (checked unchanged) and what was
    replayed per partition."""
    async with await MemoryEngine.open(
        settings=settings, embedding_provider=provider, create_if_missing=True
    ) as engine:
        before = await _digests(engine)
        replayed = await engine.rebuild(processes=processes)
        assert await _digests(engine) == before
    return before, replayed


@pytest.mark.usefixtures("small_packs_use_workers")
async def test_each_staged_partition_is_swapped_in_while_the_workers_go_on(
    local_settings: Settings, hashed_provider: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _fill(local_settings, 480, owners=24)
    swapped_at: list[float] = []
    workers_done: list[float] = []
    swap, follow = ProjectorRunner._swap, rebuild_worker._follow

    async def timed_swap(self: ProjectorRunner, *args: Any) -> None:
        swapped_at.append(time.monotonic())
        await swap(self, *args)

    async def timed_follow(*args: Any) -> None:
        try:
            await follow(*args)
        finally:
            workers_done.append(time.monotonic())

    monkeypatch.setattr(ProjectorRunner, "_swap", timed_swap)
    monkeypatch.setattr(rebuild_worker, "_follow", timed_follow)
    before, replayed = await _rebuilt(local_settings, hashed_provider, processes=2)
    assert sum(replayed.values()) == 480
    assert len(workers_done) == 2 and len(swapped_at) == len(before) > 2
    assert min(swapped_at) < max(workers_done)  # not all swapped after the last worker


@pytest.mark.usefixtures("small_packs_use_workers")
async def test_a_worker_killed_mid_rebuild_leaves_only_what_it_had_not_staged(
    local_settings: Settings,
    hashed_provider: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    await _fill(local_settings, 480, owners=24)
    children: list[Any] = []
    swapped: list[int] = []
    replayed_here: set[int] = set()
    start, swap, replay = rebuild_worker._start, ProjectorRunner._swap, ProjectorRunner._replay

    async def kept(job: rebuild_worker.RebuildJob) -> Any:
        children.append(await start(job))
        return children[-1]

    async def swap_then_kill(self: ProjectorRunner, shard: Any, *args: Any) -> None:
        for child in children:  # at the first staged partition: every worker dies
            if child.returncode is None:
                child.kill()
        swapped.append(shard.partition)
        await swap(self, shard, *args)

    async def noted(self: ProjectorRunner, staged: Any, partition: int, *args: Any) -> int:
        replayed_here.add(partition)
        return await replay(self, staged, partition, *args)

    monkeypatch.setattr(rebuild_worker, "_start", kept)
    monkeypatch.setattr(ProjectorRunner, "_swap", swap_then_kill)
    monkeypatch.setattr(ProjectorRunner, "_replay", noted)
    with caplog.at_level(logging.WARNING, logger="prme.projectors.rebuild_worker"):
        before, replayed = await _rebuilt(local_settings, hashed_provider, processes=2)
    assert sum(replayed.values()) == 480
    assert "a rebuild worker failed" in caplog.text
    assert sorted(swapped) == sorted(before)
    from_staging = set(swapped) - replayed_here
    assert from_staging and replayed_here  # the staged ones kept, the rest replayed here
    assert not list((Path(local_settings.data_dir) / "shards").glob("*.rebuild"))


async def test_a_cancelled_rebuild_swaps_in_no_partition_it_had_not_started(
    local_settings: Settings, hashed_provider: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _fill(local_settings, 480, owners=24)
    started: list[int] = []
    first = asyncio.Event()
    replay = ProjectorRunner._replay

    async def staging_everything(
        runner: ProjectorRunner, targets: dict[int, int], *args: Any
    ) -> None:
        *_, staged = args
        for partition in targets:  # reported staged to nothing: replayed by this process
            staged(partition, StagedPartition(0, -1))
        await asyncio.sleep(3600)  # workers still going

    async def noted(self: ProjectorRunner, shard: Any, partition: int, *args: Any) -> int:
        started.append(partition)
        first.set()
        return await replay(self, shard, partition, *args)

    monkeypatch.setattr(rebuild_worker, "replay_in_processes", staging_everything)
    monkeypatch.setattr(rebuild_worker, "MIN_RECORDS_PER_WORKER", 1)
    monkeypatch.setattr(ProjectorRunner, "_replay", noted)
    async with await MemoryEngine.open(
        settings=local_settings, embedding_provider=hashed_provider, create_if_missing=True
    ) as engine:
        before = await _digests(engine)
        rebuild = asyncio.ensure_future(engine.rebuild(processes=2))
        await asyncio.wait_for(first.wait(), 30)
        rebuild.cancel()
        with pytest.raises(asyncio.CancelledError):
            await rebuild
        assert await _digests(engine) == before
    assert len(before) > REBUILD_CONCURRENCY
    assert len(set(started)) <= REBUILD_CONCURRENCY  # the others never started


@pytest.mark.usefixtures("small_packs_use_workers")
async def test_a_provider_that_does_not_pickle_rebuilds_in_this_process(
    local_settings: Settings, hashed_provider: Any, caplog: pytest.LogCaptureFixture
) -> None:
    hashed_provider.lock = threading.Lock()  # a provider holding a lock cannot travel
    assert "does not pickle" in await _rebuild_with_workers(local_settings, hashed_provider, caplog)


@pytest.mark.usefixtures("small_packs_use_workers")
async def test_a_rebuild_under_qdrant_local_mode_stays_in_this_process(
    local_settings: Settings, hashed_provider: Any, caplog: pytest.LogCaptureFixture
) -> None:
    qdrant = {"path": str(Path(local_settings.data_dir).parent / "qdrant"), "collection": "m"}
    logged = await _rebuild_with_workers(
        local_settings.replace(qdrant=qdrant), hashed_provider, caplog
    )
    assert "qdrant.path is opened by one process" in logged  # a worker could not open it
    assert "failed" not in logged


async def test_history_and_events_store_the_log_bytes_as_given(
    local_settings: Settings, hashed_provider: Any
) -> None:
    producer = Producer(open_transport(local_settings))
    record = producer.build_message(MessageDraft(owner="alice", session_id="s", content="hi"))
    # A valid encoding with the fields in another order: decoding accepts it, re-encoding
    # would not give these bytes back.
    fields = msgspec.to_builtins(record)
    given = msgspec.msgpack.encode(dict(reversed(list(fields.items()))))
    assert decode_record(given) == record and given != encode_record(record)
    transport = open_transport(local_settings)
    await transport.start()
    position = await transport.append(LogItem(b"alice", given))
    await transport.close()
    async with await MemoryEngine.open(
        settings=local_settings, embedding_provider=hashed_provider, create_if_missing=True
    ) as engine:
        assert [m.content for m in await engine.history("alice", "s")] == ["hi"]
    shard = Path(local_settings.data_dir) / "shards" / f"p{position.partition}"
    for relative, table in (
        ("history/history.sqlite3", "entries"),
        ("events/events.sqlite3", "events"),
    ):
        with sqlite3.connect(shard / relative) as db:
            assert db.execute(f"SELECT record FROM {table}").fetchall() == [(given,)]


def partition_zero(settings: Settings, provider: Any) -> Any:
    """A (not yet opened) shard of partition 0 in ``settings``' data dir."""
    from prme.projectors.embeddings.validation import identity_of
    from prme.projectors.shard import Shard

    return Shard(Path(settings.data_dir) / "shards" / "p0", 0, settings, identity_of(provider))


async def test_two_callers_opening_a_shard_at_once_open_it_once(
    local_settings: Settings, hashed_provider: Any
) -> None:
    import asyncio

    shard = partition_zero(local_settings, hashed_provider)
    try:
        await asyncio.gather(shard.ensure_open(), shard.ensure_open())  # no WouldBlock
        assert sorted(shard.models) == ["events", "graph", "history", "lexical", "vector"]
    finally:
        await shard.close()


async def test_a_failing_model_close_still_closes_the_others_and_a_second_close_waits(
    local_settings: Settings, hashed_provider: Any
) -> None:
    import asyncio

    shard = partition_zero(local_settings, hashed_provider)
    await shard.ensure_open()
    models = dict(shard.models)
    graph_close = models["graph"].close

    def failing_close() -> None:
        graph_close()
        raise OSError("disk gone")

    models["graph"].close = failing_close  # type: ignore[method-assign]
    first, second = shard.close(), shard.close()
    outcomes = await asyncio.gather(first, second, return_exceptions=True)
    assert [type(outcome) for outcome in outcomes] == [OSError, OSError]
    assert shard.models == {}
    # Every other model was closed too: their files open again in a new shard.
    again = partition_zero(local_settings, hashed_provider)
    try:
        await again.ensure_open()
        assert sorted(again.models) == sorted(models)
    finally:
        await again.close()
    with pytest.raises(OSError, match="disk gone"):
        await shard.close()
