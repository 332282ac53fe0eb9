"""Pieces of the cluster that a review found wanting, each checked alone."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest

from prme.projectors.embeddings.vector_cache import content_hash
from prme.projectors.runner import (
    STANDBY_ENCODE_AFTER_S,
    ProjectorRunner,
    StandbyWait,
    VectorsNotPublished,
)
from prme.query.forwarding import _read_body
from prme.query.http_client import ClusterRoutes
from prme.query.routes import is_repeatable, safe_to_resend
from prme.query.serve import advertised_url
from prme.schemas.config import Settings
from prme.schemas.errors import ConfigurationError


def test_a_cluster_node_on_a_wildcard_address_must_say_where_it_is_reached() -> None:
    settings = Settings().replace(
        log={"transport": "kafka"}, service={"host": "0.0.0.0", "port": 8771}
    )
    with pytest.raises(ConfigurationError, match="advertised-url"):
        advertised_url(settings)
    named = settings.replace(cluster={"advertised_url": "http://node-1:8771/"})
    assert advertised_url(named) == "http://node-1:8771"
    loopback = Settings().replace(service={"host": "::1", "port": 8771})
    assert advertised_url(loopback) == "http://[::1]:8771"


async def test_the_router_stops_reading_a_body_past_the_limit() -> None:
    sent: list[dict[str, Any]] = [
        {"type": "http.request", "body": b"x" * 600, "more_body": True} for _ in range(100)
    ]
    calls = 0

    async def receive() -> dict[str, Any]:
        nonlocal calls
        calls += 1
        return sent.pop(0)

    body, complete = await _read_body(receive, limit=1000)
    assert not complete and len(body) == 1200 and calls == 2


def test_the_client_leaves_an_unreachable_owner_for_a_seed_that_forwards() -> None:
    routes = ClusterRoutes(["http://router:1"])
    routes._owners = dict.fromkeys(range(12), "http://owner:2")  # as refresh() fills it
    from prme.producers.partitioner import Partitioner

    routes._partitioner = Partitioner(12)
    assert routes.node_for("alice") == "http://owner:2"
    routes.lost("http://owner:2")
    assert routes.node_for("alice") == "http://router:1"


def test_only_reads_and_waits_are_resent_after_a_broken_connection() -> None:
    assert is_repeatable("GET", "/v1/history?user_id=a")
    assert is_repeatable("POST", "/v1/retrieve")
    assert is_repeatable("POST", "/v1/cluster/wait")
    assert not is_repeatable("DELETE", "/v1/history/messages/e1?user_id=a")
    assert not is_repeatable("POST", "/v1/nodes/mem:1/archive")


def test_a_write_is_safe_to_resend_only_with_the_request_ids_its_route_names() -> None:
    keyed, plain = b'{"user_id":"a","request_id":"r"}', b'{"user_id":"a"}'
    assert safe_to_resend("GET", "/v1/history?user_id=a", None)
    assert safe_to_resend("POST", "/v1/memories", keyed)
    assert not safe_to_resend("POST", "/v1/memories", plain)
    assert not safe_to_resend("POST", "/v1/memories", b"not json")
    every = b'{"messages":[{"request_id":"r0"},{"request_id":"r1"}]}'
    half = b'{"messages":[{"request_id":"r0"},{}]}'
    assert safe_to_resend("POST", "/v1/history/messages", every)
    assert not safe_to_resend("POST", "/v1/history/messages", half)
    assert safe_to_resend("POST", "/v1/history/replace", half)  # one idempotent write
    assert not safe_to_resend("POST", "/v1/history/clear", keyed)
    assert not safe_to_resend("DELETE", "/v1/owners?user_id=a", None)


def _free_port_below_a_taken_one() -> tuple[int, socket.socket]:
    """A free port P and a listening socket holding P+1 (a CI run's free P once found
    P+1 in use by another process)."""
    for _ in range(100):
        taken = socket.socket()
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1] - 1
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                taken.close()
                continue
        taken.listen()
        return port, taken
    raise RuntimeError("no free port below a taken one on 127.0.0.1")


def test_processes_start_when_a_members_port_is_taken(tmp_path: Path) -> None:
    port, taken = _free_port_below_a_taken_one()  # PORT+1: the first member's own port
    with taken:
        command = [sys.executable, "-m", "prme.cli", "serve", "--processes", "2"]
        command += ["--data-dir", str(tmp_path / "pack"), "--port", str(port)]
        log = tmp_path / "serve.log"
        with open(log, "wb") as out:
            parent = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while True:
                assert parent.poll() is None, log.read_text()
                try:
                    view = httpx.get(f"http://127.0.0.1:{port}/v1/cluster", timeout=5).json()
                    if len(view["members"]) == 2:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)  # poll interval while the processes start
            urls = [m["url"] for m in view["members"]]
            assert f"http://127.0.0.1:{port + 1}" not in urls
        finally:
            parent.terminate()
            parent.wait(timeout=60)


async def test_standby_replicas_try_again_after_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failing standby loop used to stop for good (logged once): every copy then fell
    behind silently and a later failover replayed whole partitions."""
    import asyncio

    from prme.producers.local_log import LocalLogTransport
    from prme.producers.transport import LogItem
    from prme.projectors import standby
    from prme.projectors.standby import StandbyKeeper

    monkeypatch.setattr(standby, "RETRY_S", 0.05, raising=False)
    transport = LocalLogTransport(tmp_path / "log.sqlite3", partitions=1)
    await transport.start()

    class Copy:
        position = -1

        def applied_offset(self) -> int:
            return self.position

        async def ensure_open(self) -> None:
            pass

        async def close(self) -> None:
            pass

    copy, attempts = Copy(), []

    async def apply(partition: int, shard: Any, entries: list[Any]) -> bool:
        attempts.append(len(entries))
        if len(attempts) == 1:
            raise OSError("disk hiccup")
        shard.position = entries[-1].offset
        return True

    async def open_shard(partition: int) -> Any:
        return copy

    locks: dict[int, asyncio.Lock] = {}
    keeper = StandbyKeeper(
        transport, open_shard, apply, lambda p: locks.setdefault(p, asyncio.Lock())
    )
    try:
        await transport.append(LogItem(b"owner", b"first"))
        keeper.want({0}, set())
        deadline = asyncio.get_running_loop().time() + 10
        while keeper.failure is None and not copy.position >= 0:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.01)
        await transport.append(LogItem(b"owner", b"second"))
        while copy.position < 1 or keeper.failure is not None:
            assert asyncio.get_running_loop().time() < deadline, (attempts, keeper.failure)
            await asyncio.sleep(0.01)
        assert attempts[0] >= 1 and len(attempts) >= 2
    finally:
        await keeper.close()
        await transport.close()


