"""Helpers of the seed tests: ``prme serve`` on a loopback port for the length of a test,
and an example script run as a user runs it."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider
from prme.query.serve import run_server
from prme.schemas.config import ServiceSettings, Settings

SERVICE_KEY = "key-alice"


@contextlib.contextmanager
def running_service(data_dir: Path, *, deadline_s: float = 60.0) -> Iterator[str]:
    """``prme serve`` (uvicorn on a loopback socket, in a thread) for ``data_dir``, with an
    API key bound to ``alice``; yields the base URL and stops the server on exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    settings = Settings(
        data_dir=str(data_dir),
        service=ServiceSettings(host="127.0.0.1", port=port, api_keys={SERVICE_KEY: "alice"}),
    )
    loop = asyncio.new_event_loop()
    shutdown = asyncio.Event()
    failure: list[BaseException] = []

    def serve() -> None:
        try:
            loop.run_until_complete(
                run_server(
                    settings,
                    embedding_provider=HashedBagOfWordsProvider(),
                    sockets=[sock],
                    shutdown=shutdown,
                    log_level="warning",
                )
            )
        except BaseException as error:  # reported to the waiting test below
            failure.append(error)

    thread = threading.Thread(target=serve, name="prme-test-service", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + deadline_s
        while True:
            if failure:
                raise RuntimeError("the service failed to start") from failure[0]
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/v1/health", timeout=1.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the service did not answer within {deadline_s}s")
            thread.join(0.05)  # waits on the server thread, returning early if it died
        yield url
    finally:
        loop.call_soon_threadsafe(shutdown.set)
        thread.join(30)
        loop.close()
        sock.close()


def run_example(name: str, directory: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``examples/<name>.py``'s ``main(directory)``; return what it printed."""
    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"prme_example_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(str(directory))
    return capsys.readouterr().out
