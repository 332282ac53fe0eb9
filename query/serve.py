"""Run the HTTP service: open the engine (which projects in-process), serve it with uvicorn,
close it on shutdown.

On the embedded default this process projects every partition. With Kafka it projects the
partitions its consumer group assigns; requests for other owners get a 503
(``shard_unavailable``) naming the partition.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Sequence

import uvicorn

from prme.projectors.embeddings.protocol import EmbeddingProvider
from prme.schemas.config import Settings

from .auth import check_bind_safety
from .engine import MemoryEngine
from .service import create_app


async def run_server(
    settings: Settings,
    *,
    embedding_provider: EmbeddingProvider | None = None,
    sockets: Sequence[socket.socket] | None = None,
    shutdown: asyncio.Event | None = None,
    log_level: str = "info",
) -> None:
    """Serve ``settings.data_dir`` on ``settings.service.host:port`` (or on ``sockets``,
    already bound) until SIGINT/SIGTERM or until ``shutdown`` is set.

    Raises ConfigurationError before opening anything when the service would listen on a
    non-loopback address without API keys.
    """
    check_bind_safety(settings.service, sockets or ())
    engine = await MemoryEngine.open(
        settings=settings, embedding_provider=embedding_provider, create_if_missing=True
    )
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
        )
        server = uvicorn.Server(config)
        watcher = asyncio.create_task(_stop_on(shutdown, server)) if shutdown else None
        try:
            await server.serve(sockets=_tcp_sockets(sockets) if sockets else None)
        finally:
            if watcher is not None:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
    finally:
        await engine.close()


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