def test_children_that_keep_dying_stop_the_supervisor_with_their_status(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import signal

    from prme.query import processes

    monkeypatch.setattr(processes, "RESTART_DELAY_S", 0.05)
    started: list[int] = []

    def start(index: int) -> subprocess.Popen[bytes]:
        started.append(index)
        return subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])

    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        began = time.monotonic()
        assert processes.supervise(start, 3) == 3
        assert time.monotonic() - began < 60
    finally:
        signal.signal(signal.SIGINT, handlers[0])
        signal.signal(signal.SIGTERM, handlers[1])
    # Each exit on its own was met by a start, until the crash loop (more than 5 a minute).
    assert len(started) == 3 + processes.RESTARTS_PER_MINUTE


class _MovingRouter:
    """The router's side of the middleware for one partition that moves away from this
    node while a read is inside the app (the race a scale-out's rebalances hit)."""

    def __init__(self) -> None:
        self.settings = Settings()
        self.url = "http://here:1"
        self.here = True
        self.forwarded: list[str] = []
        self.ran = 0
        self.runner = self

    async def wait_serving(self, partition: int, timeout_s: float) -> bool:
        return self.here

    def partition_of(self, owner: str) -> int:
        return 3

    def check_forwarded(self, headers: dict[str, str]) -> str | None:
        return "alice" if "x-prme-forwarded-caller" in headers else None

    def owns(self, partition: int) -> bool:
        return self.here

    async def forward(self, partition: int, method: str, target: str, **_: Any) -> Any:
        if self.here:
            return None
        self.forwarded.append(target)
        return httpx.Response(200, json=["from the new owner"])


