"""The background HNSW build of an embedded vector shard (``vector_index_build``).

At a low threshold (2,000 points of dimension 8) and a full-scan threshold of 1 KB, so
every search after the build walks the graph. Each indexed model is checked against a
reference model that never builds, fed the same batches: same search results, same digest.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from prme import MemoryEngine
from prme.producers.producer import MessageDraft
from prme.projectors.model import ProjectedRecord
from prme.projectors.stores import vector_edge, vector_index_build
from prme.projectors.stores.vector_base import VectorHit
from prme.projectors.stores.vector_edge import EdgeVectorModel
from prme.projectors.stores.vector_index_build import IndexBuilder, IndexPolicy
from prme.schemas.config import Settings

from .record_builders import archived, erased
from .vector_contract import DIM, IDENTITY, ids, lifecycle, message, node_of

THRESHOLD = 2000
POLICY = IndexPolicy(threshold=THRESHOLD, full_scan_threshold_kb=1)
WAIT_S = 60.0


def directories(parent: Path) -> list[str]:
    """What ``parent`` holds, stores' rewrite marks (``p0.rewrites``) aside: no build copy
    or retired shard is left."""
    return sorted(p.name for p in parent.iterdir() if not p.name.endswith(".rewrites"))


def unit(rng: random.Random) -> list[float]:
    return [rng.gauss(0.0, 1.0) for _ in range(DIM)]


def batch(start: int, count: int, seed: int, owner: str = "alice") -> list[ProjectedRecord]:
    rng = random.Random(seed)
    return [message(offset, unit(rng), owner=owner) for offset in range(start, start + count)]


QUERIES = [unit(random.Random(1000 + n)) for n in range(20)]


def searches(model: EdgeVectorModel) -> list[list[VectorHit]]:
    return [model.search(query, "alice", None, 10) for query in QUERIES]


def found_by_own_vector(model: EdgeVectorModel, items: list[ProjectedRecord]) -> bool:
    return all(
        [hit.node_id for hit in model.search(item.vector, "alice", None, 1)] == [node_of(item)]
        for item in items
        if item.vector is not None
    )


@pytest.fixture
def models(tmp_path: Path) -> Iterator[tuple[EdgeVectorModel, EdgeVectorModel]]:
    indexed = EdgeVectorModel(tmp_path / "p0", IDENTITY, POLICY)
    reference = EdgeVectorModel(tmp_path / "reference", IDENTITY)
    yield indexed, reference
    indexed.close()
    reference.close()


def apply(batch_: list[ProjectedRecord], *models: EdgeVectorModel) -> None:
    for model in models:
        model.apply(batch_)


@pytest.fixture
def gated_build(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """The build waits (copy taken, writes being noted) until the event is set."""
    gate = threading.Event()
    build = IndexBuilder._build

    def gated(self: IndexBuilder, copy: Path) -> None:
        assert gate.wait(WAIT_S)
        build(self, copy)

    monkeypatch.setattr(IndexBuilder, "_build", gated)
    yield gate
    gate.set()  # before the models close


def test_past_the_threshold_the_index_is_swapped_in_with_the_writes_made_meanwhile(
    tmp_path: Path, models: tuple[EdgeVectorModel, EdgeVectorModel], gated_build: threading.Event
) -> None:
    indexed, reference = models
    first = batch(0, THRESHOLD - 1, seed=1)
    apply(first, indexed, reference)
    status = indexed.index_status()
    assert status is not None and not status.building and status.indexed == 0
    before = searches(indexed)
    assert before == searches(reference)

    apply(batch(THRESHOLD - 1, 1, seed=2), indexed, reference)  # the 2,000th point
    status = indexed.index_status()
    assert status is not None and status.building
    # While the child builds: new points, a lifecycle change of an old one, and an owner
    # who comes and is erased; every search answers from the live shard.
    during = batch(THRESHOLD, 50, seed=3)
    bob = batch(THRESHOLD + 50, 20, seed=4, owner="bob")
    changes = [
        lifecycle(THRESHOLD + 70, archived, node_of(first[0])),
        ProjectedRecord(offset=THRESHOLD + 71, record=erased("erase-bob", owner="bob")),
    ]
    for part in (during, bob, changes):
        apply(part, indexed, reference)
    assert searches(indexed) == searches(reference)
    status = indexed.index_status()
    assert status is not None and status.building and status.indexed == 0

    gated_build.set()
    assert indexed.wait_index_idle(WAIT_S)
    status = indexed.index_status()
    assert status is not None and not status.building and status.indexed >= THRESHOLD
    assert searches(indexed) == searches(reference)
    assert indexed.digest() == reference.digest()
    assert found_by_own_vector(indexed, during)
    assert indexed.count("bob") == 0
    archived_vector = first[0].vector
    assert archived_vector is not None
    assert node_of(first[0]) not in ids(indexed.search(archived_vector, "alice", None, 5))

    after = batch(THRESHOLD + 72, 30, seed=5)  # into the appendable segment: found at once
    apply(after, indexed, reference)
    assert found_by_own_vector(indexed, after)
    assert indexed.digest() == reference.digest()
    assert directories(tmp_path) == ["p0", "reference"]

    indexed.close()
    reopened = EdgeVectorModel(tmp_path / "p0", IDENTITY, POLICY)
    try:
        status = reopened.index_status()
        assert status is not None and status.indexed >= THRESHOLD and not status.building
        assert reopened.digest() == reference.digest()
    finally:
        reopened.close()


def test_queries_and_the_event_loop_keep_running_during_a_build(
    models: tuple[EdgeVectorModel, EdgeVectorModel],
) -> None:
    indexed, reference = models
    apply(batch(0, THRESHOLD, seed=1), reference)
    expected = searches(reference)[:3]

    async def serve() -> tuple[list[list[list[VectorHit]]], int]:
        loop = asyncio.get_running_loop()
        shard_thread = ThreadPoolExecutor(max_workers=1)  # a shard's model calls
        ticks: list[float] = []
        stop = asyncio.Event()

        async def heartbeat() -> None:
            while not stop.is_set():
                ticks.append(time.monotonic())
                await asyncio.sleep(0.01)

        def run(function: Callable[..., Any], *args: Any) -> Any:
            return loop.run_in_executor(shard_thread, function, *args)

        beating = asyncio.create_task(heartbeat())
        answers: list[list[list[VectorHit]]] = []
        try:
            await run(indexed.apply, batch(0, THRESHOLD, seed=1))
            started = time.monotonic()
            while (await run(indexed.index_status)).building:
                assert time.monotonic() < started + WAIT_S, "the build did not finish"
                answers.append(
                    [await run(indexed.search, q, "alice", None, 10) for q in QUERIES[:3]]
                )
            finished = time.monotonic()
        finally:
            stop.set()
            await beating
            shard_thread.shutdown()
        return answers, sum(started <= t <= finished for t in ticks)

    answers, beats = asyncio.run(serve())
    assert answers, "no query was answered while the index was being built"
    assert all(answer == expected for answer in answers)
    assert beats >= 3, "the event loop stalled during the build"
    status = indexed.index_status()
    assert status is not None and status.indexed >= THRESHOLD
    assert searches(indexed) == searches(reference)


def test_a_killed_build_leaves_the_shard_as_it_was_and_a_later_build_succeeds(
    tmp_path: Path,
    models: tuple[EdgeVectorModel, EdgeVectorModel],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    indexed, reference = models
    popen = subprocess.Popen
    killed: list[int] = []

    def kill_the_first(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        process = popen(*args, **kwargs)
        if not killed:
            process.send_signal(signal.SIGKILL)
            killed.append(process.pid)
        return process

    monkeypatch.setattr(vector_index_build.subprocess, "Popen", kill_the_first)
    apply(batch(0, THRESHOLD, seed=1), indexed, reference)
    assert indexed.wait_index_idle(WAIT_S)
    assert killed
    status = indexed.index_status()
    assert status is not None and status.indexed == 0 and not status.building
    assert directories(tmp_path) == ["p0", "reference"]
    assert searches(indexed) == searches(reference)
    assert indexed.digest() == reference.digest()

    # Not retried at once; a quarter of the threshold later, it is (and succeeds).
    apply(batch(THRESHOLD, THRESHOLD // 4 - 1, seed=2), indexed, reference)
    status = indexed.index_status()
    assert status is not None and not status.building
    apply(batch(THRESHOLD + THRESHOLD // 4 - 1, 1, seed=3), indexed, reference)
    assert indexed.wait_index_idle(WAIT_S)
    status = indexed.index_status()
    assert status is not None and status.indexed >= THRESHOLD
    assert indexed.digest() == reference.digest()


@pytest.mark.parametrize("quantization", [True, False])
def test_a_build_stores_int8_codes_when_the_policy_says_so_and_scores_stay_exact(
    tmp_path: Path, quantization: bool
) -> None:
    indexed = EdgeVectorModel(
        tmp_path / "p0", IDENTITY, dataclasses.replace(POLICY, quantization=quantization)
    )
    reference = EdgeVectorModel(tmp_path / "reference", IDENTITY)
    try:
        items = batch(0, THRESHOLD, seed=1)
        apply(items, indexed, reference)
        assert indexed.wait_index_idle(WAIT_S)
        status = indexed.index_status()
        assert status is not None and status.indexed >= THRESHOLD
        config = json.loads((tmp_path / "p0" / "edge_config.json").read_text())
        int8 = {"scalar": {"type": "int8", "quantile": 0.99, "always_ram": True}}
        assert config.get("quantization_config") == (int8 if quantization else None)

        vectors = {node_of(item): np.asarray(item.vector) for item in items}
        for query in QUERIES[:5]:
            found = indexed.search(query, "alice", None, 300)
            exact = {hit.node_id for hit in reference.search(query, "alice", None, 300)}
            # Rescored on the float vectors: every score is the exact cosine.
            for hit in found:
                vector, wanted = vectors[hit.node_id], np.asarray(query)
                cosine = vector @ wanted / np.linalg.norm(vector) / np.linalg.norm(wanted)
                assert hit.score == pytest.approx(cosine, abs=1e-5)
            assert len({hit.node_id for hit in found} & exact) >= 0.95 * len(exact)
        assert indexed.digest() == reference.digest()
    finally:
        indexed.close()
        reference.close()


def test_with_quantization_off_a_shard_that_has_codes_is_searched_on_its_floats(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    indexed = EdgeVectorModel(tmp_path / "p0", IDENTITY, POLICY)
    reference = EdgeVectorModel(tmp_path / "reference", IDENTITY)
    try:
        apply(batch(0, THRESHOLD, seed=1), indexed, reference)
        assert indexed.wait_index_idle(WAIT_S)
    finally:
        indexed.close()
    requests: list[Any] = []
    query_request = vector_edge.QueryRequest

    def noted(*args: Any, **kwargs: Any) -> Any:
        requests.append(kwargs)
        return query_request(*args, **kwargs)

    monkeypatch.setattr(vector_edge, "QueryRequest", noted)
    off = dataclasses.replace(POLICY, quantization=False)
    reopened = EdgeVectorModel(tmp_path / "p0", IDENTITY, off)
    try:
        config = json.loads((tmp_path / "p0" / "edge_config.json").read_text())
        assert config["quantization_config"]["scalar"]["type"] == "int8"  # kept on disk
        expected = searches(reference)
        requests.clear()
        assert searches(reopened) == expected
        assert requests and all(r["params"].quantization.ignore for r in requests)
    finally:
        reopened.close()
        reference.close()


def test_leftovers_of_a_crash_are_removed_or_undone_on_open(tmp_path: Path) -> None:
    live = tmp_path / "p0"
    with EdgeVectorModel(live, IDENTITY, POLICY) as model:
        model.apply(batch(0, 100, seed=1))
        digest = model.digest()
    retired = tmp_path / "p0.index-retired"

    # A build copy of a process that died, and a retired directory left after a swap.
    shutil.copytree(live, tmp_path / "p0.index-build-0123456789ab")
    shutil.copytree(live, retired)
    with EdgeVectorModel(live, IDENTITY, POLICY) as model:
        assert model.digest() == digest
    assert directories(tmp_path) == ["p0"]

    # Killed between the swap's two renames: the live directory is gone (the opener makes
    # an empty one), its predecessor is complete.
    live.rename(retired)
    live.mkdir()
    with EdgeVectorModel(live, IDENTITY, POLICY) as model:
        assert model.digest() == digest
        assert model.count() == 100
    assert directories(tmp_path) == ["p0"]


_BUILDING_PROCESS = textwrap.dedent(
    """
    import subprocess, sys, threading
    from pathlib import Path
    from prme.projectors.stores import vector_edge, vector_index_build
    from prme.projectors.stores.vector_edge import EdgeVectorModel
    from tests.test_vector_index_build import POLICY, THRESHOLD, batch
    from tests.vector_contract import IDENTITY

    spawned = threading.Event()
    popen = subprocess.Popen

    def spy(*args, **kwargs):
        process = popen(*args, **kwargs)
        print(process.pid, flush=True)
        spawned.set()
        return process

    vector_index_build.subprocess.Popen = spy
    model = EdgeVectorModel(Path(sys.argv[1]), IDENTITY, POLICY)
    model.apply(batch(0, THRESHOLD, seed=1))
    assert spawned.wait(60)
    sys.stdin.read()  # until killed
    """
)


def _read_line(stream: Any, timeout_s: float) -> str:
    ready, _, _ = select.select([stream], [], [], timeout_s)
    assert ready, f"nothing read within {timeout_s} s"
    return str(stream.readline().decode())


def _wait_gone(pid: int, timeout_s: float) -> bool:
    try:
        handle = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        ready, _, _ = select.select([handle], [], [], timeout_s)
        return bool(ready)
    finally:
        os.close(handle)


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfd_open (Linux)")
def test_a_process_killed_during_a_build_leaves_its_shard_intact(tmp_path: Path) -> None:
    live = tmp_path / "p0"
    root = Path(__file__).resolve().parents[1]
    process = subprocess.Popen(
        [sys.executable, "-c", _BUILDING_PROCESS, str(live)],
        cwd=root,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        child = int(_read_line(process.stdout, WAIT_S))
    finally:
        process.kill()
        process.wait()
        assert process.stdin is not None and process.stdout is not None
        process.stdin.close()
        process.stdout.close()
    # The build child notices that its parent is gone and exits.
    assert _wait_gone(child, WAIT_S)
    with EdgeVectorModel(tmp_path / "reference", IDENTITY) as reference:
        reference.apply(batch(0, THRESHOLD, seed=1))
        expected = reference.digest()
    with EdgeVectorModel(live, IDENTITY) as model:
        assert model.digest() == expected
        assert model.count() == THRESHOLD
    assert directories(tmp_path) == ["p0", "reference"]


async def test_an_engine_past_the_threshold_indexes_its_shard_and_rebuild_keeps_digests(
    local_settings: Settings, hashed_provider: Any
) -> None:
    settings = local_settings.replace(qdrant={"index_threshold": 300})
    drafts = [
        MessageDraft(owner="alice", content=f"note {i} about gardening and tea", session_id="s")
        for i in range(1200)
    ]
    async with await MemoryEngine.create(
        settings=settings, embedding_provider=hashed_provider
    ) as engine:
        for start in range(0, len(drafts), 400):
            await engine.store_many(drafts[start : start + 400])
        [shard] = [s for s in engine.runner.shards.values() if s.models]  # one owner
        before = shard.digests()
        vector = shard.models["vector"]
        assert isinstance(vector, EdgeVectorModel)
        assert await asyncio.to_thread(vector.wait_index_idle, WAIT_S)
        status = vector.index_status()
        assert status is not None and status.points == 1200 and status.indexed >= 900
        assert shard.digests() == before

        await engine.rebuild(["vector"])  # a build the staged shard starts is cancelled
        assert shard.digests() == before
        response = await engine.retrieve("gardening and tea", "alice")
        assert response.results
    leftovers = [p.name for p in settings.data_path.glob("shards/*/*") if ".index-" in p.name]
    assert leftovers == []
