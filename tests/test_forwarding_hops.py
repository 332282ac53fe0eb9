"""A hop that breaks: a node forwarding a one-owner write to a loopback TCP server that
stands in for the owner's node and misbehaves on purpose (closes without answering,
answers half, drops a pooled connection as the next request arrives). The forwarding
node is a real engine on the embedded log, split statically with the stand-in, behind
the real app; only the client's side of it is in-process (ASGI)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from prme.producers.transport import dedupe_key
from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider
from prme.query.advertised_check import STARTING_ANSWER
from prme.query.engine import MemoryEngine
from prme.query.http_client import HttpMemoryBackend
from prme.query.http_types import NODE_KEEP_ALIVE_S
from prme.query.pooled_http import POOL_KEEPALIVE_S
from prme.query.service import create_app
from prme.schemas.config import Settings
from prme.schemas.errors import TransportError

from .service_harness import running_service

NODE_URL = "http://127.0.0.1:9"  # this node's URL in the map (the test reaches it in-process)
SECRET = "hop-secret"


@dataclass
class Hop:
    """One request the stand-in read whole, and the connection it came on."""

    connection: int
    request_line: bytes
    headers: dict[bytes, bytes]
    body: bytes


Behaviour = Callable[[Hop, asyncio.StreamWriter], Awaitable[bool]]
"""What the stand-in does with a request it read: writes (or not) and says whether the
connection stays open for another request."""


@dataclass
class StandIn:
    """The owner's node, as far as the hop can tell: a loopback HTTP/1.1 server that reads
    each request whole and then does what ``behaviours`` says (one per request, in order;
    the last one repeats)."""

    behaviours: list[Behaviour]
    hops: list[Hop] = field(default_factory=list)
    connections: int = 0
    dropped_on_arrival: int = 0
    """Requests a pooled connection was closed on as they arrived (never read)."""
    drop_next_on: set[int] = field(default_factory=set)
    """Connections closed, unanswered and unread, as their next request arrives."""
    reset: bool = False
    """Drop with a reset (SO_LINGER 0), as a kernel does for a socket closed with data
    unread, instead of a plain close."""
    url: str = ""
    server: asyncio.Server | None = None

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        connection = self.connections
        try:
            while True:
                first = await reader.read(1)  # the next request arrives
                if not first:
                    return  # the client closed the connection
                if connection in self.drop_next_on:  # closed, unserved
                    self.dropped_on_arrival += 1
                    self._drop(writer)
                    return
                hop = await _read_request(reader, connection, first)
                self.hops.append(hop)
                behaviour = self.behaviours[min(len(self.hops), len(self.behaviours)) - 1]
                if not await behaviour(hop, writer):
                    self._drop(writer)
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return

    def _drop(self, writer: asyncio.StreamWriter) -> None:
        if self.reset:
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()


async def _read_request(reader: asyncio.StreamReader, connection: int, first: bytes) -> Hop:
    head = first + await reader.readuntil(b"\r\n\r\n")
    request_line, *lines = head.rstrip(b"\r\n").split(b"\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get(b"content-length", b"0")))
    return Hop(connection, request_line, headers, body)


def answer(status: int, payload: Any) -> Behaviour:
    """Answer ``payload`` as JSON and keep the connection (keep-alive)."""

    async def behave(hop: Hop, writer: asyncio.StreamWriter) -> bool:
        body = msgspec.json.encode(payload)
        writer.write(
            b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
            % (status, len(body))
            + body
        )
        await writer.drain()
        return True

    return behave


async def close_unanswered(hop: Hop, writer: asyncio.StreamWriter) -> bool:
    """The request was read whole; the connection closes before any answer (the owner
    crashed, or applied it and lost the connection)."""
    return False


async def answer_half(hop: Hop, writer: asyncio.StreamWriter) -> bool:
    """A status line and headers promising 200 bytes, 12 of them, then the close."""
    writer.write(
        b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\n"
        b'content-length: 200\r\n\r\n{"event_id":'
    )
    await writer.drain()
    return False


@contextlib.asynccontextmanager
async def stand_in(standin: StandIn) -> AsyncIterator[StandIn]:
    server = await asyncio.start_server(standin.serve, "127.0.0.1", 0)
    standin.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    standin.server = server
    try:
        yield standin
    finally:
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 5)


@dataclass
class Forwarder:
    engine: MemoryEngine
    http: httpx.AsyncClient
    owner: str
    """An owner whose partition the stand-in owns."""

    async def appended(self) -> int:
        """Records on this node's log (all partitions)."""
        assert self.engine.router is not None
        return sum((await self.engine.router.transport.end_offsets()).values())