async def _moved_mid_read(
    hop: bool, method: str = "GET", path: str = "/v1/history"
) -> tuple[int, bytes, dict[str, str], _MovingRouter]:
    from prme.query.auth import ApiKeys
    from prme.query.forwarding import ForwardingMiddleware

    router = _MovingRouter()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        router.ran += 1
        router.here = False  # revoked while the request was on its way to the shard
        body = b'{"error":"shard_unavailable","detail":"not projected here"}'
        await send({"type": "http.response.start", "status": 503, "headers": []})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    middleware = ForwardingMiddleware(app, router, ApiKeys({"k": "alice"}))  # type: ignore[arg-type]
    headers = [(b"authorization", b"Bearer k")]
    if hop:
        headers.append((b"x-prme-forwarded-caller", b"alice"))
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"user_id=alice",
        "headers": headers,
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await middleware(scope, receive, send)
    start, body = sent[0], sent[-1]["body"]
    names = {k.decode().lower(): v.decode() for k, v in start["headers"]}
    return start["status"], body, names, router


async def test_a_read_whose_partition_moves_while_it_is_served_goes_to_the_new_owner() -> None:
    """A scale-out's benchmark found reads answered 503 shard_unavailable: the partition
    moved between the router's decision to serve it here and the app's reading it."""
    status, body, _, router = await _moved_mid_read(hop=False)
    assert (status, router.forwarded) == (200, ["/v1/history?user_id=alice"])
    assert b"from the new owner" in body


async def test_a_forwarded_read_whose_partition_moves_meanwhile_is_refused_as_not_owner() -> None:
    # The entry node reads the map again and sends it on (a 503 without the header was
    # relayed to the client).
    status, _, headers, _ = await _moved_mid_read(hop=True)
    assert status == 503 and headers.get("x-prme-not-owner") == "1"


async def test_a_write_that_reads_first_is_not_run_twice_when_its_partition_moves() -> None:
    # Found by a review: a delete appends before it waits, so a second run on the new
    # owner appended it twice; its 503 (which names the written token) is relayed.
    for hop in (False, True):
        status, body, headers, router = await _moved_mid_read(
            hop, "DELETE", "/v1/history/messages/m1"
        )
        assert (status, router.ran, router.forwarded) == (503, 1, [])
        assert b"shard_unavailable" in body and "x-prme-not-owner" not in headers


async def test_a_restarted_node_claims_its_shards_as_far_as_they_were_applied(
    local_settings: Settings,
) -> None:
    """Found by a review: a node claimed 0 for every shard on disk until it opened them, so
    the group held its up-to-date partitions with a node that took them meanwhile."""
    from prme.producers.factory import open_transport
    from prme.producers.producer import MessageDraft, Producer
    from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider
    from prme.projectors.runner import ProjectorRunner, stored_offsets

    settings = local_settings.replace(log={"partitions": 3})
    transport = open_transport(settings)
    await transport.start()
    runner = ProjectorRunner(settings, transport, HashedBagOfWordsProvider())
    try:
        producer = Producer(transport)
        drafts = [MessageDraft(owner=f"o{i}", content=f"note {i}") for i in range(40)]
        await producer.append_records([producer.build_message(d) for d in drafts])
        await runner.start()
        await runner.catch_up(timeout_s=60)
        applied = {p: shard.applied_offset() for p, shard in runner.shards.items()}
    finally:
        await runner.close()
        await transport.close()
    assert sorted(applied) == [0, 1, 2] and all(offset > 0 for offset in applied.values())
    assert stored_offsets(Path(settings.data_dir)) == applied


