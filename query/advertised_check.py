"""Before a node joins its group: does the URL it advertises reach it?

A node given another node's ``--advertised-url`` (two machines both left at the same URL)
would take partitions nobody can reach. The group refuses a second member advertising a
URL, but which member is second depends on who joined first: restart the right node and
the careless one keeps the URL. So a member asks its advertised URL, before it opens
anything, for a nonce it listens for on its own sockets: if the nonce arrives, the URL is
this node's (directly or through a proxy); if another PRME node answers instead, the node
refuses to start; if nothing answers (nothing listens there yet, or the node cannot reach
itself: hairpin NAT, a name published only once the node is ready), it cannot tell and
goes on. Clients that connect meanwhile get 503 (the node is starting).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
from collections.abc import Sequence
from urllib.parse import urlsplit

import httpx

from prme.schemas.errors import ConfigurationError

from .http_types import SERVED_BY_HEADER, STARTING_HEADER

PROBE_HEADER = "x-prme-probe"
_MAX_HEAD_BYTES = 16_384
_MAX_DRAIN_BYTES = 64 * 1024 * 1024
_DRAIN_S = 5.0
STARTING_ANSWER = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"retry-after: 1\r\n" + STARTING_HEADER.encode() + b": 1\r\n"
    b"connection: close\r\ncontent-length: 65\r\n\r\n"
    b'{"error":"not_ready","detail":"this node is starting, try again"}'
)
"""The answer to any client but the probe while the node starts: nothing was done."""
_OWN = b"HTTP/1.1 204 No Content\r\nconnection: close\r\n\r\n"
_log = logging.getLogger("prme.serve")


async def check_advertised_url(
    url: str, sockets: Sequence[socket.socket], timeout_s: float = 2.0
) -> bool:
    """True when ``url`` reaches one of ``sockets`` (bound, not served yet); False when
    nothing answered in time. ConfigurationError when another PRME node answers there."""
    nonce = secrets.token_hex(16)
    reached = asyncio.Event()
    listening = _sockets_for(url, sockets)
    blocking = [sock.getblocking() for sock in listening]
    acceptors = [asyncio.create_task(_answer(sock, nonce, reached)) for sock in listening]
    try:
        served_by, why = await _ask(url, nonce, timeout_s, reached)
    finally:
        for task in acceptors:
            task.cancel()
        for task in acceptors:
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await task
        for sock, was in zip(listening, blocking, strict=True):
            sock.setblocking(was)
    if reached.is_set():
        return True
    if served_by is not None:
        raise ConfigurationError(
            f"the advertised URL {url} reaches another PRME node (it answers as {served_by}), "
            "not this one: give each node its own --advertised-url "
            "(PRME_CLUSTER__ADVERTISED_URL), one the other nodes reach it at"
        )
    _log.warning("could not check that %s reaches this node (%s): going on", url, why)
    return False


def _sockets_for(url: str, sockets: Sequence[socket.socket]) -> list[socket.socket]:
    """The sockets on the URL's port (``--processes`` children share the clients' socket:
    listening there would take their clients' requests), else all of them (a proxy)."""
    parts = urlsplit(url)
    try:
        port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
    except ValueError:  # not a port: the probe itself will say so
        return list(sockets)
    matching = [sock for sock in sockets if sock.getsockname()[1] == port]
    return matching or list(sockets)


async def _ask(
    url: str, nonce: str, timeout_s: float, reached: asyncio.Event
) -> tuple[str | None, str]:
    """Who answered (its served-by URL, None when not a PRME node), and why not if nobody."""
    # The environment's CA bundle and proxies, as the hops between nodes use them.
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        asking = asyncio.ensure_future(
            client.get(url.rstrip("/") + "/v1/ready", headers={PROBE_HEADER: nonce})
        )
        waiting = asyncio.ensure_future(reached.wait())
        try:
            await asyncio.wait({asking, waiting}, timeout=timeout_s, return_when="FIRST_COMPLETED")
        finally:
            waiting.cancel()
        if reached.is_set() or not asking.done():
            asking.cancel()
            with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                await asking
            return None, "no answer"
        try:
            response = asking.result()
        except (httpx.HTTPError, httpx.InvalidURL, ValueError) as error:
            return None, str(error) or type(error).__name__
    return response.headers.get(SERVED_BY_HEADER), f"HTTP {response.status_code}"


async def _answer(sock: socket.socket, nonce: str, reached: asyncio.Event) -> None:
    """Accept on ``sock`` until cancelled, each connection answered on its own (an idle
    one must not hold up the probe): the probe gets 204 and sets ``reached``; any other
    early client gets 503 (the node is starting)."""
    loop = asyncio.get_running_loop()
    sock.setblocking(False)
    replies: set[asyncio.Task[None]] = set()
    try:
        while True:
            try:
                conn, _ = await loop.sock_accept(sock)
            except (ConnectionAbortedError, ConnectionResetError):
                continue  # a client gave up before it was accepted
            reply = asyncio.create_task(_reply(loop, conn, nonce, reached))
            replies.add(reply)
            reply.add_done_callback(replies.discard)
    finally:
        for reply in list(replies):
            reply.cancel()


async def _reply(
    loop: asyncio.AbstractEventLoop, conn: socket.socket, nonce: str, reached: asyncio.Event
) -> None:
    with conn:
        head = await _read_head(loop, conn)
        own = nonce.encode() in head and PROBE_HEADER.encode() in head.lower()
        if not own:
            # A body left unread makes the close a reset, which the client (another node
            # forwarding a large write) reads as a hop broken after sending, not a 503.
            await _drain_body(loop, conn, head)
        with contextlib.suppress(OSError):
            await loop.sock_sendall(conn, _OWN if own else STARTING_ANSWER)
        if own:
            reached.set()


async def _drain_body(loop: asyncio.AbstractEventLoop, conn: socket.socket, head: bytes) -> None:
    """Read the rest of the request's ``content-length`` body (at most
    ``_MAX_DRAIN_BYTES``, for at most ``_DRAIN_S``) and drop it."""
    _, _, received = head.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length" and value.strip().isdigit():
            length = min(int(value.strip()), _MAX_DRAIN_BYTES)
    left = length - len(received)
    with contextlib.suppress(OSError, TimeoutError):
        async with asyncio.timeout(_DRAIN_S):
            while left > 0:
                chunk = await loop.sock_recv(conn, min(left, 1 << 16))
                if not chunk:
                    break
                left -= len(chunk)


async def _read_head(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> bytes:
    head = b""
    with contextlib.suppress(OSError, TimeoutError):
        async with asyncio.timeout(1.0):
            while b"\r\n\r\n" not in head and len(head) < _MAX_HEAD_BYTES:
                chunk = await loop.sock_recv(conn, 4096)
                if not chunk:
                    break
                head += chunk
    return head
