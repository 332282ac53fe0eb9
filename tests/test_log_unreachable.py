"""``/metrics``, ``/v1/ready`` and ``prme status`` answer within seconds when Kafka does
not: a real broker, killed under a running node."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import httpx

from .cluster_harness import ADMIN, Node, node_env, running, wait_ready
from .conftest import PrivateBroker

ANSWER_WITHIN_S = 5.0
"""Prometheus' default scrape timeout is 10 s; the endpoints wait for the log at most 2 s."""


def timed_get(node: Node, path: str) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = httpx.get(node.url + path, headers=ADMIN, timeout=60)
    return response, time.monotonic() - started


def test_metrics_ready_and_status_answer_in_seconds_while_kafka_is_down(
    private_kafka: PrivateBroker, tmp_path: Path
) -> None:
    """Found by a trial with 2 of 3 brokers killed: /metrics answered after 30.03 s (every
    series lost to the scrape timeout, the transport-error counters included) and
    /v1/ready and prme status after 30.0 s (readiness probes timed out)."""
    topic = f"unreachable-{uuid.uuid4().hex[:8]}"
    node = Node(tmp_path, "node", node_env(private_kafka.bootstrap, topic, f"{topic}-group"))
    with running([node]):
        wait_ready([node])
        written = node.post("/v1/memories", {"user_id": "ada", "content": "tea at five"})
        assert written.status_code == 201, written.text
        assert node.get("/metrics").status_code == 200  # log ends read while Kafka answers
        private_kafka.kill()

        metrics, took = timed_get(node, "/metrics")
        assert metrics.status_code == 200 and took < ANSWER_WITHIN_S, took
        age = [
            float(line.split()[-1])
            for line in metrics.text.splitlines()
            if line.startswith("prme_projector_log_end_age_seconds ")
        ]
        assert age and age[0] > 0, metrics.text  # the log ends shown are the last known
        assert 'operation="end_offsets"' in metrics.text

        ready, took = timed_get(node, "/v1/ready")
        assert took < ANSWER_WITHIN_S, took
        assert ready.status_code == 503, ready.text
        assert "log end unknown" in ready.json()["detail"]

        started = time.monotonic()
        status = node.status()
        took = time.monotonic() - started
        assert "LOG UNAVAILABLE" in status.stdout, status.stdout + status.stderr
        assert status.returncode == 1
        assert took < ANSWER_WITHIN_S + 3, took  # (+ the CLI's own start)
        node.kill()  # a clean stop would wait on the dead broker
    # The Kafka client's retries: 813 ERROR lines in the ~10 s after the kill (436 of them
    # "Unable connect to node with id 1"); now each message once a minute.
    lines = node.log_path.read_text(errors="replace").splitlines()
    for message in ("Unable connect to node", "Unable to update metadata", "Failed fetch"):
        assert sum(message in line for line in lines) <= 1, [x for x in lines if message in x]
    assert sum(" ERROR " in line for line in lines) <= 10, lines[-20:]
