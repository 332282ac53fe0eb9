"""Scaling out with warm-up replicas (Kafka Streams' KIP-441) on a real broker: a node that
joins a running cluster builds copies of its share first, while their owner keeps serving
them, and takes each partition over from its copy once the copy has caught up."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import httpx

from .cluster_harness import Node, node_env, running, wait_ready, wait_split

PARTITIONS = 12
OWNERS = [f"warm-{i}" for i in range(60)]


class Reads:
    """Retrieves of every owner through each node that has started, until stopped, noting
    each answer that is not a 200 (bounded: one request at a time, stopped by the test)."""

    def __init__(self, nodes: list[Node]) -> None:
        self.nodes = nodes
        self.failures: list[tuple[str, str, int, str]] = []
        self.answered = 0
        self.started: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _started(self, node: Node) -> bool:
        try:
            ready = httpx.get(node.url + "/v1/ready", timeout=5).status_code == 200
        except httpx.ConnectError:
            return False
        if ready:
            self.started.add(node.name)
        return ready

    def __enter__(self) -> Reads:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while not self._stop.is_set():
            for owner in OWNERS:
                for node in self.nodes:
                    if node.name not in self.started and not self._started(node):
                        continue  # a node answers 503 not_ready until it has started
                    answer = node.post("/v1/retrieve", {"query": "kites", "user_id": owner})
                    self.answered += 1
                    if answer.status_code != 200:
                        failures = (node.name, owner, answer.status_code, answer.text[:200])
                        self.failures.append(failures)


def owned_by(node: Node) -> list[int]:
    view = node.get("/v1/cluster").json()
    return next((m["partitions"] for m in view["members"] if m["url"] == node.url), [])


def test_a_joining_node_warms_its_share_up_and_takes_it_over_from_the_copies(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    topic = f"warmup-{uuid.uuid4().hex[:8]}"
    env = node_env(
        kafka_bootstrap,
        topic,
        f"{topic}-group",
        # every partition holds records, so every copy starts too far behind to serve
        PRME_CLUSTER__ACCEPTABLE_RECOVERY_LAG="0",
        PRME_CLUSTER__MAX_WARMUP_REPLICAS="3",
    )
    first, second = Node(tmp_path, "first", env), Node(tmp_path, "second", env)
    with running([first]):
        wait_ready([first])
        wait_split([first], PARTITIONS)
        for owner in OWNERS:
            written = first.post(
                "/v1/memories", {"user_id": owner, "content": f"{owner} flies kites"}
            )
            assert written.status_code == 201, written.text
        with running([second]):
            with Reads([first, second]) as reads:
                wait_ready([first, second])
                deadline = time.monotonic() + 120
                while (
                    len(owned_by(second)) < PARTITIONS // 2
                    or len(owned_by(first)) > PARTITIONS // 2
                ):
                    assert time.monotonic() < deadline, (owned_by(first), second.log())
                    time.sleep(0.2)  # poll interval while the warm-ups catch up and move
                wait_split([first, second], PARTITIONS)
            # Every partition the joining node owns came from a caught-up copy, none was
            # opened and replayed; at most three warmed up at once, so it took two plans.
            assert second.metric("prme_cluster_standby_promotions_total") == PARTITIONS // 2
            assert second.metric('prme_cluster_takeover_seconds_count{how="opened"}') == 0
            assert second.metric("prme_cluster_warmup_probes_total") >= 2
            assert second.metric('prme_cluster_owned_partitions{role="warmup"}') == 0
            # and the owners answered through the whole scale-out
            assert reads.answered > len(OWNERS)
            assert reads.failures == []
            assert "Traceback" not in first.log() + second.log()
