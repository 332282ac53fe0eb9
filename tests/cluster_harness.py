"""PRME nodes as separate ``prme serve`` processes (own data dirs and ports, loopback HTTP
between them), for the cluster tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

ADMIN_KEY = "admin-key"
ALICE_KEY = "alice-key"
SECRET = "cluster-secret"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def node_env(bootstrap: str, topic: str, group: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRME_")}
    env.update(
        {
            "PRME_LOG__TRANSPORT": "kafka",
            "PRME_LOG__BOOTSTRAP": bootstrap,
            "PRME_LOG__TOPIC": topic,
            "PRME_LOG__DLQ_TOPIC": f"{topic}.dlq",
            "PRME_CLUSTER__GROUP": group,
            "PRME_CLUSTER__SECRET": SECRET,
            "PRME_SERVICE__API_KEYS": json.dumps({ADMIN_KEY: "*", ALICE_KEY: "alice"}),
            "PRME_EMBEDDING__THREADS": "1",
        }
    )
    env.update(extra)
    return env


class Node:
    """One ``prme serve`` process."""

    def __init__(
        self, root: Path, name: str, env: dict[str, str], args: Sequence[str] = ()
    ) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.data_dir = root / name
        self.log_path = root / f"{name}.log"
        self.env = env
        self.args = list(args)
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> Node:
        command = [sys.executable, "-m", "prme.cli", "serve", "--data-dir", str(self.data_dir)]
        command += [
            "--port",
            str(self.port),
            "--log-level",
            os.environ.get("PRME_TEST_NODE_LOG_LEVEL", "warning"),
            *self.args,
        ]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                command, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        return self

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.get(self.url + path, headers=ADMIN, timeout=30, **kwargs)

    def view(self) -> dict[str, Any] | None:
        """This node's ``GET /v1/cluster``, or None while it does not answer one: not
        listening yet, or answering 503 while it starts."""
        try:
            response = self.get("/v1/cluster")
        except httpx.HTTPError:
            return None
        return response.json() if response.status_code == 200 else None

    def status(self, *options: str) -> subprocess.CompletedProcess[str]:
        """``prme status [options]`` of this node, with the admin key."""
        command = [sys.executable, "-m", "prme.cli", "status", *options, "--url", self.url]
        return subprocess.run(
            [*command, "--api-key", ADMIN_KEY], capture_output=True, text=True, timeout=60
        )

    def metric(self, name: str) -> float:
        """The sum of the samples of ``name`` (with its labels, if given) on ``/metrics``."""
        total = 0.0
        for line in self.get("/metrics").text.splitlines():
            if line.startswith(name) and not line.startswith("#"):
                total += float(line.split()[-1])
        return total

    def post(self, path: str, body: Any, **kwargs: Any) -> httpx.Response:
        headers = kwargs.pop("headers", ADMIN)
        return httpx.post(self.url + path, json=body, headers=headers, timeout=60, **kwargs)


def wait_ready(nodes: Sequence[Node], timeout_s: float = 180.0) -> None:
    """Until every node answers ``/v1/ready`` with 200 (projecting and caught up)."""
    deadline = time.monotonic() + timeout_s
    pending = list(nodes)
    while pending:
        node = pending[0]
        assert node.process is not None
        assert node.process.poll() is None, f"{node.name} exited:\n{node.log()}"
        try:
            if httpx.get(node.url + "/v1/ready", timeout=5).status_code == 200:
                pending.pop(0)
                continue
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{node.name} not ready:\n{node.log()}"
        time.sleep(0.2)  # poll interval while the node starts


def wait_split(nodes: Sequence[Node], partitions: int, timeout_s: float = 120.0) -> dict[str, Any]:
    """Until every node reports the same map, in which the nodes own all partitions."""
    deadline = time.monotonic() + timeout_s
    urls = {n.url for n in nodes}
    while True:
        views = [node.view() for node in nodes]
        owned = [
            sorted(p for m in v["members"] if m["url"] in urls for p in m["partitions"])
            for v in views
            if v
        ]
        generations = {v["generation"] for v in views if v}
        serving = sum(len(v["serving"]) for v in views if v)
        if (
            len(owned) == len(nodes)
            and all(o == list(range(partitions)) for o in owned)
            and len(generations) == 1
            and {m["url"] for m in views[0]["members"]} == urls
            and serving == partitions
        ):
            return views[0]
        assert time.monotonic() < deadline, f"no stable split: {views}"
        time.sleep(0.2)  # poll interval while the group rebalances


@contextmanager
def running(nodes: Sequence[Node]) -> Iterator[Sequence[Node]]:
    try:
        for node in nodes:
            node.start()
        yield nodes
    finally:
        for node in nodes:
            node.stop()
