"""A keep-alive HTTP/1.1 connection that costs its caller almost no CPU, for load
generators that share the machine's cores with the servers they measure (httpx spends
about as much Python per request as a small handler does).

It speaks only what PRME's service answers: a status line, headers, a ``Content-Length``
body (no chunked encoding). It is a measuring instrument, not a client: use
:class:`prme.MemoryClient` for anything else.
"""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlsplit


class RawHttpConnection:
    """One persistent connection to ``url``'s host; one request at a time."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or parts.hostname is None:
            raise ValueError(f"an http:// URL is needed, not {url!r}")
        self._host = parts.hostname
        self._port = parts.port or 80
        self._authority = parts.netloc.encode()
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def post_json(self, path: str, body: bytes) -> tuple[int, bytes]:
        """POST ``body`` (JSON already encoded) to ``path``: the status and the raw body."""
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self._host, self._port)
        assert self._reader is not None
        head = (
            b"POST "
            + path.encode()
            + b" HTTP/1.1\r\nHost: "
            + self._authority
            + b"\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
        )
        self._writer.write(head + body)
        status_line = await self._reader.readuntil(b"\r\n")
        headers = await self._reader.readuntil(b"\r\n\r\n")
        length: int | None = None
        closing = False
        for line in headers.split(b"\r\n"):
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"connection" and value.strip().lower() == b"close":
                closing = True
            elif name == b"transfer-encoding":
                await self.close()
                raise ValueError("a chunked answer: RawHttpConnection reads Content-Length only")
        if length is None:
            await self.close()
            raise ValueError("an answer without Content-Length")
        payload = await self._reader.readexactly(length)
        if closing:
            await self.close()
        return int(status_line.split(b" ", 2)[1]), payload

    async def close(self) -> None:
        writer, self._writer, self._reader = self._writer, None, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
