"""`prme project --workers 2` on Kafka: two processes split the partitions through the
consumer group and together project the whole log, each serving its own metrics."""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prme.producers.factory import open_transport
from prme.producers.producer import MessageDraft, Producer
from prme.schemas.config import Settings

pytestmark = pytest.mark.kafka


def projected_events(data_dir: Path) -> int:
    total = 0
    for path in data_dir.glob("shards/p*/events/events.sqlite3"):
        connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            total += connection.execute("SELECT COUNT(*) FROM events").fetchone()[0]
        except sqlite3.OperationalError:
            pass
        finally:
            connection.close()
    return total


def wait_projected(
    data_dir: Path, count: int, workers: subprocess.Popen[str], deadline: float
) -> None:
    """Wait until the pack holds ``count`` events, by ``deadline`` (``time.monotonic()``),
    failing if ``workers`` exit first."""
    while projected_events(data_dir) < count and time.monotonic() < deadline:
        assert workers.poll() is None, workers.stderr.read() if workers.stderr else ""
        time.sleep(0.25)
    assert projected_events(data_dir) == count


def two_free_ports() -> int:
    """A port P such that P and P + 1 are free on the loopback interface."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = int(first.getsockname()[1])
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no two consecutive free ports")


def scrape(port: int) -> dict[str, float]:
    """Each series summed over its labels."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


async def test_two_workers_split_the_partitions_and_project_everything(
    kafka_settings: Settings, kafka_topic: str
) -> None:
    transport = open_transport(kafka_settings)
    await transport.start()
    producer = Producer(transport)
    owners = [f"user{i}" for i in range(40)]
    for owner in owners:
        await producer.append_message(MessageDraft(owner=owner, content=f"hello from {owner}"))
    await transport.close()

    data_dir = kafka_settings.data_path
    env = {
        **os.environ,
        "PRME_LOG__TOPIC": kafka_topic,
        "PRME_LOG__DLQ_TOPIC": kafka_topic + ".dlq",
        "PRME_LOG__PARTITIONS": "4",
    }
    command = [
        sys.executable,
        "-m",
        "prme.cli",
        "project",
        "--workers",
        "2",
        "--transport",
        "kafka",
        "--bootstrap",
        kafka_settings.log.bootstrap,
        "--data-dir",
        str(data_dir),
        "--metrics-port",
        str(port := two_free_ports()),
    ]
    workers = subprocess.Popen(
        command, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    log = ""
    try:
        deadline = time.monotonic() + 120
        wait_projected(data_dir, len(owners), workers, deadline)
        # Each worker serves its own series; together they applied every record, and the
        # lag gauges (refreshed every few seconds) come back to 0.
        while True:
            try:
                workers_metrics = [scrape(port), scrape(port + 1)]
            except httpx.ConnectError:  # a worker still starting
                if time.monotonic() >= deadline:
                    os.killpg(workers.pid, signal.SIGINT)
                    _, log = workers.communicate(timeout=60)
                    pytest.fail(f"a worker's metrics never answered:\n{log[-4000:]}")
                time.sleep(0.5)  # poll interval while the worker starts
                continue
            applied = sum(m.get("prme_projector_records_applied_total", 0) for m in workers_metrics)
            lag = sum(m.get("prme_projector_lag_records", 0) for m in workers_metrics)
            ends = sum(m.get("prme_projector_log_end_offset", 0) for m in workers_metrics)
            if applied == len(owners) and lag == 0 and ends >= len(owners):
                break
            assert time.monotonic() < deadline, workers_metrics
            time.sleep(0.5)  # poll interval: the lag gauges refresh every 5 s
    finally:
        if workers.returncode is None:
            os.killpg(workers.pid, signal.SIGINT)
            _, log = workers.communicate(timeout=60)
    assert workers.returncode == 0, log[-3000:]
    pids = {
        line.split("[")[1].split("]")[0]
        for line in log.splitlines()
        if "assigned partitions" in line
    }
    assert len(pids) == 2, log[-3000:]
