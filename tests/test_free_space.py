"""Writes and rebuilds stop short of a full disk (``limits.min_free_bytes``).

An operations trial filled the data directory's disk under ``prme serve`` and ``prme
rebuild``: both ended in SIGBUS from the engines' memory-mapped files. The disk is not
filled here: a floor above the file system's free space stands for a nearly full one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prme.producers import free_space
from prme.producers.free_space import FreeSpaceGuard, allocated_bytes, check_room
from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider
from prme.query.engine import MemoryEngine
from prme.query.service import create_app
from prme.schemas.config import Settings
from prme.schemas.errors import InsufficientSpace, ShardUnavailable

FULL = 2**62
"""A floor no file system here has free: every check finds the disk nearly full."""
GIB = 1024**3


def test_the_guard_refuses_below_its_floor_and_looks_every_time() -> None:
    """A review: a look trusted for a second let a burst of writes run past the floor."""
    free = [100]
    looks: list[Path] = []

    def free_of(path: Path) -> int:
        looks.append(path)
        return free[0]

    guard = FreeSpaceGuard(Path("/pack"), 1024, free=free_of)
    reason = guard.refusal()
    assert reason is not None
    assert "/pack has 100 B free, less than limits.min_free_bytes (1 KiB" in reason
    assert "PRME_LIMITS__MIN_FREE_BYTES" in reason
    free[0] = 1024
    assert guard.refusal() is None and len(looks) == 2
    half = FreeSpaceGuard(Path("/pack"), 1024, share=0.5, free=free_of)
    free[0] = 600
    assert half.refusal() is None
    free[0] = 500
    assert "less than half of limits.min_free_bytes" in (half.refusal() or "")
    assert FreeSpaceGuard(Path("/pack"), 0, free=free_of).refusal() is None


def test_a_rebuild_needs_room_for_a_second_copy_of_its_models(tmp_path: Path) -> None:
    model = tmp_path / "p0" / "vector"
    model.mkdir(parents=True)
    (model / "segment").write_bytes(b"x" * 64 * 1024)
    needed = allocated_bytes([model])
    assert needed >= 64 * 1024
    check_room(tmp_path, needed, "rebuilding vector", 100, free=lambda _: needed + 100)
    with pytest.raises(InsufficientSpace, match=r"rebuilding vector needs about 64 KiB more"):
        check_room(tmp_path, needed, "rebuilding vector", 100, free=lambda _: needed + 99)
    check_room(tmp_path, needed, "rebuilding vector", 0, free=lambda _: 0)  # (0: no check)


class Disk:
    """What ``shutil.disk_usage`` answers in ``free_space``: ``free`` bytes free."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, free: int) -> None:
        self.free = free
        monkeypatch.setattr(free_space.shutil, "disk_usage", self.usage)

    def usage(self, path: object) -> shutil._ntuple_diskusage:
        return shutil._ntuple_diskusage(10 * GIB, 10 * GIB - self.free, self.free)


async def test_writes_stop_at_the_reserve_and_applying_at_half_of_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    provider = HashedBagOfWordsProvider()
    settings = Settings(data_dir=str(tmp_path / "pack")).replace(limits={"min_free_bytes": GIB})
    engine = await MemoryEngine.create(settings=settings, embedding_provider=provider)
    disk = Disk(monkeypatch, free=2 * GIB)
    try:
        await engine.store("The harbour opens at six.", "alice")
        await engine.store("Bob keeps the boat keys.", "bob")
        disk.free = GIB - 1  # below the reserve: no writes, but the projector applies
        ends = await engine.runner.transport.end_offsets()
        with pytest.raises(ShardUnavailable, match="nothing is appended: .*min_free_bytes"):
            await engine.store("Another one.", "alice")
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=create_app(engine)), base_url="http://prme"
        ) as http:
            refused = await http.post(
                "/v1/memories", json={"user_id": "alice", "content": "And another."}
            )
            assert refused.status_code == 503, refused.text
            assert refused.headers["retry-after"] == "10"  # (space is not freed in a second)
            assert "free some space" in refused.json()["detail"]
            found = await http.post("/v1/retrieve", json={"user_id": "alice", "query": "harbour"})
            assert found.status_code == 200
            assert [r["text"] for r in found.json()["results"]] == ["The harbour opens at six."]
            assert (await http.get("/v1/ready")).status_code == 200
            metrics = text_string_to_metric_families((await http.get("/metrics")).text)
            free = [m.samples[0].value for m in metrics if m.name == "prme_data_free_bytes"]
            assert free == [GIB - 1]
            assert await engine.runner.transport.end_offsets() == ends  # nothing appended
            with pytest.raises(InsufficientSpace, match="rebuilding vector, lexical, graph"):
                await engine.rebuild()
            assert not list((tmp_path / "pack" / "shards").glob("*.rebuild"))
            # An erasure is small and a privacy duty: it is not refused (a review).
            erased = await engine.erase_owner("bob")
            assert erased.token is not None
            assert (await engine.retrieve("boat keys", "bob")).results == []

            disk.free = GIB // 2 - 1  # below half: the projector waits, and says so
            await asyncio.sleep(0.3)
            ready = await http.get("/v1/ready")
            assert ready.status_code == 503
            assert "the projector waits: the file system of" in ready.json()["detail"]
            disk.free = 2 * GIB
            stored = await engine.store("Room again.", "alice")  # applied: it waited no more
            assert stored.token is not None
    finally:
        await engine.close()
    disk.free = GIB // 2 - 1
    with pytest.raises(InsufficientSpace, match="the pack does not open: .*half of"):
        await MemoryEngine.open(settings=settings, embedding_provider=provider)


