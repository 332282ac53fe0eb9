"""A live ``prme serve``: ``run_server`` on its own thread and event loop, on a socket bound
to 127.0.0.1 up front (the service tests, schemathesis and the fuzzers use it)."""

from __future__ import annotations

import asyncio
import queue
import socket
import threading

from prme.projectors.embeddings.protocol import EmbeddingProvider
from prme.query.serve import run_server
from prme.schemas.config import Settings


class ServerThread:
    """``run_server`` on its own thread and loop, listening on a socket bound up front (so
    clients may connect at once: the kernel queues them until uvicorn accepts)."""

    def __init__(self, settings: Settings, provider: EmbeddingProvider | None) -> None:
        self._settings = settings
        self._provider = provider
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind(("127.0.0.1", 0))
        self._socket.listen(64)
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        self._handles: queue.Queue[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = queue.Queue()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="prme-test-server")

    def _main(self) -> None:
        async def serve() -> None:
            stop = asyncio.Event()
            self._handles.put((asyncio.get_running_loop(), stop))
            await run_server(
                self._settings,
                embedding_provider=self._provider,
                sockets=[self._socket],
                shutdown=stop,
                log_level="warning",
            )

        try:
            asyncio.run(serve())
        except BaseException as error:
            self.error = error

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        loop, stop = self._handles.get(timeout=30)
        loop.call_soon_threadsafe(stop.set)
        self._thread.join(timeout=60)
        self._socket.close()
        assert not self._thread.is_alive(), "the server did not shut down"
        assert self.error is None, self.error