async def test_a_node_backs_off_when_a_plan_keeps_the_warm_ups_it_said_were_ready(
    local_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From the review of the back-off: any map overlapping the last warm-ups doubled the
    wait, after any probe ever (a map for another node's join too)."""
    from prme.producers.factory import open_transport
    from prme.projectors import runner as runner_module
    from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider
    from prme.projectors.runner import PROBE_EVERY_S, ProjectorRunner
    from prme.schemas.cluster import ClusterMap, ClusterMember

    clock = [1000.0]
    monkeypatch.setattr(runner_module.time, "monotonic", lambda: clock[0])
    from prme.schemas.metrics import Metrics

    transport = open_transport(local_settings)
    runner = ProjectorRunner(
        local_settings, transport, HashedBagOfWordsProvider(), metrics=Metrics(enabled=True)
    )
    runner.url = "http://me:1"
    runner._consumer = transport.consumer("g", None)
    probes = runner.metrics.warmup_probes

    def plan(generation: int, warmups: list[int]) -> None:
        member = ClusterMember(url=runner.url, standbys=warmups, warmups=warmups)
        runner._on_map(ClusterMap(generation=generation, partitions=4, members=[member]))

    try:
        plan(1, [3])
        runner.standbys.caught_up = {3}
        runner._probe_when_warm()
        assert probes._value.get() == 1
        plan(2, [3])  # the plan after the probe kept partition 3: wait twice as long
        clock[0] += PROBE_EVERY_S + 1
        runner._probe_when_warm()
        assert probes._value.get() == 1
        clock[0] += PROBE_EVERY_S
        runner._probe_when_warm()
        assert probes._value.get() == 2
        plan(3, [2, 3])  # another node joined: the same warm-up kept, but no probe of ours
        plan(4, [2, 3])
        runner.standbys.caught_up = {2, 3}
        clock[0] += 4 * PROBE_EVERY_S + 1
        runner._probe_when_warm()
        assert probes._value.get() == 3
        plan(5, [1])  # the plan moved them: new warm-ups, the wait starts over
        runner.standbys.caught_up = {1}
        clock[0] += PROBE_EVERY_S + 1
        runner._probe_when_warm()
        assert probes._value.get() == 4
    finally:
        await runner.standbys.close()


async def test_a_standby_waits_for_an_owner_that_publishes_slowly() -> None:
    """Found by a cluster trial: an owner slowed by a burst published its vectors all
    along, yet after 10 s its standby encoded the whole burst again (twice the embedding
    CPU, on the machine whose writes were timing out). The wait's clock restarts whenever
    the owner has published more of the batch."""
    published: dict[str, np.ndarray] = {}

    class Cache:
        def get_hashed(self, identity: object, hashes: list[str]) -> list[np.ndarray | None]:
            return [published.get(h) for h in hashes]

    runner = SimpleNamespace(_vector_cache=Cache(), identity=None)
    texts = ["one", "two", "three"]
    wait = StandbyWait(first=0, since=time.monotonic() - STANDBY_ENCODE_AFTER_S - 1)
    with pytest.raises(VectorsNotPublished):
        await ProjectorRunner._published_vectors(runner, wait, texts)  # type: ignore[arg-type]
    assert time.monotonic() - wait.since > STANDBY_ENCODE_AFTER_S  # nothing new: overdue
    published[content_hash("one")] = np.zeros(2, dtype=np.float32)
    with pytest.raises(VectorsNotPublished):
        await ProjectorRunner._published_vectors(runner, wait, texts)  # type: ignore[arg-type]
    assert wait.published == 1 and time.monotonic() - wait.since < 1  # progress: waits on
    for text in texts:
        published[content_hash(text)] = np.ones(2, dtype=np.float32)
    vectors = await ProjectorRunner._published_vectors(runner, wait, texts)  # type: ignore[arg-type]
    assert len(vectors) == 3 and wait.published == 3