@contextlib.asynccontextmanager
async def forwarder(
    directory: Path, standin: StandIn, api_keys: dict[str, str] | None = None
) -> AsyncIterator[Forwarder]:
    """A node on the embedded log whose static split gives the stand-in every odd
    partition, served in-process by the real app."""
    settings = Settings(data_dir=str(directory)).replace(
        service={"api_keys": api_keys or {}},
        cluster={"static_members": [NODE_URL, standin.url], "secret": SECRET},
        query={"consistency_timeout_s": 2.0},
        log={"request_timeout_s": 5.0},
    )
    engine = await MemoryEngine.open(
        settings=settings,
        embedding_provider=HashedBagOfWordsProvider(),
        create_if_missing=True,
        url=NODE_URL,
    )
    try:
        router = engine.router
        assert router is not None and router.cluster_map is not None
        owner = next(
            f"owner-{i}"
            for i in range(1000)
            if router.cluster_map.owner(router.partition_of(f"owner-{i}")) == standin.url
        )
        transport = httpx.ASGITransport(app=create_app(engine))
        async with httpx.AsyncClient(
            transport=transport, base_url="http://node", timeout=60
        ) as http:
            yield Forwarder(engine, http, owner)
    finally:
        await engine.close()


@pytest.mark.parametrize("request_id", [None, "r-1"], ids=["plain", "keyed"])
@pytest.mark.parametrize("behaviour", [close_unanswered, answer_half], ids=["closed", "half"])
async def test_a_write_whose_hop_broke_after_sending_is_unconfirmed_and_not_appended_here(
    tmp_path: Path, behaviour: Behaviour, request_id: str | None
) -> None:
    """The owner read the whole write, then the connection broke before (or while) it
    answered: the owner may have appended it, so the entry node neither appends it itself
    nor says "retry later" (a 503 with Retry-After invited a blind resend). On a new
    connection it is not sent again either, request id or not: the owner took the
    connection and then failed, so a resend would most likely be appended here."""
    async with stand_in(StandIn([behaviour])) as standin, forwarder(tmp_path, standin) as node:
        write = {"user_id": node.owner, "content": "the hop breaks after this"}
        if request_id is not None:
            write["request_id"] = request_id
        response = await node.http.post("/v1/memories", json=write)
        assert response.status_code == 504, response.text
        assert response.json()["error"] == "append_unconfirmed"
        assert "retry-after" not in response.headers
        assert "it may have been applied" in response.json()["detail"]
        # The owner got it whole, with the cluster secret and the caller ...
        assert len(standin.hops) == 1
        hop = standin.hops[0]
        assert hop.request_line.startswith(b"POST /v1/memories ")
        assert msgspec.json.decode(hop.body) == write
        assert hop.headers[b"x-prme-cluster-secret"] == SECRET.encode()
        # ... and it was sent once, and not appended here.
        assert await node.appended() == 0


STORED = {"event_id": "e1", "node_ids": ["mem:e1"], "token": {"partition": 1, "offset": 0}}
"""What the stand-in answers a write with."""


async def pooled_then_dropped(node: Forwarder, standin: StandIn) -> None:
    """A write answered on a new connection, which stays in the hop pool; the stand-in
    then closes that connection, unanswered, as the next request arrives on it."""
    opened = standin.connections
    write = {"user_id": node.owner, "content": "opens a connection"}
    assert (await node.http.post("/v1/memories", json=write)).status_code == 201
    assert standin.connections == opened + 1
    standin.drop_next_on.add(standin.connections)


def resent(metrics: str) -> float:
    for line in metrics.splitlines():
        if line.startswith('prme_cluster_forwards_total{outcome="resent"}'):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.parametrize("reset", [False, True], ids=["closed", "reset"])
