"""Run the HTTP service: open the engine (which projects in-process), serve it with uvicorn,
close it on shutdown.

On the embedded default this process projects every partition. With Kafka it projects the
partitions its consumer group assigns and forwards requests for other owners to the node
that owns them (``query/cluster.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Generator, Sequence

import uvicorn

from prme.projectors.embeddings.protocol import EmbeddingProvider
from prme.projectors.tasks import cancel_and_wait
from prme.schemas.config import Settings
from prme.schemas.errors import ConfigurationError

from .advertised_check import check_advertised_url
from .auth import check_bind_safety
from .engine import MemoryEngine
from .http_types import NODE_KEEP_ALIVE_S
from .listening import listen
from .service import create_app

log = logging.getLogger("prme.serve")


async def run_server(
    settings: Settings,
    *,
    embedding_provider: EmbeddingProvider | None = None,
    sockets: Sequence[socket.socket] | None = None,
    shutdown: asyncio.Event | None = None,
    log_level: str = "info",
    check_url: bool = True,
) -> None:
    """Serve ``settings.data_dir`` on ``settings.service.host:port`` (or on ``sockets``,
    already bound, closed once it stops) until SIGINT/SIGTERM or until ``shutdown`` is
    set. ``check_url``: a member first asks its advertised URL whether it reaches it
    (query/advertised_check.py).

    Raises ConfigurationError before opening anything when the service would listen on a
    non-loopback address without API keys.
    """
    check_bind_safety(settings.service, sockets or ())
    # Bound before the engine opens: a taken port must not first join the group, take
    # partitions and leave again; and --port 0 advertises the port it got.
    listening = list(sockets) if sockets else [listen(settings.service.host, settings.service.port)]
    try:
        await _serve(settings, listening, embedding_provider, shutdown, log_level, check_url)
    finally:
        if not sockets:
            listening[0].close()


async def _serve(
    settings: Settings,
    sockets: Sequence[socket.socket],
    embedding_provider: EmbeddingProvider | None,
    shutdown: asyncio.Event | None,
    log_level: str,
    check_url: bool,
) -> None:
    url = advertised_url(settings, sockets)
    member = settings.log.transport == "kafka" or bool(settings.cluster.static_members)
    if check_url and member and settings.cluster.project:
        # Another node's URL is refused before anything is opened.
        reached = await check_advertised_url(url, sockets)
    else:
        reached = not check_url  # a --processes child: its parent bound its URL's socket
    # Listening while catching up: /v1/ready says how far; a request for a partition
    # still catching up waits for it (bounded), then answers 503 with Retry-After.
    engine = await MemoryEngine.open(
        settings=settings,
        embedding_provider=embedding_provider,
        create_if_missing=True,
        url=url,
        catch_up=False,
        url_reached=reached,
    )
    catching_up = asyncio.create_task(_catch_up(engine), name="prme-catch-up")
    try:
        config = uvicorn.Config(
            create_app(engine, settings),
            host=settings.service.host,
            port=settings.service.port,
            log_level=log_level,
            log_config=None,  # the caller configures logging (prme serve: prme.logs)
            access_log=False,  # one line per request comes from prme.http instead
            lifespan="off",
            server_header=False,
            timeout_keep_alive=NODE_KEEP_ALIVE_S,  # the hop pool lets one go before this
        )
        server = _ClosingServer(config, sockets)
        log.info("serving %s on %s; %s", url, _addresses(sockets), describe_log(settings))
        watcher = asyncio.create_task(_stop_on(shutdown, server)) if shutdown else None
        try:
            await server.serve(sockets=_tcp_sockets(sockets))
        finally:
            await cancel_and_wait(watcher)
    finally:
        catching_up.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await catching_up
        await engine.close()
        log.info("stopped: the engine is closed%s", left_group(settings))


class _ClosingServer(uvicorn.Server):
    """uvicorn re-raises a signal it caught once ``serve`` returns: SIGTERM's default
    action then killed the process before the engine was closed, and SIGINT cancelled the
    close half way, so a node stopped on purpose left its group only by the session
    timeout, like a crashed one. Here the signal only stops the server; ``run_server``
    closes the engine and returns.

    Its shutdown first closes the listening sockets it was given (uvicorn closes only the
    duplicates it serves): while one stayed open the kernel kept accepting connections
    nobody would serve, and reset them when the process exited; now they are refused."""

    def __init__(self, config: uvicorn.Config, listening: Sequence[socket.socket]) -> None:
        super().__init__(config)
        self._listening = list(listening)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for sock in self._listening:
            sock.close()
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        with super().capture_signals():
            yield
            self._captured_signals.clear()


def advertised_url(settings: Settings, sockets: Sequence[socket.socket] | None = None) -> str:
    """Where other nodes and clients reach this node: ``cluster.advertised_url``, else the
    address it listens on."""
    if settings.cluster.advertised_url:
        return settings.cluster.advertised_url.rstrip("/")
    if sockets:
        host, port = sockets[0].getsockname()[:2]
    else:
        host, port = settings.service.host, settings.service.port
    if str(host) in ("0.0.0.0", "::", "") and settings.log.transport == "kafka":
        raise ConfigurationError(
            f"listening on {host or 'every address'}, this node cannot tell the others where "
            "to reach it: set --advertised-url (PRME_CLUSTER__ADVERTISED_URL), e.g. "
            f"http://<this host's name>:{port}"
        )
    if ":" in str(host):
        host = f"[{host}]"
    return f"http://{host}:{port}"


async def _catch_up(engine: MemoryEngine) -> None:
    """Catch up in the background, logging progress (the runner's lines); a partition
    gained later is caught up by the runner itself and served once it has."""
    if not engine.settings.cluster.project:
        return
    try:
        await engine.runner.catch_up(timeout_s=24 * 3600.0)
    except Exception as error:
        log.warning("catching up stopped: %s", error)


def describe_log(settings: Settings) -> str:
    """Which log a node reads, for its first line: a misconfigured node says so at once."""
    log_settings = settings.log
    if log_settings.transport == "kafka":
        return (
            f"log: Kafka at {log_settings.bootstrap}, topic {log_settings.topic}, "
            f"group {settings.cluster.group}; data dir {settings.data_dir}"
        )
    return f"log: embedded, {log_settings.partitions} partitions in {settings.data_dir}"


def _addresses(sockets: Sequence[socket.socket]) -> str:
    return ", ".join(
        "{}:{}".format(*sock.getsockname()[:2])
        if sock.family in (socket.AF_INET, socket.AF_INET6)
        else str(sock.getsockname())
        for sock in sockets
    )


def left_group(settings: Settings) -> str:
    return " (this node has left its group)" if settings.log.transport == "kafka" else ""


def _tcp_sockets(sockets: Sequence[socket.socket]) -> list[socket.socket]:
    """Duplicates of ``sockets`` that know their protocol. asyncio turns Nagle off
    (TCP_NODELAY) only on sockets whose ``proto`` is IPPROTO_TCP, and ``socket.socket()``
    leaves it 0; without NODELAY a response written as headers then body waited for the
    client's delayed ACK: ~40 ms on every request over a reused connection. The
    duplicate's protocol is read from the descriptor; the caller keeps its own socket."""
    return [socket.socket(fileno=os.dup(sock.fileno())) for sock in sockets]


async def _stop_on(event: asyncio.Event, server: uvicorn.Server) -> None:
    await event.wait()
    server.should_exit = True
