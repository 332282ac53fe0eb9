"""``AsyncMemoryClient``: one surface over the embedded engine or the HTTP service
(``MemoryClient``, its sync wrapper, is in ``sync_client.py``)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Self, TypeVar

from prme.producers.producer import MessageDraft
from prme.producers.transport import Position
from prme.projectors.embeddings.protocol import EmbeddingProvider
from prme.schemas.config import Settings
from prme.schemas.errors import ClientClosed, ConfigurationError
from prme.schemas.records import Message

from .backend import MemoryBackend
from .engine import MemoryEngine
from .http_types import RetrieveRequest, StoreRequest, node_urls
from .types import EventView, RetrieveResponse, StoreResult

T = TypeVar("T")


def check_target(directory: object, url: object) -> None:
    """A client serves exactly one of a directory (embedded) or a URL (the service)."""
    if (directory is None) == (url is None):
        raise ConfigurationError("give exactly one of directory (embedded) or url (service)")
    if url is not None:
        node_urls(url)  # type: ignore[arg-type]  # a URL without http:// fails here, not later


class AsyncMemoryClient(MemoryBackend):
    """``AsyncMemoryClient("./memory")`` (embedded) or ``AsyncMemoryClient(url=, api_key=)``."""

    def __init__(
        self,
        directory: str | Path | None = None,
        *,
        url: str | Sequence[str] | None = None,
        api_key: str | None = None,
        settings: Settings | None = None,
        embedding_provider: EmbeddingProvider | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        check_target(directory, url)
        if url is not None and embedding_provider is not None:
            raise ConfigurationError("embedding_provider applies to the embedded engine only")
        # Which backend serves this client is decided here, once; it opens on first use.
        self._open: Callable[[], Awaitable[MemoryBackend]] = (
            functools.partial(_open_service, url, api_key, timeout_s)
            if url is not None
            else functools.partial(_open_embedded, directory, settings, embedding_provider)
        )
        self._backend: MemoryBackend | None = None
        self._closed = False
        self._lock = asyncio.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    def _check_loop(self) -> None:
        """ConfigurationError when called from another event loop than the first call's:
        the engine's tasks and the HTTP connections belong to that loop (a second
        ``asyncio.run`` failed with "bound to a different event loop")."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif loop is not self._loop:
            raise ConfigurationError(
                "this AsyncMemoryClient is used from another event loop than the one it was "
                "first used in (each asyncio.run() starts a new loop): make one client per "
                "loop and close it in that loop (`async with AsyncMemoryClient(...) as memory:` "
                "inside it: a client holds its directory until it is closed, and closing it "
                "from another loop cannot release it), or use "
                "MemoryClient, which runs its own loop"
            )

    async def _get(self) -> MemoryBackend:
        self._check_loop()
        async with self._lock:
            if self._closed:  # opening it again would hold the directory with no owner
                raise ClientClosed("this AsyncMemoryClient is closed: open a new one")
            if self._backend is None:
                self._backend = await self._open()
            return self._backend

    @property
    def engine(self) -> MemoryEngine | None:
        """The embedded engine once opened (None in service mode)."""
        return self._backend if isinstance(self._backend, MemoryEngine) else None

    async def store_request(self, request: StoreRequest) -> StoreResult:
        return await (await self._get()).store_request(request)

    async def store_many(
        self, drafts: Sequence[MessageDraft], *, wait: bool = True
    ) -> list[StoreResult]:
        return await (await self._get()).store_many(drafts, wait=wait)

    async def retrieve_request(self, request: RetrieveRequest) -> RetrieveResponse:
        return await (await self._get()).retrieve_request(request)

    async def history(
        self,
        user_id: str,
        session_id: str = "default",
        *,
        scope: str = "default",
        limit: int | None = None,
        after: Position | None = None,
    ) -> list[Message]:
        return await (await self._get()).history(
            user_id, session_id, scope=scope, limit=limit, after=after
        )

    async def add_messages(
        self,
        user_id: str,
        session_id: str,
        drafts: Sequence[MessageDraft],
        *,
        scope: str = "default",
        wait: bool = True,
    ) -> list[StoreResult]:
        return await (await self._get()).add_messages(
            user_id, session_id, drafts, scope=scope, wait=wait
        )

    async def clear_history(
        self, user_id: str, session_id: str, *, scope: str = "default", wait: bool = True
    ) -> StoreResult:
        return await (await self._get()).clear_history(user_id, session_id, scope=scope, wait=wait)

    async def replace_history(
        self,
        user_id: str,
        session_id: str,
        drafts: Sequence[MessageDraft],
        *,
        scope: str = "default",
        wait: bool = True,
    ) -> list[StoreResult]:
        return await (await self._get()).replace_history(
            user_id, session_id, drafts, scope=scope, wait=wait
        )

    async def delete_message(
        self, user_id: str, event_id: str, *, wait: bool = True
    ) -> StoreResult:
        return await (await self._get()).delete_message(user_id, event_id, wait=wait)

    async def get_event(self, event_id: str, user_id: str) -> EventView:
        return await (await self._get()).get_event(event_id, user_id)

    async def get_event_nodes(self, event_id: str, user_id: str) -> list[str]:
        return await (await self._get()).get_event_nodes(event_id, user_id)

    async def archive(
        self, node_id: str, user_id: str, *, reason: str | None = None, wait: bool = True
    ) -> StoreResult:
        return await (await self._get()).archive(node_id, user_id, reason=reason, wait=wait)

    async def restore(self, node_id: str, user_id: str, *, wait: bool = True) -> StoreResult:
        return await (await self._get()).restore(node_id, user_id, wait=wait)

    async def supersede(
        self, node_id: str, by_node_id: str, user_id: str, *, wait: bool = True
    ) -> StoreResult:
        return await (await self._get()).supersede(node_id, by_node_id, user_id, wait=wait)

    async def erase_owner(self, user_id: str, *, wait: bool = True) -> StoreResult:
        return await (await self._get()).erase_owner(user_id, wait=wait)

    async def close(self) -> None:
        if self._backend is not None:
            self._check_loop()
        async with self._lock:
            self._closed = True
            if self._backend is not None:
                await self._backend.close()
                self._backend = None

    async def __aenter__(self) -> Self:
        await self._get()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


async def _open_service(url: Any, api_key: str | None, timeout_s: float) -> MemoryBackend:
    """The HTTP backend (``url``: what ``HttpMemoryBackend`` takes, passed through)."""
    from .http_client import HttpMemoryBackend

    return HttpMemoryBackend(url, api_key, timeout_s=timeout_s)


async def _open_embedded(
    directory: str | Path | None,
    settings: Settings | None,
    provider: EmbeddingProvider | None,
) -> MemoryBackend:
    return await MemoryEngine.open(
        directory, settings=settings, embedding_provider=provider, create_if_missing=True
    )


async def make_async_client(
    directory: str | Path | None,
    url: str | Sequence[str] | None,
    api_key: str | None,
    settings: Settings | None,
    provider: EmbeddingProvider | None,
    timeout_s: float,
) -> AsyncMemoryClient:
    client = AsyncMemoryClient(
        directory,
        url=url,
        api_key=api_key,
        settings=settings,
        embedding_provider=provider,
        timeout_s=timeout_s,
    )
    await client._get()
    return client