async def test_a_keyed_write_on_a_pooled_connection_the_owner_dropped_is_resent_once(
    tmp_path: Path, reset: bool
) -> None:
    """From a review: the owner closes a pooled connection (its keep-alive timeout, a
    restart) just as the next write is sent on it. That write never reached the owner's
    app, yet it answered 504 append_unconfirmed. A write with a request id (the owner
    answers a repeat with the first write) is now sent once more on a new connection."""
    standin = StandIn([answer(201, STORED)], reset=reset)
    async with stand_in(standin), forwarder(tmp_path, standin) as node:
        await pooled_then_dropped(node, standin)
        write = {"user_id": node.owner, "content": "b", "request_id": "r-b"}
        again = await node.http.post("/v1/memories", json=write)
        assert again.status_code == 201, again.text
        assert again.json() == STORED
        assert standin.dropped_on_arrival == 1
        assert standin.connections == 2
        assert (standin.hops[-1].connection, msgspec.json.decode(standin.hops[-1].body)) == (
            2,
            write,
        )
        assert await node.appended() == 0
        assert resent((await node.http.get("/metrics")).text) == 1


async def test_a_write_without_request_id_is_not_resent_on_a_dropped_pooled_connection(
    tmp_path: Path,
) -> None:
    """Without a request id nothing tells the owner a resend from a second write, and the
    owner may have read it (the hop cannot tell): it stays 504 append_unconfirmed."""
    standin = StandIn([answer(201, STORED)])
    async with stand_in(standin), forwarder(tmp_path, standin) as node:
        await pooled_then_dropped(node, standin)
        again = await node.http.post("/v1/memories", json={"user_id": node.owner, "content": "b"})
        assert again.status_code == 504, again.text
        assert again.json()["error"] == "append_unconfirmed"
        assert "retry-after" not in again.headers
        assert standin.connections == 1 and await node.appended() == 0


async def test_a_history_write_is_resent_only_when_every_message_has_a_request_id(
    tmp_path: Path,
) -> None:
    standin = StandIn([answer(201, [STORED, STORED])])
    async with stand_in(standin), forwarder(tmp_path, standin) as node:

        def messages(*request_ids: str | None) -> dict[str, Any]:
            keyed = [{"content": f"m{i}", "request_id": r} for i, r in enumerate(request_ids)]
            return {
                "user_id": node.owner,
                "session_id": "s",
                "messages": [{k: v for k, v in m.items() if v is not None} for m in keyed],
            }

        await pooled_then_dropped(node, standin)
        half = await node.http.post("/v1/history/messages", json=messages("r-0", None))
        assert half.status_code == 504, half.text
        await pooled_then_dropped(node, standin)
        every = await node.http.post("/v1/history/messages", json=messages("r-0", "r-1"))
        assert every.status_code == 201, every.text
        assert standin.hops[-1].request_line.startswith(b"POST /v1/history/messages ")
        assert resent((await node.http.get("/metrics")).text) == 1
        assert await node.appended() == 0


async def test_a_read_on_a_dropped_pooled_connection_is_resent_at_once(tmp_path: Path) -> None:
    """A read was sent again too, but only after waiting for the map to change (0.5 s)."""
    standin = StandIn([answer(201, STORED)])
    async with stand_in(standin), forwarder(tmp_path, standin) as node:
        await pooled_then_dropped(node, standin)
        standin.behaviours = [answer(200, [])]
        read = await node.http.get("/v1/history", params={"user_id": node.owner})
        assert read.status_code == 200 and read.json() == []
        assert standin.connections == 2 and standin.dropped_on_arrival == 1
        metrics = (await node.http.get("/metrics")).text
        assert resent(metrics) == 1
        assert 'prme_cluster_forwards_total{outcome="unreachable"}' not in metrics


async def test_a_pooled_connection_the_owner_closed_while_idle_is_not_used(
    tmp_path: Path,
) -> None:
    """The plain case of an idle close (the owner's keep-alive timeout, a restart) seen
    before the next write: the pool sees the closed socket and opens a new connection, and
    the write is delivered once (httpcore checks a pooled socket before reusing it)."""
    idle: list[asyncio.StreamWriter] = []

    async def answer_and_note(hop: Hop, writer: asyncio.StreamWriter) -> bool:
        await answer(201, STORED)(hop, writer)
        idle.append(writer)
        return True

    standin = StandIn([answer_and_note])
    async with stand_in(standin), forwarder(tmp_path, standin) as node:
        first = await node.http.post("/v1/memories", json={"user_id": node.owner, "content": "a"})
        assert first.status_code == 201, first.text
        closed = idle.pop()
        closed.close()  # idle now: closed by the owner
        await closed.wait_closed()
        again = await node.http.post("/v1/memories", json={"user_id": node.owner, "content": "b"})
        assert again.status_code == 201, again.text
        assert standin.connections == 2 and len(standin.hops) == 2
        assert resent((await node.http.get("/metrics")).text) == 0


