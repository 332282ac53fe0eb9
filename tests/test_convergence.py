"""Kill the projector with SIGKILL at random points, restart it, and check its read models
end equal in content to an uninterrupted build of the same log."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from prme.producers.factory import open_transport
from prme.producers.producer import MessageDraft, Producer
from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider
from prme.projectors.embeddings.validation import identity_of
from prme.projectors.shard import Shard, shard_directory
from prme.schemas.config import Settings
from prme.schemas.records import Record, memory_node_id

CHILD = Path(__file__).with_name("projector_child.py")
RECORDS = 4000
KILLS = 10


async def write_workload(settings: Settings, seed: int = 7) -> int:
    """Messages over 20 owners and 3 sessions, with clears, deletes, archives, restores,
    supersedes, a replacement and an erasure mixed in."""
    rng = random.Random(seed)
    transport = open_transport(settings)
    await transport.start()
    producer = Producer(transport)
    messages: dict[str, list[str]] = {}
    written = 0
    try:
        while written < RECORDS:
            owner = f"owner{rng.randrange(20)}"
            session = f"s{rng.randrange(3)}"
            roll = rng.random()
            records: list[Record]
            if roll < 0.80 or not messages.get(owner):
                words = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(4, 16)))
                draft = MessageDraft(
                    owner=owner, session_id=session, content=words, name=owner.title()
                )
                records = [producer.build_message(draft)]
                messages.setdefault(owner, []).append(records[0].event_id)
            elif roll < 0.85:
                records = [producer.build_control("history_cleared", owner, session_id=session)]
            elif roll < 0.90:
                target = rng.choice(messages[owner])
                records = [producer.build_control("message_deleted", owner, target_event_id=target)]
            elif roll < 0.95:
                node = memory_node_id(rng.choice(messages[owner]))
                kind = "node_archived" if rng.random() < 0.7 else "node_restored"
                records = [producer.build_control(kind, owner, node_id=node)]
            elif roll < 0.98 and len(messages[owner]) > 1:
                old, new = rng.sample(messages[owner], 2)
                records = [
                    producer.build_control(
                        "node_superseded",
                        owner,
                        node_id=memory_node_id(old),
                        by_node_id=memory_node_id(new),
                    )
                ]
            else:
                drafts = [
                    MessageDraft(owner=owner, session_id=session, content=f"replacement {written}")
                ]
                records = producer.build_replacement(owner, session, "default", drafts)
            await producer.append_records(records)
            written += len(records)
        await producer.append_records([producer.build_control("owner_erased", "owner3")])
    finally:
        await transport.close()
    return written + 1


WORDS = [
    "Aurora",
    "deploy",
    "approval",
    "Friday",
    "Monday",
    "tea",
    "hiking",
    "Alps",
    "Paris",
    "painting",
    "guitar",
    "sister",
    "adoption",
    "marathon",
    "5",
    "km",
    "budget",
    "$20",
    "meeting",
    "Caroline",
    "Melanie",
    "project",
    "launch",
    "review",
]


def child_log(settings: Settings) -> Path:
    return settings.data_path.with_suffix(".log")


def run_child(settings: Settings, group: str) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "PRME_TEST_SETTINGS": msgspec.json.encode(settings).decode(),
        "PRME_TEST_GROUP": group,
    }
    with child_log(settings).open("a") as log:
        return subprocess.Popen(
            [sys.executable, str(CHILD)], env=env, stdout=subprocess.PIPE, stderr=log, text=True
        )


def project_to_end(settings: Settings, group: str) -> None:
    child = run_child(settings, group)
    out, _ = child.communicate(timeout=600)
    assert child.returncode == 0 and "caught-up" in out, child_log(settings).read_text()[-3000:]


def project_with_kills(settings: Settings, group: str, seed: int = 11) -> int:
    rng = random.Random(seed)
    kills = 0
    for attempt in range(KILLS * 3):
        child = run_child(settings, f"{group}-{attempt}")
        assert child.stdout is not None
        started = child.stdout.readline()
        if started.strip() != "started":
            child.communicate(timeout=60)
            pytest.fail(f"projector did not start: {child_log(settings).read_text()[-3000:]}")
        deadline = time.monotonic() + rng.uniform(0.02, 0.3)
        while time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.01)
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
            kills += 1
        else:
            child.communicate(timeout=30)
        if kills >= KILLS:
            break
    project_to_end(settings, f"{group}-final")
    return kills


async def digests(settings: Settings) -> dict[int, dict[str, str]]:
    identity = identity_of(HashedBagOfWordsProvider())
    result: dict[int, dict[str, str]] = {}
    for partition in range(settings.log.partitions):
        directory = shard_directory(settings.data_path, partition)
        if not directory.exists():
            continue
        shard = Shard(directory, partition, settings, identity)
        await shard.open()
        result[partition] = await shard.run(shard.digests)
        await shard.close()
    return result


async def check_convergence(base: Settings, tmp_path: Path, log_file: bool) -> None:
    await write_workload(base)
    clean = base.replace(data_dir=str(tmp_path / "clean"))
    killed = base.replace(data_dir=str(tmp_path / "killed"))
    if log_file:
        for target in (clean, killed):
            Path(target.data_dir).mkdir(parents=True)
            shutil.copy(Path(base.data_dir) / "log.sqlite3", Path(target.data_dir) / "log.sqlite3")
    await asyncio.to_thread(project_to_end, clean, "clean")
    kills = await asyncio.to_thread(project_with_kills, killed, "killed")
    assert kills >= KILLS
    for run in (clean, killed):
        log = child_log(run).read_text() if child_log(run).exists() else ""
        assert "dead letter" not in log, log[-3000:]
    expected = await digests(clean)
    assert expected and await digests(killed) == expected, child_log(killed).read_text()[-3000:]


async def test_local_projection_converges_after_repeated_sigkills(
    local_settings: Settings, tmp_path: Path
) -> None:
    await check_convergence(local_settings, tmp_path, log_file=True)


@pytest.mark.kafka
async def test_kafka_projection_converges_after_repeated_sigkills(
    kafka_settings: Settings, tmp_path: Path
) -> None:
    await check_convergence(kafka_settings, tmp_path, log_file=False)
