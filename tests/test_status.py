"""`prme status [--json]` against a running service, on both transports."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from prme.query.serve import run_server
from prme.schemas.config import Settings

WRITES = {"alice": 3, "bob": 2, "carol": 1}


@asynccontextmanager
async def serving(settings: Settings, provider: Any) -> AsyncIterator[str]:
    """``run_server`` on a free loopback port; yields its URL once it answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    shutdown = asyncio.Event()
    server = asyncio.create_task(
        run_server(
            settings,
            embedding_provider=provider,
            sockets=[listener],
            shutdown=shutdown,
            log_level="warning",
        )
    )
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            deadline = asyncio.get_running_loop().time() + 120
            while True:
                assert not server.done(), server.exception()
                try:
                    if (await client.get("/v1/health")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert asyncio.get_running_loop().time() < deadline, "service did not start"
                await asyncio.sleep(0.1)  # poll interval while the engine opens
        yield url
    finally:
        shutdown.set()
        await asyncio.wait_for(server, 60)
        listener.close()


async def prme_status(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "prme.cli",
        "status",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 120)
    return process.returncode or 0, out.decode(), err.decode()


async def check_status(settings: Settings, provider: Any) -> tuple[dict[str, Any], str, str]:
    """The status as JSON, as text, and the URL of the node that gave it."""
    async with serving(settings, provider) as url, httpx.AsyncClient(base_url=url) as client:
        for owner, count in WRITES.items():
            for i in range(count):
                body = {"user_id": owner, "content": f"{owner} remembers item {i}"}
                assert (await client.post("/v1/memories", json=body)).status_code == 201
        code, out, err = await prme_status("--json", "--url", url)
        assert code == 0, err
        status = json.loads(out)
        code, text, err = await prme_status("--url", url)
        assert code == 0, err
    partitions = {p["partition"]: p for p in status["partitions"]}
    assert sorted(partitions) == [0, 1, 2, 3]
    assert status["lag_records"] == 0 and status["dead_letters"] == 0
    written = [p for p in partitions.values() if p["log_end"] > 0]
    assert sum(p["applied_offset"] + 1 for p in written) >= sum(WRITES.values())
    for p in partitions.values():
        assert p["lag_records"] == 0 and p["lag_seconds"] == 0
        assert p["next_offset"] == p["log_end"]
    for p in written:
        assert p["size_bytes"]["lexical"] > 0 and p["size_bytes"]["events"] > 0
    assert status["embedding"]["dimension"] == provider.dimension
    assert status["embedding"]["model_name"] == provider.model_name
    assert status["embedding"]["mismatched_partitions"] == []
    assert "partition" in text and "lag 0 records" in text
    assert "alice" not in out and "remembers" not in out
    return status, text, url


async def test_status_on_the_local_log(local_settings: Settings, hashed_provider: Any) -> None:
    status, text, _ = await check_status(local_settings, hashed_provider)
    assert status["transport"] == "local" and status["group_members"] is None
    assert status["embedding"]["query_precision"] is None  # a provider that does not say
    assert "queries" not in text
    assert sum(p["log_end"] for p in status["partitions"]) == sum(WRITES.values())


async def test_status_says_how_queries_are_encoded(local_settings: Settings) -> None:
    """Only the start log and each receipt said it (the last stop's note)."""
    from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider

    class Int8Queries(HashedBagOfWordsProvider):
        query_precision = "int8"

    status, text, _ = await check_status(local_settings, Int8Queries(dimension=16))
    assert status["embedding"]["query_precision"] == "int8"
    assert "queries int8" in text


@pytest.mark.kafka
async def test_status_on_kafka_names_the_group_members(
    kafka_settings: Settings, hashed_provider: Any
) -> None:
    status, text, url = await check_status(kafka_settings, hashed_provider)
    assert status["transport"] == "kafka" and status["group"] == "prme-projectors"
    ours = [m for m in status["group_members"] if m["partitions"]]
    assert len(ours) == 1 and ours[0]["partitions"] == [0, 1, 2, 3]
    # Each member by its node's URL (a trial found every one named by the client id).
    assert ours[0]["url"] == url and f"member {url} at " in text


async def test_status_without_a_service_says_so(unused_tcp_port: int) -> None:
    code, _, err = await prme_status("--url", f"http://127.0.0.1:{unused_tcp_port}")
    assert code == 1 and "no PRME service answers" in err


async def test_status_with_a_url_without_http_says_what_a_url_is() -> None:
    """It said "no PRME service answers at localhost:8765" (a trial): the URL was wrong."""
    code, _, err = await prme_status("--url", "localhost:8765")
    assert code == 2 and "give http://host:port" in err


def test_sizes_count_the_blocks_a_sparse_file_takes_not_its_length(tmp_path: Any) -> None:
    from prme.projectors.status import model_sizes

    model = tmp_path / "shard" / "vector"
    model.mkdir(parents=True)
    with open(model / "segment.dat", "wb") as handle:  # qdrant preallocates sparse files
        handle.truncate(64 * 1024 * 1024)
        handle.write(b"x" * 4096)
    sizes = model_sizes(tmp_path / "shard")
    assert 4096 <= sizes["vector"] < 1024 * 1024


def test_cluster_health_names_every_partition_without_a_live_caught_up_owner() -> None:
    """`prme status` exits on this (an operator trial: it exited 0 during a rebalance and
    while a killed node still held its partitions)."""
    from prme.query.cluster_health import PeerView, assess

    a, b, c = "http://a", "http://b", "http://c"
    owners = {0: a, 1: a, 2: b, 3: b, 4: c, 5: ""}
    views: dict[str, PeerView | str] = {
        a: PeerView(owned=[0, 1], serving=[0, 1]),
        b: PeerView(owned=[2, 3], serving=[2]),  # restoring 3
        c: "ConnectError: connection refused",  # killed: still in the group
    }
    health = assess(7, owners, views, group_state="Stable", session_timeout_s=10)
    states = {h.partition: (h.state, h.owner) for h in health.partitions}
    assert states == {
        0: ("serving", a),
        1: ("serving", a),
        2: ("serving", b),
        3: ("not_serving", b),
        4: ("unreachable", c),
        5: ("worker", ""),
        6: ("unowned", None),
    }
    assert not health.healthy
    assert health.problems == [
        "partitions [6] have no owner in the group",
        "partitions [5] are held by a member that serves no requests (a `prme project` "
        "worker): run workers in a group of their own",
        "partitions [3]: their owner http://b does not serve them yet (restoring them, or "
        "taking them over)",
        "partitions [4]: their owner http://c does not answer (ConnectError: connection "
        "refused); the group moves them once the node has been silent for its session "
        "timeout (cluster.session_timeout_s: 10 s on this node)",
    ]
    settled = {a: PeerView(owned=[0, 1, 2], serving=[0, 1, 2])}
    healthy = assess(3, dict.fromkeys(range(3), a), settled, session_timeout_s=10)
    assert healthy.healthy and healthy.problems == []
    for state in ("PreparingRebalance", "CompletingRebalance"):
        moving = assess(3, {}, settled, group_state=state, session_timeout_s=10)
        assert {h.state for h in moving.partitions} == {"rebalancing"}
        assert moving.problems == [
            f"the group is rebalancing ({state}): partitions [0, 1, 2] have no settled "
            "owner until it completes"
        ]
    split = assess(2, {0: a, 1: c}, {**settled, c: "no answer within 2s"})  # embedded
    assert split.problems == [
        "partitions [1]: their owner http://c does not answer (no answer within 2s); its "
        "`prme serve --processes` parent starts a member that exits again"
    ]
    unknown = assess(2, None, settled, session_timeout_s=10)
    assert not unknown.healthy and {h.state for h in unknown.partitions} == {"unknown"}
    empty = assess(2, {}, {}, group_state="Empty", session_timeout_s=10)
    assert empty.problems == ["partitions [0, 1] have no owner in the group"]