async def test_the_hop_pool_lets_an_idle_connection_go_well_before_a_node_closes_it(
    tmp_path: Path,
) -> None:
    """httpx kept an idle hop connection 5 s and a node (uvicorn) closes one idle 5 s: a
    write sent on it as both ran out met the close (against uvicorn with both at 1 s, 2 of
    80 writes sent at that instant failed with ReadError, before any byte reached the app).
    The hop pool now lets one go after ``POOL_KEEPALIVE_S``, half the node's keep-alive."""
    assert POOL_KEEPALIVE_S <= NODE_KEEP_ALIVE_S / 2
    standin = StandIn([answer(201, STORED)])
    async with stand_in(standin), forwarder(tmp_path, standin) as node:
        write = {"user_id": node.owner, "content": "a"}
        assert (await node.http.post("/v1/memories", json=write)).status_code == 201
        await asyncio.sleep(POOL_KEEPALIVE_S + 0.5)  # the idle time under test
        assert (await node.http.post("/v1/memories", json=write)).status_code == 201
        assert standin.connections == 2


def test_a_node_keeps_an_idle_connection_open_its_keep_alive(tmp_path: Path) -> None:
    """The other half: a node (``prme serve``) holds an idle connection
    ``NODE_KEEP_ALIVE_S``, so a hop connection is let go before the node closes it."""
    with running_service(tmp_path / "pack") as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as conn:
            conn.sendall(b"GET /v1/health HTTP/1.1\r\nHost: node\r\n\r\n")
            received = b""
            while b'"ok"' not in received:
                received += conn.recv(4096)
            idle_from = time.monotonic()
            while conn.recv(4096):  # until the node closes it (EOF)
                pass
            held = time.monotonic() - idle_from
    assert NODE_KEEP_ALIVE_S - 0.5 <= held < NODE_KEEP_ALIVE_S + 5, held


async def by_method(hop: Hop, writer: asyncio.StreamWriter) -> bool:
    """A write is stored (201), a read finds nothing (200, [])."""
    stored = hop.request_line.startswith(b"POST ")
    return await (answer(201, STORED) if stored else answer(200, []))(hop, writer)


async def test_the_client_resends_a_read_or_keyed_write_whose_pooled_connection_dropped() -> None:
    """From the last review: the client (``AsyncMemoryClient`` over HTTP) had the hop's race.
    A node closing a pooled connection as the next request went out on it failed a keyed
    write or a read with a TransportError; now each is sent once more on a new connection.
    A write without request id is still raised (it may have arrived)."""
    standin = StandIn([by_method])
    async with stand_in(standin), HttpMemoryBackend(standin.url) as client:
        await client.store("opens a connection", "u1", request_id="r-a")
        assert standin.connections == 1

        standin.drop_next_on.add(standin.connections)
        stored = await client.store("b", "u1", request_id="r-b")
        assert stored.event_id == "e1"
        assert (standin.connections, standin.dropped_on_arrival) == (2, 1)
        assert msgspec.json.decode(standin.hops[-1].body)["request_id"] == "r-b"

        assert await client.history("u1") == []  # a pooled connection again: the 3rd
        standin.drop_next_on.add(standin.connections)
        assert await client.history("u1") == []
        assert (standin.connections, standin.dropped_on_arrival) == (4, 2)
        assert standin.hops[-1].request_line.startswith(b"GET /v1/history?")

        assert await client.history("u1") == []  # the 5th
        standin.drop_next_on.add(standin.connections)
        sent = len(standin.hops)
        with pytest.raises(TransportError):
            await client.store("c", "u1")
        assert (standin.connections, standin.dropped_on_arrival) == (5, 3)
        assert [h for h in standin.hops[sent:] if h.request_line.startswith(b"POST")] == []


