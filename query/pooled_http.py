"""An HTTP connection pool that sends a request once more when the pooled connection it
went out on broke before any answer, if the request is harmless to send twice.

A server closes an idle connection after its keep-alive timeout (a PRME node after
``NODE_KEEP_ALIVE_S``), or when it restarts. A request sent on that connection as it
closes fails before any answer, most often without reaching the server's app, though the
sender cannot tell. So the pool lets an idle connection go well before a node would
(``POOL_KEEPALIVE_S``), and a request that still breaks so on a pooled connection is sent
once more on a new one when the caller says it is safe (``routes.safe_to_resend``);
another is raised, a write of unknown outcome.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

import httpx

from .http_types import NODE_KEEP_ALIVE_S

POOL_KEEPALIVE_S = NODE_KEEP_ALIVE_S / 2
"""How long a pooled connection is kept idle: well before a node closes it
(``NODE_KEEP_ALIVE_S``). At the same 5 s a request sent as both ran out met the close and
failed before the node read it."""


class ResendingPool:
    """``httpx.AsyncClient`` for requests to PRME nodes, with the resend described above.
    ``transport``: another httpx transport (an ASGI app, a proxy); its requests are never
    resent, since only the pool's own connections show whether one was new."""

    def __init__(
        self,
        *,
        timeout: httpx.Timeout,
        headers: Mapping[str, str] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        max_connections: int = 100,
    ) -> None:
        self._pooled = httpx.AsyncClient(
            headers=headers,
            timeout=timeout,
            transport=transport,
            limits=httpx.Limits(
                max_keepalive_connections=min(64, max_connections),
                max_connections=max_connections,
                keepalive_expiry=POOL_KEEPALIVE_S,
            ),
        )
        self._fresh = (
            None
            if transport is not None
            else httpx.AsyncClient(
                headers=headers, timeout=timeout, limits=httpx.Limits(max_keepalive_connections=0)
            )
        )
        """Resends a request whose pooled connection broke: on a new connection each."""

    async def aclose(self) -> None:
        await self._pooled.aclose()
        if self._fresh is not None:
            await self._fresh.aclose()

    async def get(self, url: str, *, timeout_s: float | None = None) -> httpx.Response:
        """A plain GET (a read: resent like any)."""
        return await self.request("GET", url, timeout_s=timeout_s, resendable=True)

    async def request(
        self,
        method: str,
        url: str,
        *,
        content: bytes | None = None,
        params: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
        resendable: bool,
        on_resend: Callable[[BaseException], None] | None = None,
    ) -> httpx.Response:
        """Send the request within ``timeout_s`` (None: the pool's timeout). ``resendable``:
        it may be sent again on a new connection when its pooled one broke before any
        answer (in what is left of ``timeout_s``); ``on_resend`` is told, with the error."""
        loop = asyncio.get_running_loop()
        ends = None if timeout_s is None else loop.time() + timeout_s
        opened: list[str] = []

        async def trace(event: str, info: Mapping[str, object]) -> None:
            if event == "connection.connect_tcp.started":  # not a pooled connection
                opened.append(event)

        timeout: Any = httpx.USE_CLIENT_DEFAULT if timeout_s is None else timeout_s
        try:
            return await self._pooled.request(
                method,
                url,
                content=content,
                params=params,
                headers=headers,
                timeout=timeout,
                extensions={"trace": trace},
            )
        except (httpx.NetworkError, httpx.RemoteProtocolError) as error:
            left = None if ends is None else ends - loop.time()
            broken = not isinstance(error, httpx.ConnectError)
            pooled = broken and not opened
            if not (resendable and pooled and self._fresh is not None) or (
                left is not None and left <= 0
            ):
                raise
            if on_resend is not None:
                on_resend(error)
            fresh = self._fresh
        return await fresh.request(
            method,
            url,
            content=content,
            params=params,
            headers=headers,
            timeout=httpx.USE_CLIENT_DEFAULT if left is None else left,
        )
