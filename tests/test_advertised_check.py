"""A node asks its advertised URL whether it reaches it before it opens anything (found
by a cluster trial: a node started with another node's --advertised-url took the
partitions, and kept them when the right node restarted)."""

from __future__ import annotations

import contextlib
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from prme.query.advertised_check import check_advertised_url
from prme.schemas.config import Settings
from prme.schemas.errors import ConfigurationError

from .live_server import ServerThread


def _bound() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return sock


async def test_a_url_that_reaches_this_process_is_confirmed_at_once() -> None:
    with _bound() as own:
        url = f"http://127.0.0.1:{own.getsockname()[1]}"
        started = time.monotonic()
        assert await check_advertised_url(url, [own]) is True
        assert time.monotonic() - started < 1.0
        assert own.getblocking()  # handed back as uvicorn expects it


async def test_a_url_nobody_answers_cannot_be_told_and_is_let_through(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with _bound() as own, _bound() as silent:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"  # accepts, never answers
        assert await check_advertised_url(url, [own], timeout_s=0.3) is False
    assert "could not check" in caplog.text


async def test_a_url_another_prme_node_answers_is_refused(
    local_settings: Settings, hashed_provider: Any, tmp_path: Path
) -> None:
    other = ServerThread(local_settings, hashed_provider)
    other.start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(other.url + "/v1/health", timeout=5).status_code < 500:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        with _bound() as own, pytest.raises(ConfigurationError) as refused:
            await check_advertised_url(other.url, [own])
        assert f"the advertised URL {other.url} reaches another PRME node" in str(refused.value)
        assert "--advertised-url" in str(refused.value)
    finally:
        other.stop()


async def test_idle_early_connections_do_not_hold_up_the_probe() -> None:
    """From a review: one connection at a time, with a 1 s wait for each request head, let
    two idle connections push the probe past its limit."""
    with (
        _bound() as own,
        socket.create_connection(own.getsockname()),
        socket.create_connection(own.getsockname()),
    ):
        url = f"http://127.0.0.1:{own.getsockname()[1]}"
        started = time.monotonic()
        assert await check_advertised_url(url, [own], timeout_s=1.5) is True
        assert time.monotonic() - started < 1.0


async def test_a_large_request_to_a_starting_node_gets_the_starting_answer() -> None:
    """From a review: the starting answer was sent with the body unread, so the close reset
    the connection and a node forwarding a 4 MB write to a starting owner read a broken
    hop (504 append_unconfirmed, "may have been applied") instead of the 503 that lets it
    append the write itself."""
    import asyncio

    from prme.query.advertised_check import _answer

    with _bound() as starting:
        url = f"http://127.0.0.1:{starting.getsockname()[1]}"
        accepting = asyncio.create_task(_answer(starting, "nonce", asyncio.Event()))
        try:
            async with httpx.AsyncClient(timeout=10) as client:
                for size in (10, 4 * 1024 * 1024):
                    response = await client.post(url + "/v1/memories", content=b"x" * size)
                    assert response.status_code == 503, size
                    assert response.headers["x-prme-starting"] == "1"
                    assert response.json()["error"] == "not_ready"
        finally:
            accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await accepting