def answer_late(seconds: float, status: int, payload: Any) -> Behaviour:
    """Answer as ``answer`` does, after ``seconds``."""

    async def behave(hop: Hop, writer: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(seconds)
        return await answer(status, payload)(hop, writer)

    return behave


async def test_a_forwarded_read_relays_the_owners_consistency_timeout(tmp_path: Path) -> None:
    """From a new-user trial: a read with a token its owner never reaches answered 504
    consistency_timeout on the owner and 503 "its owner ... did not answer" (Retry-After)
    through any other node, which gave up at the same timeout as the owner, so it called
    a healthy owner unresponsive. It now waits for the owner's answer and relays it."""
    timeout = {"error": "consistency_timeout", "detail": "partition 1 has not applied offset 9"}
    standin = StandIn([answer_late(2.3, 504, timeout)])  # the owner's timeout is 2 s too
    async with stand_in(standin), forwarder(tmp_path, standin) as node:
        read = await node.http.get("/v1/history", params={"user_id": node.owner, "after": "1:9"})
        assert read.status_code == 504, read.text
        assert read.json() == timeout
        assert len(standin.hops) == 1


async def test_an_unreachable_owner_is_logged_once_while_a_read_waits_for_the_map(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """From a new-user trial: each read waiting for a dead owner's partition logged "forward
    to ... failed; waiting for the map" at every retry (every 0.5 s: 20 lines in 10 s)."""
    standin = StandIn([answer(200, [])])
    async with stand_in(standin):
        pass  # closed: its port now refuses connections
    async with forwarder(tmp_path, standin) as node:
        with caplog.at_level(logging.INFO, logger="prme.cluster"):
            read = await node.http.get("/v1/history", params={"user_id": node.owner})
        assert read.status_code == 503, read.text
        lines = [r for r in caplog.records if r.getMessage().startswith("forward to ")]
        assert len(lines) == 1, [r.getMessage() for r in lines]


async def starting(hop: Hop, writer: asyncio.StreamWriter) -> bool:
    """What a node answers while it starts (before it serves: it checks its advertised
    URL), and closes."""
    writer.write(STARTING_ANSWER)
    await writer.drain()
    return False


async def test_a_write_whose_owner_is_starting_is_appended_here_and_waits_for_it(
    tmp_path: Path,
) -> None:
    """From a new-user trial: writes sent through another node while the owner's node
    restarted got the owner's 503 not_ready ("this node is starting") relayed, and writes
    appended meanwhile a 503 shard_unavailable with Retry-After whose body said not to send
    them again. A starting owner is now an unreachable one: the write is appended here
    (nothing reached the owner's app), and its wait to be applied asks again until the
    owner serves."""
    standin = StandIn([starting, starting, answer(200, {})])
    async with stand_in(standin), forwarder(tmp_path, standin) as node:
        write = {"user_id": node.owner, "content": "sent while the owner restarts"}
        response = await node.http.post("/v1/memories", json=write)
        assert response.status_code == 201, response.text
        assert await node.appended() == 1
        assert [hop.request_line.split()[1] for hop in standin.hops] == [
            b"/v1/memories",
            b"/v1/cluster/wait",
            b"/v1/cluster/wait",
        ]


async def test_a_read_whose_owner_is_starting_is_asked_again(tmp_path: Path) -> None:
    standin = StandIn([starting, starting, answer(200, [])])
    async with stand_in(standin), forwarder(tmp_path, standin) as node:
        read = await node.http.get("/v1/history", params={"user_id": node.owner})
        assert (read.status_code, read.json()) == (200, [])
        assert len(standin.hops) == 3


async def test_a_write_on_the_log_whose_wait_failed_has_no_retry_after(tmp_path: Path) -> None:
    """The write is on the log and will be applied: its error says what was written and
    not to send it again without a request id, so it must not carry ``Retry-After``."""
    refused = {"error": "shard_unavailable", "detail": "the projector stopped"}
    standin = StandIn([starting, answer(503, refused)])
    async with stand_in(standin), forwarder(tmp_path, standin) as node:
        write = {"user_id": node.owner, "content": "written, then the wait fails"}
        response = await node.http.post("/v1/memories", json=write)
        assert response.status_code == 503, response.text
        assert "retry-after" not in response.headers
        body = response.json()
        assert len(body["written"]) == 1 and "do not send it again" in body["detail"]
        assert await node.appended() == 1


async def test_the_entry_node_logs_the_owner_of_a_request_it_forwards(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """From a new-user trial: the node a request reached logged a forwarded request
    without ``owner=``, so its lines could not be matched with the owner's node's."""
    from prme.query.observe import owner_hash

    standin = StandIn([answer(200, [])])
    async with stand_in(standin), forwarder(tmp_path, standin) as node:
        with caplog.at_level(logging.INFO, logger="prme.http"):
            read = await node.http.get("/v1/history", params={"user_id": node.owner})
        assert read.status_code == 200
        lines = [r.getMessage() for r in caplog.records if r.name == "prme.http"]
        assert any(
            line.startswith("GET /v1/history 200") and f"owner={owner_hash(node.owner)}" in line
            for line in lines
        ), lines


async def test_a_credential_header_sent_twice_is_401_and_not_forwarded(tmp_path: Path) -> None:
    """Found by a security review: the forwarding layer took the last of two
    ``Authorization`` headers and the app the first, so one node forwarded what a single
    node refused (403)."""
    keys = {"key-admin": "*", "key-other": "someone-else"}
    standin = StandIn([answer(200, [])])
    async with stand_in(standin), forwarder(tmp_path, standin, keys) as node:
        owner = node.owner
        params = {"user_id": owner}
        for name, values in (
            ("authorization", ["Bearer key-other", "Bearer key-admin"]),
            ("x-api-key", ["key-other", "key-admin"]),
        ):
            headers = [(name, value) for value in values]
            read = await node.http.get("/v1/history", params=params, headers=headers)
            assert read.status_code == 401, (headers, read.text)
            assert (
                read.json()["detail"] == f"the {name} header is sent twice, with different values"
            )
        assert standin.hops == []
        same = [("x-api-key", "key-admin"), ("X-API-Key", "key-admin")]  # (no doubt who)
        one = await node.http.get("/v1/history", params=params, headers=same)
        assert one.status_code == 200 and len(standin.hops) == 1


async def hang_on_events(hop: Hop, writer: asyncio.StreamWriter) -> bool:
    """An owner that takes writes and never answers a lookup of an event."""
    if b" /v1/events/" in hop.request_line:
        await asyncio.sleep(30)
        return False
    return await answer(200, {})(hop, writer)


def keys_of(node: Forwarder, count: int) -> list[str]:
    """Dedupe keys of ``count`` owners whose partition the stand-in owns."""
    router = node.engine.router
    assert router is not None
    partition = router.partition_of(node.owner)
    owners = [o for o in (f"owner-{i}" for i in range(5000)) if router.partition_of(o) == partition]
    return [dedupe_key(owner, "r-1") for owner in owners[:count]]


async def test_looking_up_request_ids_on_a_hung_owner_costs_one_second_in_all(
    tmp_path: Path,
) -> None:
    """On Kafka a node appending keyed writes of partitions it does not hold asks their
    owners where each request id was first written. From a review: each lookup had its own
    1 s, 16 at a time, so 40 ids on a hung owner held the append ~3 s (1,000 ids: a
    minute). (The embedded log looks its keys up itself, so the engine is asked here.)"""
    standin = StandIn([hang_on_events])
    async with stand_in(standin), forwarder(tmp_path, standin) as node:
        started = time.monotonic()
        found = await node.engine._first_writes(keys_of(node, 40))
        took = time.monotonic() - started
        assert found == {}
        assert sum(b" /v1/events/" in hop.request_line for hop in standin.hops) >= 16
        assert took < 2.5, took  # 1 s and the engine's own work; 3 s before


async def test_looking_up_a_request_id_on_a_crashed_owner_ends_at_once(tmp_path: Path) -> None:
    """An owner that refuses the connection is not waited for: the keyed write for a
    crashed owner, appended by the node it reached, goes on at once."""
    standin = StandIn([answer(200, {})])
    async with stand_in(standin) as running, forwarder(tmp_path, standin) as node:
        assert running.server is not None
        running.server.close()  # the owner crashed: its port refuses connections
        await running.server.wait_closed()
        started = time.monotonic()
        assert await node.engine._first_writes(keys_of(node, 3)) == {}
        assert time.monotonic() - started < 0.8  # it waited its whole 1 s before
