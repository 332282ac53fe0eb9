"""Start ``prme mcp`` (and ``prme serve``) as subprocesses and drive them with the official
MCP SDK's ``ClientSession``, over stdio or streamable HTTP."""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import IO

import httpx
import httpx2
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client

from prme.producers.audit import AuditRow, audit_owner
from prme.producers.factory import open_key_store, open_transport
from prme.schemas.config import Settings

READ_TIMEOUT_S = 120.0
START_TIMEOUT_S = 180.0


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without PRME settings (the test decides them) plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRME_")}
    env.update({"PRME_LOG__PARTITIONS": "4", **extra})
    return env


@contextlib.asynccontextmanager
async def stdio_session(
    *args: str, errlog: Path, env: dict[str, str] | None = None
) -> AsyncIterator[ClientSession]:
    """``prme mcp ARGS`` over stdio, initialized; its stderr goes to ``errlog``."""
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "prme.cli", "mcp", *args], env=env or clean_env()
    )
    async with (
        _appending(errlog) as log,
        stdio_client(params, errlog=log) as (read, write),
        ClientSession(read, write, read_timeout_seconds=READ_TIMEOUT_S) as session,
    ):
        await session.initialize()
        yield session


@contextlib.asynccontextmanager
async def _appending(path: Path) -> AsyncIterator[IO[str]]:
    with path.open("a") as handle:
        yield handle


@contextlib.asynccontextmanager
async def http_session(url: str, api_key: str | None) -> AsyncIterator[ClientSession]:
    """A streamable-HTTP session presenting ``api_key`` on every request."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with (
        httpx2.AsyncClient(headers=headers, timeout=READ_TIMEOUT_S) as http,
        streamable_http_client(url, http_client=http) as (read, write),
        ClientSession(read, write, read_timeout_seconds=READ_TIMEOUT_S) as session,
    ):
        await session.initialize()
        yield session


class Process:
    """A ``prme`` subprocess whose stderr is collected line by line on a thread."""

    def __init__(self, *args: str, env: dict[str, str]) -> None:
        self.lines: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "prme.cli", *args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.popen.stderr is not None
        self._reader = threading.Thread(target=self._read, args=(self.popen.stderr,), daemon=True)
        self._reader.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.stderr.append(line)
            self.lines.put(line)

    def wait_for_line(self, marker: str, timeout_s: float = START_TIMEOUT_S) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.popen.poll() is not None:
                    break
                continue
            if marker in line:
                return line
        raise AssertionError(f"no {marker!r} from prme; stderr:\n{''.join(self.stderr)}")

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, then the exit code (the process must stop on its own within the bound)."""
        if self.popen.poll() is None:
            self.popen.terminate()
        try:
            code = self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
            raise AssertionError(f"prme did not stop; stderr:\n{''.join(self.stderr)}") from None
        self._reader.join(5)
        return code


@contextlib.contextmanager
def mcp_http(data_dir: Path, *args: str, env: dict[str, str]) -> Iterator[str]:
    """``prme mcp --http`` on a free loopback port; yields the endpoint URL."""
    process = Process("mcp", "--http", "--port", "0", "--data-dir", str(data_dir), *args, env=env)
    try:
        line = process.wait_for_line("streamable HTTP on")
        yield line.rsplit(" on ", 1)[1].strip()
    finally:
        code = process.stop()
    assert code == 0, "".join(process.stderr)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def prme_serve(data_dir: Path, env: dict[str, str]) -> Iterator[str]:
    """``prme serve`` on a free loopback port, once /v1/health answers; yields its URL."""
    port = free_port()
    options = ["--port", str(port), "--data-dir", str(data_dir), "--log-level", "warning"]
    process = Process("serve", *options, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                if httpx.get(f"{url}/v1/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if process.popen.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"prme serve did not start:\n{''.join(process.stderr)}")
            time.sleep(0.2)
        yield url
    finally:
        process.stop()


async def records_of(data_dir: Path, owner: str) -> list[AuditRow]:
    """Every record of ``owner`` on the pack's log (the server must have exited)."""
    settings = Settings(data_dir=str(data_dir)).replace(log={"partitions": 4})
    transport, keys = open_transport(settings), open_key_store(settings)
    await transport.start()
    await keys.start()
    try:
        return [row async for row in audit_owner(transport, owner, keys=keys)]
    finally:
        await keys.close()
        await transport.close()