def test_ingest_and_rebuild_say_so_in_one_line(tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"owner": "alice", "content": "first"}) + "\n")
    pack = ["--data-dir", str(tmp_path / "pack")]
    env = {**os.environ, "PRME_LIMITS__MIN_FREE_BYTES": str(FULL)}

    def prme(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "prme.cli", *args, *pack],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )

    ingest = prme("ingest", str(source), "--quiet")
    assert ingest.returncode == 1, ingest.stderr
    assert ingest.stderr.startswith("prme ingest: nothing is appended: the file system of")
    assert ingest.stderr.strip().endswith(
        "0 records of the file were written, in its order from the first line"
    )
    assert len(ingest.stderr.strip().splitlines()) == 1
    rebuild = prme("rebuild", "--quiet")
    lines = rebuild.stderr.strip().splitlines()
    assert rebuild.returncode == 1 and len(lines) == 1, rebuild.stderr
    assert lines[0].startswith("prme rebuild: the pack does not open: the file system of")


def key_rows(path: Path, owner: str) -> int:
    with contextlib.closing(sqlite3.connect(path)) as db:
        return int(
            db.execute("SELECT count(*) FROM data_keys WHERE owner = ?", (owner,)).fetchone()[0]
        )


class FullDisk:
    """A connection whose writes fail as SQLite's on a full disk (reads still work)."""

    def __init__(self, connection: sqlite3.Connection) -> None:
        self._connection = connection

    def execute(self, sql: str, *args: object) -> object:
        if sql.startswith(("DELETE", "INSERT", "COMMIT")):
            raise sqlite3.OperationalError("database or disk is full")
        return self._connection.execute(sql, *args)

    @property
    def in_transaction(self) -> bool:
        return self._connection.in_transaction


async def test_a_key_store_on_a_full_disk_is_a_503_and_the_erasure_is_sent_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From a new-user trial: with the disk filled from outside to 0 B, an erasure answered
    500 ("internal error: OperationalError") with its marker on the log and the owner's key
    kept, so ``prme audit`` still read the owner's records; and a write by a new owner
    answered 500 the same way (its key was written before the free-space check)."""
    from prme.producers.keys import LocalKeyStore

    provider = HashedBagOfWordsProvider()
    settings = Settings(data_dir=str(tmp_path / "pack")).replace(limits={"min_free_bytes": GIB})
    engine = await MemoryEngine.create(settings=settings, embedding_provider=provider)
    disk = Disk(monkeypatch, free=2 * GIB)
    keys = engine.runner.keys
    assert isinstance(keys, LocalKeyStore)
    try:
        await engine.store("The harbour opens at six.", "alice")
        disk.free = GIB - 1
        with pytest.raises(ShardUnavailable, match="nothing is appended"):
            await engine.store("A first word.", "newcomer")
        assert key_rows(keys.path, "newcomer") == 0
        disk.free = 2 * GIB
        real = keys._require_connection()
        with monkeypatch.context() as full:
            full.setattr(keys, "_require_connection", lambda: FullDisk(real))
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=create_app(engine)), base_url="http://prme"
            ) as http:
                erased = await http.delete("/v1/owners", params={"user_id": "alice"})
            assert erased.status_code == 503, erased.text
            assert erased.json()["error"] == "transport_unavailable"
            assert "send the erasure again" in erased.json()["detail"]
        assert key_rows(keys.path, "alice") == 1  # (the erasure's marker is on the log)
        await engine.erase_owner("alice")  # sent again, with room: the key goes
        assert key_rows(keys.path, "alice") == 0
    finally:
        await engine.close()
