"""A node whose projector fails leaves its consumer group: its partitions move to the
healthy nodes, it keeps answering ``/v1/health`` and says why in ``/v1/ready`` and
``prme status``. And a model that cannot be had fails the start, before joining."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from prme.projectors.embeddings.model_assets import MODEL_FILE, default_model_dir

from .cluster_harness import Node, node_env, running, wait_ready, wait_split

PARTITIONS = 12
OWNERS = 24
TAKEOVER_S = 90.0
"""The bound on the healthy node serving every owner once the other one failed."""


def corrupt_default_model(default_model: Path, models_dir: Path) -> None:
    """A copy of the default model whose ONNX file is garbage of the right size: it passes
    the quick check at start (manifest and sizes) and fails when the model loads, at the
    first text the projector embeds (a truncated or damaged download)."""
    target = default_model_dir(models_dir)
    shutil.copytree(default_model, target)
    onnx = target / MODEL_FILE
    onnx.write_bytes(b"\0" * onnx.stat().st_size)


def served(node: Node, owner: str) -> bool:
    try:
        response = node.get("/v1/history", params={"user_id": owner})
    except httpx.HTTPError:
        return False
    return response.status_code == 200 and [m["content"] for m in response.json()] == [
        f"{owner} waters the ferns"
    ]


def test_a_node_whose_projector_fails_leaves_the_group_and_its_owners_move(
    kafka_bootstrap: str, tmp_path: Path, default_model_dir: Path
) -> None:
    """Found by an operator trial: a node whose model failed to load kept heartbeating, so
    the group never moved its partitions, and every read for their owners answered 503 on
    every node for as long as it ran."""
    topic = f"failed-{uuid.uuid4().hex[:8]}"
    env = node_env(kafka_bootstrap, topic, f"{topic}-group")
    broken_models = tmp_path / "broken-models"
    corrupt_default_model(default_model_dir, broken_models)
    healthy = Node(tmp_path, "healthy", env)
    broken = Node(tmp_path, "broken", {**env, "PRME_MODELS_DIR": str(broken_models)})
    with running([healthy]):
        wait_ready([healthy])
        wait_split([healthy], PARTITIONS)
        with running([broken]):
            # Nothing to embed yet: the broken node joins, takes half, and is ready.
            wait_ready([broken])
            wait_split([healthy, broken], PARTITIONS)
            owners = [f"fern-{i}" for i in range(OWNERS)]
            for owner in owners:  # the broken node's owners fail it at their first apply
                written = healthy.post(
                    "/v1/memories",
                    {"user_id": owner, "content": f"{owner} waters the ferns", "wait": False},
                )
                assert written.status_code in (201, 503), written.text
            deadline = time.monotonic() + TAKEOVER_S
            pending = list(owners)
            while pending:
                pending = [o for o in pending if not served(healthy, o)]
                assert time.monotonic() < deadline, (
                    f"not served by the healthy node: {pending}\n{broken.log()}"
                )
            cluster = healthy.get("/v1/cluster").json()
            assert [m["url"] for m in cluster["members"]] == [healthy.url]
            assert broken.process is not None and broken.process.poll() is None
            assert broken.get("/v1/health").status_code == 200
            ready = broken.get("/v1/ready")
            detail = ready.json()["detail"]
            assert ready.status_code == 503, ready.text
            assert "the projector stopped" in detail and "left consumer group" in detail
            assert served(broken, owners[0])  # it forwards, with the group's new map
            status = broken.status()
            assert "FAILED: the projector stopped" in status.stdout, status.stdout + status.stderr
            assert status.returncode == 1


def test_a_model_that_cannot_be_had_fails_the_start_before_joining(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """The model loads at the first embed: a node without it used to join, take its
    partitions, and fail there. Now it exits 2 at start, one line, nothing joined."""
    topic = f"nomodel-{uuid.uuid4().hex[:8]}"
    env = node_env(kafka_bootstrap, topic, f"{topic}-group")
    env.update(
        {
            "PRME_EMBEDDING__MODEL": "BAAI/bge-small-en-v1.5",
            "PRME_MODELS_DIR": str(tmp_path / "empty-models"),
            "HF_HUB_OFFLINE": "1",  # not in the cache, and never fetched: deterministic
        }
    )
    node = Node(tmp_path, "nomodel", env)
    with running([node]):
        assert node.process is not None
        assert node.process.wait(timeout=120) == 2, node.log()
    log = node.log()
    assert "prme serve: the embedding model BAAI/bge-small-en-v1.5 cannot be loaded" in log


def test_a_project_worker_whose_projector_fails_exits_for_its_supervisor(
    tmp_path: Path, default_model_dir: Path
) -> None:
    """From the review of the failed-projector fix: a `prme project` worker whose projector
    failed stayed up, idle, with nothing to tell its supervisor; it now exits 1 saying
    why (a `--workers` parent then starts it again, up to its crash-loop bound)."""
    broken_models = tmp_path / "broken-models"
    corrupt_default_model(default_model_dir, broken_models)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRME_")}
    env["PRME_MODELS_DIR"] = str(broken_models)
    data_dir = tmp_path / "pack"
    lines = tmp_path / "one.jsonl"
    lines.write_text('{"owner": "fern", "content": "fern waters the ferns"}\n')
    prme = [sys.executable, "-m", "prme.cli"]
    ingest = subprocess.run(
        [*prme, "ingest", str(lines), "--data-dir", str(data_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ingest.returncode == 0, ingest.stderr
    project = subprocess.run(
        [*prme, "project", "--data-dir", str(data_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert project.returncode == 1, project.stderr
    assert "prme project: the projector stopped" in project.stderr, project.stderr


async def test_a_lone_node_whose_projector_stopped_says_so_not_rebalancing(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """From a Kafka fault trial: once the only node's projector had stopped, every read
    answered "no node serves partition N yet (the group is rebalancing)" with Retry-After,
    a wait that never ends; it now names the stopped projector."""
    from prme import MemoryEngine
    from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider
    from prme.query.service import create_app
    from prme.schemas.config import Settings
    from prme.schemas.errors import ShardUnavailable

    topic = f"lone-{uuid.uuid4().hex[:8]}"
    settings = Settings(data_dir=str(tmp_path / "node")).replace(
        log={"transport": "kafka", "bootstrap": kafka_bootstrap, "topic": topic},
        cluster={"group": f"{topic}-group", "secret": "lone-secret"},
        query={"consistency_timeout_s": 1.0},
    )
    engine = await MemoryEngine.open(
        settings=settings,
        embedding_provider=HashedBagOfWordsProvider(),
        create_if_missing=True,
        url="http://127.0.0.1:9",
    )
    try:
        await engine.store("before the fault", "alice")
        shard = await engine.runner.shard_for("alice")
        # A real fault in one read model: its SQLite connection goes away under it.
        await shard.run(lambda: shard.models["graph"]._db.close())  # type: ignore[attr-defined]
        with pytest.raises(ShardUnavailable, match="projector stopped"):
            await engine.store("after the fault", "alice")
        await asyncio.wait_for(engine.runner.left_group.wait(), 30)
        transport = httpx.ASGITransport(app=create_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://node") as http:
            read = await http.get("/v1/history", params={"user_id": "alice"})
        assert read.status_code == 503, read.text
        assert "this node's projector stopped" in read.json()["detail"], read.text
        assert "rebalancing" not in read.text
    finally:
        await engine.close()
