"""Operator output: JSON log lines (one per request, no owner or content), catch-up
progress, and what a rebuild took from the vector cache."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from prme.logs import KafkaClientNoise

pytestmark = pytest.mark.model

OWNER = "owner-9c2e-private"
CONTENT = "The vault combination is written on the blue card"


def prme(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prme.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ.copy(),
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_serve_logs_one_json_line_per_request_without_owner_or_content(tmp_path: Path) -> None:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "prme.cli", "serve", "--port", str(port)]
        + ["--data-dir", str(tmp_path / "pack"), "--log-format", "json"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, server.stderr.read() if server.stderr else ""
            try:
                if httpx.get(f"{url}/v1/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "prme serve did not answer"
            time.sleep(0.2)  # poll interval while the service starts
        body = {"user_id": OWNER, "content": CONTENT}
        assert httpx.post(f"{url}/v1/memories", json=body, timeout=60).status_code == 201
        query = {"user_id": OWNER, "query": "vault combination"}
        assert httpx.post(f"{url}/v1/retrieve", json=query, timeout=60).status_code == 200
    finally:
        server.send_signal(signal.SIGTERM)
        _, err = server.communicate(timeout=60)
    lines = [json.loads(line) for line in err.splitlines() if line.strip()]
    requests = [line for line in lines if line["logger"] == "prme.http"]
    by_route = {(r["method"], r["route"]): r for r in requests}
    stored = by_route[("POST", "/v1/memories")]
    assert stored["status"] == 201 and stored["duration_ms"] > 0
    assert stored["owner_hash"] == hashlib.sha256(OWNER.encode()).hexdigest()[:16]
    assert by_route[("POST", "/v1/retrieve")]["status"] == 200
    assert by_route[("GET", "/v1/health")]["status"] == 200
    assert "owner_hash" not in by_route[("GET", "/v1/health")]
    assert OWNER not in err and "vault" not in err and "blue card" not in err


def test_rebuild_reports_cache_use_and_catch_up_progress(tmp_path: Path, demo_sample: Path) -> None:
    source, sample = demo_sample, demo_sample.read_text()
    data = ["--data-dir", str(tmp_path / "pack")]
    assert prme("ingest", str(source), "--quiet", *data).returncode == 0
    records = len(sample.splitlines())

    result = prme("rebuild", "--model", "vector", *data, "--log-format", "json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    # Opening the pack caught up (encoding every text once); the rebuild reused them all.
    assert report["vectors"] == {"from_cache": records, "encoded": 0}
    assert sum(report["replayed"].values()) == records
    logs = [json.loads(line) for line in result.stderr.splitlines() if line.strip()]
    messages = [line["message"] for line in logs if line["logger"] == "prme.projector"]
    assert any(
        m.startswith(f"catching up: {records} records to apply in partitions") for m in messages
    ), messages
    assert any(m.startswith(f"caught up: {records} records in ") for m in messages), messages


def test_kafka_client_retries_are_logged_once_a_minute_and_rebalances_not_at_all() -> None:
    """The filter ``configure`` installs, on aiokafka's records (a clock it is handed)."""
    now = [0.0]
    noise = KafkaClientNoise(clock=lambda: now[0])

    def passes(name: str, template: str, *args: object) -> str | None:
        record = logging.LogRecord(name, logging.ERROR, __file__, 1, template, args, None)
        return record.getMessage() if noise.filter(record) else None

    unable = "Unable connect to node with id %s: %s"
    assert passes("aiokafka", unable, 1, "refused") == "Unable connect to node with id 1: refused"
    for second in range(1, 60):
        now[0] = second
        assert passes("aiokafka", unable, 1, "refused") is None
        assert passes("aiokafka.conn", "Failed fetch messages from %s: %s", 1, "x") in (
            None,
            "Failed fetch messages from 1: x",  # its own template: its first line passes
        )
    now[0] = 61.0
    assert passes("aiokafka", unable, 1, "again") == (
        "Unable connect to node with id 1: again (59 more like this in the last 61s)"
    )
    rebalancing = "Heartbeat failed for group %s because it is rebalancing"
    assert passes("aiokafka.consumer.group_coordinator", rebalancing, "g") is None
    assert passes("prme.cluster", unable, 1, "x") is not None  # only aiokafka's records
    assert passes("prme.cluster", unable, 1, "x") is not None


def test_a_group_coordinator_being_set_up_is_not_an_error_line() -> None:
    """Every node logged ``ERROR Group Coordinator Request failed: [Error 15]
    GroupCoordinatorNotAvailableError`` at a normal start on a new broker (new-user trial);
    the same message for a broker that does not answer still shows."""
    noise = KafkaClientNoise()
    template = "Group Coordinator Request failed: %s"

    def passes(arg: str) -> bool:
        record = logging.LogRecord("aiokafka", logging.ERROR, __file__, 1, template, (arg,), None)
        return noise.filter(record)

    assert not passes("[Error 15] GroupCoordinatorNotAvailableError")
    assert passes("NodeNotReadyError: Attempt to send a request to node which is not ready")
