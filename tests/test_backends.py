"""Backends are chosen once from Settings: the workers write vectors where queries read them.

There is no Qdrant server on this machine; ``qdrant.path`` runs the same qdrant-client
backend in its local mode (the vector contract suite tests it the same way)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from qdrant_client import QdrantClient, models

from prme import MemoryEngine
from prme.producers.factory import open_transport
from prme.producers.producer import MessageDraft, Producer
from prme.projectors.backends import VectorBackend
from prme.schemas.config import Settings
from prme.schemas.errors import ConfigurationError

from .test_project_command import wait_projected


def test_the_default_vector_backend_is_the_embedded_edge_shard() -> None:
    assert VectorBackend.from_settings(Settings()).kind == "edge"


def test_a_server_and_a_local_path_at_once_is_a_configuration_error(tmp_path: Path) -> None:
    settings = Settings().replace(qdrant={"url": "http://127.0.0.1:6333", "path": str(tmp_path)})
    with pytest.raises(ConfigurationError, match=r"qdrant\.url.*qdrant\.path"):
        VectorBackend.from_settings(settings)


def owner_points(path: Path, collection: str, owner: str) -> int:
    client = QdrantClient(path=str(path))
    try:
        owner_filter = models.Filter(
            must=[models.FieldCondition(key="owner", match=models.MatchValue(value=owner))]
        )
        return client.count(collection, count_filter=owner_filter).count
    finally:
        client.close()


@pytest.mark.model
async def test_prme_project_writes_vectors_into_the_qdrant_backend_the_engine_reads(
    tmp_path: Path, default_model_dir: Path
) -> None:
    data_dir, qdrant_dir = tmp_path / "pack", tmp_path / "qdrant"
    settings = Settings(data_dir=str(data_dir)).replace(
        log={"partitions": 2}, qdrant={"path": str(qdrant_dir), "collection": "memories"}
    )
    transport = open_transport(settings)
    await transport.start()
    producer = Producer(transport)
    notes = ["Aurora ships on Friday.", "The blue door is the back entrance.", "Tea at four."]
    for note in notes:
        await producer.append_message(MessageDraft(owner="alice", content=note))
    await transport.close()

    env = {
        **os.environ,
        "PRME_DATA_DIR": str(data_dir),
        "PRME_LOG__PARTITIONS": "2",
        "PRME_QDRANT__PATH": str(qdrant_dir),
        "PRME_QDRANT__COLLECTION": "memories",
    }
    worker = subprocess.Popen(
        [sys.executable, "-m", "prme.cli", "project"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        wait_projected(data_dir, len(notes), worker, time.monotonic() + 180)
    finally:
        os.killpg(worker.pid, signal.SIGINT)
        _, log = worker.communicate(timeout=60)
    assert worker.returncode == 0, log[-3000:]

    assert owner_points(qdrant_dir, "memories", "alice") == len(notes)
    edge_files = [p for d in data_dir.glob("shards/p*/vector") for p in d.rglob("*")]
    assert edge_files == []

    async with await MemoryEngine.open(settings=settings, create_if_missing=True) as engine:
        response = await engine.retrieve("When does Aurora ship?", "alice")
    assert response.results[0].text == "Aurora ships on Friday."
    vector = next(c for c in response.receipt.channels if c.name == "vector")
    assert vector.used and vector.error is None
    assert response.receipt.results[0].ranks.get("vector") is not None
